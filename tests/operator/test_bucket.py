"""The bucket module against the real S3 server (moto): create, empty a run's prefix only,
and errors that name a reason and never a credential."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.api.v1alpha1 import AdapterStoreSpec
from asyncgrpo.bucket import folder as bucket


def store(s3, **kw):
    return AdapterStoreSpec(endpoint=s3.endpoint, bucket=kw.pop("bucket", f"b-{uuid.uuid4().hex[:8]}"),
                            credentials_secret={"name": "s3"}, **kw)


def creds(s3):
    return bucket.Credentials(s3.access_key, s3.secret_key)


def test_ensure_creates_once(s3_server):
    st = store(s3_server)
    assert bucket.ensure_bucket(st, creds(s3_server)) is True
    assert bucket.ensure_bucket(st, creds(s3_server)) is False


def test_missing_bucket_without_create_is_bucket_not_found(s3_server):
    with pytest.raises(bucket.BucketError) as e:
        bucket.ensure_bucket(store(s3_server, create_bucket=False), creds(s3_server))
    assert e.value.reason == "BucketNotFound"


def owner(ns="team-a", name="run-a", uid=None):
    return bucket.Owner(ns, name, uid or str(uuid.uuid4()))


def put(s3, st, keys):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=st.bucket, Key=k, Body=b"1"), keys))


def keys_of(s3, st):
    out = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=st.bucket):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def test_cleanup_deletes_only_the_runs_own_folder(s3_server):
    st = store(s3_server, prefix="team/x")
    me = owner()
    assert bucket.setup_run_folder(st, creds(s3_server), me) is True
    s3 = s3_server.client()
    # more than one page (1000 keys) of the run's objects
    mine = [f"team/x/team-a/run-a/adapters/v{i}/f" for i in range(1001)]
    others = ["team/x/team-a/run-ab/adapters/v1/f", "team/x/team-b/run-a/adapters/v1/f",
              "team/x/run-a/f", "other/team-a/run-a/f"]
    put(s3, st, mine + others)
    assert bucket.cleanup_run_folder(st, creds(s3_server), me) == 1002  # + the marker
    assert keys_of(s3, st) == set(others)
    with pytest.raises(bucket.BucketError) as e:  # the marker went last: nothing to own
        bucket.cleanup_run_folder(st, creds(s3_server), me)
    assert e.value.reason == "NotOwner"


def test_same_name_in_two_namespaces_never_share_or_delete(s3_server):
    st = store(s3_server, prefix="asyncgrpo")
    a, b = owner("team-a", "shared"), owner("team-b", "shared")
    bucket.setup_run_folder(st, creds(s3_server), a)
    bucket.setup_run_folder(st, creds(s3_server), b)
    s3 = s3_server.client()
    put(s3, st, ["asyncgrpo/team-a/shared/adapters/v1/f", "asyncgrpo/team-b/shared/adapters/v1/f"])
    bucket.cleanup_run_folder(st, creds(s3_server), a)
    assert keys_of(s3, st) == {"asyncgrpo/team-b/shared/adapters/v1/f",
                               "asyncgrpo/team-b/shared/.asyncgrpo-owner.json"}


def test_another_runs_uid_is_never_cleaned_nor_claimed(s3_server):
    st = store(s3_server)
    first = owner()
    bucket.setup_run_folder(st, creds(s3_server), first)
    put(s3_server.client(), st, ["asyncgrpo/team-a/run-a/checkpoints/step-1/f"])
    second = bucket.Owner(first.namespace, first.name, "another-uid")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(st, creds(s3_server), second)
    assert e.value.reason == "FolderOwnedByAnotherRun"
    with pytest.raises(bucket.BucketError) as e:
        bucket.cleanup_run_folder(st, creds(s3_server), second)
    assert e.value.reason == "NotOwner"
    assert "asyncgrpo/team-a/run-a/checkpoints/step-1/f" in keys_of(s3_server.client(), st)


def test_a_folder_inside_another_runs_folder_is_refused_and_never_emptied(s3_server):
    # the victim's adapters/v1 folder is exactly where a run named "v1" in a namespace named
    # "adapters" with prefix <victim folder> would live
    st = store(s3_server, prefix="asyncgrpo")
    victim = owner("team-b", "victim")
    bucket.setup_run_folder(st, creds(s3_server), victim)
    put(s3_server.client(), st, ["asyncgrpo/team-b/victim/adapters/v1/manifest.json"])
    attacker = AdapterStoreSpec(**{**st.model_dump(), "prefix": "asyncgrpo/team-b/victim"})
    evil = owner("adapters", "v1")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(attacker, creds(s3_server), evil)
    assert e.value.reason == "FolderInsideAnotherRun"
    # even with a marker planted by hand, the cleanup sees the enclosing run and stops
    s3_server.client().put_object(Bucket=st.bucket, Body=evil.marker(),
                                  Key="asyncgrpo/team-b/victim/adapters/v1/.asyncgrpo-owner.json")
    with pytest.raises(bucket.BucketError) as e:
        bucket.cleanup_run_folder(attacker, creds(s3_server), evil)
    assert e.value.reason == "FolderInsideAnotherRun"
    assert "asyncgrpo/team-b/victim/adapters/v1/manifest.json" in keys_of(s3_server.client(), st)


def test_a_folder_around_another_run_is_refused_and_skips_it_on_cleanup(s3_server):
    st = store(s3_server, prefix="p")
    inner_store = AdapterStoreSpec(**{**st.model_dump(), "prefix": "p/team-a/outer"})
    inner = owner("team-b", "inner")
    bucket.setup_run_folder(inner_store, creds(s3_server), inner)
    put(s3_server.client(), st, ["p/team-a/outer/team-b/inner/adapters/v1/f"])
    outer = owner("team-a", "outer")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(st, creds(s3_server), outer)
    assert e.value.reason == "FolderContainsAnotherRun"
    # the outer run's marker (as if it had come first): its cleanup leaves the inner run alone
    s3_server.client().put_object(Bucket=st.bucket, Key="p/team-a/outer/.asyncgrpo-owner.json",
                                  Body=outer.marker())
    put(s3_server.client(), st, ["p/team-a/outer/adapters/v1/f"])
    assert bucket.cleanup_run_folder(st, creds(s3_server), outer) == 2
    assert keys_of(s3_server.client(), st) == {
        "p/team-a/outer/team-b/inner/adapters/v1/f",
        "p/team-a/outer/team-b/inner/.asyncgrpo-owner.json"}


@pytest.mark.parametrize("prefix", ["/", "", "a//b", "../a", "a/../b", "a/", "/a", "a/./b",
                                    ".hidden"])
def test_unsafe_prefixes_are_refused_by_the_model(prefix):
    with pytest.raises(ValueError):
        AdapterStoreSpec(bucket="runs", prefix=prefix)


def test_credentials_from_the_jobs_env_and_redaction():
    """The keys as the kubelet gives them to the bucket Job (secretKeyRef env)."""
    assert bucket.credentials_from_env({}) is None   # the pod's own identity
    with pytest.raises(bucket.BucketError) as e:
        bucket.credentials_from_env({"AWS_ACCESS_KEY_ID": "x"})
    assert e.value.reason == "SecretKeyMissing" and "AWS_SECRET_ACCESS_KEY" in e.value.message
    # not UTF-8 (a kubelet passes the bytes; Python decodes them as surrogates), empty,
    # control characters
    for bad in (b"\xff\xfe".decode("utf-8", "surrogateescape"), "", " ", "a\x00b"):
        with pytest.raises(bucket.BucketError) as e:
            bucket.credentials_from_env({"AWS_ACCESS_KEY_ID": bad,
                                         "AWS_SECRET_ACCESS_KEY": "x"})
        assert e.value.reason == "SecretInvalid"
    c = bucket.credentials_from_env({"AWS_ACCESS_KEY_ID": "id",
                                     "AWS_SECRET_ACCESS_KEY": "hunter2\n"})
    assert c.secret_access_key == "hunter2" and "hunter2" not in repr(c)


def test_unreachable_endpoint_is_named_without_its_url():
    from tests.conftest import free_port

    st = AdapterStoreSpec(endpoint=f"http://127.0.0.1:{free_port()}", bucket="x-bucket")
    with pytest.raises(bucket.BucketError) as e:
        bucket.ensure_bucket(st, bucket.Credentials("a", "b"))
    assert e.value.reason == "EndpointUnreachable" and "127.0.0.1" not in e.value.message


def test_silent_endpoint_gives_up_with_a_reason(s3_server):
    """A listener that accepts and never answers: the short timeouts end the call."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        st = AdapterStoreSpec(endpoint=f"http://127.0.0.1:{srv.getsockname()[1]}",
                              bucket="x-bucket")
        with pytest.raises(bucket.BucketError) as e:
            bucket.setup_run_folder(st, bucket.Credentials("a", "b"), owner())
        assert e.value.reason == "EndpointUnreachable"
    finally:
        srv.close()


@pytest.mark.parametrize("endpoint", ["http://169.254.169.254", "http://[fe80::1]:80",
                                      "http://0.0.0.0:9000"])
def test_link_local_and_metadata_endpoints_are_refused_by_default(endpoint):
    with pytest.raises(bucket.BucketError) as e:
        bucket.check_endpoint(AdapterStoreSpec(endpoint=endpoint, bucket="x-bucket"))
    assert e.value.reason == "EndpointNotAllowed"


def test_allowlist_admits_only_listed_endpoints(s3_server):
    st = store(s3_server)
    bucket.check_endpoint(st, [s3_server.endpoint])
    bucket.check_endpoint(st, ["127.0.0.1"])
    with pytest.raises(bucket.BucketError) as e:
        bucket.check_endpoint(st, ["https://minio.storage:9000"])
    assert e.value.reason == "EndpointNotAllowed"
    with pytest.raises(bucket.BucketError) as e:   # AWS itself needs listing too
        bucket.check_endpoint(AdapterStoreSpec(bucket="x-bucket"), ["127.0.0.1"])
    assert e.value.reason == "EndpointNotAllowed"
    # link-local only when the admin lists it explicitly
    bucket.check_endpoint(AdapterStoreSpec(endpoint="http://169.254.1.1", bucket="x-bucket"),
                          ["169.254.1.1"])


@pytest.mark.parametrize("changes", [{"endpoint": "http://"}, {"region": "us east"},
                                     {"endpoint": "http://a b"}, {"endpoint": "http://u:p@h"}])
def test_malformed_endpoint_or_region_becomes_a_bucket_error(changes):
    """Refused by the model; a stored object that predates the rule still gets a reason."""
    with pytest.raises(ValueError):
        AdapterStoreSpec(bucket="x-bucket", **changes)
    st = AdapterStoreSpec.model_construct(**{**AdapterStoreSpec(bucket="x-bucket").__dict__,
                                             **changes})
    with pytest.raises(bucket.BucketError) as e:
        bucket.check_endpoint(st)
        bucket.setup_run_folder(st, bucket.Credentials("a", "b"), owner())
    assert e.value.reason in ("InvalidEndpoint", "EndpointUnreachable")


# ---------------------------------------------------------------- races on the claim


def _nested_pair(s3_server):
    """An outer run's store and an inner run's whose folder lies inside the outer one's."""
    outer_store = store(s3_server, prefix="p")
    inner_store = AdapterStoreSpec(**{**outer_store.model_dump(), "prefix": "p/team-a/outer"})
    return (outer_store, owner("team-a", "outer")), (inner_store, owner("team-b", "inner"))


def _claim_at_once(s3_server, monkeypatch, pair, meet_at_write: bool):
    """Both setups in threads; with `meet_at_write`, each waits at its marker write until the
    other reached its own (the interleaving the check-then-write claim lost: both checked,
    then both wrote). Returns the set of owners whose setup succeeded."""
    import threading

    barrier = threading.Barrier(2, timeout=5)
    real_client = bucket.client

    def meeting_client(*a, **kw):
        s3 = real_client(*a, **kw)
        put_object = s3.put_object

        def put(**args):
            if args["Key"].endswith(".asyncgrpo-owner.json"):
                try:
                    barrier.wait()
                except threading.BrokenBarrierError:
                    pass
            return put_object(**args)

        s3.put_object = put
        return s3

    if meet_at_write:
        monkeypatch.setattr(bucket, "client", meeting_client)
    won = set()

    def setup(st, who):
        try:
            bucket.setup_run_folder(st, creds(s3_server), who)
            won.add(who.name)
        except bucket.BucketError as e:
            assert e.reason in ("FolderInsideAnotherRun", "FolderContainsAnotherRun"), e
    threads = [threading.Thread(target=setup, args=p) for p in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.setattr(bucket, "client", real_client)
    return won


def _markers(s3_server, st):
    return {k for k in keys_of(s3_server.client(), st) if k.endswith(".asyncgrpo-owner.json")}


def test_two_nested_runs_claiming_at_once_never_both_hold_their_folder(s3_server, monkeypatch):
    (outer_store, outer), inner = _nested_pair(s3_server)
    won = _claim_at_once(s3_server, monkeypatch, [(outer_store, outer), inner],
                         meet_at_write=True)
    assert len(won) <= 1, "both nested runs claimed their folders"
    # whoever lost removed its marker: at most the winner's is left
    assert len(_markers(s3_server, outer_store)) == len(won)
    # the next setups, one after the other, settle it: exactly one run holds its folder
    results = []
    for st, who in ((outer_store, outer), inner):
        try:
            bucket.setup_run_folder(st, creds(s3_server), who)
            results.append(who.name)
        except bucket.BucketError:
            pass
    assert len(set(results) | won) == 1
    assert len(_markers(s3_server, outer_store)) == 1


def test_nested_claims_in_free_running_threads_never_both_hold(s3_server, monkeypatch):
    for _ in range(8):
        pair = _nested_pair(s3_server)
        won = _claim_at_once(s3_server, monkeypatch, list(pair), meet_at_write=False)
        assert len(won) <= 1
        assert len(_markers(s3_server, pair[0][0])) == len(won)


def test_an_established_run_keeps_its_folder_beside_a_newcomer(s3_server):
    (outer_store, outer), (inner_store, inner) = _nested_pair(s3_server)
    bucket.setup_run_folder(outer_store, creds(s3_server), outer)
    # a newcomer's marker written (its setup not yet done checking): the older run's recheck
    # passes, the newcomer's own setup is refused and removes its marker
    s3_server.client().put_object(Bucket=outer_store.bucket, Body=inner.marker(),
                                  Key="p/team-a/outer/team-b/inner/.asyncgrpo-owner.json")
    bucket.setup_run_folder(outer_store, creds(s3_server), outer)
    s3_server.client().delete_object(Bucket=outer_store.bucket,
                                     Key="p/team-a/outer/team-b/inner/.asyncgrpo-owner.json")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(inner_store, creds(s3_server), inner)
    assert e.value.reason == "FolderInsideAnotherRun"
    assert _markers(s3_server, outer_store) == {"p/team-a/outer/.asyncgrpo-owner.json"}


def test_a_recreated_run_takes_its_retained_folder_back_only_when_asked(s3_server):
    st = store(s3_server)
    first = owner()
    bucket.setup_run_folder(st, creds(s3_server), first)
    kept = "asyncgrpo/team-a/run-a/checkpoints/step-7/f"
    put(s3_server.client(), st, [kept])
    again = bucket.Owner(first.namespace, first.name, "uid-of-the-new-run")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(st, creds(s3_server), again)
    assert e.value.reason == "FolderOwnedByAnotherRun"
    assert "reclaimRetainedFolder" in e.value.message
    bucket.setup_run_folder(st, creds(s3_server), again, reclaim=True)
    body = s3_server.client().get_object(Bucket=st.bucket,
                                         Key="asyncgrpo/team-a/run-a/.asyncgrpo-owner.json")
    assert json.loads(body["Body"].read())["uid"] == "uid-of-the-new-run"
    assert kept in keys_of(s3_server.client(), st)   # resumed from, not emptied
    # the old run's cleanup can no longer touch it; the new run's can
    with pytest.raises(bucket.BucketError):
        bucket.cleanup_run_folder(st, creds(s3_server), first)


def test_reclaim_never_takes_a_folder_whose_marker_names_another_run(s3_server):
    st = store(s3_server)
    me = owner()
    # a marker naming another run (as a tenant with the bucket's keys could write one)
    other = bucket.Owner("team-z", "someone", "their-uid")
    s3_server.client().create_bucket(Bucket=st.bucket)
    s3_server.client().put_object(Bucket=st.bucket, Body=other.marker(),
                                  Key="asyncgrpo/team-a/run-a/.asyncgrpo-owner.json")
    with pytest.raises(bucket.BucketError) as e:
        bucket.setup_run_folder(st, creds(s3_server), me, reclaim=True)
    assert e.value.reason == "FolderOwnedByAnotherRun"
    assert "reclaimRetainedFolder" not in e.value.message

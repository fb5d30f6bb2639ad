"""A local run's lifecycle around its processes: the local S3 keeps its objects on disk
between runs, the last run's work folder is kept, and a second run that would share the
first's folders is refused with a message saying so (it used to get a misleading
credentials error, then share the folder and crash). Real moto servers; no vLLM."""

from __future__ import annotations

import pytest
import yaml

from asyncgrpo.testing.net import free_port
from tests.api.invalid_specs import REPO

EXAMPLE = REPO / "examples" / "local-tiny.yaml"


def _run(port: int, name: str = "local-tiny"):
    from asyncgrpo.api import parse_run

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["adapterStore"]["endpoint"] = f"http://127.0.0.1:{port}"
    return parse_run(doc)


def test_the_local_s3_keeps_its_objects_on_disk_across_restarts(tmp_path):
    from asyncgrpo.local.s3 import S3Server

    data = tmp_path / "s3"
    first = S3Server.start(tmp_path / "a.log", data_dir=data)
    s3 = first.client()
    s3.create_bucket(Bucket="keep")
    s3.put_object(Bucket="keep", Key="asyncgrpo/default/r/final/manifest.json", Body=b"{}")
    s3.put_object(Bucket="keep", Key="asyncgrpo/default/r/adapters/v1/a.bin", Body=b"x" * 4096)
    first.stop()
    assert first.saved[0] == 2
    # plain files a user can find
    assert (data / "keep" / "asyncgrpo/default/r/final/manifest.json").read_bytes() == b"{}"

    second = S3Server.start(tmp_path / "b.log", data_dir=data)
    try:
        assert second.restored[0] == 2
        body = second.client().get_object(Bucket="keep", Key="asyncgrpo/default/r/adapters/v1/a.bin")
        assert body["Body"].read() == b"x" * 4096
        second.client().delete_object(Bucket="keep", Key="asyncgrpo/default/r/adapters/v1/a.bin")
    finally:
        second.stop()
    assert not (data / "keep" / "asyncgrpo/default/r/adapters/v1/a.bin").exists()  # a mirror


def test_a_second_run_on_the_same_folders_is_refused_while_the_first_runs(tmp_path):
    from asyncgrpo.local.backend import LocalBackend, LocalRunError

    port = free_port()
    first = LocalBackend(_run(port), tmp_path / "work", say=lambda _l: None)
    first.workdir.mkdir(parents=True)
    first._lock()
    try:
        same = LocalBackend(_run(port), tmp_path / "work", say=lambda _l: None)
        with pytest.raises(LocalRunError, match=r"another `asyncgrpo local run` \(pid \d+.*\) "
                           r"is using the work folder"):
            same._lock()
        # another work folder, same run in the same bucket: the run folder is shared
        elsewhere = LocalBackend(_run(port), tmp_path / "work2", say=lambda _l: None)
        elsewhere.workdir.mkdir()
        with pytest.raises(LocalRunError, match="is using the run folder of local-tiny"):
            elsewhere._lock()
    finally:
        first.stop()
    again = LocalBackend(_run(port), tmp_path / "work", say=lambda _l: None)
    again._lock()  # released with the first run
    again.stop()


def test_an_endpoint_held_by_another_runs_s3_is_named_not_a_credentials_error(tmp_path,
                                                                               monkeypatch):
    from asyncgrpo.local.backend import LocalBackend, LocalRunError
    from asyncgrpo.local.s3 import S3Server

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    other = S3Server.start(tmp_path / "other.log")
    try:
        backend = LocalBackend(_run(other.port, name="second"), tmp_path / "w",
                               say=lambda _l: None)
        with pytest.raises(LocalRunError, match="something already listens on 127.0.0.1:"
                           f"{other.port}.*another local run's S3 server"):
            backend._s3()
    finally:
        other.stop()


def test_the_last_runs_work_folder_is_kept_not_wiped(tmp_path):
    from asyncgrpo.local.backend import LocalBackend

    backend = LocalBackend(_run(free_port()), tmp_path, say=lambda _l: None)
    work = tmp_path / "local-tiny-trainer-0" / "work"
    (work / "output").mkdir(parents=True)
    (work / "status.json").write_text("{}")
    backend._keep_previous_work()
    assert (tmp_path / "local-tiny-trainer-0" / "work.previous" / "status.json").exists()
    assert not work.exists()


def test_the_final_output_is_named_with_where_it_lies_on_disk(tmp_path):
    """What the end of a local run can print: final/ in the bucket and on disk."""
    import json

    from asyncgrpo.local.backend import LocalBackend
    from asyncgrpo.local.s3 import S3Server

    backend = LocalBackend(_run(free_port()), tmp_path / "work", say=lambda _l: None)
    assert backend.final_output() is None
    backend.status_path = tmp_path / "status.json"
    backend.status_path.write_text(json.dumps({"outputs": [{
        "bucket": "asyncgrpo-local", "key": "asyncgrpo/default/local-tiny/final/",
        "kind": "lora", "step": 20}]}))
    server = S3Server.start(tmp_path / "s3.log", data_dir=tmp_path / "s3")
    backend.started.append(server)
    backend.stop()
    out = backend.final_output()
    assert out["local_path"] == str(tmp_path / "s3" / "asyncgrpo-local" /
                                    "asyncgrpo/default/local-tiny/final/")
    assert out["pull"].startswith("asyncgrpo pull ")
    assert backend.final_output_line().startswith("final adapter (step 20): ")

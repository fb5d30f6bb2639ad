"""AdapterStore against a real S3 server (moto_server on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncgrpo.adapters.store import (
    MANIFEST,
    AdapterCorrupt,
    AdapterIncomplete,
    AdapterNotFound,
    AdapterStore,
    AdapterVersionExists,
    Manifest,
    StoreRequestError,
    StoreUnavailable,
    adapter_name,
    parse_adapter_name,
    sha256_file,
)


class RecordingClient:
    """Passes every call to the real boto3 client and records (operation, key) in order."""

    def __init__(self, client):
        self._client = client
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name):
        fn = getattr(self._client, name)

        def call(*args, **kwargs):
            key = kwargs.get("Key") or (args[2] if name == "upload_file" else "")
            self.calls.append((name, key))
            return fn(*args, **kwargs)

        return call


def test_names_round_trip():
    assert adapter_name(3) == "policy-v3"
    assert parse_adapter_name("policy-v3") == 3
    for bad in ("policy-v", "policy-v-1", "policy-v3a", "other-v3", "policy-v٣"):
        assert parse_adapter_name(bad) is None


def test_publish_writes_files_then_manifest(store, adapters, s3_server):
    store.client = RecordingClient(store.client)
    manifest = store.publish(adapters[1], 1, step=10)

    puts = [key for op, key in store.client.calls if op in ("upload_file", "put_object")]
    vprefix = "team/x/default/run-a/adapters/v1/"
    assert puts[-1] == vprefix + MANIFEST
    assert set(puts[:-1]) == {vprefix + f for f in ("adapter_config.json",
                                                    "adapter_model.safetensors", "README.md")}

    cfg = json.loads((adapters[1] / "adapter_config.json").read_text())
    assert manifest.rank == cfg["r"] == 8
    assert manifest.base_model == cfg["base_model_name_or_path"]
    assert (manifest.version, manifest.step, manifest.run) == (1, 10, "run-a")
    weights = adapters[1] / "adapter_model.safetensors"
    assert manifest.files["adapter_model.safetensors"].sha256 == sha256_file(weights)
    assert manifest.files["adapter_model.safetensors"].size == weights.stat().st_size

    body = s3_server.client().get_object(Bucket=store.bucket, Key=vprefix + MANIFEST)["Body"].read()
    assert Manifest.from_json(body) == manifest
    assert store.manifest(1) == manifest


def test_list_latest_and_fetch_verified(store, adapters, tmp_path):
    assert store.versions() == [] and store.latest() is None
    store.publish(adapters[1], 1, step=1)
    store.publish(adapters[2], 2, step=2)
    assert store.versions() == [1, 2] and store.latest() == 2

    dest, manifest = store.fetch(2, tmp_path / "cache" / "v2")
    for rel in manifest.files:
        assert (dest / rel).read_bytes() == (adapters[2] / rel).read_bytes()
    assert (dest / MANIFEST).is_file()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no temp dir left
    assert store.verify(1).version == 1


def test_complete_version_is_never_overwritten(store, adapters):
    store.publish(adapters[1], 1, step=1)
    with pytest.raises(AdapterVersionExists):
        store.publish(adapters[2], 1, step=1)


def test_corrupt_version_refused(store, adapters, s3_server, tmp_path):
    store.publish(adapters[1], 1, step=1)
    key = store.version_prefix(1) + "adapter_model.safetensors"
    data = (adapters[1] / "adapter_model.safetensors").read_bytes()
    client = s3_server.client()

    client.put_object(Bucket=store.bucket, Key=key, Body=data[: len(data) // 2])  # truncated
    with pytest.raises(AdapterCorrupt, match="bytes, manifest says"):
        store.fetch(1, tmp_path / "v1")
    assert not (tmp_path / "v1").exists()

    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    client.put_object(Bucket=store.bucket, Key=key, Body=bytes(flipped))  # same size, bad sum
    with pytest.raises(AdapterCorrupt, match="sha256"):
        store.verify(1)

    client.delete_object(Bucket=store.bucket, Key=key)  # listed but gone
    with pytest.raises(AdapterCorrupt, match="missing"):
        store.fetch(1, tmp_path / "v1")

    client.put_object(Bucket=store.bucket, Key=store.version_prefix(1) + MANIFEST, Body=b"{not json")
    with pytest.raises(AdapterCorrupt, match="not a valid adapter manifest"):
        store.manifest(1)
    assert not (tmp_path / "v1").exists()


def test_partial_version_not_listed_and_refused(store, adapters, s3_server, tmp_path):
    store.publish(adapters[1], 1, step=1)
    # A trainer that died after uploading the weights of v2 but before its manifest.
    s3_server.client().upload_file(str(adapters[2] / "adapter_model.safetensors"), store.bucket,
                                   store.version_prefix(2) + "adapter_model.safetensors")
    assert store.versions() == [1] and store.latest() == 1
    with pytest.raises(AdapterIncomplete, match="no manifest.json"):
        store.fetch(2, tmp_path / "v2")
    with pytest.raises(AdapterNotFound):
        store.manifest(3)
    # The restarted trainer publishes v2 again: allowed, since it was never complete.
    store.publish(adapters[2], 2, step=2)
    assert store.versions() == [1, 2]


def test_retention_keeps_newest_and_staleness_margin(store, adapters, s3_server):
    for v in range(1, 7):
        store.publish(adapters[1 + v % 2], v, step=v)
    # A partial old version (dead publish long ago) and a partial newer one (in flight).
    client = s3_server.client()
    client.put_object(Bucket=store.bucket, Key=store.version_prefix(0) + "adapter_config.json", Body=b"{}")
    client.put_object(Bucket=store.bucket, Key=store.version_prefix(7) + "adapter_config.json", Body=b"{}")

    # retention 2 but max staleness 2: at least 4 versions survive.
    assert store.prune(retention=2, max_staleness=2) == [0, 1, 2]
    assert store.versions() == [3, 4, 5, 6]
    assert store.prune(retention=5, max_staleness=0) == []
    assert store.prune(retention=1, max_staleness=1) == [3]
    assert store.versions() == [4, 5, 6]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=store.bucket)["Contents"]}
    assert not [k for k in keys if "/v3/" in k or "/v0/" in k]
    assert store.version_prefix(7) + "adapter_config.json" in keys


def test_unreachable_store_gives_clear_error_without_secrets(s3_env, s3_server):
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    store = AdapterStore("b", run="r", endpoint_url=endpoint, attempts=2, backoff_s=0.01,
                         connect_timeout_s=1)
    with pytest.raises(StoreUnavailable) as info:
        store.versions()
    text = str(info.value) + repr(info.value)
    assert "unreachable after 2 attempts" in text and "s3://b/asyncgrpo/default/r/adapters/" in text
    for secret in (endpoint, str(port), s3_server.access_key, s3_server.secret_key):
        assert secret not in text
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_bucket_is_a_request_error(s3_env, s3_server):
    store = AdapterStore("no-such-bucket-here", run="r", endpoint_url=s3_server.endpoint, attempts=1)
    with pytest.raises(StoreRequestError, match="NoSuchBucket") as info:
        store.latest()
    assert s3_server.secret_key not in str(info.value)
    assert s3_server.endpoint not in str(info.value)


def test_retries_until_the_server_comes_up(s3_env, tmp_path):
    """Connection refused at first, then a real server on that port: the call gets through."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = AdapterStore("late-bucket", run="r", endpoint_url=f"http://127.0.0.1:{port}",
                         attempts=30, backoff_s=0.2, max_backoff_s=1.0, connect_timeout_s=1)
    moto = Path(sys.executable).parent / "moto_server"
    log = open(tmp_path / "moto.log", "w")  # noqa: SIM115 - outlives this block (thread)
    procs: list[subprocess.Popen] = []

    def start_later():
        time.sleep(0.5)
        procs.append(subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)],
                                      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)))

    t = threading.Thread(target=start_later)
    t.start()
    try:
        # The bucket does not exist on the fresh server: reaching it is what this proves.
        with pytest.raises(StoreRequestError, match="NoSuchBucket"):
            store.versions()
    finally:
        t.join()
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
        log.close()


def test_large_files_go_through_the_transfer_manager(store, adapters, tmp_path, monkeypatch):
    """Files above the single-request size use boto3's multipart transfer; same result."""
    import asyncgrpo.storage.versions as store_module

    monkeypatch.setattr(store_module, "SINGLE_REQUEST_BYTES", 1000)
    store.client = RecordingClient(store.client)
    store.publish(adapters[1], 1, step=1)
    assert ("upload_file", store.version_prefix(1) + "adapter_model.safetensors") in store.client.calls
    dest, _ = store.fetch(1, tmp_path / "v1")
    assert ("download_file", "") in store.client.calls
    assert (dest / "adapter_model.safetensors").read_bytes() == \
        (adapters[1] / "adapter_model.safetensors").read_bytes()

"""The resolver's core (name -> verified local directory) against the real S3 server.

The same object runs inside vLLM (tests/adapters/test_vllm_serving.py); here its failure
paths are driven directly, without a vLLM process.
"""

from __future__ import annotations

import logging

import pytest

from asyncgrpo.adapters.store import MANIFEST, AdapterStore
from asyncgrpo.adapters.vllm_plugin import S3AdapterResolver


@pytest.fixture
def resolver_env(s3_server, s3_env, bucket, tmp_path):
    return {
        **s3_env,
        "ASYNCGRPO_ADAPTER_BUCKET": bucket,
        "ASYNCGRPO_ADAPTER_PREFIX": "p",
        "ASYNCGRPO_ADAPTER_RUN": "main-run",
        "ASYNCGRPO_ADAPTER_ENDPOINT": s3_server.endpoint,
        "ASYNCGRPO_ADAPTER_CACHE_DIR": str(tmp_path / "cache"),
        "ASYNCGRPO_ADAPTER_ATTEMPTS": "1",
    }


def _store(env, run="main-run"):
    return AdapterStore.from_env({**env, "ASYNCGRPO_ADAPTER_RUN": run})


def test_names(resolver_env):
    r = S3AdapterResolver(resolver_env)
    assert r.parse("policy-v7") == ("main-run", 7)
    assert r.parse("other/policy-v7") is None  # run-qualified names only with ANY_RUN
    assert r.parse("policy-v0") is None and r.parse("Qwen/Qwen3-8B") is None
    r = S3AdapterResolver({**resolver_env, "ASYNCGRPO_ADAPTER_ANY_RUN": "1"})
    assert r.parse("other/policy-v7") == ("other", 7)
    assert r.parse("../policy-v7") is None and r.parse("a/b/policy-v7") is None
    with pytest.raises(ValueError, match="ASYNCGRPO_ADAPTER_BUCKET"):
        S3AdapterResolver({})


def test_resolves_verified_copy_and_cache_is_append_only(resolver_env, adapters, s3_server):
    store = _store(resolver_env)
    store.publish(adapters[1], 1, step=5)
    r = S3AdapterResolver(resolver_env)
    path = r.resolve("policy-v1")
    assert path == r.local_dir("main-run", 1)
    assert (path / "adapter_model.safetensors").read_bytes() == \
        (adapters[1] / "adapter_model.safetensors").read_bytes()
    assert (path / MANIFEST).is_file()
    # Pruned from the bucket later: vLLM may still reload it from disk, so the copy stays.
    store.delete_version(1)
    assert S3AdapterResolver(resolver_env).resolve("policy-v1") == path
    assert (path / "adapter_model.safetensors").is_file()


def test_refuses_corrupt_partial_and_missing(resolver_env, adapters, s3_server, caplog):
    store = _store(resolver_env)
    store.publish(adapters[1], 1, step=1)
    key = store.version_prefix(1) + "adapter_model.safetensors"
    s3_server.client().put_object(Bucket=store.bucket, Key=key, Body=b"\0" * 100)
    s3_server.client().put_object(Bucket=store.bucket,
                                  Key=store.version_prefix(2) + "adapter_config.json", Body=b"{}")
    r = S3AdapterResolver(resolver_env)
    with caplog.at_level(logging.INFO, logger="vllm.asyncgrpo"):
        assert r.resolve("policy-v1") is None
        assert r.resolve("policy-v2") is None
        assert r.resolve("policy-v3") is None
    text = caplog.text
    assert "'policy-v1' refused: corrupt version" in text
    assert "'policy-v2' refused" in text and "no manifest.json" in text
    assert "'policy-v3'" in text and "not in the bucket" in text
    assert s3_server.endpoint not in text and s3_server.secret_key not in text
    assert not r.local_dir("main-run", 1).exists()  # nothing half-verified left for vLLM

    # The trainer re-publishes v2 properly: the next request finds it (no negative cache).
    store.publish(adapters[2], 2, step=2)
    assert r.resolve("policy-v2") == r.local_dir("main-run", 2)


def test_unreachable_store_returns_none_and_logs(resolver_env, caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    r = S3AdapterResolver({**resolver_env, "ASYNCGRPO_ADAPTER_ENDPOINT": endpoint})
    with caplog.at_level(logging.ERROR, logger="vllm.asyncgrpo"):
        assert r.resolve("policy-v1") is None
    assert "unreachable after 1 attempts" in caplog.text
    assert endpoint not in caplog.text


def test_only_canonical_names_resolve(resolver_env):
    """vLLM's resolver tests expect one name per adapter: an alias takes a second LoRA slot."""
    r = S3AdapterResolver(resolver_env)
    for alias in ("policy-v01", "policy-v001", "/policy-v1", "policy-v+1", "policy-v 1"):
        assert r.parse(alias) is None, alias
    assert r.parse("policy-v10") == ("main-run", 10)
    any_run = S3AdapterResolver({**resolver_env, "ASYNCGRPO_ADAPTER_ANY_RUN": "1"})
    assert any_run.parse("/policy-v1") is None and any_run.parse("r/policy-v01") is None


def test_a_published_adapter_that_is_not_lora_is_refused(resolver_env, adapters, tmp_path,
                                                         caplog):
    """A P-tuning config in the bucket: vLLM would fail to load it and answer 400; refused here
    (and on every later call), the client gets the clean 404 of an unknown adapter."""
    import json
    import shutil

    ptuning = tmp_path / "ptuning"
    shutil.copytree(adapters[1], ptuning)
    cfg = json.loads((ptuning / "adapter_config.json").read_text())
    cfg["peft_type"] = "P_TUNING"
    (ptuning / "adapter_config.json").write_text(json.dumps(cfg))
    store = _store(resolver_env)
    store.publish(ptuning, 3, step=3)
    store.publish(adapters[1], 4, step=4)
    r = S3AdapterResolver(resolver_env)
    with caplog.at_level(logging.ERROR, logger="vllm.asyncgrpo.s3_lora_resolver"):
        assert r.resolve("policy-v3") is None
        assert r.resolve("policy-v3") is None  # the verified copy on disk is not served either
    assert "is not LORA" in caplog.text
    assert r.resolve("policy-v4") is not None

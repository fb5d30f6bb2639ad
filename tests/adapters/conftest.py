"""Fixtures of the adapter tests: a tiny base checkpoint, random adapters, an `AdapterStore` on
the shared `bucket` (tests/conftest.py).

The shared real vLLM server fixture lives in tests/vllm_server.py and is imported here so
these tests can use it; other test folders import it the same way (one server per session).
"""

from __future__ import annotations

import pytest

from tests.vllm_server import vllm_server  # noqa: F401  (fixture re-export)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """Tiny dense Qwen3 + tokenizer on disk (seed 0, same as the shared vLLM server's)."""
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("base") / "tiny-qwen3-dense")


@pytest.fixture(scope="session")
def adapters(tiny_base, tmp_path_factory):
    """Two different random adapters (rank 8) on the tiny base: {1: dir, 2: dir}."""
    from asyncgrpo.adapters.tiny import save_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for v in (1, 2):
        save_random_adapter(tiny_base, root / f"v{v}", seed=v)
        out[v] = root / f"v{v}"
    return out


@pytest.fixture
def store(s3_server, s3_env, bucket):
    from asyncgrpo.adapters.store import AdapterStore

    return AdapterStore(bucket, run="run-a", prefix="team/x", endpoint_url=s3_server.endpoint,
                        attempts=2, backoff_s=0.05)

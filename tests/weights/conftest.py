"""Fixtures of the weights tests: a `WeightStore` on the shared `bucket` (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm_server import vllm_server  # noqa: F401  (fixture re-export)

torch.set_num_threads(1)


@pytest.fixture
def store(s3_server, s3_env, bucket):
    from asyncgrpo.weights.store import WeightStore

    return WeightStore(bucket, run="run-w", prefix="team/x", endpoint_url=s3_server.endpoint,
                       attempts=2, backoff_s=0.05)

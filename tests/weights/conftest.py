"""Fixtures of the weights tests: a fresh bucket on the session's real S3 server, a store."""

from __future__ import annotations

import uuid

import pytest
import torch

from tests.vllm_server import vllm_server  # noqa: F401  (fixture re-export)

torch.set_num_threads(1)


@pytest.fixture
def bucket(s3_server):
    name = f"weights-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server.env()


@pytest.fixture
def store(s3_server, s3_env, bucket):
    from asyncgrpo.weights.store import WeightStore

    return WeightStore(bucket, run="run-w", prefix="team/x", endpoint_url=s3_server.endpoint,
                       attempts=2, backoff_s=0.05)

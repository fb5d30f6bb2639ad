"""The embedded default: `asyncgrpo local run` starts S3, vLLM and the trainer from one run
file, trains, and stops everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.local.vllm import vllm_python
from asyncgrpo.testing.net import free_port
from tests.api.invalid_specs import REPO

EXAMPLE = REPO / "examples" / "local-tiny.yaml"


def _local_run(tmp_path: Path, mutate=None, env=None, max_steps: int = 3):
    doc = yaml.safe_load(EXAMPLE.read_text())
    s3_port = free_port()
    doc["spec"]["adapterStore"]["endpoint"] = f"http://127.0.0.1:{s3_port}"
    doc["spec"]["model"]["name"] = str(tmp_path / "demo" / "tiny-qwen3")
    doc["spec"]["data"]["path"] = str(tmp_path / "demo" / "prompts.jsonl")
    doc["spec"]["trainer"]["metricsPort"] = free_port()
    if mutate:
        mutate(doc)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(doc))
    cli = [sys.executable, "-m", "asyncgrpo.cli", "local"]
    subprocess.run([*cli, "demo-assets", str(tmp_path / "demo")], check=True,
                   capture_output=True, timeout=300)
    result = subprocess.run(
        [*cli, "run", str(run_file), "--workdir", str(tmp_path / "work"),
         "--max-steps", str(max_steps)],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    return result, s3_port


@pytest.mark.slow
@pytest.mark.vllm
def test_local_run_trains_and_stops_everything(tmp_path):
    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    result, s3_port = _local_run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"starting a local S3 server on 127.0.0.1:{s3_port}" in result.stdout
    assert "run local-tiny finished: step 3, policy versions published: v1..v4" in result.stdout
    status = json.loads((tmp_path / "work" / "trainer" / "status.json").read_text())
    assert [p["version"] for p in status["published"]] == [1, 2, 3, 4]
    assert all(p.get("served") for p in status["published"][1:])  # vLLM served each update
    # nothing it started is left: the S3 port is free again, no process in their groups
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", s3_port)) != 0
    for log in ("vllm.log", "trainer.log", "s3.log"):
        assert (tmp_path / "work" / log).exists()


def test_local_run_refuses_a_run_without_endpoint(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["adapterStore"].pop("endpoint"))
    assert result.returncode == 1
    assert "spec.adapterStore.endpoint" in result.stderr


def test_local_run_names_a_missing_vllm_venv(tmp_path):
    result, _ = _local_run(tmp_path, env={"ASYNCGRPO_VLLM_VENV": str(tmp_path / "nowhere")})
    assert result.returncode == 1
    assert "no vLLM venv at" in result.stderr and "setup-vllm-venv.sh" in result.stderr


def test_local_run_refuses_an_invalid_run_file(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["trainer"].update(
        expertParallelSize=2))
    assert result.returncode == 1
    assert "spec.trainer.expertParallelSize" in result.stderr

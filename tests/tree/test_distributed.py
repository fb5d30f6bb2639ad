"""FSDP2 ranks (torchrun, gloo on CPU) training a step of tree rows equal one process training unpacked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.testing.net import free_port

WORKER = Path(__file__).with_name("fsdp_worker.py")


def run_worker(tmp_path, ranks: int, scenario: str) -> dict:
    result = tmp_path / "result.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", str(ranks), "--master_port", str(free_port()), str(WORKER),
         str(result), scenario],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


def assert_step_equals_unpacked(r: dict) -> None:
    assert abs(r["loss_sum_over_ranks_div_world"] - r["loss_reference"]) < 2e-6
    assert r["max_grad_rel_diff"] < 1e-4
    assert set(r["metrics"]) == set(r["metrics_reference"])
    for key, value in r["metrics_reference"].items():
        assert abs(r["metrics"][key] - value) < 1e-5, (key, r["metrics"][key], value)


@pytest.mark.slow
def test_fsdp2_ranks_with_uneven_micro_batches_match_unpacked_training(tmp_path):
    r = run_worker(tmp_path, 2, "uneven")
    assert r["world"] == 2 and min(r["rank_rows"]) > 0
    assert r["micro_batches"] >= 2 and len(set(r["micro_batch_trained_tokens"])) > 1
    assert_step_equals_unpacked(r)


@pytest.mark.slow
def test_more_ranks_than_rollouts_log_the_unpacked_metrics(tmp_path):
    """One 9-term rollout on 3 ranks: two filler rows, whose inert terms must not reach any metric."""
    r = run_worker(tmp_path, 3, "filler")
    assert r["world"] == 3 and r["filler_rows"] == 2
    assert_step_equals_unpacked(r)

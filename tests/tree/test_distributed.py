"""Two FSDP2 ranks (torchrun, gloo on CPU) training their tree rows equal one process training unpacked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.testing.net import free_port

WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.slow
def test_fsdp2_ranks_with_tree_rows_match_unpacked_training(tmp_path):
    result = tmp_path / "result.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(WORKER), str(result)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["world"] == 2 and min(r["rank_rows"]) > 0
    assert abs(r["loss_sum_over_ranks_div_world"] - r["loss_reference"]) < 2e-6
    assert r["max_grad_rel_diff"] < 1e-4

"""The example tasks train end to end: `asyncgrpo local run` of the task's own run file (real
vLLM CPU server, the task's package on the trainer's PYTHONPATH), with a tiny model taught to
write one tool call (asyncgrpo.testing.tool_caller), so the rollouts reach the task's real
environment through TRL's real parsing, and the run's records say so."""

from __future__ import annotations

import json
import sys
import time

import pytest

from asyncgrpo.local.vllm import vllm_python
from tests.api.invalid_specs import REPO
from tests.local.test_local_backend import _local_run

CALCULATOR = REPO / "examples" / "tasks" / "calculator-math"


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.vllm
def test_calculator_math_trains_and_its_calculator_is_called(tmp_path):
    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    sys.path.insert(0, str(CALCULATOR))
    try:
        from calculator_math.env import Calculator
    finally:
        sys.path.remove(str(CALCULATOR))
    from asyncgrpo.testing.tool_caller import save_tool_calling_checkpoint

    data = CALCULATOR / "calculator_math" / "data" / "train.jsonl"
    taught = save_tool_calling_checkpoint(
        tmp_path / "demo" / "tiny-qwen3", prompts=[r["prompt"] for r in _rows(data)],
        tools=[Calculator().calculator],
        call={"name": "calculator", "arguments": {"expression": "1 + 1"}})
    print(f"tool-call fine-tuning: {taught}")

    def task(d):  # the task's run file as shipped, its paths made absolute
        d["spec"]["data"] = {"path": str(data)}
        for e in d["spec"]["trainer"]["env"]:
            if e["name"] == "PYTHONPATH":
                e["value"] = str(CALCULATOR)

    t0 = time.monotonic()
    result, _ = _local_run(tmp_path, mutate=task, max_steps=2, example=CALCULATOR / "run.yaml")
    print(f"local run of calculator-math, 2 steps: {time.monotonic() - t0:.0f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "run calculator-math finished: step 2" in result.stdout, result.stdout
    work = tmp_path / "work"
    status = json.loads((work / "calculator-math-trainer-0" / "work" / "status.json")
                        .read_text())
    history = status["history"]
    print("history:", history)
    assert [h["step"] for h in history] == [1, 2]
    # TRL's worker parsed calls from vLLM's text and ran them on Calculator.calculator: the
    # calls per rollout it counted, none failed (an unknown tool or a raising method would)
    assert any(h.get("tools/call_frequency", 0) > 0 for h in history), history
    assert all(h.get("tools/failure_frequency", 0) == 0 for h in history), history

"""The example tasks of examples/tasks/ as packages, driven the way TRL's rollout worker
drives an environment (pickled factory from the run file, reset(**row), tools, get_reward)
and the way it calls a reward (completions plus the row's columns); the code-fix task
against real sandbox servers behind a real gateway, its reward through `/v1/score`."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path

import httpx
import pytest
from transformers.utils import get_json_schema

from asyncgrpo.api import load_run
from asyncgrpo.preflight import check_modules
from asyncgrpo.sandbox.client.environment import SandboxEnvConfig
from asyncgrpo.trainer.data import parse_jsonl
from asyncgrpo.trainer.environments import UserEnvironmentFactory
from asyncgrpo.trainer.rewards import build_rewards
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "tasks"


def rows(task: str, package: str) -> list[dict]:
    text = (TASKS / task / package / "data" / "train.jsonl").read_text()
    return parse_jsonl(text, "prompt", task)


def tools_of(env) -> list[str]:
    return sorted(n for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                  if n not in ("reset", "get_reward") and not n.startswith("_"))


def factory_of(task: str, sandbox=None) -> UserEnvironmentFactory:
    """The factory the trainer makes from the task's run file (its path: the task folder)."""
    run = load_run(TASKS / task / "run.yaml")
    ref = run.spec.harness.environment
    return pickle.loads(pickle.dumps(UserEnvironmentFactory(
        ref.module, ref.args, path=str(TASKS / task), sandbox=sandbox)))


def test_calculator_task_tools_reward_and_run_file(monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS / "calculator-math"))
    env = factory_of("calculator-math")()
    assert type(env).__name__ == "Calculator" and tools_of(env) == ["calculator"]
    schema = get_json_schema(env.calculator)["function"]
    assert schema["parameters"]["required"] == ["expression"]
    data = rows("calculator-math", "calculator_math")
    assert len(data) == 24 and all(set(r) == {"prompt", "answer"} for r in data)
    row = data[0]
    env.reset(**row)
    expression = row["prompt"][0]["content"].split("What is ")[1].split("?")[0]
    assert env.calculator(expression) == row["answer"]  # the data's answers are right
    assert env.calculator("1/3") == "0.333333" and env.calculator("2**0.5 * 2**0.5") == "2"
    # refused, as text the model reads: no names, no huge powers, no division by zero
    for bad in ("__import__('os')", "9**9**9", "1/0", "x + 1", "(" * 300):
        assert env.calculator(bad).startswith("error: ")
    assert env.calls == 8
    # the run's reward, as TRL calls it: one group, the row's columns aligned
    run = load_run(TASKS / "calculator-math" / "run.yaml")
    (reward,) = build_rewards(run.spec.reward)
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": expression}}}]},
        {"role": "tool", "name": "calculator", "content": row["answer"]}]
    completions = [calls + [{"role": "assistant", "content": f"The answer is {row['answer']}."}],
                   calls + [{"role": "assistant", "content": "The answer is 12."}],
                   [{"role": "assistant", "content": "no idea"}]]
    got = reward(completions, prompts=[row["prompt"]] * 3, completion_ids=[[1]] * 3,
                 answer=[row["answer"]] * 3)
    assert got == [1.0, 0.0, 0.0]
    # what `validate --deep` checks of the modules: they import and take TRL's call
    assert list(check_modules(run, {"answer"})) == []


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    sbs = [start_sandbox(tmp_path, f"fix{i}") for i in range(3)]
    gw = start_gateway(tmp_path, [s.url for s in sbs], "--lease-ttl-seconds", "10",
                       "--health-interval-seconds", "0.3")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 3, 30, what="pool warm")
    yield gw
    gw.stop()
    for s in sbs:
        s.stop()


FIXED_MEDIAN = ("def median(xs):\n    xs = sorted(xs)\n    n = len(xs)\n"
                "    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2\n")


def test_code_fix_task_in_sandboxes_scored_by_the_tests_where_it_never_ran(gateway, monkeypatch):
    monkeypatch.syspath_prepend(str(TASKS / "code-fix"))
    cfg = SandboxEnvConfig(num_generations=3, gateway_url=gateway.url, heartbeat_seconds=0.5,
                           timeout_seconds=20)
    factory = factory_of("code-fix", sandbox=cfg)
    envs = [factory() for _ in range(3)]
    assert type(envs[0]).__name__ == "CodeFix"
    assert tools_of(envs[0]) == ["read_file", "run_tests", "write_file"]
    for name in ("read_file", "run_tests", "write_file"):
        get_json_schema(getattr(envs[0], name))
    data = rows("code-fix", "code_fix")
    assert len(data) == 4
    row = data[0]
    assert json.loads(row["files"]).keys() == {"stats.py", "test_stats.py"}
    for env in envs:
        env.reset(**row)
    honest, fixed, cheat = envs
    assert "xs[len(xs) // 2]" in honest.read_file("stats.py")  # seeded from the row's files
    before = honest.run_tests()
    assert "FAILED (failures=1)" in before and "Ran 3 tests" in before
    assert fixed.write_file("stats.py", FIXED_MEDIAN).startswith("wrote")
    assert "OK" in fixed.run_tests()
    # the cheat empties the tests in its session: its own run says OK, the score does not
    assert cheat.write_file("test_stats.py", "import unittest\n").startswith("wrote")
    assert "OK" in cheat.run_tests() or "Ran 0 tests" in cheat.run_tests()
    rewards = [env.get_reward() for env in envs]
    assert rewards == [pytest.approx(2 / 3), 1.0, pytest.approx(2 / 3)]
    demand = lambda: httpx.get(f"{gateway.url}/v1/demand").json()
    wait_until(lambda: demand()["leases_active"] == 0, 20, what="leases released after get_reward")


PREFLIGHT = """
import sys
from asyncgrpo.api import load_run
from asyncgrpo.preflight import preflight
run = load_run(sys.argv[1])
if sys.argv[2] == "drop":
    run.spec.trainer.env = [v for v in run.spec.trainer.env if v.name != "PYTHONPATH"]
for e in preflight(run, tokenizer=False).errors:
    print(e)
"""


@pytest.mark.parametrize("task", ["calculator-math", "code-fix"])
def test_the_deep_checks_find_the_tasks_modules_where_the_trainer_does(task):
    """`validate --deep` (and the start of `local run`) imports the task's modules from the
    trainer's PYTHONPATH, as the local trainer pod does; without it, it names the field.
    A fresh process each: an earlier import must not hide a path that is missing."""
    import subprocess
    import sys

    def errors(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", PREFLIGHT, f"examples/tasks/{task}/run.yaml", mode],
                              cwd=REPO, capture_output=True, text=True, check=True).stdout

    assert "module" not in errors("keep")
    assert "spec.harness.environment.module" in errors("drop")

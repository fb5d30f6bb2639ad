"""The TRL harness environment against a real gateway and real sandbox servers.

TRL's rollout worker is driven the way it drives environments (trl 1.16.0
`async_rollout_worker._generate_loop`): the factory is pickled, instances are made by
calling it, tools are the class's public functions, `reset(**row)` runs in draw order, tool
calls run concurrently in threads, `get_reward()` ends each rollout.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from transformers.utils import get_json_schema

from asyncgrpo.sandbox.client.environment import SandboxEnvironmentFactory
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

CALC = "def add(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
TESTS = (
    "import unittest\nfrom calc import add, mul\n\n"
    "class T(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n\n"
    "if __name__ == '__main__':\n    unittest.main()\n"
)
ROW = {"prompt": [{"role": "user", "content": "Fix calc.py"}], "files": {"calc.py": CALC, "test_calc.py": TESTS},
       "test_command": "python3 -m unittest -v 2>&1"}


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    sbs = [start_sandbox(tmp_path, f"env{i}") for i in range(3)]
    gw = start_gateway(tmp_path, [s.url for s in sbs], "--lease-ttl-seconds", "10",
                       "--health-interval-seconds", "0.3")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 3, 30, what="pool warm")
    yield gw
    gw.stop()
    for s in sbs:
        s.stop()


def tools_of(env) -> dict:
    """Exactly TRL's discovery: public functions of the class but reset/get_reward."""
    return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


def demand(gw) -> dict:
    return httpx.get(f"{gw.url}/v1/demand").json()


def test_tools_are_what_trl_and_transformers_can_describe():
    factory = pickle.loads(pickle.dumps(SandboxEnvironmentFactory(num_generations=2, gateway_url="http://127.0.0.1:9")))
    env = factory()
    tools = tools_of(env)
    assert sorted(tools) == ["python", "read_file", "shell", "write_file"]
    for name, fn in tools.items():
        schema = get_json_schema(fn)
        assert schema["function"]["name"] == name
        assert schema["function"]["parameters"]["required"]
    only = SandboxEnvironmentFactory(num_generations=2, gateway_url="http://127.0.0.1:9", tools=["shell"])()
    assert sorted(tools_of(only)) == ["shell"]
    assert callable(env.reset) and callable(env.get_reward)
    with pytest.raises(ValueError, match="unknown sandbox tools"):
        SandboxEnvironmentFactory(num_generations=2, tools=["rm_rf"])


def test_each_rollout_of_a_group_has_its_own_sandbox_and_is_scored_by_its_tests(gateway):
    factory = pickle.loads(pickle.dumps(SandboxEnvironmentFactory(
        num_generations=3, gateway_url=gateway.url, heartbeat_seconds=0.5, timeout_seconds=2,
        max_output_bytes=1000)))
    envs = [factory() for _ in range(3)]
    for env in envs:  # TRL awaits each reset in draw order
        assert env.reset(**ROW) is None

    fix = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"
    plays = [
        lambda e: [e.write_file("calc.py", fix), e.shell("python3 -c 'import calc; print(calc.add(2, 3))'")],
        lambda e: [e.read_file("calc.py"), e.python("import calc\nprint(calc.add(2, 3))")],
        lambda e: [e.shell("echo 'def broken(:' > calc.py"), e.read_file("calc.py")],
    ]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda pair: pair[1](pair[0]), zip(envs, plays)))
    assert results[0] == [f"wrote {len(fix)} bytes to calc.py", "exit code: 0\nstdout:\n5"]
    assert results[1] == [CALC, "exit code: 0\nstdout:\n-1"]  # its own session: unfixed
    assert results[2][1] == "def broken(:\n"
    d = demand(gateway)
    assert d["leases_active"] == 3 and d["busy"] == 3  # a sandbox per rollout: siblings isolated

    rewards = [envs[0].get_reward(), envs[1].get_reward()]
    assert demand(gateway)["leases_active"] == 1  # the third rollout still runs
    rewards.append(envs[2].get_reward())
    assert rewards == [1.0, 0.5, 0.0]
    wait_until(lambda: demand(gateway)["leases_active"] == 0 and demand(gateway)["idle"] == 3, 20,
               what="every rollout's lease released")

    # the next group starts from the row's files again, on a reset sandbox
    for env in envs:
        env.reset(**ROW)
    assert envs[0].shell("cat calc.py; ls") == "exit code: 0\nstdout:\n" + CALC + "calc.py\ntest_calc.py"
    for env in envs:
        env.get_reward()
    wait_until(lambda: demand(gateway)["leases_active"] == 0, 20, what="second group released")


def test_timeouts_truncation_and_refusals_come_back_as_tool_results(gateway):
    factory = SandboxEnvironmentFactory(num_generations=2, gateway_url=gateway.url, timeout_seconds=1,
                                        max_output_bytes=256, heartbeat_seconds=0.5)
    a, b = factory(), factory()
    row = {"prompt": "x"}
    a.reset(**row)
    b.reset(**row)
    assert a.python("import time\nwhile True: time.sleep(0.01)") == "timed out after 1s (killed)"
    big = a.shell("yes | head -c 100000")
    assert big.startswith("exit code: 0\nstdout:\ny\ny") and big.endswith("[stdout truncated: 100000 bytes in all]")
    assert len(big) < 600
    assert a.read_file("../../etc/passwd").startswith("error: path_refused")
    assert a.read_file("missing.txt").startswith("error: not_found")
    # identical calls give identical results (no timings): shared prefixes stay shared
    assert a.shell("echo same; ls") == b.shell("echo same; ls")
    assert a.get_reward() is None and b.get_reward() is None  # the row has no tests
    wait_until(lambda: demand(gateway)["leases_active"] == 0, 20, what="released")


def test_the_trainer_side_needs_no_server_framework():
    """The trainer image has pydantic and httpx but not FastAPI/Starlette (the sandbox image's):
    the client, the environment and the shared message types must import without them."""
    code = ("import sys; import asyncgrpo.sandbox.client.gateway_client, asyncgrpo.sandbox.client.environment, "
            "asyncgrpo.sandbox.common.messages; "
            "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

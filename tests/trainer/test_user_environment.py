"""spec.harness.environment: a user's own TRL environment class, with and without the
group's sandbox (real gateway, real sandbox servers), driven the way TRL 1.16's rollout
worker drives environments (pickled factory, tools listed from the class, reset(**row),
get_reward())."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import httpx
import pytest
from transformers.utils import get_json_schema

from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.api.validation import semantic_errors
from asyncgrpo.sandbox.client.environment import SandboxEnvConfig
from asyncgrpo.trainer.environments import UserEnvironmentFactory
from asyncgrpo.trainer.main import environment_factory
from asyncgrpo.trainer.runtime_env import RuntimeEnv
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

HERE = str(Path(__file__).parent / "user_env")


def tools_of(env) -> dict:
    return {n: getattr(env, n) for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")}


def test_a_plain_environment_gets_its_args_and_keeps_trls_protocol():
    factory = pickle.loads(pickle.dumps(UserEnvironmentFactory("calc_env:Calculator", {"precision": 2},
                                                               path=HERE)))
    env = factory()
    assert type(env).__name__ == "Calculator" and env.precision == 2
    assert sorted(tools_of(env)) == ["multiply"]
    assert get_json_schema(env.multiply)["function"]["parameters"]["required"] == ["a", "b"]
    env.reset(prompt="2*3.5?", answer="7")
    assert env.multiply(2, 3.5) == "7.0" and env.get_reward() == 1.0


def test_bad_environments_fail_at_startup_naming_what_is_wrong():
    with pytest.raises(ValueError, match="cannot be loaded"):
        UserEnvironmentFactory("calc_env:Nope", path=HERE)
    with pytest.raises(TypeError, match=r"takes no argument\(s\) \['digits'\]"):
        UserEnvironmentFactory("calc_env:Calculator", {"digits": 3}, path=HERE)
    with pytest.raises(TypeError, match="tool NoSchema.look has no usable schema"):
        UserEnvironmentFactory("calc_env:NoSchema", path=HERE)


def run_with(harness: dict, sandboxes: bool) -> AsyncGRPORun:
    spec = {"model": {"name": "m"}, "data": {"path": "p.jsonl"},
            "reward": {"functions": [{"name": "exact_match"}]}, "harness": harness,
            "trainer": {"numGenerations": 2}, "adapterStore": {"bucket": "bucket"}}
    if sandboxes:
        spec["sandboxes"] = {}
    return AsyncGRPORun.model_validate({"apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
                                        "metadata": {"name": "r"}, "spec": spec})


def test_the_run_names_the_environment_and_validation_keeps_it_multi_turn():
    env = {"module": "calc_env:Calculator", "args": {"precision": 3}, "path": HERE}
    f = environment_factory(run_with({"type": "multi-turn", "environment": env}, False), RuntimeEnv(vllm_url="x"))
    assert isinstance(f, UserEnvironmentFactory) and f.sandbox is None and f().precision == 3
    f = environment_factory(run_with({"type": "multi-turn", "environment": {"module": "calc_env:Repo", "path": HERE}},
                                     True), RuntimeEnv(vllm_url="x", gateway_url="http://gw"))
    assert f.sandbox.num_generations == 2 and f.sandbox.gateway_url == "http://gw"
    paths = {e.path for e in semantic_errors(run_with({"environment": env}, False))}
    assert "spec.harness.environment" in paths
    paths = {e.path for e in semantic_errors(run_with({"type": "multi-turn", "environment": env, "tools": ["shell"]},
                                                   True))}
    assert "spec.harness.tools" in paths


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    sbs = [start_sandbox(tmp_path, f"env{i}") for i in range(2)]
    gw = start_gateway(tmp_path, [s.url for s in sbs], "--lease-ttl-seconds", "10",
                       "--health-interval-seconds", "0.3")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 2, 30, what="pool warm")
    yield gw
    gw.stop()
    for s in sbs:
        s.stop()


def test_a_users_tools_run_in_the_groups_sandbox_with_private_sessions(gateway):
    cfg = SandboxEnvConfig(num_generations=2, gateway_url=gateway.url, heartbeat_seconds=0.5, timeout_seconds=5)
    factory = pickle.loads(pickle.dumps(UserEnvironmentFactory("calc_env:Repo", path=HERE, sandbox=cfg)))
    envs = [factory(), factory()]
    assert type(envs[0]).__name__ == "Repo" and sorted(tools_of(envs[0])) == ["replace_file", "run"]
    row = {"id": 1, "files": {"check.py": "import sys\nsys.exit(open('x').read() != 'ok')\n", "x": "no"}}
    for env in envs:
        env.reset(**row)
    assert envs[0].row_id == 1
    assert envs[0].replace_file("x", "ok") == "wrote 2 bytes to x"
    assert envs[1].run("cat x") == "exit code: 0\nstdout:\nno"  # its own session
    assert envs[1].replace_file("../../etc/x", "no").startswith("error:")  # the server's path checks
    demand = lambda: httpx.get(f"{gateway.url}/v1/demand").json()
    assert demand()["leases_active"] == 2  # a sandbox per rollout: siblings never share one
    assert [envs[0].get_reward(), envs[1].get_reward()] == [1.0, 0.0]
    wait_until(lambda: demand()["leases_active"] == 0, 20, what="leases released after each get_reward")

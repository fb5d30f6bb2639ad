"""The environment inside TRL's own rollout loop code (trl 1.16.0), against a real gateway.

`_AsyncRolloutLoop` is built with our factory the way the trainer builds it: its constructor
probes the environment (reset, tools, `get_reward` as a reward source) and renders the tool
schemas through the chat template. Tool calls then go through TRL's `_execute_tool_calls`
with the tool dict built as `_generate_loop` builds it, so the strings the model would see are
the ones TRL produces. Only generation (vLLM) is not involved.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import multiprocessing as mp

import httpx
import pytest

from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

trl_loop = pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker")
datasets = pytest.importorskip("datasets")


def test_trl_rollout_loop_probes_and_calls_the_sandbox_environment(tmp_path, monkeypatch):
    from asyncgrpo.sandbox.client.environment import SandboxEnvironmentFactory
    from asyncgrpo.trainer.tiny_tokenizer import tiny_tokenizer

    # a sandbox per rollout (siblings never share one): two for the group of two
    sbs = [start_sandbox(tmp_path, f"trl{i}") for i in range(2)]
    gw = start_gateway(tmp_path, [sb.url for sb in sbs], "--health-interval-seconds", "0.3")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    try:
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 2, 30, what="pool warm")
        row = {"prompt": [{"role": "user", "content": "make hello.txt"}], "test_command": "grep -q hello hello.txt",
               "editable": ["hello.txt"]}  # the task author's contract: what the rollout may change
        dataset = datasets.Dataset.from_list([row])
        ctx = mp.get_context("spawn")
        tok = tiny_tokenizer()
        loop = trl_loop._AsyncRolloutLoop(
            model_name="tiny", dataset=dataset, reward_funcs=[], processing_class=tok,
            eos_token_ids=[tok.eos_token_id], rollout_buffer=ctx.Queue(), model_version_value=ctx.Value("i", 0),
            heartbeat_value=ctx.Value("d", 0.0), failed_event=ctx.Event(), exception_info_queue=ctx.Queue(),
            metrics_queue=ctx.Queue(), num_generations=2, max_inflight_tasks=4,
            environment_factory=SandboxEnvironmentFactory(num_generations=2, gateway_url=gw.url,
                                                          heartbeat_seconds=0.5),
        )
        env_type = loop._environment_pool[None][0].__class__
        assert loop._env_reward_types == [env_type]  # get_reward: the env scores its rollouts
        assert sorted(t.__name__ for t in loop._env_tools[None]) == ["python", "read_file", "shell", "write_file"]
        # the tool schemas render through the chat template, as every turn does
        tok.apply_chat_template(row["prompt"], tools=loop._env_tools[None], add_generation_prompt=True)

        async def one_group():
            envs = []
            for _ in range(2):  # as _generate_loop: pop or create, reset in draw order
                pool = loop._environment_pool[None]
                env = pool.pop() if pool else loop.environment_factories[None]()
                await asyncio.get_running_loop().run_in_executor(loop._tool_pool,
                                                                 functools.partial(env.reset, **row))
                envs.append(env)

            def tool_dict(env):
                return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
                        if name not in ("reset", "get_reward") and not name.startswith("_")}

            calls = [[{"function": {"name": "write_file", "arguments": {"path": "hello.txt", "content": "hello"}}},
                      {"function": {"name": "shell", "arguments": {"command": "cat hello.txt"}}}],
                     [{"function": {"name": "shell", "arguments": {"command": "ls; exit 4"}}},
                      {"function": {"name": "nope", "arguments": {}}}]]
            results = await asyncio.gather(*(loop._execute_tool_calls(c, tool_dict(e)) for c, e in zip(calls, envs)))
            rewards = [await asyncio.get_running_loop().run_in_executor(loop._tool_pool, e.get_reward) for e in envs]
            return results, rewards

        results, rewards = loop._loop.run_until_complete(one_group())
        (msgs0, calls0, fails0), (msgs1, calls1, fails1) = results
        assert [m["content"] for m in msgs0] == ["wrote 5 bytes to hello.txt", "exit code: 0\nstdout:\nhello"]
        assert msgs1[0]["content"] == "exit code: 4"  # its own sandbox: nothing there
        assert (calls0, fails0, calls1, fails1) == (2, 0, 2, 1)  # the unknown tool is the one failure
        assert rewards == [1.0, 0.0]
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["leases_active"] == 0, 20, what="released")
        loop._tool_pool.shutdown()
        loop._loop.close()
    finally:
        gw.stop()
        for sb in sbs:
            sb.stop()

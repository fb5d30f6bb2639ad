"""Sandbox leases from the warm pool on the test cluster's node: FreshPerGroup against Reuse.

One run of this script brings up the project's test cluster with its real node
(asyncgrpo.testing.node, the API server's opt-in audit log of writes on), imports the
operator and sandbox images into the node's containerd, installs the operator with the
project's Helm chart, and then, for each lifecycle in turn, applies a run that has a sandbox
pool (its vLLM pod names a scheduler that does not exist, so it stays Pending and the trainer,
which waits for vLLM, never starts: only the gateway and the sandbox pods run) and drives
leases through the gateway's HTTP API at a steady rate, as rollout groups would: take a lease
(`POST /v1/leases`, what is timed), run one command in the sandbox, hold it, release it.

It records, per lifecycle:
- lease acquire latency (p50/p99/max), and the exec on the fresh lease;
- the pool over time (`GET /v1/demand` every 0.25 s): warm sandboxes at the lowest, time
  from the last release until the pool is back at its warm target (minWarm), pods that turned
  warm per second during the drive (the refill rate), and per replacement pod: retired ->
  deleted by the operator, and created -> warm (pod start + the gateway's health check and
  reset);
- API writes during the drive from the audit log, by user, verb and resource, in the run's
  namespace, and per lease; pod starts per lease (sandbox pods the operator created).

Prints one table with both lifecycles side by side; `--json` writes everything.

    flock /tmp/asyncgrpo-node.lock python bench/sandbox_pool_node_bench.py --leases 20

Needs root (the node), the images (`make images`) and the cluster binaries, as the node
e2e tests do. Results: docs/benchmarks/sandbox-pool.md.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from asyncgrpo import wire
from asyncgrpo.testing.shell import sh

IMAGE_TAG = os.environ.get("IMAGE_TAG") or \
    (REPO / "pyproject.toml").read_text().split('version = "', 1)[1].split('"', 1)[0]
SANDBOX_IMAGE = f"ghcr.io/asyncgrpo/sandbox:{IMAGE_TAG}"
OPERATOR_NAMESPACE = "asyncgrpo-system"
LIFECYCLES = ("FreshPerGroup", "Reuse")
#: agent-sandbox's published warm-pool claim latency (ms), for the comparison column
AGENT_SANDBOX_MS = {"p50": 92, "p99": 376}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def parse_ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


class Kube:
    def __init__(self, kubeconfig: Path):
        self.kubectl_bin = shutil.which("kubectl") or str(wire.user_cache_dir() / "bin" / "kubectl")
        self.kubeconfig = str(kubeconfig)

    def __call__(self, *args: str, input: str | None = None, check: bool = True,
                 timeout: float = 120) -> str:
        return sh(self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args, input=input,
                  check=check, timeout=timeout)

    def apply(self, *docs: dict) -> None:
        self("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                    "items": list(docs)}))

    def get_json(self, *args: str) -> dict:
        out = self(*args, "-o", "json", check=False)
        return json.loads(out) if out.strip() else {}


def wait_for(what: str, fn, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def bench_run(name: str, ns: str, s3_endpoint: str, lifecycle: str, min_warm: int,
              max_pods: int, hard_cap: int | None = None) -> dict:
    """The smallest run with a sandbox pool: vLLM is held Pending (a scheduler nobody runs),
    so the trainer never starts; the gateway and the sandbox pods are the operator's."""
    return {"apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "model": {"name": "/models/none", "dtype": "float32",
                          "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj"]}},
                "trainer": {"gpusPerReplica": 0, "numGenerations": 4, "promptsPerStep": 2,
                            "totalSteps": 1},
                "rollout": {"gpusPerReplica": 0,
                            "pod": {"schedulerName": "asyncgrpo-bench-no-scheduler"}},
                "harness": {"type": "multi-turn", "maxTurns": 2, "tools": ["shell"]},
                "sandboxes": {"image": SANDBOX_IMAGE, "minWarm": min_warm, "max": max_pods,
                              "hardCap": hard_cap or max_pods, "lifecycle": lifecycle,
                              "execTimeoutSeconds": 30,
                              # small requests: the node has 2 CPUs for everything
                              "resources": {"requests": {"cpu": "10m", "memory": "64Mi"},
                                            "limits": {"cpu": "1", "memory": "512Mi"}}},
                "adapterStore": {"endpoint": s3_endpoint, "bucket": f"bench-{name}",
                                 "credentialsSecret": {"name": "s3"},
                                 "deletionPolicy": "Delete"},
                "data": {"configMap": {"name": "prompts", "key": "prompts.jsonl"}},
                "reward": {"functions": [{"name": "sandbox_tests", "args": {
                    "test_command": "true", "extract": False}}]},
            }}


class Poller(threading.Thread):
    """`GET /v1/demand` every `interval` s: (wall time, document) samples."""

    def __init__(self, client, interval: float = 0.25):
        super().__init__(daemon=True)
        self.client, self.interval = client, interval
        self.samples: list[tuple[float, dict]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.samples.append((time.time(), self.client.demand()))
            except Exception as e:  # noqa: BLE001 (a failed poll is a gap, not an end)
                log(f"demand poll failed: {e}")
            self.stop_event.wait(self.interval)

    def warm(self, doc: dict) -> int:
        return sum(1 for s in (doc.get("members") or {}).values() if s == "warm")


def drive(client_factory, leases: int, rate: float, hold_s: float) -> list[dict]:
    """`leases` groups at `rate` per second: lease, one exec, hold, release."""
    local = threading.local()
    t0 = time.monotonic() + 0.5
    results: list[dict] = []

    def one(i: int) -> dict:
        if not hasattr(local, "client"):
            local.client = client_factory()
        c = local.client
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        rec: dict = {"i": i, "scheduled": t0 + i / rate, "start_wall": time.time()}
        t = time.perf_counter()
        try:
            lease = c.lease(f"bench-{uuid.uuid4().hex[:12]}", wait_seconds=120)
        except Exception as e:  # noqa: BLE001 (recorded)
            rec["error"] = f"lease: {e!r}"
            return rec
        rec["acquire_ms"] = (time.perf_counter() - t) * 1000
        rec["sandbox"] = lease.sandbox
        t = time.perf_counter()
        try:
            out = c.exec(lease, "true", timeout_seconds=20)
            rec["exec_ms"] = (time.perf_counter() - t) * 1000
            rec["exit_code"] = out.exit_code
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"exec: {e!r}"
        time.sleep(hold_s)
        try:
            c.release(lease)
        except Exception as e:  # noqa: BLE001
            rec.setdefault("error", f"release: {e!r}")
        rec["released_wall"] = time.time()
        return rec

    workers = max(4, int(rate * (hold_s + 5)) + 4)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(one, range(leases)))
    return results


def who(e: dict) -> str:
    """The writer: its user, and the program (user agent) where users are shared (the test
    node's kubelet, scheduler and controller-manager all use the admin kubeconfig)."""
    user = e["user"]["username"].removeprefix("system:serviceaccount:")
    agent = (e.get("userAgent") or "?").split("/", 1)[0]
    if user.endswith(":asyncgrpo-operator"):
        return "operator"
    return f"{user}({agent})"


def audit_summary(events: list[dict], ns: str, t0: float, t1: float) -> dict:
    """Writes in [t0, t1] on objects of namespace `ns`, by user/verb/resource."""
    by = collections.Counter()
    for e in events:
        if e.get("stage") != "ResponseComplete":
            continue
        ref = e.get("objectRef") or {}
        if ref.get("namespace") != ns:
            continue
        t = parse_ts(e["requestReceivedTimestamp"])
        if not (t0 <= t <= t1):
            continue
        res = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        by[(who(e), e["verb"], res)] += 1
    return {" ".join(k): v for k, v in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))}


def pod_events(events: list[dict], ns: str, prefix: str, t0: float, t1: float,
               verb: str) -> list[tuple[float, str]]:
    """(time, pod) of the operator's `verb` on the run's sandbox pods (not the kubelet's final
    delete of a terminated pod)."""
    out = []
    for e in events:
        ref = e.get("objectRef") or {}
        if (e.get("stage") == "ResponseComplete" and e["verb"] == verb and who(e) == "operator"
                and ref.get("namespace") == ns and ref.get("resource") == "pods"
                and not ref.get("subresource")
                and (e.get("responseStatus") or {}).get("code", 0) < 300):
            name = ref.get("name") or ""
            if verb == "create" and not name:
                name = ((e.get("responseObject") or {}).get("metadata") or {}).get("name", "")
            t = parse_ts(e["requestReceivedTimestamp"])
            if name.startswith(prefix) and t0 <= t <= t1:
                out.append((t, name))
    return sorted(out)


def one_lifecycle(kube: Kube, cluster, s3, config: str, args) -> dict:
    """`config`: a lifecycle, optionally `:<minWarm>` (e.g. FreshPerGroup:12)."""
    from asyncgrpo.sandbox.client.gateway_client import GatewayClient

    lifecycle, _, warm = config.partition(":")
    args = argparse.Namespace(**{**vars(args), "min_warm": int(warm) if warm else args.min_warm})
    name = "pool"
    ns = f"bench-{lifecycle.lower()}" + (f"-w{warm}" if warm else "")
    log(f"{lifecycle}: namespace {ns}")
    kube("create", "namespace", ns)
    kube("-n", ns, "create", "secret", "generic", "s3",
         f"--from-literal=AWS_ACCESS_KEY_ID={s3.access_key}",
         f"--from-literal=AWS_SECRET_ACCESS_KEY={s3.secret_key}")
    kube("-n", ns, "label", "secret", "s3", "asyncgrpo.dev/s3-credentials=true")
    kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "prompts", "namespace": ns},
                "data": {"prompts.jsonl": '{"prompt": "Say something."}\n'}},
               bench_run(name, ns, s3.endpoint, lifecycle, args.min_warm, args.max_pods,
                         args.hard_cap))

    def gateway_ip():
        pods = kube.get_json("-n", ns, "get", "pods", "-l", "app.kubernetes.io/component=gateway")
        for p in pods.get("items", []):
            st = p.get("status", {})
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in st.get("conditions", []))
            if ready and st.get("podIP"):
                return st["podIP"]
        return None

    ip = wait_for("the gateway pod Ready", gateway_ip, timeout=args.ready_timeout)
    secret = kube.get_json("-n", ns, "get", "secret", f"{name}-tokens")
    token = base64.b64decode(secret["data"]["gateway-token"]).decode()
    url = f"http://{ip}:{wire.GATEWAY_PORT}"

    def client():
        return GatewayClient(url, token)

    control = client()
    poller = Poller(control)
    poller.start()
    wait_for(f"{args.min_warm} warm sandboxes", lambda: poller.samples and poller.warm(
        poller.samples[-1][1]) >= args.min_warm and poller.samples[-1][1].get("starting", 0) == 0,
        timeout=args.ready_timeout)
    time.sleep(args.settle)  # the operator's last creations settle; no write of the bring-up
    log(f"{lifecycle}: pool warm ({poller.warm(poller.samples[-1][1])}); driving "
        f"{args.leases} leases at {args.rate}/s, held {args.hold}s")
    t0 = time.time()
    recs = drive(client, args.leases, args.rate, args.hold)
    t_last_release = max((r.get("released_wall", 0) for r in recs), default=time.time())
    log(f"{lifecycle}: drive done in {time.time() - t0:.1f} s; waiting for the pool to refill")

    def refilled():
        doc = poller.samples[-1][1] if poller.samples else {}
        return poller.warm(doc) >= args.min_warm and doc.get("busy", 0) == 0
    try:
        wait_for("the pool back at minWarm", refilled, timeout=args.refill_timeout, interval=0.25)
    except TimeoutError as e:
        log(f"{lifecycle}: {e}")
    t1 = time.time()
    time.sleep(1.0)  # the audit log's last lines
    poller.stop_event.set()
    poller.join(timeout=5)
    events = cluster.read_audit()
    samples = [(t, d) for t, d in poller.samples if t0 <= t <= t1 + 1]

    # this run's pods go before the next lifecycle's run starts (they would share the CPUs)
    kube("-n", ns, "delete", "agr", name, "--wait=false")
    try:
        wait_for(f"{ns}'s pods gone", lambda: not kube.get_json(
            "-n", ns, "get", "pods").get("items"), timeout=180, interval=2)
    except TimeoutError as e:
        log(f"{lifecycle}: {e}")

    ok = [r for r in recs if "acquire_ms" in r]
    acq = [r["acquire_ms"] for r in ok]
    execs = [r["exec_ms"] for r in recs if "exec_ms" in r]
    errors = [r["error"] for r in recs if "error" in r]
    back_at = next((t for t, d in samples if t >= t_last_release
                    and poller.warm(d) >= args.min_warm and d.get("busy", 0) == 0), None)
    # pods that turned warm during the drive: a name seen warm after a sample it was not
    prev: dict[str, str] = {}
    turned_warm: list[tuple[float, str]] = []
    for t, d in samples:
        members = d.get("members") or {}
        for m, state in members.items():
            if state == "warm" and prev.get(m) != "warm":
                turned_warm.append((t, m))
        prev = members
    prefix = f"{name}-sandbox-"
    creates = pod_events(events, ns, prefix, t0, t1, "create")
    deletes = pod_events(events, ns, prefix, t0, t1, "delete")
    create_to_warm = []
    for tc, pod in creates:
        w = next((t for t, m in turned_warm if m == pod and t >= tc), None)
        if w is not None:
            create_to_warm.append(w - tc)
    # a pod retires when its lease is released (names are reused: the latest release before)
    released: dict[str, list[float]] = collections.defaultdict(list)
    for r in recs:
        if r.get("sandbox") and r.get("released_wall"):
            released[r["sandbox"]].append(r["released_wall"])
    retire_to_delete = []
    for td, pod in deletes:
        before = [t for t in released.get(pod, ()) if t <= td]
        if before:
            retire_to_delete.append(td - max(before))
    drive_end = t_last_release
    warm_in_drive = [w for w in turned_warm if t0 <= w[0] <= drive_end]
    writes = audit_summary(events, ns, t0, t1)
    total_writes = sum(writes.values())
    n = max(1, len(ok))
    warm_series = [poller.warm(d) for _, d in samples]
    return {
        "config": config, "lifecycle": lifecycle, "leases": len(recs), "ok": len(ok), "errors": errors[:10],
        "rate_per_s": args.rate, "hold_s": args.hold, "min_warm": args.min_warm,
        "max_pods": args.max_pods, "hard_cap": args.hard_cap or args.max_pods,
        "acquire_ms": {"p50": pct(acq, 50), "p99": pct(acq, 99), "max": max(acq, default=None),
                       "mean": statistics.fmean(acq) if acq else None},
        "acquire_over_1s": sum(1 for a in acq if a > 1000),
        "exec_ms": {"p50": pct(execs, 50), "p99": pct(execs, 99)},
        "distinct_sandboxes": len({r.get("sandbox") for r in ok}),
        "drive_seconds": drive_end - t0,
        "refill_seconds_after_last_release": (back_at - t_last_release) if back_at else None,
        "warm_min_during_drive": min((poller.warm(d) for t, d in samples if t <= drive_end),
                                     default=None),
        "warm_max": max(warm_series, default=None),
        "turned_warm_in_drive": len(warm_in_drive),
        "refill_rate_per_s": len(warm_in_drive) / max(1e-9, drive_end - t0),
        "pod_creates": len(creates), "pod_deletes": len(deletes),
        "pod_starts_per_lease": len(creates) / n,
        "create_to_warm_s": {"p50": pct(create_to_warm, 50), "p99": pct(create_to_warm, 99),
                             "n": len(create_to_warm)},
        "retire_to_delete_s": {"p50": pct(retire_to_delete, 50),
                               "p99": pct(retire_to_delete, 99), "n": len(retire_to_delete)},
        "api_writes": total_writes, "api_writes_per_lease": total_writes / n,
        "api_writes_by_user_verb_resource": writes,
        "records": recs,
        "demand_samples": [(round(t - t0, 3), {k: d.get(k) for k in (
            "busy", "idle", "waiting", "starting", "total", "consumption_per_second")}
            | {"warm": poller.warm(d)}) for t, d in samples],
    }


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def table(res: dict[str, dict]) -> str:
    rows = [
        ("leases (ok)", lambda r: f"{r['leases']} ({r['ok']})"),
        ("rate, hold", lambda r: f"{r['rate_per_s']:g}/s, {r['hold_s']:g} s"),
        ("acquire p50 ms", lambda r: fmt(r["acquire_ms"]["p50"])),
        ("acquire p99 ms", lambda r: fmt(r["acquire_ms"]["p99"])),
        ("acquire max ms", lambda r: fmt(r["acquire_ms"]["max"])),
        ("acquires > 1 s", lambda r: fmt(r["acquire_over_1s"])),
        ("first exec p50 ms", lambda r: fmt(r["exec_ms"]["p50"])),
        ("distinct sandboxes", lambda r: fmt(r["distinct_sandboxes"])),
        ("warm pods, min in drive", lambda r: fmt(r["warm_min_during_drive"])),
        ("pods turned warm / s (refill)", lambda r: fmt(r["refill_rate_per_s"], 2)),
        ("back at minWarm after last release s",
         lambda r: fmt(r["refill_seconds_after_last_release"])),
        ("retired -> deleted p50 s", lambda r: fmt(r["retire_to_delete_s"]["p50"])),
        ("created -> warm p50 s", lambda r: fmt(r["create_to_warm_s"]["p50"])),
        ("created -> warm p99 s", lambda r: fmt(r["create_to_warm_s"]["p99"])),
        ("pod starts / lease", lambda r: fmt(r["pod_starts_per_lease"], 2)),
        ("API writes / lease (run's namespace)", lambda r: fmt(r["api_writes_per_lease"], 2)),
        ("errors", lambda r: fmt(len(r["errors"]))),
    ]
    names = list(res)
    w0 = max(len(r[0]) for r in rows)
    out = [f"{'':{w0}}  " + "  ".join(f"{n:>17}" for n in names)
           + f"  {'agent-sandbox':>17}"]
    for label, f in rows:
        extra = {"acquire p50 ms": str(AGENT_SANDBOX_MS["p50"]),
                 "acquire p99 ms": str(AGENT_SANDBOX_MS["p99"])}.get(label, "")
        out.append(f"{label:{w0}}  " + "  ".join(f"{f(res[n]):>17}" for n in names)
                   + f"  {extra:>17}")
    out.append("")
    out.append("API writes in the run's namespace during the drive, by user / verb / resource:")
    keys = sorted({k for r in res.values() for k in r["api_writes_by_user_verb_resource"]})
    wk = max([len(k) for k in keys] + [10])
    out.append(f"{'':{wk}}  " + "  ".join(f"{n:>17}" for n in names))
    for k in keys:
        out.append(f"{k:{wk}}  " + "  ".join(
            f"{res[n]['api_writes_by_user_verb_resource'].get(k, 0):>17}" for n in names))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leases", type=int, default=20, help="leases per lifecycle")
    p.add_argument("--rate", type=float, default=0.5, help="leases started per second")
    p.add_argument("--hold", type=float, default=1.0, help="seconds a lease is held")
    p.add_argument("--min-warm", type=int, default=4)
    p.add_argument("--max-pods", type=int, default=16)
    p.add_argument("--hard-cap", type=int, default=None,
                   help="spec.sandboxes.hardCap (default: --max-pods); pods being deleted count "
                   "against it, so a cap at max delays replacements by a resync")
    p.add_argument("--resync", type=float, default=10.0,
                   help="the operator's resync (the chart's default: 10)")
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--refill-timeout", type=float, default=180)
    p.add_argument("--lifecycles", default=",".join(LIFECYCLES),
                   help="comma-separated, each optionally :<minWarm> (FreshPerGroup:12)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    args = p.parse_args(argv)

    from asyncgrpo.testing.node import HOST_IP, ClusterWithNode
    from asyncgrpo.testing.s3 import S3Server

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sandbox-pool-bench-"))
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        whole = ClusterWithNode(workdir / "cluster", audit=True)
        log(f"starting the cluster and its node in {workdir}")
        whole.start()
        stack.callback(whole.stop)
        env = dict(os.environ)
        conf = wire.user_cache_dir() / "images" / "containers.conf"
        if conf.exists():
            env.setdefault("CONTAINERS_CONF", str(conf))
        env["CONTAINERD_ADDRESS"] = str(whole.node.containerd_socket)
        log("importing the operator and sandbox images into containerd")
        sh("bash", str(REPO / "hack" / "import-images-containerd.sh"), "operator", "sandbox",
           env=env, timeout=900)
        images = {n: sh("podman", "image", "inspect", "--format",
                        "{{.Id}} {{index .Labels \"dev.asyncgrpo.inputs\"}}",
                        f"ghcr.io/asyncgrpo/{n}:{IMAGE_TAG}", env=env).strip()
                  for n in ("operator", "sandbox")}
        log(f"images (id, inputs hash): {images}")
        s3 = S3Server.start(workdir / "s3.log", host=HOST_IP)
        stack.callback(s3.stop)
        kube = Kube(whole.cluster.kubeconfig)
        helm = shutil.which("helm") or str(wire.user_cache_dir() / "bin" / "helm")
        log("installing the operator (helm)")
        sh(helm, "--kubeconfig", str(whole.cluster.kubeconfig), "install", "asyncgrpo",
           str(REPO / "charts" / "asyncgrpo"), "--namespace", OPERATOR_NAMESPACE,
           "--create-namespace", "--set", f"operator.resyncSeconds={args.resync:g}",
           "--set", f"image.tag={IMAGE_TAG}", "--wait", "--timeout", "5m")
        for lc in args.lifecycles.split(","):
            results[lc] = one_lifecycle(kube, whole.cluster, s3, lc, args)
            log(f"{lc}: acquire p50 {fmt(results[lc]['acquire_ms']['p50'])} ms, "
                f"p99 {fmt(results[lc]['acquire_ms']['p99'])} ms")
            if args.json:
                args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                 "images": images, "results": results}, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

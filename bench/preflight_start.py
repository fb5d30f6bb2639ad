"""How much the cluster preflight adds to a run's start, on the API-server harness: the same
example run (lora-math, as tests/operator's make_run makes it), created one at a time under
an embedded operator with the preflight on, then off; for each, seconds from create to the
vLLM Deployment scaled up (the first thing the preflight holds). The preflight Job's pod is run
by the harness's job kubelet (asyncgrpo.testing.jobs) as a local process with the seeded
hub cache (asyncgrpo.testing.hub): the real `asyncgrpo preflight`, not its image pull.

    PYTHONPATH=operator .venv/bin/python bench/preflight_start.py [--runs 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncgrpo.controller.kube import request
from asyncgrpo.testing.cluster import TestCluster
from asyncgrpo.testing.kube import Api
from asyncgrpo.testing.s3 import S3Server


def measure(api: Api, s3, ns_prefix: str, preflight: bool, runs: int, timeout: float,
            kubeconfig: str) -> list[dict]:
    from tests.operator.helpers import make_run, s3_secret

    from asyncgrpo.controller.embedded import EmbeddedOperator
    from asyncgrpo.controller.runtime import Settings

    settings = Settings(resync_seconds=1.0, gateway_url="http://127.0.0.1:1/{namespace}/{name}",
                        trainer_metrics_url="http://127.0.0.1:1/{namespace}/{name}",
                        scrapers=None, preflight=preflight, kubeconfig=kubeconfig)
    op = EmbeddedOperator([f"{ns_prefix}-*"], settings).start()
    out = []
    try:
        for i in range(runs):
            ns = api.namespace(ns_prefix)
            api.create(s3_secret(s3, ns))
            t0 = time.monotonic()
            api.create(make_run(s3, ns, "start"))
            while time.monotonic() - t0 < timeout:
                dep = api.get("Deployment", ns, "start-vllm")
                if dep and dep["spec"].get("replicas", 0) > 0:
                    break
                time.sleep(0.1)
            else:
                conds = (api.run(ns, "start").get("status") or {}).get("conditions")
                raise SystemExit(f"{ns}: vLLM not scaled up in 300 s; conditions {conds}")
            out.append({"vllm_scaled_s": round(time.monotonic() - t0, 1),
                        "preflight": api.condition(ns, "start", "Preflight").get("reason")})
            print(f"preflight {'on ' if preflight else 'off'} run {i}: {out[-1]}", flush=True)
    finally:
        op.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()

    import urllib3
    from kubernetes import config

    from asyncgrpo.testing.hub import seed_hub_cache
    from asyncgrpo.testing.jobs import BucketJobKubelet

    urllib3.disable_warnings()
    work = Path(tempfile.mkdtemp(prefix="preflight-start-"))
    cluster = TestCluster(work / "kube")
    cluster.start()
    s3 = S3Server.start(work / "s3.log")
    try:
        client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api = Api(client)
        crd = yaml.safe_load((REPO / "crds/asyncgrpo.dev_asyncgrporuns.yaml").read_text())
        request(client, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(2)
        jobs = BucketJobKubelet(client, hub_cache=seed_hub_cache(work / "hub")).start()
        try:
            on = measure(api, s3, "on", True, args.runs, args.timeout,
                         str(cluster.kubeconfig))
            off = measure(api, s3, "off", False, args.runs, args.timeout,
                         str(cluster.kubeconfig))
        finally:
            jobs.stop()
        med = {m: statistics.median(r["vllm_scaled_s"] for r in rs)
               for m, rs in (("on", on), ("off", off))}
        result = {"runs": args.runs, "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0],
                  "on": on, "off": off, "median_vllm_scaled_s": med,
                  "added_s": round(med["on"] - med["off"], 1)}
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        s3.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

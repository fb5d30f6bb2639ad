"""The per-namespace sandbox cap on the real API server (issue 28): many runs created at
once in one namespace never hold more sandbox pods than the cap, and neither do they after
an operator restart (a fresh process knows the pods only from its index, which kopf fills
from a full list before any handler runs).

Every sandbox pod object of the namespace counts, terminating ones too: that is what the
namespace holds. The 100-run case is bench/operator_bench.py --cap-per-namespace."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.operator.conftest import operator_settings
from tests.operator.helpers import make_run, s3_secret, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CAP, MIN_WARM, RUNS = 10, 4, 8
SANDBOX = "app.kubernetes.io/component=sandbox"


def pool_run(s3, ns, name):
    run = make_run(s3, ns, name, "multi-turn-sandboxes.yaml")
    sb = run["spec"]["sandboxes"]
    sb.pop("runtimeClassName")
    sb["network"].pop("allowedEgressHosts")
    sb.update({"minWarm": MIN_WARM, "max": MIN_WARM, "hardCap": MIN_WARM})
    return run


class Sampler:
    """The most sandbox pods the namespace held at once, sampled every 0.1 s."""

    def __init__(self, api, ns):
        self.api, self.ns, self.most, self.last = api, ns, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        from kubernetes.client.exceptions import ApiException

        while not self._stop.is_set():
            try:
                self.last = len(self.api.list("Pod", self.ns, SANDBOX))
            except (ApiException, OSError):   # a busy API server: the next sample counts
                time.sleep(0.1)
                continue
            self.most = max(self.most, self.last)
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def starved(api, ns, names) -> list[str]:
    return [n for n in names
            if api.condition(ns, n, "SandboxesReady").get("reason") == "NamespaceSandboxCap"]


def test_the_namespace_cap_holds_under_concurrent_runs_and_after_a_restart(
        api, crd_installed, peers, s3_server):
    from asyncgrpo.controller.embedded import EmbeddedOperator

    ns = api.namespace("own")
    api.create(s3_secret(s3_server, ns))
    settings = operator_settings(peers)
    settings.caps.sandboxes_per_namespace = CAP
    names = [f"cap{i}" for i in range(RUNS)]
    op = EmbeddedOperator([ns], settings).start()
    sampler = Sampler(api, ns)
    try:
        # RUNS runs of MIN_WARM pods each, created at once: far more than the cap wants
        with ThreadPoolExecutor(RUNS) as pool:
            list(pool.map(lambda n: api.create(pool_run(s3_server, ns, n)), names))
        wait_for(lambda: sampler.last == CAP, timeout=120, what="the namespace at its cap")
        wait_for(lambda: len(starved(api, ns, names)) >= RUNS - CAP // MIN_WARM - 1,
                 timeout=60, what="the runs left out report NamespaceSandboxCap")
        time.sleep(5)   # five resyncs at the cap
        assert sampler.most == CAP, f"{sampler.most} sandbox pods held against a cap of {CAP}"
    finally:
        op.stop()

    # a run created while the operator is down: its name sorts first, so the restarted
    # operator's first reconciles include it before the runs that hold the pods
    api.create(pool_run(s3_server, ns, "a-late"))
    names.append("a-late")
    second = EmbeddedOperator([ns], settings).start()
    try:
        wait_for(lambda: "a-late" in starved(api, ns, names), timeout=60,
                 what="the new run reports NamespaceSandboxCap")
        time.sleep(5)
        assert sampler.most == CAP, \
            f"after a restart: {sampler.most} sandbox pods held against a cap of {CAP}"
        # pods freed by one run are taken by another, never past the cap
        holder = next(n for n in names if api.list("Pod", ns, f"asyncgrpo.dev/run={n}"
                                                    f",{SANDBOX}"))
        api.delete("AsyncGRPORun", ns, holder)
        wait_for(lambda: api.get("AsyncGRPORun", ns, holder) is None, timeout=120,
                 what="the deleted run gone")
        wait_for(lambda: sampler.last == CAP and not api.list(
            "Pod", ns, f"asyncgrpo.dev/run={holder},{SANDBOX}"), timeout=120,
            what="the freed room taken by the others")
        time.sleep(3)
        assert sampler.most == CAP, \
            f"after freeing room: {sampler.most} sandbox pods held against a cap of {CAP}"
    finally:
        sampler.stop()
        for run in api.list("AsyncGRPORun", ns):
            api.delete("AsyncGRPORun", ns, run["metadata"]["name"])
        wait_for(lambda: not api.list("AsyncGRPORun", ns), timeout=60, what="runs gone")
        second.stop()
        api.call("DELETE", f"/api/v1/namespaces/{ns}")

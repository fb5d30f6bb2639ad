"""The sandbox pool's I/O in one reconcile of a run: read the gateway's demand, reserve room
under the per-namespace cap (`Runtime.reserve_sandboxes`), create the pods the plan asks for
(`sandbox_scaling.plan`, the pure rule), ask the gateway to drain the idle ones it removes,
delete them, and count the pool by state for the status.

Every read of the gateway goes through `tenant_io` (a deadline per exchange, the reconcile's
one wait budget); every create through `ownership.create_own` (a name another object holds
is a conflict, never adopted). `reconcile` calls `scale` while the spec has a pool and
`remove_all` once it has none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import gateway, ownership, sandbox_scaling, sandboxes, untrusted
from asyncgrpo.controller.kube import api_error
from asyncgrpo.controller.observe import STUCK_REASONS, Child, ready
from asyncgrpo.controller.runtime import RunState, Runtime
from asyncgrpo.controller.status import Observation
from asyncgrpo.controller.tenant_io import Budget

#: Seconds before retrying a sandbox creation the API server refused.
POOL_RETRY_SECONDS = 30.0
#: most bytes of a gateway's answer the operator reads
MAX_DEMAND_BYTES = 1 << 20


def fetch_demand(rt: Runtime, obs: Observation, ns: str, name: str,
                 budget: Budget) -> sandbox_scaling.Demand | None:
    url = rt.settings.gateway_url.format(name=name, namespace=ns).rstrip("/") + \
        wire.GATEWAY_DEMAND_PATH
    # an open route of the gateway: no token sent
    return rt.tenant_io.latest(
        (ns, name, "demand"), ns, url, untrusted.demand, max_bytes=MAX_DEMAND_BYTES,
        budget=budget, what=f"the sandbox gateway's {wire.GATEWAY_DEMAND_PATH}",
        problems=obs.endpoint_problems)


def drain(rt: Runtime, state: RunState, obs: Observation, ns: str, name: str, pod: str,
          budget: Budget) -> bool:
    """Ask the gateway to stop leasing `pod`; True once it says the pod may be deleted (an
    answer may come on a later reconcile: the ask does not wait past the budget)."""
    url = rt.settings.gateway_url.format(name=name, namespace=ns).rstrip("/") + \
        wire.GATEWAY_DRAIN_PATH.format(name=pod)
    return bool(rt.tenant_io.latest(
        (ns, name, "drain", pod), ns, url, untrusted.drain, max_bytes=1 << 16, budget=budget,
        what="the sandbox gateway's drain", problems=obs.endpoint_problems, method="POST",
        headers={"Authorization": f"Bearer {state.gateway_token or ''}"}))


def remove_all(rt: Runtime, ns: str, name: str, children: list[Child]) -> None:
    """The pool was removed from the spec: its pods go too (each deletion expected once)."""
    key = f"{ns}/{name}"
    left = [c.name for c in children if c.kind == "Pod"
            and c.component == sandboxes.COMPONENT and not c.deleting]
    _, pending = rt.expectations.observe(key, left)
    for pod in set(left) - pending:
        rt.expectations.expect_delete(key, pod)
        rt.kube.delete("Pod", ns, pod)


def scale(rt: Runtime, state: RunState, owner: dict[str, Any], run: AsyncGRPORun,
          children: list[Child], stopped: bool, foreign: list[Child],
          conflicts: list[tuple[str, str]], uid: str, budget: Budget, obs: Observation,
          held: Callable[[], set[str]] | None = None
          ) -> tuple[dict[str, int], int, tuple[str, str] | None]:
    """One step of the run's pool toward its plan: (the pool by state for the status, pods
    created, why a creation stopped). `held`: the names of every sandbox pod of the namespace
    (the per-namespace cap); None: the run's own."""
    spec = run.spec.sandboxes
    assert spec is not None
    ns, name = run.metadata.namespace, run.metadata.name
    key = f"{ns}/{name}"
    current = sandboxes.current_hash(run)
    pods = [sandbox_scaling.PodView(name=c.name, phase=c.phase, ready=c.ready,
                                    failed=c.phase == "Failed" or c.problem in STUCK_REASONS,
                                    unschedulable=c.unschedulable, deleting=c.deleting,
                                    outdated=c.hash != current, start_seconds=c.start_seconds,
                                    image_key=c.image_key, image=c.image)
            for c in children if c.kind == "Pod" and c.component == sandboxes.COMPONENT]
    adds, dels = rt.expectations.observe(key, [p.name for p in pods])
    state.sandbox_image_of = {n: k for n, k in state.sandbox_image_of.items() if n in adds}
    demand = None
    if not stopped and ready(children, gateway.COMPONENT):
        demand = fetch_demand(rt, obs, ns, name, budget)
    now = time.monotonic()
    image_plans = sandbox_scaling.plan_images(
        spec, pods, {n: state.sandbox_image_of.get(n, wire.DEFAULT_SANDBOX_IMAGE_KEY) for n in adds},
        dels, demand, {k: now - t for k, t in state.excess_since.items()}, suspended=stopped,
        max_step=rt.settings.pool_max_step, resync_seconds=rt.settings.resync_seconds)
    state.excess_since = {ip.key: state.excess_since.get(ip.key, now) for ip in image_plans
                          if ip.plan.target < ip.plan.live and not stopped}
    plan = sandbox_scaling.Plan(
        sum(ip.plan.create for ip in image_plans), [n for ip in image_plans for n in ip.plan.delete],
        [n for ip in image_plans for n in ip.plan.replace], sum(ip.plan.live for ip in image_plans),
        sum(ip.plan.target for ip in image_plans))

    created, error = 0, None
    if state.pool_error is not None and state.pool_error[2] == current \
            and time.monotonic() < state.pool_error[0]:
        # a refused creation (missing RuntimeClass, quota): retry later, not every tick
        error, plan = state.pool_error[1], sandbox_scaling.Plan(
            0, plan.delete, plan.replace, plan.live, plan.target)
    if held is None:   # no index of the namespace (unit tests): this run's pods alone
        def held() -> set[str]:
            return {p.name for p in pods}
    granted = rt.reserve_sandboxes(state, ns, plan.create, held)
    if plan.create > granted:
        caps = rt.settings.caps
        error = ("NamespaceSandboxCap", (f"the namespace holds the operator's cap of "
                 f"{caps.sandboxes_per_namespace} sandbox pods (all runs together)"))
        plan = sandbox_scaling.Plan(granted, plan.delete, plan.replace, plan.live, plan.target)
    taken = {p.name for p in pods} | adds | {c.name for c in foreign if c.kind == "Pod"}
    prefix = sandboxes.pod_prefix(run)
    # the images of the creations in the plans' order (the images with waiting leases got
    # the room first), cut to what the namespace cap granted
    images = [ip.image for ip in image_plans for _ in range(ip.plan.create)][:plan.create]
    try:
        for pod, image in zip(sandbox_scaling.free_names(prefix, taken, plan.create), images,
                              strict=True):
            body = sandboxes.build_pod(run, pod.removeprefix(prefix + "-"), image=image)
            state.sandbox_image_of[pod] = wire.sandbox_image_key(image)
            kopf.adopt(body, owner=owner)
            rt.expectations.expect_create(key, pod)   # kept on AlreadyExists: it exists
            rt.release_sandbox(state)   # counted as expected now (after: never zero times)
            try:
                if ownership.create_own(rt.kube, state.conflicts, body, uid, conflicts):
                    created += 1
                else:   # the name is another object's: it never appears as the run's
                    rt.expectations.observe(key, [pod])
                    break
            except ApiException as e:
                rt.expectations.observe(key, [pod])  # settle: this one will never appear
                if e.status >= 500:
                    raise
                error = api_error(e)  # e.g. a missing RuntimeClass, a quota: stop and report
                state.pool_error = (time.monotonic() + POOL_RETRY_SECONDS, error, current)
                break
    finally:
        rt.end_reservation(state)   # the unused part of the reservation goes back
    if created and error is None:
        state.pool_error = None
    # unhealthy (or suspended) pods go now; idle ones only once the gateway drained them
    deleted = list(plan.replace) + [p for p in plan.delete
                                    if drain(rt, state, obs, ns, name, p, budget)]
    for pod in deleted:
        rt.expectations.expect_delete(key, pod)
        rt.kube.delete("Pod", ns, pod)
    if created:
        rt.metrics.spawned.labels(ns, name).inc(created)

    members = demand.members if demand else {}
    counts = {"warm": 0, "busy": 0, "starting": len(adds) + created, "failed": 0,
              "wanted": plan.target}
    for p in pods:
        if p.deleting or p.name in dels or p.name in deleted:
            continue
        if p.failed or p.unschedulable:
            counts["failed"] += 1
        elif members.get(p.name) == "busy":
            counts["busy"] += 1
        elif p.ready:
            counts["warm"] += 1
        else:
            counts["starting"] += 1
    return counts, created, error

"""One reconcile of one run: compare what the indexes show with what the builders want,
write only the difference, and compute the status.

Order: validate (the model, cross-field rules, the operator's caps) -> bucket (read the
setup Job) -> token Secret -> the allowedEgressHosts' addresses -> children (what nothing
runs as first, then the workloads; the trainer gated on vLLM, the gateway and the bucket)
-> setup Job -> sandbox pool (`sandbox_io`: the gateway's demand; a drain request for each
pod to remove)
-> progress (the trainer's metrics and termination message; on a full fine-tuning run each
weights puller's status) -> status. At steady state every step finds nothing to do, so a
reconcile costs no API write; its reads are the indexes (memory) and, for a running run,
the tenant's endpoints: one scrape of the trainer, one read of the gateway's demand, one of
each weights puller, and a drain request per sandbox pod being removed, each bounded by
`controller.tenant_io` (a deadline per exchange, one wait budget per reconcile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.api.validation import (
    FieldError,
    checkpoint_identity,
    immutable_errors,
    validate_run,
)
from asyncgrpo.bucket import policy as bucket
from asyncgrpo.controller import (
    bucketjob,
    gateway,
    ownership,
    preflightjob,
    progress,
    rollout_replicas,
    sandbox_io,
    secret,
    served,
    trainer,
    untrusted,
    vllm,
)
from asyncgrpo.controller.caps import cap_errors
from asyncgrpo.controller.children import build_children
from asyncgrpo.controller.common import HASH_ANNOTATION, operator_defaults
from asyncgrpo.controller.kube import PRUNED_KINDS, api_error
from asyncgrpo.controller.observe import IDENTITY_ANNOTATION, Child, ready, workload
from asyncgrpo.controller.runtime import BucketState, RunState, Runtime
from asyncgrpo.controller.status import TERMINAL, Observation, Transition, compute
from asyncgrpo.controller.tenant_io import Budget

log = logging.getLogger("asyncgrpo.operator")

#: Longest wait between two checks of a failing bucket.
BUCKET_RETRY_MAX_SECONDS = 30.0


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[Transition] = field(default_factory=list)
    delete_run: bool = False


def run_document(body: dict[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
            "spec": body.get("spec") or {}}


def reconcile(rt: Runtime, body: dict[str, Any], children: list[Child],
              namespace_sandboxes: Callable[[], set[str]] | None = None) -> Outcome:
    """One reconcile of one run from its body and its children (the index's summaries).

    `namespace_sandboxes`: the names of every sandbox pod of the run's namespace, read from
    the pod index when called (the per-namespace cap, `_reserve_room`); None: the run's own.
    """
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    uid = str(meta.get("uid") or "")
    state = rt.run((ns, name))
    # the status is tenant-writable: only typed fields of it are read (controller.untrusted)
    old = untrusted.status(body.get("status"))
    rv = meta.get("resourceVersion")
    if state.last_status is not None and state.last_status[0] == rv:
        # the watch has not delivered our last status patch yet: compute from what we wrote,
        # so transition times and events are not produced twice (the handler still compares
        # with the body, so a patch that was lost is sent again)
        old.update(state.last_status[1])
    if state.finished is not None and old.get("phase") not in TERMINAL:
        # the body predates our own patch that finished the run: never un-finish it
        old.update(state.finished)
    children, foreign = ownership.split(children, uid)
    # the identity the run's checkpoints were made for: on the operator's own ConfigMap (a
    # tenant with run rights can patch the status, not the ConfigMap), never the status
    fixed = next((c.identity for c in children if c.kind == "ConfigMap" and c.identity), None)
    run, errors, reason = check_run(rt, body, fixed)
    obs = Observation(generation=int(meta.get("generation") or 0), spec_errors=errors,
                      spec_error_reason=reason, children=children)
    if run is None or errors:
        status, events = compute(None, obs, old, now_iso())
        state.last_status = (rv, {**old, **status})
        return Outcome(status, events)

    terminal = old.get("phase") in TERMINAL
    stopped = run.spec.suspend or terminal

    budget = Budget(rt.settings.endpoint_wait_seconds)
    conflicts = _known_conflicts(state, foreign)
    bucket_action = _check_bucket(rt, state, run, obs, uid, children)
    trainer_up = (w := workload(children, trainer.COMPONENT)) is not None and w.replicas > 0
    deps_ready = ready(children, vllm.COMPONENT) and (
        run.spec.sandboxes is None or ready(children, gateway.COMPONENT))
    preflight_action, preflight_ok = _check_preflight(rt, state, run, obs, children, stopped)
    start = trainer_up or (deps_ready and obs.bucket_error is None and obs.bucket_checked
                           and preflight_ok)
    obs.trainer_gated = not start and not stopped
    preflight_hold = not preflight_ok and not trainer_up   # vLLM and the trainer wait at zero

    if run.spec.sandboxes is not None:
        conflicts += _ensure_secret(rt, state, run, body, obs)
    hosts = _resolve_hosts(rt, run, obs)

    def desired_children(gated: bool) -> list[dict[str, Any]]:
        out = build_children(run, stopped=stopped or gated, start_trainer=start and not gated,
                             resolved_hosts=hosts, scrapers=rt.settings.scrapers,
                             hold=preflight_hold)
        for obj in out:   # written once, with the spec that passed check_run
            if obj["kind"] == "ConfigMap":
                obj["metadata"].setdefault("annotations", {})[IDENTITY_ANNOTATION] = \
                    checkpoint_identity(run.spec)
        return out

    # what nothing runs as first (accounts, config, policies), then the workloads: scaled to
    # zero when any child's name is held by an object that is not the run's (never adopt)
    support = [o for o in desired_children(bool(conflicts))
               if o["kind"] not in ownership.WORKLOAD_KINDS]
    obs.apply_errors = _apply(rt, state, body, support, children, foreign, conflicts, uid)
    # the trainer's config refused (a spec too large for a ConfigMap): nothing may start
    # without it, the run says why
    obs.config_refused = next((e for e in obs.apply_errors
                               if e[1].startswith(f"ConfigMap {name}-")), None)
    hold = bool(conflicts) or obs.config_refused is not None
    workloads = [o for o in desired_children(hold)
                 if o["kind"] in ownership.WORKLOAD_KINDS]
    obs.apply_errors += _apply(rt, state, body, workloads, children, foreign, conflicts, uid,
                               prune=False)
    _prune_workloads(rt, ns, workloads, children)
    if conflicts and bucket_action is not None and bucket_action[0] == "create":
        bucket_action = None
    # after the children: the Job's pod runs as the run's ServiceAccount, created above
    obs.apply_errors += _act_on_bucket_job(rt, state, body, bucket_action, conflicts, uid)
    if not conflicts:
        obs.apply_errors += _act_on_bucket_job(rt, state, body, preflight_action, conflicts, uid)

    if run.spec.sandboxes is None:   # the pool was removed from the spec: its pods go too
        sandbox_io.remove_all(rt, ns, name, children)
    else:
        # `conflicts`, not `hold` alone: a workload's name may have been found held only by
        # its create just above, and no sandbox pod starts beside a conflict
        obs.sandboxes, spawned, obs.pool_error = sandbox_io.scale(
            rt, state, body, run, children, stopped or hold or bool(conflicts), foreign, conflicts,
            uid, budget, obs, namespace_sandboxes)
        # the body may predate our last status patch: the count lives in memory too
        seen = int((old.get("sandboxes") or {}).get("spawnedTotal", 0))
        state.spawned_total = max(state.spawned_total, seen) + spawned
        obs.sandboxes["spawnedTotal"] = state.spawned_total

    if ready(children, trainer.COMPONENT) and not stopped:
        url = rt.settings.trainer_metrics_url.format(name=name, namespace=ns,
                                                     port=run.spec.trainer.metrics_port)
        scraped = rt.tenant_io.latest(
            (ns, name, "metrics"), ns, url, untrusted.metrics,
            max_bytes=progress.MAX_METRICS_BYTES, budget=budget,
            what="the trainer's metrics endpoint", problems=obs.endpoint_problems)
        if scraped is not None:
            state.progress = _merge_progress(state.progress, scraped)
    # a trainer that finished says its last numbers in its termination message: the final
    # step may never have been scraped
    final = progress.from_termination_message(_rank0_message(children))
    if final is not None:
        state.progress = _merge_progress(state.progress, final)
    obs.progress = state.progress
    versions: dict[str, int | None] = {}
    if run.spec.model.finetuning == "full" and not stopped:
        def read_puller(ip):
            versions[ip] = rt.tenant_io.latest(
                (ns, name, "puller", ip), ns, served.puller_url(ip), untrusted.puller,
                max_bytes=served.MAX_STATUS_BYTES, budget=budget,
                what=f"the weights puller at {ip}", problems=obs.endpoint_problems)
            return versions[ip]
        obs.served_weights = served.served_weights(children, read_puller)
    if not stopped and served.running_ips(children):
        obs.rollout_replicas = rollout_replicas.summarize(
            children, state.progress.replicas if state.progress is not None else None,
            lambda ip: rt.tenant_io.latest(
                (ns, name, "vllm-metrics", ip), ns,
                f"http://{rollout_replicas.replica_key(ip)}/metrics",
                rollout_replicas.vllm_prefix_cache,
                max_bytes=rollout_replicas.MAX_VLLM_METRICS_BYTES, budget=budget,
                what=f"the vLLM metrics at {ip}", problems=obs.endpoint_problems),
            versions)
    obs.conflicts = conflicts

    status, events = compute(run.spec, obs, old, now_iso())
    # informational: what the run's checkpoints are for (decisions read the ConfigMap)
    status["checkpointIdentity"] = fixed or checkpoint_identity(run.spec)
    merged = {**old, **status}
    state.last_status = (rv, merged)
    if merged.get("phase") in TERMINAL:
        state.finished = {"phase": merged["phase"], "completionTime": merged["completionTime"]}
    return Outcome(status, events, delete_run=_ttl_expired(run, merged))


def check_run(rt: Runtime, body: dict[str, Any], fixed_identity: str | None = None
              ) -> tuple[AsyncGRPORun | None, list[FieldError], str]:
    """The run and why it cannot be applied: the model's rules (`asyncgrpo validate`), the
    operator's caps, and the immutable checkpoint identity; with the condition reason."""
    run, errors = validate_run(run_document(body))
    if run is None or errors:
        return run, errors, "InvalidSpec"
    run = operator_defaults(run, rt.settings.gpu_resource_name)
    if fixed_identity and (errors := immutable_errors(fixed_identity, run.spec)):
        return run, errors, "ImmutableFieldChanged"
    if errors := cap_errors(run, rt.settings.caps):
        return run, errors, "OverCap"
    return run, [], ""


def _rank0_message(children) -> str:
    return next((c.termination_message for c in children if c.kind == "Pod"
                 and c.component == "trainer" and c.name.endswith("-0")), "")


def _merge_progress(old: progress.Progress | None,
                    new: progress.Progress) -> progress.Progress:
    if old is None:
        return new
    for k, v in vars(new).items():
        if v is not None:
            setattr(old, k, v)
    return old


def _ttl_expired(run: AsyncGRPORun, status: dict[str, Any]) -> bool:
    ttl = run.spec.ttl_seconds_after_finished
    finished = untrusted.timestamp(status.get("completionTime"))
    if ttl is None or status.get("phase") not in TERMINAL or finished is None:
        return False
    return (datetime.now(UTC) - finished).total_seconds() >= ttl


# ---------------------------------------------------------------- bucket and secrets


def _find(children: list[Child], kind: str, name: str) -> Child | None:
    return next((c for c in children if c.kind == kind and c.name == name), None)


def _record_bucket(b: BucketState, key: str, result: bucketjob.Outcome) -> None:
    """Count one finished setup Job once (by its uid): success resets the backoff, a failure
    doubles it (1 s up to BUCKET_RETRY_MAX_SECONDS)."""
    if result.uid and result.uid == b.seen_job:
        return
    b.seen_job = result.uid
    if result.state == "succeeded":
        b.ok_for, b.failures = key, 0
        b.error, b.failed_for = None, None
        b.checked_at = time.monotonic()
        return
    b.failures = b.failures + 1 if b.failed_for == key else 1
    b.ok_for = None
    b.error = bucket.BucketError(result.reason, result.message)
    b.failed_for = key
    b.retry_at = time.monotonic() + min(2.0 ** (b.failures - 1), BUCKET_RETRY_MAX_SECONDS)


def _check_bucket(rt: Runtime, state: RunState, run: AsyncGRPORun, obs: Observation,
                  uid: str, children: list[Child]) -> tuple[str, dict[str, Any]] | None:
    """Read the setup Job (`bucketjob`) and say what to do with it: ("create", job),
    ("delete", job) or None. The operator itself never talks to the bucket.

    One Job per spec of it (its hash: adapterStore, uid, image, allowlist). A Job that
    succeeded is re-run every `bucket_recheck_seconds`; a failed one (or one whose pod cannot
    start: a missing Secret) is reported, deleted, and run again after a growing backoff.
    While a Job runs, the last finding for the same spec stands.
    """
    store = run.spec.adapter_store
    try:
        # the admin's allowlist and literal metadata addresses, without a DNS query; the Job
        # checks again, resolving names, from the run's own pod
        bucket.check_endpoint(store, rt.settings.allowed_endpoints, resolve=False)
        bucket.run_folder(store, bucketjob.owner_of(run, uid))
    except bucket.BucketError as e:
        obs.bucket_checked, obs.bucket_error = True, e
        job = _find(children, "Job", bucketjob.job_name(run, bucketjob.SETUP))
        return ("delete", {"metadata": {"name": job.name}}) if job and not job.deleting \
            else None
    desired = bucketjob.build_job(run, bucketjob.SETUP, uid, bucketjob.job_settings(rt.settings))
    key = desired["metadata"]["annotations"][HASH_ANNOTATION]
    job = _find(children, "Job", desired["metadata"]["name"])
    action: tuple[str, dict[str, Any]] | None = None
    now = time.monotonic()
    if job is None:
        if state.bucket.failed_for != key or now >= state.bucket.retry_at:
            refused = bucketjob.credentials_refusal_of(rt.kube, run)
            if refused is None:
                action = ("create", desired)
            else:   # counted as a failed setup: reported, retried after the backoff
                _record_bucket(state.bucket, key, bucketjob.Outcome("failed", *refused,
                                                                    uid=f"secret@{now}"))
    elif job.deleting:
        pass
    elif job.hash != key:
        action = ("delete", desired)   # another spec: a new Job once this one is gone
    else:
        result = bucketjob.outcome(job, [c for c in children if c.kind == "Pod"])
        if result.state != "running":
            _record_bucket(state.bucket, key, result)
        if result.state == "failed" or (
                result.state == "succeeded"
                and now - state.bucket.checked_at >= rt.settings.bucket_recheck_seconds):
            action = ("delete", desired)
    obs.bucket_checked = key in (state.bucket.ok_for, state.bucket.failed_for)
    obs.bucket_error = state.bucket.error if state.bucket.failed_for == key else None
    return action


def _check_preflight(rt: Runtime, state: RunState, run: AsyncGRPORun, obs: Observation,
                     children: list[Child], stopped: bool
                     ) -> tuple[tuple[str, dict[str, Any]] | None, bool]:
    """The preflight Job (`preflightjob`, when the operator runs preflights): what to do with
    it, and whether vLLM and the trainer may scale up; its outcome goes to `obs.preflight`."""
    if not rt.settings.preflight:
        return None, True
    if state.preflight is None:
        state.preflight = preflightjob.State()
    desired = preflightjob.build_job(run, rt.settings.bucket_job_pull_policy)
    job = _find(children, "Job", desired["metadata"]["name"])
    ready = obs.bucket_checked and obs.bucket_error is None and not stopped
    action, result = preflightjob.step(desired, job, [c for c in children if c.kind == "Pod"],
                                       state.preflight, ready)
    obs.preflight = preflightjob.condition(result)
    return action, obs.preflight[0] is True


def _act_on_bucket_job(rt: Runtime, state: RunState, owner: dict[str, Any],
                       action: tuple[str, dict[str, Any]] | None,
                       conflicts: list[tuple[str, str]], uid: str) -> list[tuple[str, str]]:
    """Create or delete the setup Job; a refused creation is reported like any child's, a
    name held by a Job that is not the run's is a conflict (never read as the run's)."""
    if action is None:
        return []
    verb, job = action
    ns, job_name = owner["metadata"]["namespace"], job["metadata"]["name"]
    try:
        if verb == "create":
            kopf.adopt(job, owner=owner)
            ownership.create_own(rt.kube, state.conflicts, job, uid, conflicts)
        else:   # Background: the Job goes now, its pod after it (told apart by owner uid)
            rt.kube.delete("Job", ns, job_name, propagation="Background")
    except ApiException as e:
        if e.status >= 500:
            raise
        reason, message = api_error(e)
        return [(reason, f"Job {job_name}: {message}")]
    return []


def _known_conflicts(state: RunState, foreign: list[Child]) -> list[tuple[str, str]]:
    """Names held by objects that are not the run's: those in the index (the operator's
    labels, another owner) and those a create found (409, then a read) until their retry."""
    now = time.monotonic()
    for key in [k for k, until in state.conflicts.items() if until <= now]:
        del state.conflicts[key]
    found = {(c.kind, c.name) for c in foreign} | set(state.conflicts)
    return sorted(found)


def _ensure_secret(rt: Runtime, state: RunState, run: AsyncGRPORun,
                   owner: dict[str, Any], obs: Observation) -> list[tuple[str, str]]:
    """The run's token Secret, created once; returns [("Secret", name)] when that name is
    held by a Secret that is not the run's (its tokens would be the tenant's choice)."""
    if state.secret_ready:
        return []
    ns, sname = run.metadata.namespace, secret.secret_name(run)
    if ("Secret", sname) in state.conflicts:
        return [("Secret", sname)]
    found = rt.kube.get("Secret", ns, sname)
    uid = str(owner["metadata"].get("uid") or "")
    if found is None:
        body = secret.build_secret(run)
        kopf.adopt(body, owner=owner)
        conflicts: list[tuple[str, str]] = []
        if not ownership.create_own(rt.kube, state.conflicts, body, uid, conflicts):
            return conflicts
        token = body["stringData"][secret.GATEWAY_TOKEN_KEY]
    elif not ownership.owned_by(found.get("metadata") or {}, uid):
        state.conflicts[("Secret", sname)] = time.monotonic() + ownership.CONFLICT_RETRY_SECONDS
        return [("Secret", sname)]
    else:
        try:
            token = untrusted.secret_text(found.get("data"), secret.GATEWAY_TOKEN_KEY)
        except ValueError as e:
            obs.endpoint_problems.append(("TokenSecretInvalid", (
                f"Secret {sname}: {e}; delete it to have new tokens made")))
            return []   # read again next time: someone may fix it
    state.gateway_token, state.secret_ready = token, True
    return []


def _resolve_hosts(rt: Runtime, run: AsyncGRPORun, obs: Observation) -> list[str]:
    """The addresses of the run's allowedEgressHosts the operator knows, from the cache of
    `tenant_io` (asynchronous lookups with a deadline: never a DNS wait on this thread)."""
    sb = run.spec.sandboxes
    if sb is None or not sb.network.allowed_egress_hosts:
        return []
    found, missing = rt.tenant_io.resolve(run.metadata.namespace or "",
                                          list(sb.network.allowed_egress_hosts),
                                          ttl=rt.settings.dns_refresh_seconds)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        obs.endpoint_problems.append(("EgressHostsUnresolved", (
            f"{', '.join(missing[:3])}{more} of spec.sandboxes.network.allowedEgressHosts "
            f"did not resolve within {rt.settings.dns_deadline_seconds:g} s: the sandboxes' "
            "egress to them is closed until they do (the last answer is kept)")))
    return found


# ---------------------------------------------------------------- children


def _apply(rt: Runtime, state: RunState, owner: dict[str, Any], desired: list[dict[str, Any]],
           children: list[Child], foreign: list[Child], conflicts: list[tuple[str, str]],
           uid: str, prune: bool = True) -> list[tuple[str, str]]:
    """Create what is missing, patch what drifted, prune what the spec no longer implies;
    returns refused writes (reason, message). `children` are the run's own (controller
    reference to its uid): a name held by anything else is added to `conflicts`, never
    patched, used or deleted."""
    have = {(c.kind, c.name): c for c in children}
    held = {(c.kind, c.name) for c in foreign}
    wanted = set()
    errors = []
    for obj in desired:
        key = (obj["kind"], obj["metadata"]["name"])
        wanted.add(key)
        kopf.adopt(obj, owner=owner)
        current = have.get(key)
        if current is None and (key in held or key in state.conflicts):
            if key not in conflicts:
                conflicts.append(key)
            continue
        try:
            if current is None:
                ownership.create_own(rt.kube, state.conflicts, obj, uid, conflicts)
            elif current.hash != obj["metadata"]["annotations"][HASH_ANNOTATION] \
                    and not current.deleting:
                rt.kube.patch(obj)
        except ApiException as e:
            if e.status >= 500:
                raise
            reason, message = api_error(e)
            errors.append((reason, f"{key[0]} {key[1]}: {message}"))
    if not prune:
        return errors
    ns = owner["metadata"]["namespace"]
    for c in children:
        if c.kind in PRUNED_KINDS and (c.kind, c.name) not in wanted and not c.deleting \
                and c.kind not in ownership.WORKLOAD_KINDS:
            rt.kube.delete(c.kind, ns, c.name)
    return errors


def _prune_workloads(rt: Runtime, ns: str, desired: list[dict[str, Any]],
                     children: list[Child]) -> None:
    wanted = {(o["kind"], o["metadata"]["name"]) for o in desired}
    for c in children:
        if c.kind in PRUNED_KINDS and c.kind in ownership.WORKLOAD_KINDS \
                and (c.kind, c.name) not in wanted and not c.deleting:
            rt.kube.delete(c.kind, ns, c.name)

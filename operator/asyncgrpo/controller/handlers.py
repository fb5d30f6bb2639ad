"""kopf handlers: thin wiring from events to `reconcile`, status patches and events.

`registry(settings)` builds a fresh kopf registry per operator (the CLI's, or one of several
in a test process), so timer intervals and the optional admission webhook follow that
operator's settings instead of import-time globals.

- Indexes keep a summary of every child (label managed-by=asyncgrpo-operator) per run, fed
  by watches, so a reconcile reads memory, not the API server.
- The run is reconciled on create, on spec changes, on operator start (resume), and by a
  timer every `resync_seconds` (status, pool scaling, progress). A per-run lock lets only
  one of them act at a time; a reconcile that finds the lock taken skips: the running one,
  or the next tick, covers it.
- The finalizer (kopf's, added because of the delete handler) applies the bucket's
  deletionPolicy by a cleanup Job in the run's namespace (`bucketjob`) and waits for it;
  children go with the run through their ownerReferences.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from asyncgrpo import API_GROUP, API_VERSION, PLURAL
from asyncgrpo.api.validation import checkpoint_identity, validate_run
from asyncgrpo.bucket import policy as bucket
from asyncgrpo.controller import (
    bucketjob,
    kube,
    observe,
    rbac,
    reconcile,
    sandboxes,
    untrusted,
)
from asyncgrpo.controller.common import HASH_ANNOTATION, MANAGED_BY, RUN_LABEL, child_name
from asyncgrpo.controller.runtime import Runtime, Settings

log = logging.getLogger("asyncgrpo.operator")
RUNS = {"group": API_GROUP, "version": API_VERSION, "plural": PLURAL}
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY, RUN_LABEL: kopf.PRESENT}

#: (group, version, plural) of every child kind the operator watches (`kube.RESOURCES`);
#: index id per kind.
CHILD_RESOURCES = {f"idx_{r.plural}": (r.group, r.version, r.plural)
                   for r in (kube.RESOURCES[k] for k in kube.WATCHED_KINDS)}
#: plural -> kind of the watched children
KINDS = {kube.RESOURCES[k].plural: k for k in kube.WATCHED_KINDS}


def runtime(memo: Any) -> Runtime:
    return memo.runtime


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled state as digests of the spec and metadata, not a copy of them.

    kopf's default keeps the whole spec in an annotation: a run over 256 kB then gets a 422
    on kopf's own patch and can never be deleted. The handlers only need to know *that* the
    spec changed (they read the body itself), so a digest per stanza is enough; kopf's diff of
    two digests names the stanza ("spec"), which is what `on.update(field="spec")` filters on.
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        essence = super().build(body=body, extra_fields=extra_fields)
        return {k: {"sha256": hashlib.sha256(json.dumps(v, sort_keys=True).encode())
                    .hexdigest()} for k, v in essence.items()}


def kopf_settings(settings: Settings) -> kopf.OperatorSettings:
    """kopf's settings for one operator, fixed before it starts."""
    ks = kopf.OperatorSettings()
    # progress and the last-handled spec live in annotations of our group; status stays ours
    ks.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    ks.persistence.diffbase_storage = DigestDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-digest")
    ks.posting.level = logging.WARNING       # no event per routine timer tick
    ks.posting.reporting_component = MANAGED_BY
    ks.execution.max_workers = 16
    ks.watching.server_timeout = 300
    ks.watching.client_timeout = 330
    # A deleted run waits for its timer to exit before kopf drops the finalizer; a sync timer
    # caught mid-tick cannot be cancelled, and kopf's default re-check (60 s) would hold the
    # deletion that long. Re-check about as often as the timer ticks.
    ks.background.cancellation_polling = max(1.0, min(5.0, settings.resync_seconds))
    if settings.webhook is not None:
        from asyncgrpo.controller.webhook import server

        ks.admission.server = server(settings.webhook)
        ks.admission.managed = "validate.asyncgrpo.dev"
    return ks


async def close(memo: kopf.Memo, **_: Any) -> None:
    """The reads of tenants' endpoints end with the operator (their loop and sockets)."""
    if getattr(memo, "runtime", None) is not None:
        runtime(memo).close()


async def configure(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "runtime", None) is None:
        memo.runtime = Runtime(Settings())
    rt = runtime(memo)
    if rt.kube is None:
        rt.kube = make_kube(rt)


def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: its service account; elsewhere: KUBECONFIG, read now (not at import)."""
    path = runtime(memo).settings.kubeconfig if getattr(memo, "runtime", None) else None
    if path:
        return _kubeconfig_token_login(path)
    return kopf.login_with_service_account(memo=memo, **kwargs) or \
        kopf.login_with_kubeconfig(memo=memo, **kwargs)


def _kubeconfig_token_login(path: str) -> kopf.ConnectionInfo:
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f)
    ctx_name = doc.get("current-context")
    ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in doc["users"] if u["name"] == ctx["user"])
    return kopf.ConnectionInfo(server=cluster["server"], token=user.get("token"),
                               insecure=bool(cluster.get("insecure-skip-tls-verify")),
                               ca_path=cluster.get("certificate-authority"),
                               default_namespace=ctx.get("namespace"))


def make_kube(rt: Runtime):
    from kubernetes import client, config

    from asyncgrpo.controller.kube import Kube

    if rt.settings.kubeconfig:
        api = config.new_client_from_config(config_file=rt.settings.kubeconfig)
    else:
        try:
            config.load_incluster_config()
            api = client.ApiClient()
        except config.ConfigException:
            # read KUBECONFIG now: the client library reads it once, at its import
            api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
    return Kube(api, on_write=lambda verb, kind: rt.metrics.api_writes.labels(verb, kind).inc(),
                fence=rt.fence)


def _summarize(body: kopf.Body, memo: kopf.Memo, resource: kopf.Resource,
               **_: Any) -> dict[tuple[str, str], observe.Child]:
    delay = runtime(memo).settings.pod_watch_delay_seconds if resource.plural == "pods" else 0
    if delay:
        time.sleep(delay)
    doc = dict(body)
    doc["kind"] = KINDS[resource.plural]
    return {(body.metadata.namespace, body.metadata.labels[RUN_LABEL]): observe.summarize(doc)}


def _children(kwargs: dict[str, Any], key: tuple[str, str]) -> list[observe.Child]:
    # one entry per object: a pod deleted and re-created under the same name (its ordinal)
    # while a watch lagged is two objects for a moment
    out: dict[tuple[str, str], observe.Child] = {}
    for idx in CHILD_RESOURCES:
        for child in kwargs[idx].get(key) or ():
            out[(child.kind, child.name)] = child
    return list(out.values())


def _namespace_sandboxes(kwargs: dict[str, Any], ns: str) -> set[str]:
    """Names of every sandbox pod object of namespace `ns` in the pod index (every run's,
    terminating ones too): what the per-namespace cap counts. The index is kopf's, filled
    from a full list before any handler runs, so a restarted operator counts what the API
    server holds. Read from this worker thread while kopf's loop updates it: snapshots by
    `list()` (one step under the GIL), again if a resize still got in the way."""
    index = kwargs["idx_pods"]
    for _ in range(5):
        try:
            names: set[str] = set()
            for key in [k for k in list(index) if k[0] == ns]:
                store = index.get(key)
                names.update(c.name for c in list(store or ())
                             if c.component == sandboxes.COMPONENT)
            return names
        except RuntimeError:   # changed size during the copy
            continue
    raise kopf.TemporaryError("the pod index kept changing", delay=1)


def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any) -> None:
    rt = runtime(memo)
    key = (body.metadata.namespace, body.metadata.name)
    if body.metadata.get("deletionTimestamp"):
        return
    state = rt.run(key)
    if not state.lock.acquire(blocking=False):
        return
    t0 = time.perf_counter()
    try:
        out = reconcile.reconcile(rt, dict(body), _children(kwargs, key),
                                  lambda: _namespace_sandboxes(kwargs, key[0]))
    except Exception as e:
        rt.metrics.reconciles.labels("error").inc()
        rt.metrics.reconcile_errors.labels(type(e).__name__).inc()
        raise
    else:
        rt.metrics.reconciles.labels("ok").inc()
    finally:
        state.lock.release()
        rt.metrics.reconcile_seconds.observe(time.perf_counter() - t0)
    if rt.fence is not None and not rt.fence.allows():
        return   # the Lease was lost during this reconcile: the next leader reports
    old = body.status or {}
    for k, v in out.status.items():
        if old.get(k) != v:
            patch.status[k] = v
    for ev in out.events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)
    rt.metrics.set_phase(*key, out.status.get("phase"))
    rt.metrics.set_status(*key, out.status)
    if out.delete_run:
        kopf.event(body, type="Normal", reason="TTLExpired",
                   message="deleting the finished run (ttlSecondsAfterFinished)")
        rt.kube.delete("AsyncGRPORun", *key)


def on_change(**kwargs: Any) -> None:
    _reconcile(**kwargs)


#: Annotation a user sets on a run whose bucket cleanup cannot finish (an endpoint that is
#: gone): the deletion completes at once, the objects stay, a Warning event says so.
SKIP_CLEANUP = f"{API_GROUP}/skip-bucket-cleanup"


def _deleting_for(body: kopf.Body) -> float:
    from datetime import UTC, datetime

    since = untrusted.timestamp(body.metadata.get("deletionTimestamp"))
    if since is None:
        return 0.0
    return (datetime.now(UTC) - since).total_seconds()


def release_workload_account(rt: Runtime, ns: str, run_name: str) -> None:
    """Drop the cleanup finalizer from the run's ServiceAccount (`rbac.CLEANUP_FINALIZER`):
    the cleanup is over, or was never to be. A conflict (someone else wrote it) is retried by
    kopf."""
    account = rt.kube.get("ServiceAccount", ns, child_name(run_name, rbac.WORKLOAD))
    held = (account or {}).get("metadata", {}).get("finalizers") or []
    if rbac.CLEANUP_FINALIZER not in held:
        return
    meta = account["metadata"]
    try:
        rt.kube.patch({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
            "name": meta["name"], "namespace": ns, "resourceVersion": meta["resourceVersion"],
            "finalizers": [f for f in held if f != rbac.CLEANUP_FINALIZER]}})
    except ApiException as e:
        if e.status != 404:  # gone meanwhile: nothing to release
            raise


def _stop_trainer(rt: Runtime, ns: str, children: list[observe.Child]) -> None:
    for c in children:
        if c.component == "trainer" and c.kind in ("StatefulSet", "Pod") and not c.deleting:
            rt.kube.delete(c.kind, ns, c.name, propagation="Background")


def _create_cleanup_job(rt: Runtime, job: dict[str, Any]) -> tuple[str, str] | None:
    """Create the cleanup Job: (reason, message) when none can ever be created there (the run
    is then released, its objects kept); kopf.TemporaryError when a later try may work."""
    try:
        rt.kube.create(job)
    except ApiException as e:
        reason, message = kube.api_error(e)
        if e.status == 403 and "terminat" in message:
            # the namespace is going away, with the Secret and the ServiceAccount
            return ("CleanupAbandoned",
                    "the namespace is being deleted, no cleanup Job can run there")
        if e.status < 500 and e.status != 409:
            return "CleanupFailed", f"the cleanup Job was refused ({reason}: {message})"
        raise kopf.TemporaryError(f"creating the cleanup Job: {reason}", delay=5) from None
    return None


def _setup_running(rt: Runtime, ns: str, run_name: str, uid: str,
                   children: list[observe.Child]) -> bool:
    """Delete the run's own setup Job (never one it does not own); True while it or a pod of
    it may still run."""
    job_name = child_name(run_name, bucketjob.SETUP)
    job = next((c for c in children if c.kind == "Job" and c.name == job_name
                and uid and c.owner_uid == uid), None)
    if job is not None and not job.deleting:
        rt.kube.delete("Job", ns, job_name, propagation="Background")
    live = [c for c in children if c.kind == "Pod" and c.component == bucketjob.SETUP
            and c.phase not in ("Succeeded", "Failed")
            and (job is None or c.owner_uid in (None, "", job.uid))]
    return bool(live) or (job is not None and job.phase not in ("Complete", "Failed"))


def _has_workload_account(rt: Runtime, ns: str, run_name: str,
                          children: list[observe.Child]) -> bool:
    account = child_name(run_name, rbac.WORKLOAD)
    if any(c.kind == "ServiceAccount" and c.name == account for c in children):
        return True
    return rt.kube.get("ServiceAccount", ns, account) is not None   # the index may lag


def on_delete(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
              **kwargs: Any) -> None:
    """Apply deletionPolicy Delete to the run's own folder by a cleanup Job, never blocking.

    The trainer's pods are stopped first (they would write after the cleanup). The Job runs
    in the run's namespace as its ServiceAccount with its Secret (`bucketjob`); this handler
    creates it, then asks kopf to call again (TemporaryError) until the Job finished, the user
    set SKIP_CLEANUP, or `cleanup_timeout_seconds` passed since the deletion. Every outcome is
    an event; on every way out the Job is deleted and the ServiceAccount released. The Job has
    no ownerReference to the run: a foreground deletion would otherwise remove it first.
    """
    rt = runtime(memo)
    key = (body.metadata.namespace, body.metadata.name)
    ns = key[0]
    children = _children(kwargs, key)
    job_name = child_name(body.metadata.name, bucketjob.CLEANUP)
    job = next((c for c in children if c.kind == "Job" and c.name == job_name), None)

    def finish() -> None:
        release_workload_account(rt, ns, body.metadata.name)
        rt.forget(key)

    def done(type_: str, reason: str, message: str) -> None:
        if job is not None and not job.deleting:
            rt.kube.delete("Job", ns, job_name, propagation="Background")
        kopf.event(body, type=type_, reason=reason, message=message)
        finish()

    waited = _deleting_for(body)
    timeout = rt.settings.cleanup_timeout_seconds
    skip = str(body.metadata.annotations.get(SKIP_CLEANUP, "")).lower() == "true"
    if _setup_running(rt, ns, body.metadata.name, str(body.metadata.get("uid") or ""),
                      children) and not skip:
        # a setup running beside the cleanup (or after the run is gone) would write its
        # marker into an emptied folder: stop it, and wait until its pod has ended
        if waited < timeout:
            raise kopf.TemporaryError("waiting for the bucket setup Job to stop", delay=2)
        kopf.event(body, type="Warning", reason="SetupNotStopped", message=(
            f"the bucket setup Job did not stop in {timeout:.0f} s"))
    run, _errors = validate_run(reconcile.run_document(dict(body)))
    if run is None:
        if ((body.spec or {}).get("adapterStore") or {}).get("deletionPolicy") == "Delete":
            return done("Warning", "CleanupSkipped", "bucket objects kept: the spec is not "
                        "a valid run")
        return finish()
    if run.spec.adapter_store.deletion_policy != "Delete":
        return finish()
    if skip:
        return done("Warning", "CleanupSkipped", f"bucket objects kept: {SKIP_CLEANUP} is set")
    if not _has_workload_account(rt, ns, body.metadata.name, children):
        # every writer of the run's folder (setup Job, trainer) runs as this account, which
        # holds the cleanup finalizer: without it nothing of this run ever wrote (a run
        # refused OverCap or InvalidSpec), and no cleanup Job could run either
        return done("Normal", "CleanupSkipped", "nothing to clean: the run never set its "
                    "bucket folder up")
    uid = str(body.metadata.get("uid") or "")
    try:
        bucket.check_endpoint(run.spec.adapter_store, rt.settings.allowed_endpoints,
                              resolve=False)
        bucket.run_folder(run.spec.adapter_store, bucketjob.owner_of(run, uid))
    except bucket.BucketError as e:
        return done("Warning", e.reason, f"bucket objects kept: {e.message}")

    def give_up(why: str) -> None:
        done("Warning", "CleanupAbandoned", f"bucket objects kept: the cleanup did not "
             f"finish in {timeout:.0f} s ({why})")

    writers = [c for c in children if c.kind == "Pod" and c.component == "trainer"]
    if job is None and writers:
        # The trainer writes checkpoints and versions until it stops, and the run's children
        # outlive it while its finalizer holds: stop them first, clean up after them.
        if waited >= timeout:
            return give_up("the trainer pods did not stop")
        _stop_trainer(rt, ns, children)
        raise kopf.TemporaryError("waiting for the trainer to stop before the bucket cleanup",
                                  delay=2)
    desired = bucketjob.build_job(run, bucketjob.CLEANUP, uid, bucketjob.job_settings(rt.settings))
    if job is None or job.deleting:
        if waited >= timeout:
            return give_up("no cleanup Job could run")
        if job is None and (refused := bucketjob.credentials_refusal_of(rt.kube, run)):
            return done("Warning", refused[0], f"bucket objects kept: {refused[1]}")
        if job is None and (refused := _create_cleanup_job(rt, desired)):
            return done("Warning", refused[0], f"bucket objects kept: {refused[1]}")
        raise kopf.TemporaryError("waiting for the bucket cleanup Job", delay=2)
    if job.hash != desired["metadata"]["annotations"][HASH_ANNOTATION]:
        # a Job of an earlier run of the same name, or of another operator version
        rt.kube.delete("Job", ns, job_name, propagation="Background")
        raise kopf.TemporaryError("replacing a stale cleanup Job", delay=2)
    result = bucketjob.outcome(job, [c for c in children if c.kind == "Pod"])
    if result.state == "succeeded":
        logger.info("bucket cleanup of %s/%s: %s", *key, result.message)
        return done("Normal", "BucketCleaned", result.message or "the run's folder is empty")
    if result.state == "running":
        if waited >= timeout:
            return give_up("the Job is still running")
        raise kopf.TemporaryError("waiting for the bucket cleanup Job", delay=2)
    if result.reason == "EndpointUnreachable" or result.reason in ("SecretNotFound",
                                                                   "DeadlineExceeded"):
        # may pass on a later try: a new Job, until the timeout
        if waited >= timeout:
            return give_up(result.message)
        rt.kube.delete("Job", ns, job_name, propagation="Background")
        raise kopf.TemporaryError(result.message, delay=5)
    done("Warning", result.reason, f"bucket objects kept: {result.message}")


def validate(body: kopf.Body, memo: kopf.Memo, old: kopf.Body | None = None,
             **_: Any) -> None:
    """Admission: refuse a run `asyncgrpo validate` would refuse, one over the operator's
    caps, and an update of a field its checkpoints depend on; with every field path."""
    fixed = None
    if old is not None and old.get("spec"):
        # the previous spec, never the status (a tenant may patch it): every spec this
        # webhook admitted kept the identity of the one before, back to the first
        prev, _prev_errors = validate_run(reconcile.run_document(dict(old)))
        fixed = checkpoint_identity(prev.spec) if prev is not None else None
    _run, errors, _reason = reconcile.check_run(runtime(memo), dict(body), fixed)
    if errors:
        raise kopf.AdmissionError("; ".join(str(e) for e in errors[:20]), code=422)


def registry(settings: Settings, controller: bool = True) -> kopf.OperatorRegistry:
    """Every handler of one operator, with that operator's intervals and webhook.

    `controller=False`: the admission webhook alone (every replica serves it, leader or not).
    """
    reg = kopf.OperatorRegistry()
    kopf.on.startup(registry=reg)(configure)
    kopf.on.login(registry=reg)(login)
    kopf.on.cleanup(registry=reg)(close)
    if settings.webhook is not None:
        kopf.on.validate(**RUNS, id="run", operation="CREATE", registry=reg)(validate)
        kopf.on.validate(**RUNS, id="run-update", operation="UPDATE", registry=reg)(validate)
    if not controller:
        return reg
    for id_, (group, version, plural) in CHILD_RESOURCES.items():
        kopf.index(group=group, version=version, plural=plural, id=id_, labels=MANAGED,
                   registry=reg)(_summarize)
    for decorator in (kopf.on.resume(**RUNS, registry=reg), kopf.on.create(**RUNS, registry=reg),
                      kopf.on.update(**RUNS, field="spec", registry=reg)):
        decorator(on_change)
    every = settings.resync_seconds
    kopf.timer(**RUNS, id="on_timer", interval=every, initial_delay=every,
               registry=reg)(_reconcile)
    kopf.on.delete(**RUNS, registry=reg)(on_delete)
    return reg

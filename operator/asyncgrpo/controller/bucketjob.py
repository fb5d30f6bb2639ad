"""Bucket setup and cleanup as Jobs in the run's own namespace: the builders and the reading
of their outcome. Pure: spec in, manifests out; Job and pod summaries in, outcome out.

Why a Job (and not the trainer's init container, nor the operator itself):
- the operator then holds no tenant data-plane credential and sends no tenant-chosen request
  from its own network position (issue 9, docs/security.md): the Job's pod runs as the run's
  own ServiceAccount (`<run>-workload`, the one the trainer and vLLM use), gets the run's
  credentials Secret through `secretKeyRef` env (the kubelet resolves it, the operator never
  reads it) and talks to the endpoint from the tenant's namespace;
- one setup gates the trainer (and so every writer of the bucket) and gives one clear
  condition, BucketReady, from one place; an init container would run once per trainer pod
  and report only as a stuck pod;
- cleanup has to run after the run's pods are gone, on deletion, which only a Job can.

The container is the operator image (`Settings.bucket_job_image`): the smallest image with
boto3 and the `asyncgrpo` command; it runs `asyncgrpo bucket setup|cleanup`, which writes
`<Reason>: <message>` as its termination message on failure (and a one-line summary on
success), so the reason reaches the run's condition unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.bucket import policy as bucket
from asyncgrpo.controller import rbac
from asyncgrpo.controller.common import (
    bucket_env,
    container_security,
    metadata,
    name,
    place,
    pod_labels,
    pod_security,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.observe import Child

SETUP, CLEANUP = "bucket-setup", "bucket-cleanup"
ACTIONS = {SETUP: "setup", CLEANUP: "cleanup"}
#: Kubelet reasons of a container that cannot start because of its Secret reference, mapped
#: to the condition reasons the operator used when it read the Secret itself.
_CONFIG_ERRORS = ((re.compile(r"secret .* not found", re.IGNORECASE), "SecretNotFound"),
                  (re.compile(r"couldn't find key", re.IGNORECASE), "SecretKeyMissing"))
#: What marks a Secret as S3 credentials a run may name in spec.adapterStore.credentialsSecret
#: (docs/security.md): this label, on a Secret of one of these types. A tenant who may create
#: runs but not read Secrets could otherwise have the Job send any Secret of the namespace
#: (a ServiceAccount token, a registry password, a TLS key) as the access key to an endpoint
#: of theirs.
S3_SECRET_LABEL = "asyncgrpo.dev/s3-credentials"
S3_SECRET_TYPES = frozenset({"Opaque", "asyncgrpo.dev/s3-credentials"})
_IMAGE_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
_REASON = re.compile(r"^([A-Z][A-Za-z0-9]{1,63}): (.+)$", re.DOTALL)


@dataclass(frozen=True)
class JobSettings:
    """What the operator's settings give every bucket Job."""

    image: str
    pull_policy: str = "IfNotPresent"
    #: The Job's pod is killed after this long (a cleanup retried by the operator).
    deadline_seconds: int = 300
    allowed_endpoints: tuple[str, ...] = ()


def job_settings(s: Any) -> JobSettings:
    """The bucket Jobs' settings from the operator's (`runtime.Settings`)."""
    return JobSettings(image=s.bucket_job_image, pull_policy=s.bucket_job_pull_policy,
                       deadline_seconds=s.bucket_job_deadline_seconds,
                       allowed_endpoints=tuple(s.allowed_endpoints))


def owner_of(run: AsyncGRPORun, uid: str) -> bucket.Owner:
    """The run as the owner its bucket folder's marker names."""
    return bucket.Owner(run.metadata.namespace or "default", run.metadata.name, uid)


def job_name(run: AsyncGRPORun, component: str) -> str:
    """`<run>-bucket-setup` / `<run>-bucket-cleanup`: with the longest run name (44) the
    `job-name` label the Job controller sets is 59 characters, below 63."""
    return name(run, component)


def build_job(run: AsyncGRPORun, component: str, uid: str, js: JobSettings) -> dict[str, Any]:
    """The setup or cleanup Job of a run. No retries of its own (`backoffLimit: 0`): the
    operator reads each failure, reports it and decides when to run another."""
    store = run.spec.adapter_store
    env = bucket_env(run) + [
        {"name": wire.RUN_UID_ENV, "value": uid},
        {"name": wire.CREATE_BUCKET_ENV, "value": "true" if store.create_bucket else "false"},
        {"name": wire.ALLOWED_ENDPOINTS_ENV, "value": ",".join(js.allowed_endpoints)},
        {"name": wire.RECLAIM_RETAINED_ENV, "value": "true" if store.reclaim_retained_folder else "false"},
        {"name": "HOME", "value": "/tmp"},
    ]
    container = {
        "name": "bucket",
        "image": js.image,
        "imagePullPolicy": js.pull_policy,
        "command": ["asyncgrpo", "bucket", ACTIONS[component]],
        "env": env,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"cpu": "500m", "memory": "256Mi"}},
        "securityContext": container_security(),
        "terminationMessagePath": wire.TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = {
        "metadata": {"labels": pod_labels(run, component)},
        "spec": {
            # the run's own identity: with no credentialsSecret, boto3 uses this account's
            # cloud identity (IRSA's projected token, GKE's metadata server); no API token
            "serviceAccountName": name(run, rbac.WORKLOAD),
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": [tmp_volume()],
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(run, component, job_name(run, component)),
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": js.deadline_seconds,
                 "template": place(run, "bucket", pod)},
    }
    return stamp(job)


def endpoint_ports(endpoint: str | None) -> list[int]:
    import urllib.parse

    if not endpoint:
        return [443]
    try:
        url = urllib.parse.urlsplit(endpoint)
        return [url.port or (443 if url.scheme == "https" else 80)]
    except ValueError:
        return [443]


# ---------------------------------------------------------------- outcome


@dataclass(frozen=True)
class Outcome:
    """What one Job says: `state` is running, succeeded or failed; for a failure, the
    reason (CamelCase) and message for the condition and the event."""

    state: str
    reason: str = ""
    message: str = ""
    uid: str = ""


def parse_message(text: str, default_reason: str) -> tuple[str, str]:
    """`Reason: message` as the bucket command writes it; anything else keeps the default."""
    text = (text or "").strip()
    m = _REASON.match(text)
    if m:
        return m.group(1), m.group(2).strip()[:1000]
    return default_reason, (text or "the bucket Job failed without a message")[:1000]


def outcome(job: Child, pods: list[Child]) -> Outcome:
    """The outcome of `job` from its summary and its pods' (matched by owner uid)."""
    mine = [p for p in pods if p.owner_uid and p.owner_uid == job.uid]
    message = next((p.termination_message for p in mine if p.termination_message), "")
    if job.phase == "Complete":
        return Outcome("succeeded", "", message, job.uid)
    if job.phase == "Failed":
        reason, text = parse_message(message, "BucketJobFailed")
        if not message and job.problem:   # DeadlineExceeded, BackoffLimitExceeded
            reason, text = job.problem, job.problem_message or text
        return Outcome("failed", reason, text, job.uid)
    for p in mine:
        if p.problem == "CreateContainerConfigError":
            reason = next((r for rx, r in _CONFIG_ERRORS if rx.search(p.problem_message)),
                          "SecretInvalid")
            return Outcome("failed", reason, f"the bucket Job cannot start: "
                           f"{p.problem_message}", job.uid)
        if p.problem in _IMAGE_ERRORS:   # the Job would wait until its deadline
            return Outcome("failed", p.problem, f"the bucket Job cannot start: "
                           f"{p.problem_message}", job.uid)
    return Outcome("running", uid=job.uid)


def credentials_refusal(found: tuple[str, dict[str, str]] | None, name: str
                        ) -> tuple[str, str] | None:
    """(reason, message) when the Secret (its type and labels, `Kube.secret_kind`) may not be
    sent as S3 credentials; None when it may, or is missing (the Job says SecretNotFound)."""
    if found is None:
        return None
    type_, labels = found
    if type_ not in S3_SECRET_TYPES:
        return ("SecretNotAllowed", (f"Secret {name} is of type {type_ or 'unknown'}: S3 "
                "credentials must be a Secret of type Opaque (or asyncgrpo.dev/s3-credentials)"))
    if labels.get(S3_SECRET_LABEL) != "true":
        return ("SecretNotAllowed", (f"Secret {name} is not labelled {S3_SECRET_LABEL}=true: "
                "only a Secret marked as S3 credentials is sent to the endpoint"))
    return None


def credentials_refusal_of(kube: Any, run: AsyncGRPORun) -> tuple[str, str] | None:
    """Why the run's credentialsSecret may not be sent (`credentials_refusal`), from its type
    and labels only (`Kube.secret_kind`): the operator never reads a credentials Secret's
    data."""
    ref = run.spec.adapter_store.credentials_secret
    if ref is None:
        return None
    return credentials_refusal(kube.secret_kind(run.metadata.namespace or "default", ref.name),
                               ref.name)

"""Summaries of child objects, as the operator's indexes keep them.

The operator watches its children (label `app.kubernetes.io/managed-by=asyncgrpo-operator`)
and keeps, per run, only what the reconcile and the status need: the spec hash, readiness,
and the reasons a pod is stuck (image pulls, scheduling, crashes). Pure functions of the
object body, so the status logic can be tested on plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo import API_GROUP, wire
from asyncgrpo.controller import untrusted
from asyncgrpo.controller.common import COMPONENT_LABEL, HASH_ANNOTATION, SANDBOX_IMAGE_ANNOTATION

#: On the run's ConfigMap: the checkpoint identity (`api.validation.checkpoint_identity`) of
#: the spec the operator first applied. The immutability check reads it here, where only the
#: operator writes, never from the run's status (which a tenant can patch).
IDENTITY_ANNOTATION = f"{API_GROUP}/checkpoint-identity"

#: Container waiting reasons a user must act on (not transient start-up states).
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull",
                           "InvalidImageName",
                           "CrashLoopBackOff", "CreateContainerConfigError",
                           "CreateContainerError", "RunContainerError"})


@dataclass(frozen=True)
class Child:
    kind: str
    name: str
    component: str
    hash: str | None
    deleting: bool = False
    replicas: int = 0
    ready_replicas: int = 0
    up_to_date: bool = True
    phase: str = ""
    ready: bool = False
    unschedulable: bool = False
    problem: str = ""          # reason, e.g. ImagePullBackOff
    problem_message: str = ""
    exit_codes: tuple[int, ...] = field(default_factory=tuple)
    restarts: int = 0
    #: the last termination message of its first container (the trainer's final numbers,
    #: a bucket Job's outcome)
    termination_message: str = ""
    #: the pod's IP (the operator reads each vLLM replica's weights puller there)
    ip: str = ""
    uid: str = ""
    #: uid of its controller (a Job's pod: the Job), so an old Job's pod is never read as
    #: the new one's
    owner_uid: str = ""
    #: IDENTITY_ANNOTATION (the run's ConfigMap)
    identity: str = ""
    #: a ready pod's start: creation to its Ready condition, in seconds (None before Ready)
    start_seconds: float | None = None
    #: a sandbox pod's image key (wire.sandbox_image_key) and, for a row's image, its
    #: reference (None: the run's own image)
    image_key: str = wire.DEFAULT_SANDBOX_IMAGE_KEY
    image: str | None = None


def _pod_fields(status: dict[str, Any]) -> dict[str, Any]:
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    sched = conds.get("PodScheduled", {})
    out: dict[str, Any] = {
        "phase": status.get("phase", "Pending"),
        "ready": conds.get("Ready", {}).get("status") == "True",
        "unschedulable": sched.get("status") == "False" and sched.get("reason") == "Unschedulable",
    }
    problem, message, codes, restarts, final = "", "", [], 0, ""
    for cs in status.get("containerStatuses") or []:
        restarts += int(cs.get("restartCount", 0))
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS and not problem:
            problem, message = waiting["reason"], waiting.get("message", "")
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term is not None and "exitCode" in term:
                codes.append(int(term["exitCode"]))
                final = final or (term.get("message") or "")[:4096]
    if out["unschedulable"] and not problem:
        problem, message = "Unschedulable", sched.get("message", "")
    out |= {"problem": problem, "problem_message": message[:300],
            "exit_codes": tuple(codes), "restarts": restarts, "termination_message": final,
            "ip": status.get("podIP") or ""}
    return out


def _start_seconds(meta: dict[str, Any], status: dict[str, Any]) -> float | None:
    """Seconds from a pod's creation to its Ready condition (bounded: the times are text)."""
    created = untrusted.timestamp(meta.get("creationTimestamp"))
    conds = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, dict)}
    ready = untrusted.timestamp(conds.get("Ready", {}).get("lastTransitionTime"))
    if created is None or ready is None:
        return None
    seconds = (ready - created).total_seconds()
    return seconds if 0.0 <= seconds <= 3600.0 else None


def _job_fields(status: dict[str, Any]) -> dict[str, Any]:
    """A Job as a phase (Complete, Failed or Running) and, when failed, its reason."""
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "Failed"):
            failed = c["type"] == "Failed"
            return {"phase": c["type"], "problem": c.get("reason", "") if failed else "",
                    "problem_message": (c.get("message") or "")[:300] if failed else ""}
    return {"phase": "Running"}


def summarize(body: dict[str, Any]) -> Child:
    meta = body.get("metadata") or {}
    kind = body.get("kind", "")
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    fields: dict[str, Any] = {}
    if kind == "Pod":
        fields = _pod_fields(status)
        fields["start_seconds"] = _start_seconds(meta, status) if fields["ready"] else None
    elif kind in ("Deployment", "StatefulSet"):
        fields = {
            "replicas": int(spec.get("replicas", 1)),
            "ready_replicas": int(status.get("readyReplicas") or 0),
            "up_to_date": int(status.get("observedGeneration") or 0)
            >= int(meta.get("generation") or 0),
        }
    elif kind == "Job":
        fields = _job_fields(status)
    owner = next((o.get("uid", "") for o in meta.get("ownerReferences") or []
                  if o.get("controller")), "")
    if kind == "Pod":
        fields |= _pod_image(meta)
    return Child(kind=kind, name=meta.get("name", ""),
                 component=(meta.get("labels") or {}).get(COMPONENT_LABEL, ""),
                 hash=(meta.get("annotations") or {}).get(HASH_ANNOTATION),
                 deleting=bool(meta.get("deletionTimestamp")), uid=meta.get("uid", ""),
                 owner_uid=owner,
                 identity=str((meta.get("annotations") or {}).get(IDENTITY_ANNOTATION) or "")
                 [:4096], **fields)


def _pod_image(meta: dict[str, Any]) -> dict[str, Any]:
    """A sandbox pod's image key and row image, as `sandboxes.build_pod` labelled it."""
    key = str((meta.get("labels") or {}).get(wire.SANDBOX_IMAGE_LABEL) or wire.DEFAULT_SANDBOX_IMAGE_KEY)
    ref = (meta.get("annotations") or {}).get(SANDBOX_IMAGE_ANNOTATION)
    if key == wire.DEFAULT_SANDBOX_IMAGE_KEY or not isinstance(ref, str) \
            or wire.sandbox_image_key(ref) != key:
        return {"image_key": key, "image": None}
    return {"image_key": key, "image": ref}


def workload(children: list[Child], component: str) -> Child | None:
    """The Deployment or StatefulSet of one component among a run's children, if any."""
    return next((c for c in children if c.kind in ("Deployment", "StatefulSet")
                 and c.component == component), None)


def ready(children: list[Child], component: str) -> bool:
    """The component's workload has replicas, and all of them ready."""
    w = workload(children, component)
    return w is not None and w.replicas > 0 and w.ready_replicas >= w.replicas

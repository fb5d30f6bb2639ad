"""The cluster preflight: `asyncgrpo preflight` as a Job of the run's namespace, before vLLM
and the trainer are scaled up, and the `Preflight` condition from its outcome. Pure: spec in,
manifest out; Job and pod summaries in, outcome out.

Why a Job, built like the bucket setup Job (`bucketjob`): the checks need what only the
trainer's pod has (the model as its image, cache and hub settings see it, the mounted data
ConfigMap, the bucket with the run's credentials, the user's modules in the trainer image),
and the operator reads none of that itself. So the Job runs the trainer image as the run's
workload ServiceAccount, with the run ConfigMap and the data ConfigMap mounted where the
trainer has them, `common.bucket_env` and the trainer's `env`. Its command writes
`{"errors": [{"path", "message"}]}` as its termination message; each error becomes
`field.path: message` in the condition, so a typo in `spec.model.name` is a condition naming
that field within a minute, not a CrashLoopBackOff of GPU pods after vLLM has been pulled.

One Job per hash of the Job (the checked spec: model, data, reward, harness, image, env...):
a new spec runs it again; a passed one is not re-run (nothing it checked changed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import configmap, rbac
from asyncgrpo.controller.common import (
    bucket_env,
    container_security,
    merge_env,
    metadata,
    model_cache,
    name,
    place,
    pod_labels,
    pod_security,
    spec_hash,
    stamp,
    tmp_volume,
)
from asyncgrpo.controller.observe import Child

COMPONENT = "preflight"
#: On the Job: a hash of what the checks read (CHECKED), so a changed field gets a new Job.
CHECKED_ANNOTATION = "asyncgrpo.dev/checked-hash"
#: The parts of the spec `asyncgrpo preflight` reads (asyncgrpo.preflight).
CHECKED = ("model", "data", "reward", "harness", "adapter_store")
TERMINATION_LOG = "/dev/termination-log"
#: The deep checks import transformers and load a tokenizer: a few seconds, some hundred MB.
DEADLINE_SECONDS = 600
_IMAGE_ERRORS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})


def job_name(run: AsyncGRPORun) -> str:
    """`<run>-preflight` (with the longest run name the Job's pod labels stay within 63)."""
    return name(run, COMPONENT)


def checked_hash(run: AsyncGRPORun) -> str:
    """A hash of the fields the checks read (the image and env are in the Job itself)."""
    spec = run.spec.model_dump(mode="json", include=set(CHECKED), exclude_none=True)
    spec["rolloutEnv"] = [e.model_dump(mode="json", exclude_none=True) for e in run.spec.rollout.env]
    return spec_hash({"spec": spec})


def build_job(run: AsyncGRPORun, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """The preflight Job of a run: the trainer image, `asyncgrpo preflight` on the run file.
    No retries of its own (`backoffLimit: 0`): a failure is the user's to fix (a new spec
    gets a new Job)."""
    t = run.spec.trainer
    mounts = [{"name": "config", "mountPath": wire.CONFIG_MOUNT, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"},
              {"name": "cache", "mountPath": wire.CACHE_DIR}]   # HF_HOME, as the trainer's
    volumes = [{"name": "config", "configMap": {"name": name(run, configmap.COMPONENT)}},
               tmp_volume(), tmp_volume("cache")]
    data_cm = run.spec.data.config_map
    if data_cm is not None:  # where the trainer reads it: <DATA_DIR>/<key>
        mounts.append({"name": "data", "mountPath": wire.DATA_DIR, "readOnly": True})
        volumes.append({"name": "data", "configMap": {
            "name": data_cm.name, "items": [{"key": data_cm.key, "path": data_cm.key}]}})
    base = [{"name": "HF_HOME", "value": wire.HF_HOME}, {"name": "HOME", "value": "/tmp"},
            {"name": "TRL_EXPERIMENTAL_SILENCE", "value": "1"}, *bucket_env(run)]
    container = {
        "name": COMPONENT,
        "image": t.image,
        "imagePullPolicy": pull_policy,
        "command": ["asyncgrpo", "preflight", "--config",
                    f"{wire.CONFIG_MOUNT}/{wire.CONFIG_KEY}",
                    "--termination-log", TERMINATION_LOG],
        "env": merge_env(base, t.env),   # the trainer's hub settings (HF_HUB_OFFLINE, ...)
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                      "limits": {"cpu": "2", "memory": "4Gi"}},
        "securityContext": container_security(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "File",
        "volumeMounts": mounts,
    }
    if (cache := model_cache(run)) is not None:  # the model as the trainer's cache has it
        volume, mount, env = cache
        volumes.append(volume)
        mounts.append(mount)
        container["env"] = container["env"] + env
    pod = {
        "metadata": {"labels": pod_labels(run, COMPONENT)},
        "spec": {
            "serviceAccountName": name(run, rbac.WORKLOAD),
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "securityContext": pod_security(),
            "containers": [container],
            "volumes": volumes,
        },
    }
    meta = metadata(run, COMPONENT, job_name(run))
    meta["annotations"] = {CHECKED_ANNOTATION: checked_hash(run)}
    return stamp({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        # CPU only, like the bucket Jobs: their placement (spec.adapterStore.bucketJobPod)
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": DEADLINE_SECONDS,
                 "template": place(run, "bucket", pod)},
    })


# ---------------------------------------------------------------- outcome


@dataclass(frozen=True)
class Outcome:
    """`state`: running, passed or failed; for a failure the condition's reason and message
    (each `field.path: message` the command reported)."""

    state: str
    reason: str = ""
    message: str = ""
    uid: str = ""


def parse_errors(text: str) -> list[str]:
    """`field.path: message` lines from the command's termination message (JSON); a message
    that is not that JSON (a crash before the checks ran) is kept as it is."""
    try:
        doc = json.loads(text or "")
        return [f"{e['path']}: {e['message']}" for e in doc["errors"]]
    except (ValueError, KeyError, TypeError):
        return [text.strip()] if text and text.strip() else []


def outcome(job: Child, pods: list[Child]) -> Outcome:
    """The outcome of `job` from its summary and its pods' (matched by owner uid)."""
    mine = [p for p in pods if p.owner_uid and p.owner_uid == job.uid]
    message = next((p.termination_message for p in mine if p.termination_message), "")
    if job.phase == "Complete":
        return Outcome("passed", "Passed", "the model, tokenizer, data and modules of the "
                       "run check out where the trainer runs", job.uid)
    if job.phase == "Failed":
        errors = parse_errors(message)
        if errors:
            return Outcome("failed", "PreflightFailed", "; ".join(errors)[:2000], job.uid)
        return Outcome("failed", job.problem or "PreflightFailed",
                       job.problem_message or "the preflight Job failed without a message",
                       job.uid)
    for p in mine:
        if p.problem in _IMAGE_ERRORS or p.problem == "CreateContainerConfigError":
            return Outcome("failed", p.problem, f"the preflight Job cannot start: "
                           f"{p.problem_message}", job.uid)
    return Outcome("running", uid=job.uid)


def condition(result: Outcome | None) -> tuple[bool | None, str, str]:
    """(status, reason, message) of the Preflight condition."""
    if result is None or result.state == "running":
        return None, "Checking", "the preflight Job has not finished yet"
    if result.state == "passed":
        return True, result.reason, result.message
    return False, result.reason, result.message


# ---------------------------------------------------------------- what to do


@dataclass
class State:
    """What the operator remembers of a run's preflight (its RunState holds one)."""

    #: hash of the Job whose outcome counted, and that outcome
    key: str | None = None
    result: Outcome | None = None


def step(desired: dict[str, Any], job: Child | None, pods: list[Child], state: State,
         ready: bool) -> tuple[tuple[str, dict[str, Any]] | None, Outcome | None]:
    """(("create"|"delete", job) or None, the outcome of the current spec's Job or None).

    `ready`: the bucket is set up (the Job runs as the run's ServiceAccount and may read
    the data from the bucket). One Job per hash: a finished one stays (its pod's message is
    the record) until the spec changes; a Job of another hash is deleted, then the new one
    created. A stored outcome is kept for its hash across Jobs going away."""
    key = desired["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"]
    known = state.result if state.key == key else None
    if job is None:
        if known is None and ready:
            return ("create", desired), None
        return None, known
    if job.deleting:
        return None, known
    if job.hash != key:
        return ("delete", desired), known
    result = outcome(job, pods)
    if result.state != "running":
        state.key, state.result = key, result
    return None, result if result.state != "running" else known

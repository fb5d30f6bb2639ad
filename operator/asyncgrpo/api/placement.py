"""Pod settings: which component reads which, how they merge, and what the operator owns.

One shape (`PodSettings`) for every component; spec.pod is the run-wide base and each
component's settings are merged over it (`merged`). The operator owns the labels its
selectors and indexes read, the annotations its reconcile and scrapes read, the volumes and
mounts its processes need, the variables that wire components together, and every security
setting (not part of the shape at all). `conflicts` lists each user entry that would replace
one of those, with its field path, for `asyncgrpo validate`, the webhook and the reconcile;
the builders also let the operator's entries win, so a run that skipped validation still
cannot weaken a pod.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORunSpec, PodSettings

#: Label and annotation prefixes the operator owns (selectors, indexes, hashes, scrapes).
OWNED_LABEL_PREFIXES = ("app.kubernetes.io/", "asyncgrpo.dev/")
OWNED_ANNOTATION_PREFIXES = ("asyncgrpo.dev/", "prometheus.io/")
#: Volume names the operator's pods use.
OWNED_VOLUMES = frozenset({"config", "tmp", "dshm", "work", "cache", "data", "weights",
                           "workspace", "model-cache"})
#: Paths the operator mounts (a user mount at or under one would shadow it), and where the
#: kubelet writes termination messages.
OWNED_MOUNT_PATHS = ("/tmp", "/dev/shm", wire.TERMINATION_LOG, wire.CACHE_DIR,
                     wire.CONFIG_MOUNT, wire.DATA_DIR, wire.TRAINER_WORK_DIR,
                     wire.SANDBOX_WORKSPACE)
#: Variables the operator sets to wire components together or reach the bucket.
OWNED_ENV_PREFIXES = (wire.ENV_PREFIX,)
OWNED_ENV = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3",
                       "AWS_DEFAULT_REGION", "HF_HOME", "HF_HUB_OFFLINE", "HOME"})

#: Each component's settings, by field path; bucketJobs and gateway are pods too.
COMPONENTS = {
    "trainer": "spec.trainer.pod",
    "vllm": "spec.rollout.pod",
    "sandbox": "spec.sandboxes.pod",
    "gateway": "spec.sandboxes.gatewayPod",
    "bucket": "spec.adapterStore.bucketJobPod",
}


def component_settings(spec: AsyncGRPORunSpec, component: str) -> PodSettings:
    """The component's own settings (not merged); bucket-setup/cleanup are "bucket"."""
    if component == "trainer":
        return spec.trainer.pod
    if component == "vllm":
        return spec.rollout.pod
    if component in ("sandbox", "gateway"):
        sb = spec.sandboxes
        if sb is None:
            return PodSettings()
        return sb.pod if component == "sandbox" else sb.gateway_pod
    if component == "bucket":
        return spec.adapter_store.bucket_job_pod
    raise KeyError(component)


def _by(items: list[Any], key: str) -> dict[Any, Any]:
    return {getattr(i, key): i for i in items}


def merged(spec: AsyncGRPORunSpec, component: str) -> PodSettings:
    """spec.pod with the component's settings over it, field by field:

    - nodeSelector, labels, annotations: by key, the component's value wins;
    - tolerations, imagePullSecrets: appended (run-wide first; a secret named twice once);
    - volumes: by name; volumeMounts: by mountPath; env: by name; the component's wins;
    - affinity, topologySpreadConstraints, priorityClassName, schedulerName, gpuToleration:
      the component's replaces the run-wide one when it sets it.
    """
    base, over = spec.pod, component_settings(spec, component)
    secrets = list(_by(base.image_pull_secrets + over.image_pull_secrets, "name").values())
    return PodSettings.model_validate({
        "node_selector": {**base.node_selector, **over.node_selector},
        "tolerations": base.tolerations + [t for t in over.tolerations
                                           if t not in base.tolerations],
        "gpu_toleration": over.gpu_toleration if over.gpu_toleration is not None
        else base.gpu_toleration,
        "affinity": over.affinity or base.affinity,
        "topology_spread_constraints": over.topology_spread_constraints
        or base.topology_spread_constraints,
        "priority_class_name": over.priority_class_name or base.priority_class_name,
        "scheduler_name": over.scheduler_name or base.scheduler_name,
        "image_pull_secrets": secrets,
        "labels": {**base.labels, **over.labels},
        "annotations": {**base.annotations, **over.annotations},
        "volumes": list({**_by(base.volumes, "name"), **_by(over.volumes, "name")}.values()),
        "volume_mounts": list({**_by(base.volume_mounts, "mountPath"),
                               **_by(over.volume_mounts, "mountPath")}.values()),
        "env": list({**_by(base.env, "name"), **_by(over.env, "name")}.values()),
    }, strict=False)


def owned_label(key: str) -> bool:
    return key.startswith(OWNED_LABEL_PREFIXES)


def owned_annotation(key: str) -> bool:
    return key.startswith(OWNED_ANNOTATION_PREFIXES)


def owned_env(name: str) -> bool:
    return name in OWNED_ENV or name.startswith(OWNED_ENV_PREFIXES)


def owned_mount(path: str) -> bool:
    path = path.rstrip("/") or "/"
    return any(path == p or path.startswith(p + "/") or p.startswith(path + "/")
               for p in OWNED_MOUNT_PATHS)


def _at(path: str, *message: str) -> tuple[str, str]:
    return path, "".join(message)


def settings_conflicts(at: str, ps: PodSettings, base: PodSettings | None = None
                       ) -> Iterator[tuple[str, str]]:
    """(field path, message) for each entry of `ps` (at field path `at`) the operator owns,
    and each mount of a volume neither `ps` nor `base` (spec.pod) has."""
    for key in ps.labels:
        if owned_label(key):
            yield _at(f"{at}.labels.{key}", f"{', '.join(OWNED_LABEL_PREFIXES)} labels are the "
                   "operator's (its selectors and indexes read them): choose another key")
    for key in ps.annotations:
        if owned_annotation(key):
            yield _at(f"{at}.annotations.{key}", f"{', '.join(OWNED_ANNOTATION_PREFIXES)} "
                   "annotations are the operator's: choose another key")
    for i, v in enumerate(ps.volumes):
        if v.name in OWNED_VOLUMES:
            yield _at(f"{at}.volumes[{i}].name", f"{v.name!r} is a volume of the operator "
                   f"({', '.join(sorted(OWNED_VOLUMES))}): choose another name")
    for i, m in enumerate(ps.volume_mounts):
        if owned_mount(m.mountPath):
            yield _at(f"{at}.volumeMounts[{i}].mountPath", f"{m.mountPath} is at, above or under "
                   f"a path the operator mounts ({', '.join(OWNED_MOUNT_PATHS)})")
        if m.name in OWNED_VOLUMES:
            yield _at(f"{at}.volumeMounts[{i}].name", f"{m.name!r} is a volume of the operator: "
                   "mount a volume of your own")
    for i, e in enumerate(ps.env):
        if owned_env(e.name):
            yield _at(f"{at}.env[{i}].name", f"{e.name} is set by the operator (ASYNCGRPO_*, the "
                   "bucket's AWS_* variables, HOME, HF_HOME, HF_HUB_OFFLINE): it cannot be "
                   "replaced")
    names = {v.name for v in ps.volumes + (base.volumes if base else [])}
    for i, m in enumerate(ps.volume_mounts):
        if m.name not in names and m.name not in OWNED_VOLUMES:
            yield _at(f"{at}.volumeMounts[{i}].name", f"no volume {m.name!r} in {at}.volumes"
                   + ("" if base is None else " or spec.pod.volumes"))


def conflicts(spec: AsyncGRPORunSpec) -> Iterator[tuple[str, str]]:
    """Every operator-owned entry a run's pod settings would replace, with its field path."""
    yield from settings_conflicts("spec.pod", spec.pod)
    for component, at in COMPONENTS.items():
        if component in ("sandbox", "gateway") and spec.sandboxes is None:
            continue
        yield from settings_conflicts(at, component_settings(spec, component), spec.pod)
    for key in spec.service_account.annotations:
        if key.startswith("asyncgrpo.dev/"):
            yield _at(f"spec.serviceAccount.annotations.{key}",
                   "asyncgrpo.dev/ annotations are the operator's: choose another key")
    cache = spec.model.cache
    if cache is not None:
        if (cache.claim_name is None) == (cache.volume is None):
            yield _at("spec.model.cache", "give exactly one of claimName, volume")
        if cache.volume is not None and cache.volume.name in OWNED_VOLUMES - {"model-cache"}:
            yield _at("spec.model.cache.volume.name", f"{cache.volume.name!r} is a volume of the "
                   "operator: choose another name")

"""Operator-wide caps (Helm values caps.*): what a run may ask for beyond the model's bounds.

The model (`asyncgrpo.api`) bounds each field for every cluster; a cluster admin lowers the
bounds for theirs. `cap_errors` is read by the admission webhook (refused at apply) and by
the reconcile (reason OverCap on the Degraded and Progressing conditions, nothing created),
so a run over a cap never floods the cluster. The per-namespace sandbox cap is a sum over
runs: the reconcile enforces it when it plans the pool's creations, counting the namespace's
sandbox pods from the pod index (not from memory a restart loses) plus in-flight creations
(`Runtime.reserve_sandboxes`).
"""

from __future__ import annotations

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.api.validation import FieldError
from asyncgrpo.controller.runtime import Caps


def cap_errors(run: AsyncGRPORun, caps: Caps) -> list[FieldError]:
    s = run.spec
    errors = []
    if s.trainer.replicas > caps.trainer_replicas:
        errors.append(FieldError("spec.trainer.replicas", f"{s.trainer.replicas} is above the "
                                 f"operator's cap of {caps.trainer_replicas} trainer replicas"))
    if s.rollout.replicas > caps.vllm_replicas:
        errors.append(FieldError("spec.rollout.replicas", f"{s.rollout.replicas} is above the "
                                 f"operator's cap of {caps.vllm_replicas} vLLM replicas"))
    if s.sandboxes is not None:
        most = max(s.sandboxes.hard_cap, s.sandboxes.max, s.sandboxes.min_warm)
        if most > caps.sandboxes_per_run:
            errors.append(FieldError("spec.sandboxes.hardCap", f"{most} sandboxes is above the "
                                     f"operator's cap of {caps.sandboxes_per_run} per run"))
        if s.sandboxes.min_warm > caps.sandboxes_per_namespace:
            errors.append(FieldError("spec.sandboxes.minWarm", f"{s.sandboxes.min_warm} is "
                                     "above the operator's cap of "
                                     f"{caps.sandboxes_per_namespace} sandboxes per namespace"))
    return errors

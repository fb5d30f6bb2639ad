"""The run's status: phase and conditions, computed from what the operator observed.

Pure: `compute` takes the spec, the observation and the previous status and returns the new
status plus the transitions worth an event. Conditions follow metav1.Condition: a CamelCase
reason a program can switch on, a message a person can act on, `observedGeneration`, and a
`lastTransitionTime` that moves only when the status does (so an unchanged run yields an
identical status, and the handler writes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncgrpo import wire
from asyncgrpo.api.v1alpha1 import AsyncGRPORunSpec
from asyncgrpo.api.validation import FieldError
from asyncgrpo.bucket.policy import BucketError
from asyncgrpo.controller.gateway import COMPONENT as GATEWAY
from asyncgrpo.controller.observe import Child, workload
from asyncgrpo.controller.progress import Progress
from asyncgrpo.controller.sandboxes import COMPONENT as SANDBOX
from asyncgrpo.controller.served import ServedWeights
from asyncgrpo.controller.trainer import COMPONENT as TRAINER
from asyncgrpo.controller.vllm import COMPONENT as VLLM

PENDING, STARTING, RUNNING, SUSPENDED, SUCCEEDED, FAILED = (
    "Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed")
TERMINAL = frozenset({SUCCEEDED, FAILED})

#: Trainer restarts with a non-zero exit after which the run is Failed (a Job's default).
TRAINER_BACKOFF_LIMIT = 6

#: The deep checks of the run where its model, data and modules are (`asyncgrpo preflight`;
#: docs/api.md): set False with the field path before vLLM and the trainer are scaled up.
PREFLIGHT_CONDITION = "Preflight"


@dataclass
class Observation:
    generation: int
    spec_errors: list[FieldError] = field(default_factory=list)
    #: InvalidSpec, ImmutableFieldChanged or OverCap: why the spec is not applied
    spec_error_reason: str = "InvalidSpec"
    bucket_error: BucketError | None = None
    #: the setup Job of the current spec has finished at least once (bucketjob)
    bucket_checked: bool = False
    children: list[Child] = field(default_factory=list)
    sandboxes: dict[str, int] = field(default_factory=dict)
    progress: Progress | None = None
    trainer_gated: bool = False
    apply_errors: list[tuple[str, str]] = field(default_factory=list)
    pool_error: tuple[str, str] | None = None
    #: full fine-tuning: the weights versions the vLLM replicas serve (oldest, newest)
    served_weights: ServedWeights | None = None
    #: per vLLM replica (controller.rollout_replicas); None: not read (stopped, no pod)
    rollout_replicas: list[dict] | None = None
    #: (kind, name) of children whose names are held by objects that are not the run's
    conflicts: list[tuple[str, str]] = field(default_factory=list)
    #: (reason, message) of the refused write of the run's ConfigMap: nothing starts
    config_refused: tuple[str, str] | None = None
    #: (reason, message): a tenant endpoint that was slow, too large or malformed, names
    #: that did not resolve, a token Secret that cannot be read (controller.tenant_io)
    endpoint_problems: list[tuple[str, str]] = field(default_factory=list)
    #: (status, reason, message) of the Preflight condition; None: no preflight (off)
    preflight: tuple[bool | None, str, str] | None = None


@dataclass(frozen=True)
class Transition:
    type: str          # Normal or Warning
    reason: str
    message: str


def _cond(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _problem(children: list[Child], component: str) -> Child | None:
    return next((c for c in children if c.kind == "Pod" and c.component == component
                 and c.problem and not c.deleting), None)


def _workload_condition(type_: str, children: list[Child], component: str, what: str,
                        stopped: str | None) -> dict[str, Any]:
    if stopped:
        return _cond(type_, False, stopped, f"{what} scaled to zero ({stopped.lower()})")
    w = workload(children, component)
    if w is None:
        return _cond(type_, False, "NotCreated", f"{what} not created yet")
    if w.replicas and w.ready_replicas >= w.replicas and w.up_to_date:
        return _cond(type_, True, "Ready", f"{w.ready_replicas}/{w.replicas} {what} pods ready")
    p = _problem(children, component)
    if p is not None:
        return _cond(type_, False, p.problem, f"pod {p.name}: {p.problem_message or p.problem}")
    return _cond(type_, False, "Starting",
                 f"{w.ready_replicas}/{w.replicas} {what} pods ready")


def _trainer_outcome(children: list[Child], progress: Progress | None,
                     spec: AsyncGRPORunSpec) -> str | None:
    if progress is not None and progress.step is not None \
            and progress.step >= spec.trainer.total_steps:
        return SUCCEEDED
    pods = [c for c in children if c.kind == "Pod" and c.component == "trainer"]
    rank0 = next((p for p in pods if p.name.endswith("-0")), None)
    if rank0 is not None and rank0.exit_codes and rank0.exit_codes[0] == 0 \
            and rank0.phase != "Pending":
        return SUCCEEDED
    if any(p.restarts >= TRAINER_BACKOFF_LIMIT and any(p.exit_codes) for p in pods):
        return FAILED
    return None


def compute(spec: AsyncGRPORunSpec | None, obs: Observation, old: dict[str, Any],
            now: str) -> tuple[dict[str, Any], list[Transition]]:
    """New status (camelCase, as stored) and the events its transitions deserve."""
    old_phase = old.get("phase") or PENDING
    kept: list[dict[str, Any]] = []
    if obs.spec_errors or spec is None:
        conds = _invalid_spec_conditions(obs)
        phase = old_phase
        # the workloads still run the last valid spec: what was observed of them stays true
        # (with the generation it was observed for)
        kept = [c for c in old.get("conditions") or []
                if c.get("type") not in ("Progressing", "Degraded")]
    else:
        conds, phase = _conditions_and_phase(spec, obs, old, old_phase)
    status: dict[str, Any] = {"observedGeneration": obs.generation, "phase": phase}
    status["conditions"] = kept + _merge_conditions(old.get("conditions") or [], conds,
                                                    obs.generation, now)
    status.update(_observed_fields(spec, obs))
    if phase == RUNNING and not old.get("startTime"):
        status["startTime"] = now
    if phase in TERMINAL and not old.get("completionTime"):
        status["completionTime"] = now
    return status, _transitions(old, old_phase, phase, status["conditions"])


def _invalid_spec_conditions(obs: Observation) -> list[dict[str, Any]]:
    msg = "; ".join(str(e) for e in obs.spec_errors[:10])
    reason = obs.spec_error_reason
    return [_cond("Progressing", False, reason, f"{msg}; the workloads keep the "
                  "last spec the operator applied"),
            _cond("Degraded", True, reason, msg)]


#: False conditions that are a step of a healthy run, not a problem (Degraded stays False).
_ON_THE_WAY = ("Starting", "NotCreated", "WaitingForRollout", "Suspended", "Finished",
               "SandboxesStarting")


def _conditions_and_phase(spec: AsyncGRPORunSpec, obs: Observation, old: dict[str, Any],
                          old_phase: str) -> tuple[list[dict[str, Any]], str]:
    """Every condition of a valid spec's run, and its phase."""
    outcome = None if old_phase in TERMINAL else _trainer_outcome(
        obs.children, obs.progress, spec)
    terminal = old_phase if old_phase in TERMINAL else outcome
    stopped = ("Suspended" if spec.suspend and terminal is None else
               ("Finished" if terminal else None))

    bucket, bucket_pending = _bucket_condition(spec, obs, old)
    conds = [bucket, _workload_condition("RolloutReady", obs.children, VLLM, "vLLM", stopped)]
    if spec.sandboxes is not None:
        conds.append(_sandboxes_condition(spec, obs, stopped))
    if obs.trainer_gated and not stopped:
        trainer = _cond("TrainerReady", False, "WaitingForRollout",
                        "the trainer starts once vLLM (and the sandbox gateway) are ready")
    else:
        trainer = _workload_condition("TrainerReady", obs.children, TRAINER, "trainer",
                                      stopped)
    conds.append(trainer)
    conds.append(_adapter_condition(obs.progress, probe_tolerance(spec)))
    preflight_pending = obs.preflight is not None and obs.preflight[0] is not True
    if obs.preflight is not None:
        conds.append(_cond(PREFLIGHT_CONDITION, *obs.preflight))

    degraded: tuple[str, str] | None = None
    if obs.bucket_checked and obs.bucket_error is not None:
        degraded = (obs.bucket_error.reason, obs.bucket_error.message)
    if obs.apply_errors:
        reason, message = obs.apply_errors[0]
        degraded = ("ApplyFailed", f"{reason}: {message}")
    if degraded is None:
        degraded = next(((c["reason"], c["message"]) for c in conds
                         if c["status"] == "False" and c["reason"] not in _ON_THE_WAY), None)
    if degraded is None and obs.endpoint_problems:
        degraded = obs.endpoint_problems[0]
    if obs.config_refused is not None:
        why = f"{obs.config_refused[0]}: {obs.config_refused[1][:300]}"
        degraded = ("ConfigRefused", (f"the run's ConfigMap was refused ({why}); nothing "
                    "starts without it: make the spec smaller (a ConfigMap holds at most 1 MiB)"))
    if obs.conflicts:
        from asyncgrpo.controller.ownership import message

        degraded = ("ChildConflict", message(obs.conflicts))

    if terminal:
        phase = terminal
    elif spec.suspend:
        phase = SUSPENDED
    elif obs.bucket_error is not None or bucket_pending or obs.conflicts \
            or (preflight_pending and trainer["status"] != "True") \
            or obs.config_refused is not None:
        phase = PENDING
    elif trainer["status"] == "True":
        phase = RUNNING
    else:
        phase = STARTING

    if phase in TERMINAL:
        conds.append(_cond("Progressing", False, phase, f"the run {phase.lower()}"))
    elif phase == SUSPENDED:
        conds.append(_cond("Progressing", False, "Suspended", "spec.suspend is true"))
    else:
        conds.append(_cond("Progressing", True, phase, f"the run is {phase.lower()}"))
    conds.append(_cond("Degraded", True, *degraded) if degraded
                 else _cond("Degraded", False, "AsExpected", "no problem found"))
    return conds, phase


#: BucketReady reasons that say the Job has not answered yet, not what it found
_WAITING_REASONS = frozenset({"Checking", "Unschedulable"})


def _bucket_condition(spec: AsyncGRPORunSpec, obs: Observation,
                      old: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """BucketReady, and whether the run must still wait for the bucket."""
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == "BucketReady"),
                None)
    if not obs.bucket_checked:
        if (stuck := _unschedulable_setup_pod(obs.children)) is not None:
            return _cond("BucketReady", False, "Unschedulable", "the bucket setup Job's pod "
                         f"{stuck.name} cannot be scheduled: {stuck.problem_message}"), True
        if prev is not None and prev.get("observedGeneration") == obs.generation \
                and prev.get("reason") not in _WAITING_REASONS:
            # a check is in flight (an operator restart): what the last one found still
            # stands, so a restart neither flips the condition nor holds the run. Only a
            # finding: "Checking" or "Unschedulable" kept here would hide the pod's state
            # from every later reconcile of this generation
            ok = {"True": True, "False": False}.get(prev.get("status"))
            return _cond("BucketReady", ok, prev.get("reason", ""),
                         prev.get("message", "")), ok is not True
        return _cond("BucketReady", None, "Checking", "the bucket setup Job "
                     "has not finished yet"), True
    if obs.bucket_error is not None:
        return _cond("BucketReady", False, obs.bucket_error.reason,
                     obs.bucket_error.message), False
    return _cond("BucketReady", True, "BucketReady", f"bucket {spec.adapter_store.bucket!r} "
                 "is set up and the run folder is the run's"), False


def _unschedulable_setup_pod(children: list[Child]) -> Child | None:
    """The setup Job's pod the scheduler refuses (a taint it does not tolerate, a
    nodeSelector no node matches): the run waits on it, so BucketReady says why, with the
    scheduler's message, instead of "not finished yet" until the Job's deadline."""
    return next((c for c in children if c.kind == "Pod" and c.component == "bucket-setup"
                 and c.problem == "Unschedulable" and not c.deleting), None)


def _observed_fields(spec: AsyncGRPORunSpec | None, obs: Observation) -> dict[str, Any]:
    """What the status shows of the trainer's progress, the served weights and the pool."""
    out: dict[str, Any] = {}
    p = obs.progress
    if p is not None:
        if p.step is not None:
            out["step"] = p.step
            if spec is not None:
                out["progress"] = f"{p.step}/{spec.trainer.total_steps}"
        if p.reward_mean is not None and p.reward_mean == p.reward_mean:   # not NaN
            out["reward"] = round(p.reward_mean, 4)
        if p.policy_version is not None:
            out["policyVersion"] = p.policy_version
        tp = {k: v for k, v in (("rawTokensPerSecond", p.raw_tokens_per_second),
                                ("uniqueTokensPerSecond", p.unique_tokens_per_second),
                                ("treeCompressionRatio", p.tree_compression_ratio))
              if v is not None}
        if tp:
            out["throughput"] = tp
        if p.outputs:
            out["outputs"] = p.outputs
    if obs.served_weights is not None:
        out["servedWeights"] = obs.served_weights.status()
    if obs.rollout_replicas is not None:
        out["rolloutReplicas"] = obs.rollout_replicas
    if spec is not None and spec.sandboxes is not None and obs.sandboxes:
        sb = out["sandboxes"] = dict(obs.sandboxes)
        if "wanted" in sb:
            sb["ready"] = f"{sb.get('warm', 0) + sb.get('busy', 0)}/{sb['wanted']}"
    return out


def _sandboxes_condition(spec: AsyncGRPORunSpec, obs: Observation,
                         stopped: str | None) -> dict[str, Any]:
    if stopped:
        return _cond("SandboxesReady", False, stopped, f"sandbox pool emptied ({stopped.lower()})")
    counts = obs.sandboxes
    if obs.pool_error is not None:
        if obs.pool_error[0] == "NamespaceSandboxCap":
            return _cond("SandboxesReady", False, *obs.pool_error)
        return _cond("SandboxesReady", False, "SandboxCreateFailed",
                     f"cannot create sandbox pods: {obs.pool_error[1]}")
    unschedulable = [c for c in obs.children if c.kind == "Pod" and c.component == SANDBOX
                     and c.unschedulable]
    if unschedulable:
        return _cond("SandboxesReady", False, "SandboxesUnschedulable",
                     f"{len(unschedulable)} sandbox pods cannot be scheduled: "
                     f"{unschedulable[0].problem_message}")
    refused = next((c for c in obs.children if c.kind == "Pod" and c.component == SANDBOX
                    and c.image and c.problem and not c.deleting), None)
    if refused is not None:
        # a row's image that cannot run the server: no python3, one too old, a pull failure
        said = refused.termination_message.strip().splitlines()[-1:] or [refused.problem_message]
        return _cond("SandboxesReady", False, "SandboxImageRefused",
                     f"image {refused.image} (a row's spec.sandboxes.imageColumn) cannot run "
                     f"the sandbox server ({refused.problem}): {said[0][:300]}; it needs a "
                     "python3, 3.11 or newer, on its PATH")
    if counts.get("failed"):
        stuck = _problem(obs.children, SANDBOX)
        detail = f" ({stuck.name}: {stuck.problem})" if stuck else ""
        return _cond("SandboxesReady", False, "SandboxesFailed",
                     f"{counts['failed']} sandbox pods failed{detail}; they are kept for "
                     "inspection and removed when the pool shrinks")
    gw = _workload_condition("SandboxesReady", obs.children, GATEWAY, "gateway", None)
    if gw["status"] != "True":
        return gw
    ready = counts.get("warm", 0) + counts.get("busy", 0)
    need = spec.sandboxes.min_warm  # type: ignore[union-attr]
    if ready >= need:
        return _cond("SandboxesReady", True, "PoolReady", f"{ready} sandboxes ready")
    return _cond("SandboxesReady", False, "SandboxesStarting",
                 f"{ready}/{need} warm sandboxes ready")


def probe_tolerance(spec: AsyncGRPORunSpec) -> float:
    """The tolerance the trainer applies to its probe: its default, or the run's override in
    `spec.trainer.env` (a malformed one stops the trainer at start; here it is the default)."""
    env = {e.name: e.value for e in spec.trainer.env if e.value is not None}
    try:
        return wire.probe_tolerance(env)
    except ValueError:
        return wire.DEFAULT_PROBE_TOLERANCE


def _adapter_condition(p: Progress | None, tolerance: float) -> dict[str, Any]:
    """The trainer probes vLLM with `policy-v<N>` after publishing N and exports the largest
    log-prob difference between served and trained policy (asyncgrpo.adapters.probe)."""
    if p is None or p.policy_version is None:
        return _cond("AdapterInSync", None, "NoPolicyYet", "the trainer has not published yet")
    if p.served_logprob_diff is None or p.served_logprob_diff != p.served_logprob_diff:
        return _cond("AdapterInSync", None, "NotProbed",
                     f"policy v{p.policy_version} published; not probed on vLLM yet")
    if p.served_logprob_diff <= tolerance:
        return _cond("AdapterInSync", True, "InSync", f"vLLM serves policy v{p.policy_version} "
                     f"(probe log-prob difference {p.served_logprob_diff:.2g})")
    return _cond("AdapterInSync", False, "ServedPolicyMismatch",
                 f"vLLM's policy v{p.policy_version} differs from the trained one by "
                 f"{p.served_logprob_diff:.3g} nats on the probe (tolerance {tolerance:g})")


def _merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]], generation: int,
                      now: str) -> list[dict[str, Any]]:
    by_type = {c.get("type"): c for c in old}
    out = []
    for c in new:
        prev = by_type.get(c["type"])
        moved = prev is None or prev.get("status") != c["status"]
        out.append({**c, "observedGeneration": generation,
                    "lastTransitionTime": now if moved else prev.get("lastTransitionTime", now)})
    return out


_GOOD_WHEN_FALSE = {"Degraded"}


def _transitions(old: dict[str, Any], old_phase: str, phase: str,
                 conds: list[dict[str, Any]]) -> list[Transition]:
    events: list[Transition] = []
    prev = {c.get("type"): c for c in old.get("conditions") or []}
    for c in conds:
        p = prev.get(c["type"])
        if p is not None and (p.get("status"), p.get("reason")) == (c["status"], c["reason"]):
            continue
        if p is None and c["status"] == "Unknown":
            continue
        good = (c["status"] == "False") if c["type"] in _GOOD_WHEN_FALSE else (
            c["status"] != "False")
        if c["type"] == "Progressing":
            continue  # the phase event says it
        events.append(Transition("Normal" if good else "Warning", c["reason"] or c["type"],
                                 f"{c['type']}={c['status']}: {c['message']}"))
    if phase != old_phase or not old.get("phase"):
        events.append(Transition("Warning" if phase == FAILED else "Normal", phase,
                                 f"phase {old.get('phase') or 'none'} -> {phase}"))
    return events

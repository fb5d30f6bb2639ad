"""Status computation: phases, condition reasons, transition times and events."""

from __future__ import annotations

import pytest

from asyncgrpo.api.validation import FieldError
from asyncgrpo.bucket.policy import BucketError
from asyncgrpo.controller.observe import Child, summarize
from asyncgrpo.controller.progress import Progress, parse
from asyncgrpo.controller.status import Observation, compute
from tests.operator.test_builders import run_of

SPEC = run_of("lora-math.yaml").spec


def workload(component, ready, replicas=1, kind="Deployment"):
    return Child(kind=kind, name=f"r-{component}", component=component, hash="h",
                 replicas=replicas, ready_replicas=ready)


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def running_obs(**kw):
    return Observation(generation=3, bucket_checked=True, children=[
        workload("vllm", 2, 2), workload("trainer", 1, kind="StatefulSet")], **kw)


def test_running_when_every_part_is_ready():
    status, events = compute(SPEC, running_obs(), {}, "T1")
    c = conds(status)
    assert status["phase"] == "Running" and status["startTime"] == "T1"
    assert c["RolloutReady"]["status"] == "True"
    assert c["TrainerReady"]["status"] == "True"
    assert c["Degraded"] == {**c["Degraded"], "status": "False", "reason": "AsExpected"}
    assert all(x["observedGeneration"] == 3 for x in status["conditions"])
    assert ("Normal", "Running") in {(e.type, e.reason) for e in events}


def test_unchanged_observation_gives_identical_status_and_no_events():
    first, _ = compute(SPEC, running_obs(), {}, "T1")
    again, events = compute(SPEC, running_obs(), first, "T2")
    assert {k: v for k, v in again.items() if k != "startTime"} == \
        {k: v for k, v in first.items() if k != "startTime"}
    assert events == []
    assert all(c["lastTransitionTime"] == "T1" for c in again["conditions"])


def test_invalid_spec_keeps_the_phase_and_says_which_field():
    obs = Observation(generation=1, spec_errors=[FieldError("spec.model.lora.rank", "too big")])
    status, events = compute(None, obs, {"phase": "Running"}, "T")
    c = conds(status)
    assert status["phase"] == "Running"
    assert c["Degraded"]["reason"] == "InvalidSpec"
    assert "spec.model.lora.rank" in c["Degraded"]["message"]
    assert any(e.type == "Warning" and e.reason == "InvalidSpec" for e in events)


def test_bucket_errors_hold_the_run_pending():
    obs = running_obs(bucket_error=BucketError("SecretNotFound", "Secret 's' missing"))
    status, _ = compute(SPEC, obs, {}, "T")
    assert status["phase"] == "Pending"
    assert conds(status)["BucketReady"]["reason"] == "SecretNotFound"
    assert conds(status)["Degraded"]["reason"] == "SecretNotFound"


def test_stuck_pods_name_the_reason():
    pod = summarize({"kind": "Pod", "metadata": {"name": "r-vllm-x", "labels": {
        "app.kubernetes.io/component": "vllm"}}, "status": {"phase": "Pending",
        "containerStatuses": [{"restartCount": 0, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": "pull access denied"}}}]}})
    unsched = summarize({"kind": "Pod", "metadata": {"name": "r-trainer-0", "labels": {
        "app.kubernetes.io/component": "trainer"}}, "status": {"phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "Insufficient nvidia.com/gpu"}]}})
    obs = Observation(generation=1, bucket_checked=True, children=[
        workload("vllm", 0, 2), workload("trainer", 0, kind="StatefulSet"), pod, unsched])
    c = conds(compute(SPEC, obs, {}, "T")[0])
    assert (c["RolloutReady"]["reason"], c["RolloutReady"]["message"]) == (
        "ImagePullBackOff", "pod r-vllm-x: pull access denied")
    assert c["TrainerReady"]["reason"] == "Unschedulable"
    assert "nvidia.com/gpu" in c["TrainerReady"]["message"]


def test_succeeded_at_total_steps_and_stays_terminal():
    obs = running_obs(progress=Progress(step=SPEC.trainer.total_steps, policy_version=9))
    status, _ = compute(SPEC, obs, {"phase": "Running"}, "T")
    assert status["phase"] == "Succeeded" and status["completionTime"] == "T"
    later, _ = compute(SPEC, running_obs(), status, "T2")
    assert later["phase"] == "Succeeded"
    assert conds(later)["Progressing"]["reason"] == "Succeeded"


def test_trainer_crash_loop_fails_the_run():
    crash = Child(kind="Pod", name="r-trainer-0", component="trainer", hash=None,
                  phase="Running", exit_codes=(1,), restarts=6, problem="CrashLoopBackOff")
    obs = running_obs()
    obs.children.append(crash)
    status, events = compute(SPEC, obs, {"phase": "Running"}, "T")
    assert status["phase"] == "Failed"
    assert ("Warning", "Failed") in {(e.type, e.reason) for e in events}


def test_suspended():
    spec = SPEC.model_copy(update={"suspend": True})
    status, _ = compute(spec, running_obs(), {"phase": "Running"}, "T")
    assert status["phase"] == "Suspended"
    assert conds(status)["RolloutReady"]["reason"] == "Suspended"


def test_trainer_metrics_are_mirrored():
    p = parse("# HELP x\nasyncgrpo_trainer_step 12\nasyncgrpo_trainer_policy_version 4\n"
              "asyncgrpo_trainer_served_logprob_diff 0.3\n"
              "asyncgrpo_trainer_forwarded_tokens_per_second 10.5\nother_metric 1\n")
    status, _ = compute(SPEC, running_obs(progress=p), {}, "T")
    assert status["step"] == 12 and status["policyVersion"] == 4
    assert status["throughput"] == {"uniqueTokensPerSecond": 10.5}
    assert conds(status)["AdapterInSync"]["reason"] == "ServedPolicyMismatch"
    p.served_logprob_diff = 0.01
    assert conds(compute(SPEC, running_obs(progress=p), {}, "T")[0])["AdapterInSync"][
        "status"] == "True"


def test_adapter_in_sync_uses_the_trainers_tolerance_from_its_env():
    """A run that overrides ASYNCGRPO_PROBE_TOLERANCE in spec.trainer.env gets a condition
    that agrees with the trainer's own judgement (RuntimeEnv reads the same variable)."""
    from asyncgrpo.trainer.runtime_env import RuntimeEnv

    loose = run_of(**{"spec.trainer.env": [
        {"name": "ASYNCGRPO_PROBE_TOLERANCE", "value": "0.5"}]}).spec
    env = {e.name: e.value for e in loose.trainer.env}
    assert RuntimeEnv.from_env(env).probe_tolerance == 0.5
    p = Progress(step=3, policy_version=2, served_logprob_diff=0.3)
    assert conds(compute(SPEC, running_obs(progress=p), {}, "T")[0])["AdapterInSync"][
        "reason"] == "ServedPolicyMismatch"
    c = conds(compute(loose, running_obs(progress=p), {}, "T")[0])["AdapterInSync"]
    assert c["status"] == "True", c
    # a malformed override stops the trainer; the condition keeps the default meanwhile
    bad = run_of(**{"spec.trainer.env": [
        {"name": "ASYNCGRPO_PROBE_TOLERANCE", "value": "lots"}]}).spec
    assert conds(compute(bad, running_obs(progress=p), {}, "T")[0])["AdapterInSync"][
        "reason"] == "ServedPolicyMismatch"


def test_progress_metric_names_are_the_trainers():
    pytest.importorskip("asyncgrpo.trainer.metrics")
    from asyncgrpo.controller.progress import METRICS
    from asyncgrpo.trainer.metrics import METRICS as TRAINER
    from asyncgrpo.trainer.metrics import PREFIX

    assert set(METRICS) <= {PREFIX + name for name in TRAINER}


def test_sandbox_conditions():
    spec = run_of().spec
    children = [workload("vllm", 2, 2), workload("gateway", 1),
                workload("trainer", 1, kind="StatefulSet")]
    obs = Observation(generation=1, bucket_checked=True, children=children,
                      sandboxes={"warm": 1, "busy": 0, "starting": 15, "failed": 0})
    assert conds(compute(spec, obs, {}, "T")[0])["SandboxesReady"]["reason"] == \
        "SandboxesStarting"
    obs.sandboxes = {"warm": 16, "busy": 0, "starting": 0, "failed": 2}
    c = conds(compute(spec, obs, {}, "T")[0])["SandboxesReady"]
    assert c["reason"] == "SandboxesFailed" and "2 sandbox pods failed" in c["message"]
    obs.pool_error = ("Forbidden", 'RuntimeClass "gvisor" not found')
    c = conds(compute(spec, obs, {}, "T")[0])["SandboxesReady"]
    assert c["reason"] == "SandboxCreateFailed" and "gvisor" in c["message"]


def test_a_rows_image_that_cannot_run_the_server_is_named_with_the_runtimes_words():
    """A row's image without python3: its pod never starts; the condition names the image,
    the field it came from and what the runtime said, not just "a pod failed"."""
    from asyncgrpo.api.v1alpha1 import AsyncGRPORun
    from asyncgrpo.controller import sandboxes
    from tests.operator.helpers import example

    run = AsyncGRPORun.model_validate(example("multi-turn-sandboxes.yaml"))
    pod = sandboxes.build_pod(run, "3", image="registry.example/no-python:1")
    pod["status"] = {"phase": "Running", "containerStatuses": [{
        "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
        "lastState": {"terminated": {"exitCode": 128, "reason": "StartError", "message":
                      'failed to create containerd task: exec: "python3": executable file '
                      'not found in $PATH: unknown'}}}]}
    children = [workload("vllm", 2, 2), workload("gateway", 1),
                workload("trainer", 1, kind="StatefulSet"), summarize(pod)]
    obs = Observation(generation=1, bucket_checked=True, children=children,
                      sandboxes={"warm": 2, "busy": 0, "starting": 0, "failed": 1})
    c = conds(compute(run.spec, obs, {}, "T")[0])["SandboxesReady"]
    assert c["reason"] == "SandboxImageRefused", c
    assert "registry.example/no-python:1" in c["message"] and "imageColumn" in c["message"]
    assert '"python3": executable file not found' in c["message"]
    from asyncgrpo.sandbox.server.portable import CODE_MINIMUM  # the bundle's own floor

    assert f"python3, {CODE_MINIMUM[0]}.{CODE_MINIMUM[1]} or newer" in c["message"]


def test_invalid_patch_keeps_what_is_observed_of_the_running_workloads():
    """Issue 9: a later invalid patch must not erase the running run's conditions or say it
    progresses; the kept conditions keep the generation they were observed for."""
    running, _ = compute(SPEC, running_obs(), {}, "T1")
    obs = Observation(generation=4, spec_errors=[FieldError("spec.model.name", "immutable")],
                      spec_error_reason="ImmutableFieldChanged")
    status, events = compute(None, obs, running, "T2")
    c = conds(status)
    assert status["phase"] == "Running"
    assert c["TrainerReady"]["status"] == "True" and c["TrainerReady"]["observedGeneration"] == 3
    assert c["Progressing"]["status"] == "False"
    assert c["Progressing"]["reason"] == "ImmutableFieldChanged"
    assert "last spec the operator applied" in c["Progressing"]["message"]
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["observedGeneration"] == 4
    assert ("Warning", "ImmutableFieldChanged") in {(e.type, e.reason) for e in events}


def test_a_setup_job_still_running_holds_the_run_pending():
    obs = running_obs()
    obs.bucket_checked = False
    status, _ = compute(SPEC, obs, {}, "T1")
    assert conds(status)["BucketReady"]["status"] == "Unknown"
    assert conds(status)["BucketReady"]["reason"] == "Checking"
    assert status["phase"] == "Pending"


def test_a_restart_keeps_the_last_bucket_finding_while_the_check_runs():
    """After an operator restart the first bucket check is in flight: the condition must not
    flip to Checking (a spurious transition and event) nor hold a Running run in Pending."""
    running, _ = compute(SPEC, running_obs(), {}, "T1")
    restarted = Observation(generation=3, bucket_checked=False,
                            children=running_obs().children)
    status, events = compute(SPEC, restarted, running, "T2")
    assert conds(status)["BucketReady"] == conds(running)["BucketReady"]
    assert status["phase"] == "Running" and not events


def test_a_finished_trainer_reports_its_last_step_through_its_termination_message(tmp_path,
                                                                                 monkeypatch):
    """Found on the test node: the run ended Succeeded with status.step one short, the last
    step done after the operator's last scrape. The trainer's termination message carries it."""
    from asyncgrpo.controller import progress
    from asyncgrpo.controller.observe import summarize
    from asyncgrpo.controller.reconcile import _rank0_message
    from asyncgrpo.trainer.main import write_termination_message

    log = tmp_path / "termination-log"
    assert not write_termination_message(4, 5, path=str(log))  # outside a pod: nothing
    log.touch()
    monkeypatch.setenv("ASYNCGRPO_TERMINATION_LOG", str(log))
    assert write_termination_message(4, 5)
    pod = {"kind": "Pod", "metadata": {"name": "r-trainer-0",
                                       "labels": {"app.kubernetes.io/component": "trainer"}},
           "status": {"phase": "Succeeded", "containerStatuses": [{"restartCount": 0, "state": {
               "terminated": {"exitCode": 0, "message": log.read_text()}}}]}}
    final = progress.from_termination_message(_rank0_message([summarize(pod)]))
    assert (final.step, final.policy_version) == (4, 5)
    assert progress.from_termination_message("Error: something else") is None
    assert progress.from_termination_message('{"step": "4"}') is None


def test_an_image_the_node_may_not_pull_is_named():
    """imagePullPolicy: Never and the image missing on the node (ErrImageNeverPull): the
    user gets the kubelet's reason, not a run that silently waits."""
    pod = summarize({"kind": "Pod", "metadata": {"name": "r-vllm-x", "labels": {
        "app.kubernetes.io/component": "vllm"}}, "status": {"phase": "Pending",
        "containerStatuses": [{"restartCount": 0, "state": {"waiting": {
            "reason": "ErrImageNeverPull", "message": "image is not present"}}}]}})
    obs = Observation(generation=1, bucket_checked=True, children=[
        workload("vllm", 0, 1), workload("trainer", 0, kind="StatefulSet"), pod])
    c = conds(compute(SPEC, obs, {}, "T")[0])
    assert c["RolloutReady"]["reason"] == "ErrImageNeverPull"

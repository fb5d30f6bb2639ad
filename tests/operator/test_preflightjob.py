"""The cluster preflight (controller.preflightjob): the Job's manifest, its outcome, the
condition, and the gate on vLLM and the trainer; pure, no cluster. The API-server test is
tests/operator/test_cluster_preflight.py."""

from __future__ import annotations

import json

from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.controller import preflightjob
from asyncgrpo.controller.children import build_children
from asyncgrpo.controller.observe import Child
from asyncgrpo.controller.status import PREFLIGHT_CONDITION, Observation, compute
from tests.operator.helpers import example


def run_of(**changes) -> AsyncGRPORun:
    doc = example("lora-math.yaml")
    doc["metadata"] = {"name": "pf", "namespace": "team"}
    doc["spec"].update(changes)
    return AsyncGRPORun.model_validate(doc)


def test_the_job_runs_the_checks_in_the_trainer_image_as_the_trainer_would_see_things():
    run = run_of(data={"configMap": {"name": "prompts", "key": "p.jsonl"}},
                 trainer={"image": "reg/tasks/calc:1", "gpusPerReplica": 8,
                          "env": [{"name": "HF_HUB_OFFLINE_X", "value": "1"}]})
    job = preflightjob.build_job(run)
    assert job["metadata"]["name"] == "pf-preflight" and job["metadata"]["namespace"] == "team"
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "reg/tasks/calc:1"
    assert c["command"][:4] == ["asyncgrpo", "preflight", "--config", "/etc/asyncgrpo/run.yaml"]
    assert pod["serviceAccountName"] == "pf-workload" and not pod["automountServiceAccountToken"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HUB_OFFLINE_X"]["value"] == "1"                  # the trainer's env
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"]  # the bucket's, by ref
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/asyncgrpo"]]["configMap"]["name"] == "pf-config"
    assert volumes[mounts["/etc/asyncgrpo/data"]]["configMap"]["name"] == "prompts"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])       # no GPU for a check
    assert c["terminationMessagePolicy"] == "File"
    # another checked field, another Job (the hash): a fixed typo is checked again; a field
    # the checks do not read (vLLM's replicas) keeps the Job
    key = lambda r: preflightjob.build_job(r)["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"]
    assert key(run_of(model={"name": "Qwen/Qwen3-4B"})) != key(run_of())
    assert key(run_of(rollout={"replicas": 3})) == key(run_of())


def child(kind, phase="", message="", uid="j1", owner="", hash_=None, problem="", name="pf-preflight"):
    return Child(kind=kind, name=name, component="preflight", hash=hash_, phase=phase,
                 termination_message=message, uid=uid, owner_uid=owner, problem=problem)


ERRORS = json.dumps({"errors": [
    {"path": "spec.model.name", "message": "/models/nope: no such folder"},
    {"path": "spec.data.configMap", "message": "p.jsonl: no such file"}]})


def test_outcome_names_each_field_and_a_stored_outcome_stands_for_its_spec():
    desired = preflightjob.build_job(run_of())
    key = desired["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"]
    state = preflightjob.State()
    # bucket not ready: nothing yet; ready: create
    assert preflightjob.step(desired, None, [], state, ready=False) == (None, None)
    assert preflightjob.step(desired, None, [], state, ready=True)[0] == ("create", desired)
    job = child("Job", "Failed", hash_=key)
    pod = child("Pod", "Failed", ERRORS, uid="p1", owner="j1", name="pf-preflight-x")
    action, result = preflightjob.step(desired, job, [pod], state, ready=True)
    assert action is None and result.state == "failed" and result.reason == "PreflightFailed"
    assert result.message == ("spec.model.name: /models/nope: no such folder; "
                              "spec.data.configMap: p.jsonl: no such file")
    status, reason, message = preflightjob.condition(result)
    assert (status, reason) == (False, "PreflightFailed") and "spec.model.name" in message
    # the Job went away (deleted by hand, TTL): the finding stands, no new Job for it
    assert preflightjob.step(desired, None, [], state, ready=True) == (None, result)
    # a pod of an older Job is never read as this one's
    stale = preflightjob.outcome(job, [child("Pod", "Failed", ERRORS, owner="old")])
    assert stale.message == "the preflight Job failed without a message"
    assert preflightjob.outcome(child("Job", "Running", hash_=key), [pod]).state == "running"
    # another spec: the old Job is deleted, then a new one created
    other = preflightjob.build_job(run_of(model={"name": "Qwen/Qwen3-4B"}))
    assert preflightjob.step(other, job, [pod], state, ready=True)[0] == ("delete", other)
    assert preflightjob.step(other, None, [], state, ready=True)[0] == ("create", other)
    passed = preflightjob.outcome(child("Job", "Complete", hash_=key), [])
    assert preflightjob.condition(passed)[:2] == (True, "Passed")
    assert preflightjob.parse_errors("Traceback: boom") == ["Traceback: boom"]
    # an image the pod cannot pull fails now, not at the Job's deadline
    pulling = child("Pod", "Pending", uid="p2", owner="j9", problem="ImagePullBackOff")
    stuck = preflightjob.outcome(child("Job", "Running", uid="j9", hash_=key), [pulling])
    assert (stuck.state, stuck.reason) == ("failed", "ImagePullBackOff")


def test_the_condition_keeps_the_run_pending_and_vllm_and_the_trainer_at_zero():
    run = run_of()
    held = {o["kind"]: o for o in build_children(run, hold=True)
            if o["kind"] in ("Deployment", "StatefulSet")}
    assert held["Deployment"]["spec"]["replicas"] == 0 and held["StatefulSet"]["spec"]["replicas"] == 0
    free = {o["kind"]: o for o in build_children(run) if o["kind"] in ("Deployment", "StatefulSet")}
    assert free["Deployment"]["spec"]["replicas"] == run.spec.rollout.replicas
    obs = Observation(generation=1, bucket_checked=True, trainer_gated=True,
                      preflight=(False, "PreflightFailed", "spec.model.name: nope"))
    status, events = compute(run.spec, obs, {}, "2026-01-01T00:00:00Z")
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond[PREFLIGHT_CONDITION]["status"] == "False"
    assert cond[PREFLIGHT_CONDITION]["message"] == "spec.model.name: nope"
    assert status["phase"] == "Pending"
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "PreflightFailed"
    assert any(e.type == "Warning" and e.reason == "PreflightFailed" for e in events)
    # preflights off (the default): no condition at all
    status, _ = compute(run.spec, Observation(generation=1, bucket_checked=True), {}, "t")
    assert PREFLIGHT_CONDITION not in {c["type"] for c in status["conditions"]}

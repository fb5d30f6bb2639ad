"""A user's own multi-turn task on the test node: the code-fix example package, in a trainer
image built from the task's own Dockerfile (docs/tasks.md), trains through the operator's
pods; its environment's tools run in sandbox pods grown from the gateway's demand, its reward
is scored there, and a real Prometheus has data for every dashboard panel the run feeds.

Its rows name the image their sandbox runs (`spec.sandboxes.imageColumn`, SWE-style): two
task images built FROM the plain Python base, with nothing of the project's in them, each
get sandbox pods of their own image (the server comes from the init container and runs on
the image's own python3), and an image without python3 is refused with the runtime's words.

The tiny model is first taught the task's one tool call (asyncgrpo.testing.tool_caller, as
tests/tasks does for the local run): a random tiny model never writes a parseable call, and
then no tool would ever run. The taught checkpoint is cached by the files it depends on, so
the images (and their import into the node's containerd) are rebuilt only when those change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from asyncgrpo import wire
from asyncgrpo.testing.prometheus import missing_data
from asyncgrpo.testing.shell import CommandFailed

from .conftest import (
    E2E_TRAINER_IMAGE,
    E2E_VLLM_IMAGE,
    REPO,
    SANDBOX_IMAGE,
    import_into_node,
    podman_build,
    readable_by_pods,
    wait_for,
)
from .test_runs_on_the_node import last_scraped, status_of

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]

TASK = REPO / "examples" / "tasks" / "code-fix"
TASK_MODEL_PATH = "/models/tiny-qwen3-code-fix"
BASE_TRAINER_IMAGE = "asyncgrpo.local/trainer-code-fix-base:e2e"
TASK_TRAINER_IMAGE = "asyncgrpo.local/code-fix-trainer:e2e"
TASK_VLLM_IMAGE = "asyncgrpo.local/vllm-code-fix:e2e"
#: the task's data, where its Dockerfile puts the package (the path its comment names)
TASK_DATA_PATH = "/opt/asyncgrpo/tasks/code-fix/code_fix/data/train.jsonl"
#: the rows' own sandbox images: two task images FROM the plain Python base (no asyncgrpo,
#: no FastAPI, nothing pip installed), and one without any python3 (FROM scratch)
ROW_IMAGES = ("asyncgrpo.local/code-fix-task-a:e2e", "asyncgrpo.local/code-fix-task-b:e2e")
NO_PYTHON_IMAGE = "asyncgrpo.local/no-python:e2e"


def _taught_model_folder():
    """The tiny checkpoint taught `run_tests()` on the task's prompts with its real tool
    schemas, in a folder named by a hash of what it is made from (kept across runs)."""
    from asyncgrpo.testing.tool_caller import save_tool_calling_checkpoint

    inputs = [TASK / "code_fix" / "env.py", TASK / "code_fix" / "data" / "train.jsonl",
              REPO / "operator" / "asyncgrpo" / "testing" / "tool_caller.py",
              REPO / "operator" / "asyncgrpo" / "trainer" / "tiny_tokenizer.py"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()[:16]
    ctx = wire.user_cache_dir() / "e2e" / f"code-fix-{key}"
    model = ctx / "tiny-qwen3-code-fix"
    if not (model / "config.json").is_file():
        sys.path.insert(0, str(TASK))
        try:
            from code_fix.env import CodeFix
        finally:
            sys.path.remove(str(TASK))
        env = CodeFix(sandbox=None)
        prompts = [json.loads(line)["prompt"] for line in
                   (TASK / "code_fix" / "data" / "train.jsonl").read_text().splitlines()
                   if line.strip()]
        taught = save_tool_calling_checkpoint(
            model, prompts=prompts, tools=[env.read_file, env.run_tests, env.write_file],
            call={"name": "run_tests", "arguments": {}})
        print(f"tool-call fine-tuning: {taught}")
    readable_by_pods(ctx)
    return ctx


def _task_images(stack) -> None:
    """The user's recipe: the task's Dockerfile FROM a trainer image (here the e2e trainer
    image plus the taught model), and a vLLM image with the same model; both into the node."""
    ctx = _taught_model_folder()
    for base, ref in ((E2E_TRAINER_IMAGE, BASE_TRAINER_IMAGE), (E2E_VLLM_IMAGE, TASK_VLLM_IMAGE)):
        (ctx / "Containerfile").write_text(
            f"FROM {base}\nCOPY tiny-qwen3-code-fix {TASK_MODEL_PATH}\n")
        podman_build(ref, ctx)
    podman_build(TASK_TRAINER_IMAGE, TASK, TASK / "Dockerfile",
                 build_args={"TRAINER_IMAGE": BASE_TRAINER_IMAGE})
    for ref in (TASK_TRAINER_IMAGE, TASK_VLLM_IMAGE):
        import_into_node(stack.whole.node, ref, stack.workdir)


def _row_images(stack) -> None:
    """The task images a data set's rows name: built FROM the Python base image (as a SWE
    image is FROM its language's), and a scratch image with no interpreter."""
    base = subprocess.run(["bash", str(REPO / "hack" / "build-base-images.sh"), "python"],
                          check=True, capture_output=True, text=True).stdout.strip()
    base = base.splitlines()[-1].split("=", 1)[1]
    for ref, containerfile in (*((r, f"FROM {base}\nCOPY task.txt /etc/asyncgrpo-task\n")
                                 for r in ROW_IMAGES),
                               (NO_PYTHON_IMAGE, "FROM scratch\nCOPY task.txt /task.txt\n")):
        ctx = stack.workdir / "row-images" / ref.rsplit("/", 1)[1].replace(":", "-")
        ctx.mkdir(parents=True, exist_ok=True)
        (ctx / "task.txt").write_text(ref + "\n")
        (ctx / "Containerfile").write_text(containerfile)
        podman_build(ref, ctx)
        import_into_node(stack.whole.node, ref, stack.workdir)


def rows_naming_images(ns: str) -> dict:
    """The task's rows, each naming one of the two task images, as a ConfigMap source."""
    lines = [json.loads(line) for line in
             (TASK / "code_fix" / "data" / "train.jsonl").read_text().splitlines() if line.strip()]
    rows = [{**row, "image": ROW_IMAGES[i % 2]} for i, row in enumerate(lines)]
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "code-fix-rows", "namespace": ns},
            "data": {"train.jsonl": "".join(json.dumps(r) + "\n" for r in rows)}}


def code_fix_run(ns: str, endpoint: str, steps: int) -> dict:
    """examples/tasks/code-fix/run.yaml as a cluster run: the task's image, its data inside
    it, the run's bucket on the test S3 server, sandbox pods of the project's image with no
    warm pool (every pod grown from the gateway's demand)."""
    import yaml

    run = yaml.safe_load((TASK / "run.yaml").read_text())
    spec = run["spec"]
    spec["model"]["name"] = TASK_MODEL_PATH
    spec["trainer"].update(image=TASK_TRAINER_IMAGE, totalSteps=steps, checkpointInterval=steps)
    # installed in the image: the local run's PYTHONPATH is not needed there
    spec["trainer"]["env"] = [e for e in spec["trainer"]["env"] if e["name"] != "PYTHONPATH"]
    spec["rollout"].update(image=TASK_VLLM_IMAGE, gpusPerReplica=0)
    spec["adapterStore"] = {"endpoint": endpoint, "bucket": "e2e-code-fix",
                            "credentialsSecret": {"name": "s3"}, "retention": 4,
                            "deletionPolicy": "Delete"}
    # a pool per row image: minWarm 0 for the run's own (only the refused image's probe
    # would use it), one warm pod kept for each task image in use
    spec["sandboxes"] = {"image": SANDBOX_IMAGE, "minWarm": 0, "max": 8, "hardCap": 10,
                         "execTimeoutSeconds": 30, "imageColumn": "image",
                         "images": {"maxDistinct": 3, "minWarmPerImage": 1}}
    spec["data"] = {"configMap": {"name": "code-fix-rows", "key": "train.jsonl"}}
    # besides the environment's get_reward (the task's reward, column CodeFix), the built-in
    # sandbox_tests: each completion scored in a sandbox of its own, 1 where the row's files
    # and the completion's solution.py lie side by side, which is only in the scoring
    # session /v1/score makes in a sandbox (the trainer's folder has neither)
    spec["reward"] = {"functions": [{"name": "sandbox_tests", "args": {
        "test_command": "ls test_*.py > /dev/null && test -f solution.py",
        "extract": False, "timeout_seconds": 20}}]}
    run["metadata"] = {"name": "code-fix", "namespace": ns}
    return run


def _logged_steps(logs: str) -> list[dict[str, float]]:
    """TRL's printed log dicts of the training steps (those with a reward), key by key
    (values quoted or not)."""
    steps = []
    for line in logs.splitlines():
        if "'reward':" in line:
            steps.append({k: float(v) for k, v in
                          re.findall(r"'([\w/.-]+)': '?([-+0-9.eE]+)'?[,}]", line)})
    return steps


def gateway_lease_metrics(stack, ns: str, run: str) -> list[str]:
    """The gateway's lease series, read from inside its pod (its /metrics)."""
    out = stack.kubectl("-n", ns, "exec", f"deploy/{run}-gateway", "--", "python3", "-c",
                        "import urllib.request;print(urllib.request.urlopen("
                        "'http://127.0.0.1:8080/metrics').read().decode())", check=False)
    return [line for line in out.splitlines()
            if line.startswith("asyncgrpo_gateway_") and "lease" in line.split("{")[0]]


def gateway_call(stack, ns: str, run: str, path: str, body: dict | None = None) -> dict:
    """One call to the run's gateway from inside its pod, with the run's gateway token; the
    JSON answer, or {"status": code, "error": ...} for a refusal."""
    code = ("import json, os, sys, urllib.request as u, urllib.error as e\n"
            "body = sys.argv[2].encode() if sys.argv[2] else None\n"
            "r = u.Request('http://127.0.0.1:8080' + sys.argv[1], data=body, headers={"
            "'authorization': 'Bearer ' + os.environ['ASYNCGRPO_GATEWAY_TOKEN'], "
            "'content-type': 'application/json'})\n"
            "try:\n    print(u.urlopen(r, timeout=120).read().decode())\n"
            "except e.HTTPError as x:\n"
            "    print(json.dumps({'status': x.code, **json.loads(x.read() or b'{}')}))\n")
    out = stack.kubectl("-n", ns, "exec", f"deploy/{run}-gateway", "--", "python3", "-c", code,
                        path, json.dumps(body) if body is not None else "", timeout=180)
    return json.loads(out.strip().splitlines()[-1])


def sandbox_pods_by_image(stack, ns: str) -> dict[str, list[dict]]:
    """The run's sandbox pods now, by image key: name, images, Ready."""
    pods = json.loads(stack.kubectl("-n", ns, "get", "pods", "-l",
                                    "app.kubernetes.io/component=sandbox", "-o", "json"))
    out: dict[str, list[dict]] = {}
    for p in pods["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True"
                    for c in (p.get("status") or {}).get("conditions") or [])
        out.setdefault(p["metadata"]["labels"].get(wire.SANDBOX_IMAGE_LABEL, ""), []).append({
            "name": p["metadata"]["name"], "image": p["spec"]["containers"][0]["image"],
            "init": [c["image"] for c in p["spec"].get("initContainers") or []], "ready": ready})
    return out


@pytest.mark.timeout(1800)  # the suite's 900 s count the stack's set-up when this runs first
def test_a_users_task_trains_from_its_image_with_tools_and_rewards_in_sandbox_pods(e2e_stack):
    stack, ns, name = e2e_stack, "team-code-fix", "code-fix"
    _task_images(stack)
    _row_images(stack)
    stack.namespace(ns)
    stack.apply(rows_naming_images(ns), code_fix_run(ns, stack.s3.endpoint, steps=2))
    wait_for("a sandbox pod grown from demand", lambda: status_of(stack, name, ns)
             .get("sandboxes", {}).get("spawnedTotal", 0) >= 1, timeout=900,
             on_timeout=lambda: stack.describe(ns))
    # a row naming an image without python3: the lease waits (and gives up), the pod the
    # operator makes for it cannot start, and the run's status says why
    probe = gateway_call(stack, ns, name, "/v1/leases", {
        "group_id": "probe", "image": NO_PYTHON_IMAGE, "wait_seconds": 15})
    assert probe.get("status") == 503 and probe.get("error") == "no_sandbox", probe

    logs: list[str] = []
    leases: list[str] = []
    pods_seen: dict[str, dict[str, dict]] = {}
    refusals: list[tuple[str, str]] = []   # SandboxesReady as the run's status said it
    gateway_images: dict[str, dict] = {}

    def finished_keeping_logs():  # trainer logs and gateway metrics, read while they run
        logs.append(stack.logs(ns, "app.kubernetes.io/component=trainer"))
        if not leases:
            leases.extend(gateway_lease_metrics(stack, ns, name))
        for key, pods in sandbox_pods_by_image(stack, ns).items():
            for pod in pods:
                seen = pods_seen.setdefault(key, {}).setdefault(pod["name"], pod)
                seen["ready"] = seen["ready"] or pod["ready"]
        try:  # the gateway goes with the run's end: its last demand is kept
            gateway_images.update(gateway_call(stack, ns, name, wire.GATEWAY_DEMAND_PATH)["images"])
        except CommandFailed:
            pass
        s = status_of(stack, name, ns)
        refusals.extend((c.get("reason"), c.get("message", "")[:300]) for c in s.get("conditions", [])
                        if c.get("type") == "SandboxesReady")
        print(f"E2E code-fix {s.get('phase')} progress {s.get('progress')} "
              f"sandboxes {s.get('sandboxes')} pods seen "
              f"{ {k[:8]: (len(v), sum(p['ready'] for p in v.values())) for k, v in pods_seen.items()} }",
              flush=True)
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    status = wait_for(f"{name} finished", finished_keeping_logs, timeout=1200, interval=5,
                      on_timeout=lambda: stack.describe(ns) + "\n".join(logs[-1:]))
    log = max(logs, key=len)
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + log[-3000:]
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    steps = _logged_steps(log)
    calls = [(h.get("tools/call_frequency", 0.0), h.get("tools/failure_frequency", 1.0))
             for h in steps]
    rewards = [h["rewards/CodeFix"] for h in steps if "rewards/CodeFix" in h]
    in_sandbox = [h.get("rewards/sandbox_tests") for h in steps]
    print(f"\nE2E code-fix: sandboxes {status.get('sandboxes')}, (calls per rollout, failed "
          f"fraction) {calls}, CodeFix per step {rewards}, sandbox_tests {in_sandbox}, preflight "
          f"{conditions.get('Preflight', {}).get('reason')}")
    # the preflight ran in the task's image: the user's module and data were found there
    assert conditions.get("Preflight", {}).get("status") == "True", conditions
    # grown from demand (minWarm is 0), one sandbox per rollout
    assert status["sandboxes"]["spawnedTotal"] >= 1, status["sandboxes"]
    assert leases, "the gateway exported no lease metrics while the run went on"
    # TRL's worker parsed the model's call and ran the environment's run_tests, which
    # executes in the rollout's sandbox pod: calls counted, not all of them failed
    assert any(c * (1 - f) > 0 for c, f in calls), log[-3000:]
    # get_reward is the sandbox server's clean score of the row's tests (/v1/score): the
    # buggy files pass part of their tests, so a step's CodeFix mean lies strictly between
    # 0 and 1; no sandbox, no score
    assert any(0 < r < 1 for r in rewards), log[-3000:]
    # the built-in sandbox reward scored every completion of every step in a sandbox
    assert in_sandbox and all(v == 1.0 for v in in_sandbox), log[-3000:]

    # each row's image: pods of that image, its server written by the init container of the
    # run's sandbox image, Ready on the image's own python3, and leases served there (the
    # gateway grants a group only a sandbox of the image it asked for)
    images = gateway_images
    print(f"E2E row images: pods {json.dumps(pods_seen)}, gateway {json.dumps(images)}")
    for ref in ROW_IMAGES:
        key = wire.sandbox_image_key(ref)
        pods = list(pods_seen.get(key, {}).values())
        assert pods and all(p["image"] == ref and p["init"] == [SANDBOX_IMAGE] for p in pods), pods
        assert any(p["ready"] for p in pods), pods
        assert images[key]["image"] == ref and images[key]["retired_total"] >= 1, images
    # nothing of a row's image ran on the run's own image
    assert not pods_seen.get("default"), pods_seen
    # the image without python3: its pods never became Ready (the status's SandboxImageRefused
    # for it was not seen on the node yet: what SandboxesReady said is printed for a follow-up)
    refused = list(pods_seen.get(wire.sandbox_image_key(NO_PYTHON_IMAGE), {}).values())
    assert refused and not any(p["ready"] for p in refused), pods_seen
    print(f"E2E SandboxesReady said: {sorted(set(refusals))}")

    # A real Prometheus discovered the run's pods through the API server and scraped them:
    # every dashboard panel and rule has data for the last moment the trainer was scraped
    # (vLLM and the gateway outlive it; the run may take seconds, so no poll catches it)
    prom = stack.prometheus
    at = last_scraped(prom, f'asyncgrpo_trainer_step{{namespace="{ns}"}}')
    assert at is not None, "Prometheus never scraped the trainer"
    up = {(t["labels"].get("component"), t["health"]) for t in prom.targets()}
    print(f"E2E Prometheus targets (component, health) seen: {sorted(up, key=str)}")
    # over the run's last minutes up to then, as its dashboard would draw them
    empty, skipped = missing_data(prom, {"operator", "trainer", "gateway", "vllm"}, at=at,
                                  since=at - 300)
    assert not empty, "no data for:\n" + "\n".join(f"{c.source}: {c.expr}" for c in empty)
    if out := os.environ.get("ASYNCGRPO_E2E_REPORT_DIR"):  # pictures for the docs
        from asyncgrpo.cli import main as cli

        assert cli(["report", name, "--namespace", ns, "--prometheus", prom.url,
                    "--since", "15m", "--out", out]) == 0
    # left out: only what sandbox pods (not scraped) or full fine-tuning's pullers feed
    assert all(c.components & {"sandbox", "weights"} for c in skipped), \
        [c.source for c in skipped]

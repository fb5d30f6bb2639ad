"""The embedded default: `asyncgrpo local run` starts S3 and the operator's pods (vLLM, the
trainer; sandboxes and the gateway) as local processes, trains, and stops everything it
started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from asyncgrpo.local.vllm import vllm_python
from asyncgrpo.testing.net import free_port
from tests.api.invalid_specs import REPO

EXAMPLE = REPO / "examples" / "local-tiny.yaml"


def _local_run(tmp_path: Path, mutate=None, env=None, max_steps: int = 3, example=EXAMPLE,
               during=None):
    """`asyncgrpo local run` of `example` (its model, prompts and ports made this test's);
    `during(stdout_path, process)` is called while it runs."""
    doc = yaml.safe_load(example.read_text())
    s3_port = free_port()
    doc["spec"]["adapterStore"]["endpoint"] = f"http://127.0.0.1:{s3_port}"
    doc["spec"]["model"]["name"] = str(tmp_path / "demo" / "tiny-qwen3")
    doc["spec"]["data"]["path"] = str(tmp_path / "demo" / "prompts.jsonl")
    doc["spec"]["trainer"]["metricsPort"] = free_port()
    if mutate:
        mutate(doc)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(doc))
    cli = [sys.executable, "-m", "asyncgrpo.cli", "local"]
    subprocess.run([*cli, "demo-assets", str(tmp_path / "demo")], check=True,
                   capture_output=True, timeout=300)
    argv = [*cli, "run", str(run_file), "--workdir", str(tmp_path / "work"),
            "--max-steps", str(max_steps)]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        if during is not None:
            during(out, proc)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out.read_text(),
                                       err.read_text()), s3_port


@dataclass
class LoraRun:
    """One finished `asyncgrpo local run` of the LoRA example, shared by the module's tests
    that only read it (a local run is a vLLM start, a trainer start and the steps: over a
    minute on two cores). `mutate` is its run file's change to the example, for a rerun."""

    root: Path  # the run's tmp folder: run.yaml, demo/, work/ (--workdir) and s3/
    result: subprocess.CompletedProcess
    s3_port: int
    mutate: Callable[[dict], None]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> LoraRun:
    """3 steps with TRL's offline loggers (trackio, tensorboard), prompts from Parquet (a
    `question` column) with a system prompt, an eval split (Parquet too) scored after step 2
    and after the last; a checkpoint every 2 steps and the bucket's objects retained, for
    the rerun of `test_a_finished_run_leaves_its_result_on_disk_and_a_rerun_resumes`."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncgrpo.local.demo import PROMPTS

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    root = tmp_path_factory.mktemp("lora-run")
    pq.write_table(pa.Table.from_pylist([{"question": p} for p in PROMPTS]),
                   root / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": p} for p in PROMPTS[-3:]]),
                   root / "eval.parquet")

    def mutate(d):
        d["spec"]["trainer"].update(reportTo=["trackio", "tensorboard"], checkpointInterval=2)
        d["spec"]["adapterStore"]["deletionPolicy"] = "Retain"
        d["spec"]["data"] = {"path": str(root / "train.parquet"), "promptField": "question",
                             "systemPrompt": "Answer with digits only.",
                             "eval": {"path": str(root / "eval.parquet"), "evalSteps": 2,
                                      "numGenerations": 2}}

    t0 = time.monotonic()
    result, s3_port = _local_run(root, mutate=mutate, max_steps=3)
    print(f"local run of 3 steps with trackio, tensorboard and 2 evals: "
          f"{time.monotonic() - t0:.0f} s")
    return LoraRun(root, result, s3_port, mutate)


@pytest.mark.slow
@pytest.mark.vllm
def test_local_run_trains_and_stops_everything(lora_run):
    """... and reports to TRL's offline loggers (trackio, tensorboard), which write under the
    trainer pod's work directory and never reach for the network. The prompts come from
    Parquet (a `question` column) with a system prompt, and an eval split (Parquet too) is
    scored after step 2 and after the last: its reward reaches both loggers and status."""
    result, s3_port, root = lora_run.result, lora_run.s3_port, lora_run.root
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"starting a local S3 server on 127.0.0.1:{s3_port}" in result.stdout
    assert "run local-tiny finished: step 3, policy versions published: v1..v4" in result.stdout
    # each step with the trainer's throughput and compression (its metrics endpoint), never
    # a line before the first step; the records are kept for `asyncgrpo report --local`
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    # (a step the poll missed is said with its reward only: the endpoint has moved on)
    assert any("tokens/s raw" in line and "tree compression" in line for line in steps), steps
    assert "reward None" not in result.stdout
    assert "mean over 3 steps:" in result.stdout and "last checkpoint:" in result.stdout
    assert len((root / "work" / "progress.jsonl").read_text().splitlines()) == 3
    work = root / "work"
    # the trainer pod's work emptyDir (ASYNCGRPO_WORK_DIR) holds its status
    status = json.loads((work / "local-tiny-trainer-0" / "work" / "status.json").read_text())
    assert [p["version"] for p in status["published"]] == [1, 2, 3, 4]
    assert all(p.get("served") for p in status["published"][1:])  # vLLM served each update
    # nothing it started is left: the S3 port is free again, no process in their groups
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", s3_port)) != 0
    for log in ("local-tiny-vllm-0.log", "local-tiny-trainer-0.log", "s3.log"):
        assert (work / log).exists()
    # the pods' servers bound their own loopback addresses, not every interface
    vllm_log = (work / "local-tiny-vllm-0.log").read_text()
    assert "'host': '127." in vllm_log and "0.0.0.0" not in vllm_log
    assert "metrics on 127." in result.stdout
    _assert_the_loggers_recorded_every_step(work / "local-tiny-trainer-0", steps=3,
                                            evals=[2, 3])
    # the eval split: 3 rows x 2 completions after step 2 and after step 3, under the
    # version rollouts used then, scored by the run's reward (digit_fraction, in [0, 1])
    evals = status["evals"]
    print("evals:", evals)
    assert [e["step"] for e in evals] == [2, 3]
    assert all(e["eval_rollouts"] == 6 and e["eval_scored_ratio"] == 1.0 for e in evals)
    assert all(0.0 <= e["eval_reward"] <= 1.0 for e in evals)
    assert "eval_rewards/digit_fraction" in evals[0]
    assert evals[1]["eval_policy_version"] >= evals[0]["eval_policy_version"] >= 1
    assert (f"eval reward (6 rollouts each): step 2 {evals[0]['eval_reward']:.3f}, "
            f"step 3 {evals[1]['eval_reward']:.3f}") in result.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_a_finished_run_leaves_its_result_on_disk_and_a_rerun_resumes(lora_run, tmp_path):
    """The local S3 keeps its objects under --workdir's parent (s3/): after the run its
    final/ is there, `asyncgrpo pull` brings it down, peft loads it and it gives the
    log-probs of the trainer's last adapter; a rerun loads the objects back and resumes
    from the run's checkpoint, the last run's work folder kept as work.previous.

    The run is the module's (`lora_run`, which the test above reads too); the rerun goes on
    in a copy of its s3/ and work/ folders, so that run stays as it ended."""
    import shutil

    import torch

    from asyncgrpo.trainer.final import write_final_lora  # noqa: F401 (the module under test)
    from tests.adapters.test_final import IDS, _logprobs, _peft

    result, first = lora_run.result, lora_run.root
    assert result.returncode == 0, result.stdout + result.stderr
    status = json.loads((first / "work" / "local-tiny-trainer-0" / "work" / "status.json")
                        .read_text())
    (output,) = status["outputs"]
    assert (output["kind"], output["step"]) == ("lora", 3)
    run_folder = first / "s3" / "asyncgrpo-local" / "asyncgrpo" / "default" / "local-tiny"
    final = first / "s3" / output["bucket"] / output["key"]
    assert final == run_folder / "final" and (final / "manifest.json").is_file()
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["version"] == status["policy_version"]
    pulled = tmp_path / "pulled"
    subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "pull", str(first / "run.yaml"),
                    "--s3-dir", str(first / "s3"), "--dest", str(pulled)], check=True,
                   timeout=120)
    base = first / "demo" / "tiny-qwen3"
    last = run_folder / "adapters" / f"v{status['policy_version']}"
    assert torch.equal(_logprobs(_peft(base, pulled), IDS), _logprobs(_peft(base, last), IDS))

    for folder in ("s3", "work"):
        shutil.copytree(first / folder, tmp_path / folder, symlinks=True)
    again, _ = _local_run(tmp_path, mutate=lora_run.mutate, max_steps=4)
    assert again.returncode == 0, again.stdout + again.stderr
    print("\n".join(line for line in (result.stdout + again.stdout).splitlines()
                    if line.startswith("local S3:")))
    assert "objects (" in again.stdout and "loaded in" in again.stdout
    work = tmp_path / "work"
    status = json.loads((work / "local-tiny-trainer-0" / "work" / "status.json").read_text())
    assert status["resumed_from_step"] == 3 and status["step"] == 4
    assert (work / "local-tiny-trainer-0" / "work.previous" / "status.json").is_file()
    final = tmp_path / "s3" / output["bucket"] / output["key"]
    assert json.loads((final / "manifest.json").read_text())["step"] == 4


def _assert_the_loggers_recorded_every_step(pod: Path, steps: int, evals=()):
    """The trainer pod's loggers (wire.LOGGER_DIR in its work emptyDir), read back with the
    loggers' own readers: trackio's SQLite storage and tensorboard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = pod / "work" / "loggers"
    # trackio said it logs locally, to that directory (a Space would be named instead)
    assert f"* Trackio metrics logged to: {loggers / 'trackio'}" in (
        pod.parent / f"{pod.name}.log").read_text()
    # trackio reads TRACKIO_DIR at import: its reader runs in a process of its own
    read = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps(S.get_logs('asyncgrpo-default', 'local-tiny'), default=str))")
    out = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True,
                         check=True, timeout=120,
                         env={**os.environ, "TRACKIO_DIR": str(loggers / "trackio")})
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    print("trackio:", [{k: v for k, v in log.items() if k.startswith(("train/loss",
          "train/reward", "train/global_step", "step"))} for log in logs])
    per_step = [log for log in logs if "train/loss" in log]
    assert [log["train/global_step"] for log in per_step] == list(range(1, steps + 1))
    assert all("train/reward" in log for log in per_step), per_step

    acc = EventAccumulator(str(loggers / "tensorboard"))
    acc.Reload()
    for tag in ("train/loss", "train/reward"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, steps + 1)), tag
    if evals:  # the eval reward, as the Trainer logs eval metrics (eval/<name>)
        assert [e.step for e in acc.Scalars("eval/reward")] == evals, acc.Tags()["scalars"]
        assert [log["train/global_step"] for log in logs if "eval/reward" in log] == evals


@pytest.mark.slow
@pytest.mark.vllm
def test_two_trainer_pods_train_together(tmp_path):
    """trainer.replicas 2: two StatefulSet pods, each its own torchrun node, meeting at pod
    0's address on a rendezvous port of their own (world 2 over gloo)."""
    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["trainer"].update(replicas=2),
                           max_steps=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting the trainer (2 processes)" in result.stdout
    assert "run local-tiny finished: step 2" in result.stdout
    work = tmp_path / "work"
    node1 = (work / "local-tiny-trainer-1.log").read_text()
    # pod 1 joined the process group (it serves its pod's endpoint after that) and ended well
    assert "metrics on :" in node1 and "Traceback" not in node1


FULL_EXAMPLE = REPO / "examples" / "local-tiny-full.yaml"


@pytest.mark.slow
@pytest.mark.vllm
def test_local_full_finetuning_serves_every_version_and_stops_everything(tmp_path):
    """Full fine-tuning locally: the vLLM pod's weights puller runs beside vLLM (one address,
    one `weights` directory) and follows the published versions to the newest, each one it
    swaps in served == trained by the probe; the dev routes answer the puller but not the
    trainer's pod; everything stops at the end.

    The puller swaps in the newest version it finds each round (2 s), so a version published
    less than a round after the previous one is skipped over, by design (measured: 4 swaps
    for 6 versions). Every version is an anchor here: Adam moves 90-98 % of the tiny fp32
    model's elements each step, and a delta (index + value) of more than half the elements
    outweighs the copy; deltas are covered on vLLM by tests/weights/test_puller_vllm.py."""
    import re
    import socket
    import time

    from tests.weights.test_guard import status_from

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    steps, pod = 5, "local-tiny-full-vllm-0"
    seen: dict = {}

    def during(stdout: Path, proc: subprocess.Popen):
        """Once the trainer runs: the guarded routes, from each side (real sockets)."""
        while proc.poll() is None:
            text = stdout.read_text()
            served = re.search(rf"vLLM ready on (127[\d.]+):(\d+) \({pod}\), "
                               rf"127[\d.]+:(\d+) \({pod}.weights-puller\)", text)
            trainer = re.search(r"metrics on (127[\d.]+):", text)
            if served and trainer:
                host, port = served[1], int(served[2])
                seen["vllm"], seen["puller_port"] = (host, port), int(served[3])
                seen["statuses"] = {who: status_from(host, port, "/weight_info", source)
                                    for who, source in (("pod", host), ("unbound", None),
                                                        ("trainer", trainer[1]))}
                seen["models"] = status_from(host, port, "/v1/models", trainer[1])
                return
            time.sleep(1)

    t0 = time.monotonic()
    result, s3_port = _local_run(tmp_path, max_steps=steps, example=FULL_EXAMPLE, during=during)
    seen["wall_s"] = time.monotonic() - t0
    print(f"local full fine-tuning run of {steps} steps: {seen['wall_s']:.0f} s wall")
    assert result.returncode == 0, result.stdout + result.stderr
    # the trainer's pod reaches the OpenAI routes, not the dev routes; the puller's pod does
    assert seen.get("statuses") == {"pod": 200, "unbound": 403, "trainer": 403}, seen
    assert seen["models"] == 200

    work = tmp_path / "work"
    status = json.loads((work / "local-tiny-full-trainer-0" / "work" / "status.json")
                        .read_text())
    published = status["published"]
    versions = [p["version"] for p in published]
    assert len(versions) >= steps and versions == list(range(1, len(versions) + 1))
    assert published[0]["kind"] == "anchor"
    assert all(p["kind"] == "anchor" for p in published if p["version"] % 3 == 1)  # interval
    assert (f"run local-tiny-full finished: step {steps}, policy versions published: "
            f"v1..v{versions[-1]}") in result.stdout

    # the puller's /status, kept by the backend before it stopped the pod
    puller = json.loads((work / f"{pod}.weights-puller.status.json").read_text())
    assert puller["served_version"] == versions[-1] and puller["refused"] == {}, puller
    history = puller["history"]
    served = [h["version"] for h in history]
    print(f"published {[(p['version'], p['kind']) for p in published]}, served {served}")
    # v1 before any rollout, then forward only, up to the newest
    assert served[0] == 1 and served[-1] == versions[-1] and served == sorted(set(served))
    assert all(h["probe_max_diff"] <= 1e-5 for h in history), history  # served == trained
    assert all(h["probe_cached_diff"] <= 1e-5 for h in history), history  # no stale KV
    assert f"{pod} served weights v1..v{versions[-1]} ({len(served)} swaps" in result.stdout
    # every trained sample carries the version its replica says sampled it: the base (0) or
    # one it swapped in (rollouts reach the generate route from the trainer's pod)
    tags = {int(v) for v in status["sample_versions"]}
    assert tags and tags <= set(served) | {0}, (tags, served)
    assert (work / f"{pod}.weights-puller.log").exists()

    # nothing it started is left: S3, vLLM and the puller ports answer no more
    host, port = seen["vllm"]
    for address in (("127.0.0.1", s3_port), (host, port), (host, seen["puller_port"])):
        with socket.socket() as s:
            assert s.connect_ex(address) != 0, address


def _setup_backend(tmp_path, endpoint: str, name: str = "local-tiny"):
    from asyncgrpo.api import load_run
    from asyncgrpo.local.backend import LocalBackend

    run = load_run(EXAMPLE)
    run = run.model_copy(update={
        "metadata": run.metadata.model_copy(update={"name": name}),
        "spec": run.spec.model_copy(update={"adapter_store": run.spec.adapter_store.model_copy(
            update={"endpoint": endpoint, "bucket": "setup-test"})})})
    return LocalBackend(run, tmp_path / name, say=lambda _: None)


def test_the_bucket_is_set_up_by_the_jobs_command_with_its_marker(tmp_path, s3_server,
                                                                  monkeypatch):
    """The local backend runs `asyncgrpo bucket setup` from the setup Job's pod, as a
    cluster does: the bucket is created and the folder claimed with the ownership marker; a
    second local run of the same run reclaims it; a folder another run owns stops the run
    with the command's reason."""
    from asyncgrpo.api import layout
    from asyncgrpo.local.backend import LocalRunError
    from asyncgrpo.local.placement import local_uid

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)

    def setup(backend):
        backend.workdir.mkdir(parents=True, exist_ok=True)
        try:
            backend._s3()
            pods, procs = backend._processes()
            (setup_process,) = procs[pods[0].name]
            backend._setup_bucket(pods[0], setup_process)
        finally:
            backend.stop()

    first = _setup_backend(tmp_path / "a", s3_server.endpoint)
    setup(first)
    marker = layout.run_folder("asyncgrpo", "default", "local-tiny") + layout.OWNER_MARKER
    body = json.loads(s3_server.client().get_object(Bucket="setup-test", Key=marker)["Body"]
                      .read())
    assert body["uid"] == local_uid(first.run) and body["name"] == "local-tiny"
    setup(_setup_backend(tmp_path / "b", s3_server.endpoint))   # the same run: its own folder

    s3_server.client().put_object(Bucket="setup-test", Key=layout.run_folder(
        "asyncgrpo", "default", "taken") + layout.OWNER_MARKER, Body=b'{"uid": "another"}')
    with pytest.raises(LocalRunError, match="bucket setup failed: FolderOwnedByAnotherRun"):
        setup(_setup_backend(tmp_path / "c", s3_server.endpoint, name="taken"))


def test_local_run_refuses_a_run_without_endpoint(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["adapterStore"].pop("endpoint"))
    assert result.returncode == 1
    assert "spec.adapterStore.endpoint" in result.stderr


def test_local_run_refuses_a_config_map_data_source(tmp_path):
    def mutate(doc):
        doc["spec"]["data"] = {"configMap": {"name": "prompts", "key": "prompts.jsonl"}}
    result, _ = _local_run(tmp_path, mutate=mutate)
    assert result.returncode == 1
    assert "spec.data.configMap" in result.stderr and "spec.data.path" in result.stderr

    def eval_cm(doc):
        doc["spec"]["data"]["eval"] = {"configMap": {"name": "held-out", "key": "e.jsonl"}}
    result, _ = _local_run(tmp_path, mutate=eval_cm)
    assert result.returncode == 1
    assert "spec.data.eval.configMap" in result.stderr and "spec.data.eval.path" in result.stderr


def test_local_run_refuses_a_loggers_secret(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["trainer"].update(
        reportTo=["wandb"], reportToSecret="wandb-creds"))
    assert result.returncode == 1
    assert "spec.trainer.reportToSecret" in result.stderr and "spec.trainer.env" in result.stderr


def test_local_run_names_a_missing_vllm_venv(tmp_path):
    result, _ = _local_run(tmp_path, env={"ASYNCGRPO_VLLM_VENV": str(tmp_path / "nowhere")})
    assert result.returncode == 1
    assert "no vLLM venv at" in result.stderr and "setup-vllm-venv.sh" in result.stderr


def test_local_run_refuses_an_invalid_run_file(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["trainer"].update(
        expertParallelSize=2))
    assert result.returncode == 1
    assert "spec.trainer.expertParallelSize" in result.stderr

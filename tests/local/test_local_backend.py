"""The embedded default: `asyncgrpo local run` starts S3 and the operator's pods (vLLM, the
trainer; sandboxes and the gateway) as local processes, trains, and stops everything it
started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.local.vllm import vllm_python
from asyncgrpo.testing.net import free_port
from tests.api.invalid_specs import REPO

EXAMPLE = REPO / "examples" / "local-tiny.yaml"


def _local_run(tmp_path: Path, mutate=None, env=None, max_steps: int = 3):
    doc = yaml.safe_load(EXAMPLE.read_text())
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
    result = subprocess.run(
        [*cli, "run", str(run_file), "--workdir", str(tmp_path / "work"),
         "--max-steps", str(max_steps)],
        check=False, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    return result, s3_port


@pytest.mark.slow
@pytest.mark.vllm
def test_local_run_trains_and_stops_everything(tmp_path):
    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run hack/setup-vllm-venv.sh (make test does)")
    result, s3_port = _local_run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"starting a local S3 server on 127.0.0.1:{s3_port}" in result.stdout
    assert "run local-tiny finished: step 3, policy versions published: v1..v4" in result.stdout
    work = tmp_path / "work"
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
            backend._setup_bucket(pods[0], procs[pods[0].name])
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


def test_local_run_names_a_missing_vllm_venv(tmp_path):
    result, _ = _local_run(tmp_path, env={"ASYNCGRPO_VLLM_VENV": str(tmp_path / "nowhere")})
    assert result.returncode == 1
    assert "no vLLM venv at" in result.stderr and "setup-vllm-venv.sh" in result.stderr


def test_local_run_refuses_an_invalid_run_file(tmp_path):
    result, _ = _local_run(tmp_path, mutate=lambda d: d["spec"]["trainer"].update(
        expertParallelSize=2))
    assert result.returncode == 1
    assert "spec.trainer.expertParallelSize" in result.stderr


def test_sandbox_pods_and_gateway_run_as_built(tmp_path):
    """The sandbox pods and the gateway the builders make, started through the translation:
    the gateway leases a sandbox it was told about and proxies a command into it."""
    import shutil
    import tempfile

    from asyncgrpo.api import load_run
    from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, secret_name
    from asyncgrpo.local.backend import start_process
    from asyncgrpo.local.placement import build_placement, run_pods
    from asyncgrpo.local.pods import translate
    from asyncgrpo.sandbox.client import GatewayClient

    run = load_run(REPO / "examples" / "multi-turn-sandboxes.yaml")
    pods = [p for p in run_pods(run, 2) if p.component in ("sandbox", "gateway")]
    # commands run as another uid when the server is root: the workspace must be reachable
    # by path, and pytest's tmp_path lives under a root-only directory
    workdir = Path(tempfile.mkdtemp(prefix="asyncgrpo-local-pods-"))
    workdir.chmod(0o711)
    placement = build_placement(run, pods, workdir, s3_credentials={
        "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"})
    procs = [translate(p.name, p.spec["containers"][0], placement) for p in pods]
    started: list = []
    try:
        for lp in procs:  # sandboxes first, then the gateway: each until its probe answers
            start_process(lp, workdir, started=started)
        gw = procs[-1]
        client = GatewayClient(gw.ready_url.rsplit("/", 1)[0], token=placement.secrets[
            (secret_name(run), GATEWAY_TOKEN_KEY)])
        lease = client.lease("group-0", wait_seconds=60)
        members = gw.env["ASYNCGRPO_GATEWAY_MEMBERS"].split(",")
        assert f"http://{lease.sandbox}" in members  # a member is named by its host:port
        out = client.exec(lease.lease_id, "echo hi from $(pwd)")
        assert out["exit_code"] == 0 and out["stdout"].startswith("hi from "), out
        assert out["stdout"].split()[-1].startswith(str(workdir))  # the workspace emptyDir
        client.release(lease.lease_id)
        client.close()
    finally:
        while started:
            started.pop().stop()
        shutil.rmtree(workdir, ignore_errors=True)

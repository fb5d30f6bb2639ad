"""The trainer end to end: real vLLM (CPU) resolving adapters from a real S3 server.

One run, two trainer processes (the second a fresh "pod" with an empty work dir):

1. `asyncgrpo trainer --config run.yaml` trains LoRA on the tiny Qwen3 the shared vLLM
   server serves. Every step publishes `policy-vN` to the bucket; vLLM resolves it by name.
   Version 3 is corrupted in the bucket right after publishing (fault injection through the
   real S3 API): vLLM must refuse it, rollouts stay on v2, training goes on to v4.... The
   process is killed (SIGKILL) once a checkpoint is complete in the bucket and it has gone
   past it, so versions newer than the checkpoint exist.
2. A restarted trainer resumes from the newest complete checkpoint and trains to the end.

Checked: >= 5 optimizer steps in all; every published version number is used exactly once
and the sequence has no gap across the restart; the resumed trainer's first version is the
killed one's last + 1 and its steps continue from the checkpoint; vLLM serves every good
version from the bucket and refuses the corrupt one; served and trained log-probs of the
probe agree within the tolerance; the metrics endpoint exports the documented names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from asyncgrpo.api.layout import run_folder
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 7
CHECKPOINT_INTERVAL = 2
CORRUPT_VERSION = 3
PROBE_TOLERANCE = 0.02
DEADLINE_S = 420  # generous: a guard against hangs, not a performance assertion


def _pin(pid: int, cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(pid, cpus)
    except (OSError, AttributeError):
        pass


def _vllm_pids(server) -> list[int]:
    """The server's process group (API server + engine core + worker)."""
    pgid = os.getpgid(server.proc.pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


@pytest.fixture
def cores(vllm_server):
    """Trainer on one core, vLLM on the others (they starve each other otherwise: docs/local.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield None
        return
    for pid in _vllm_pids(vllm_server):
        _pin(pid, set(cpus[1:]))
    yield {cpus[0]}
    for pid in _vllm_pids(vllm_server):
        _pin(pid, set(cpus))


def _write_run(tmp: Path, vllm_server, s3_server, run: str) -> Path:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": f"What is {a} + {b}? Answer with a number.", "answer": str(a + b)}) + "\n"
        for a in range(1, 6) for b in range(1, 6)))
    doc = {
        "apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
        "metadata": {"name": run},
        "spec": {
            "model": {"name": str(vllm_server.model), "dtype": "float32",
                      "lora": {"rank": 8, "alpha": 16,
                               "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
            "trainer": {"numGenerations": 4, "promptsPerStep": 2, "tokenBudgetPerRank": 1024,
                        "maxStaleness": 1, "totalSteps": TOTAL_STEPS,
                        "checkpointInterval": CHECKPOINT_INTERVAL, "learningRate": 1e-3},
            "rollout": {"maxLoraRank": 16, "maxModelLen": 1024,
                        "sampling": {"maxCompletionTokens": 12}},
            "adapterStore": {"bucket": vllm_server.bucket, "prefix": "asyncgrpo",
                             "endpoint": s3_server.endpoint, "retention": 50},
            "data": {"path": str(prompts)},
            "reward": {"functions": [{"name": "numeric_match"}]},
        },
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _env(vllm_server, s3_server, run: str, work: Path, port: int, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(s3_server.env())
    env.update({
        "ASYNCGRPO_VLLM_URL": vllm_server.base_url,
        # The shared server resolves "<run>/policy-vN" (ASYNCGRPO_ADAPTER_ANY_RUN).
        "ASYNCGRPO_ADAPTER_NAME_PREFIX": f"{run}/policy-v",
        "ASYNCGRPO_WORK_DIR": str(work),
        "ASYNCGRPO_METRICS_PORT": str(port),
        "ASYNCGRPO_PROBE_TOLERANCE": str(PROBE_TOLERANCE),
        "ASYNCGRPO_RETRY_BACKOFF_S": "0.2",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
        **extra,
    })
    return env


def _start(config: Path, env: dict[str, str], log: Path, cpus) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "trainer", "--config", str(config)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    if cpus:
        _pin(proc.pid, cpus)  # children (the rollout worker) inherit it
    return proc


def _status(work: Path) -> dict:
    try:
        return json.loads((work / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _manifests(client, bucket: str, run: str) -> dict[int, dict]:
    out = {}
    resp = client.list_objects_v2(Bucket=bucket, Prefix=run_folder("asyncgrpo", None, run) + "adapters/")
    for obj in resp.get("Contents", []):
        if obj["Key"].endswith("/manifest.json"):
            doc = json.loads(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            out[doc["version"]] = doc
    return out


def _complete_checkpoints(client, bucket: str, run: str) -> list[int]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix=run_folder("asyncgrpo", None, run) + "checkpoints/")
    return sorted(int(o["Key"].split("/")[-2].removeprefix("step-"))
                  for o in resp.get("Contents", []) if o["Key"].endswith("/COMPLETE"))


def _wait_or_kill(proc: subprocess.Popen) -> int | None:
    """The trainer's exit code; a trainer still running at the deadline is killed (group)."""
    try:
        return proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-6000:] if log.exists() else ""


def test_lora_training_through_the_bucket_with_refusal_and_restart(
        vllm_server, s3_server, cores, tmp_path):
    run = f"e2e-{uuid.uuid4().hex[:8]}"
    s3 = s3_server.client()
    config = _write_run(tmp_path, vllm_server, s3_server, run)

    # -- phase 1: train, corrupt v3, kill after a checkpoint ------------------------------
    work1, log1, port1 = tmp_path / "pod1", tmp_path / "trainer1.log", free_port()
    first = _start(config, _env(vllm_server, s3_server, run, work1, port1,
                                ASYNCGRPO_FAULT_CORRUPT_VERSIONS=str(CORRUPT_VERSION)),
                   log1, cores)
    metrics_text = ""
    killed_at = None
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline:
            assert first.poll() is None, f"trainer exited early ({first.returncode}):\n{_tail(log1)}"
            st = _status(work1)
            ckpts = _complete_checkpoints(s3, vllm_server.bucket, run)
            if ckpts and st.get("step", 0) > ckpts[-1] and ckpts[-1] >= CHECKPOINT_INTERVAL \
                    and st.get("policy_version", 0) > CORRUPT_VERSION:
                metrics_text = urllib.request.urlopen(
                    f"http://127.0.0.1:{port1}/metrics", timeout=10).read().decode()
                os.killpg(first.pid, signal.SIGKILL)
                killed_at = st
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"no checkpoint + progress within {DEADLINE_S}s:\n{_tail(log1)}")
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)

    before = _manifests(s3, vllm_server.bucket, run)
    ckpt = _complete_checkpoints(s3, vllm_server.bucket, run)[-1]
    assert ckpt < TOTAL_STEPS

    # The corrupt version was refused by vLLM and training went on past it.
    pub1 = {p["version"]: p for p in _status(work1)["published"]}
    assert pub1[CORRUPT_VERSION]["served"] is False
    assert any(v > CORRUPT_VERSION and p.get("served") for v, p in pub1.items())
    status, body = vllm_server.completion(f"{run}/policy-v{CORRUPT_VERSION}", prompt=[1, 2, 3],
                                          max_tokens=1)
    assert status >= 400, body
    assert "asyncgrpo_trainer_served_logprob_probe_failures_total 1.0" in metrics_text
    # The hint turned False at v3 and back to True with the next served version.
    served_hint = next(c for c in killed_at["conditions"] if c["type"] == "AdapterServed")
    assert served_hint["status"] == "True"
    assert "asyncgrpo_trainer_policy_version" in metrics_text
    assert "asyncgrpo_trainer_served_logprob_diff" in metrics_text

    # -- phase 2: a fresh pod resumes from the bucket ----------------------------------------
    work2, log2 = tmp_path / "pod2", tmp_path / "trainer2.log"
    second = _start(config, _env(vllm_server, s3_server, run, work2, free_port()), log2, cores)
    rc = _wait_or_kill(second)
    assert rc == 0, _tail(log2)
    st2 = _status(work2)
    assert st2["resumed_from_step"] == ckpt
    assert st2["step"] == TOTAL_STEPS

    after = _manifests(s3, vllm_server.bucket, run)
    versions = sorted(after)
    # No version repeated or skipped: 1..N, each once (names are keys, so "once" is the
    # manifests' own version field matching its key and the phases not overlapping).
    assert versions == list(range(1, len(versions) + 1))
    assert all(after[v]["version"] == v for v in versions)
    first_resumed = min(v for v in after if v not in before)
    assert first_resumed == max(before) + 1
    # The resumed trainer starts at the checkpoint's step and continues one step per version.
    resumed = [after[v] for v in versions if v >= first_resumed]
    assert [m["step"] for m in resumed] == list(range(ckpt, TOTAL_STEPS + 1))
    assert all(m["extra"]["resumed_from_step"] == ckpt for m in resumed)
    steps_trained = max(m["step"] for m in before.values()) + (TOTAL_STEPS - ckpt)
    assert steps_trained >= 5

    # Served == trained for every version vLLM served, and vLLM serves each good version.
    pub2 = {p["version"]: p for p in st2["published"]}
    # (The killed trainer may have died between a publish and its probe: that version has no
    # probe record, but vLLM must still serve it.)
    probed = {**{v: p for v, p in pub1.items() if "served" in p},
              **{v: p for v, p in pub2.items() if "served" in p}}
    assert all(p["served"] for v, p in probed.items() if v != CORRUPT_VERSION)
    assert set(pub2) <= set(probed) and len(probed) >= 5
    for v, p in probed.items():
        if v != CORRUPT_VERSION:
            assert p["logprob_max_diff"] <= PROBE_TOLERANCE, (v, p)
    for v in versions:
        if v != CORRUPT_VERSION:
            status, body = vllm_server.completion(f"{run}/policy-v{v}", prompt=[1, 2, 3],
                                                  max_tokens=1)
            assert status == 200, (v, body)


def test_two_rank_fsdp2_trainer_trains_and_resumes(vllm_server, s3_server, cores, tmp_path):
    """`torchrun --nproc_per_node 2`: the LoRA policy on an FSDP2-sharded base, adapters
    through the bucket; a second torchrun resumes from the bucket's checkpoint with the
    exact adapter (its first version probes identically to the checkpointed one)."""
    run = f"fsdp-{uuid.uuid4().hex[:8]}"
    config = _write_run(tmp_path, vllm_server, s3_server, run)
    doc = yaml.safe_load(config.read_text())
    doc["spec"]["trainer"].update(totalSteps=3, checkpointInterval=3)
    config.write_text(yaml.safe_dump(doc))
    bin_dir = Path(sys.executable).parent

    def torchrun(work: Path, log: Path, steps: int) -> dict:
        env = _env(vllm_server, s3_server, run, work, free_port())
        doc["spec"]["trainer"]["totalSteps"] = steps
        config.write_text(yaml.safe_dump(doc))
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "asyncgrpo.cli", "trainer",
               "--config", str(config)]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        if cores:
            _pin(proc.pid, cores)
        rc = _wait_or_kill(proc)
        assert rc == 0, _tail(log)
        return _status(work)

    first = torchrun(tmp_path / "a", tmp_path / "a.log", 3)
    assert first["step"] == 3 and first["resumed_from_step"] is None
    second = torchrun(tmp_path / "b", tmp_path / "b.log", 5)
    assert second["resumed_from_step"] == 3 and second["step"] == 5
    versions = sorted(_manifests(s3_server.client(), vllm_server.bucket, run))
    assert versions == list(range(1, 1 + 4 + 3))  # v1 + 3 steps, then v5 (resume) + 2 steps
    last_before, first_after = first["published"][-1], second["published"][0]
    assert first_after["version"] == last_before["version"] + 1
    assert first_after["logprob_max_diff"] == pytest.approx(last_before["logprob_max_diff"],
                                                            abs=1e-6)
    for p in first["published"] + second["published"]:
        assert p["served"] and p["logprob_max_diff"] <= PROBE_TOLERANCE, p

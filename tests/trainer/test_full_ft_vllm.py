"""Full fine-tuning end to end: the real trainer, two real vLLM CPU replicas, two pullers.

`asyncgrpo trainer` trains every weight of the tiny dense Qwen3 (finetuning: full) for 6
steps. Each version goes to the bucket (anchor every 3 versions, sparse deltas between) with
the trained log-probs of the probe in its manifest; one puller per replica
(`asyncgrpo weights pull`, a process as in the pod) swaps it in and compares its replica's
served log-probs with the trainer's. Rollouts come from replica A; replica B only follows.

Checked: >= 5 optimizer steps; every trained sample carries the version replica A says
sampled it (vLLM's weight-version spans), not the trainer's version at request time; every version each replica swapped in serves the probe within
1e-5 of the trainer's weights, on both replicas, for prompt log-probs (no prefix cache) and for
a token generated after a prompt cached under the previous weights; versions 3 and 7 (the last)
are corrupted in the bucket right after publishing: no replica ever serves them, training goes
on past 3, and both pullers refuse 7 and keep serving 6 (a puller may jump over 3 to a newer
anchor, none can jump over the last); replica B's puller is killed (SIGKILL) mid-run and its
restart comes back on the newest good version.
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

from asyncgrpo.controller.vllm import FULL_FINETUNING_ARGS
from asyncgrpo.local.vllm import vllm_python, vllm_venv
from asyncgrpo.testing.net import free_port
from asyncgrpo.testing.vllm import launch_vllm
from tests.trainer.test_e2e_vllm import _env, _start, _status, _tail, _wait_or_kill
from tests.vllm_server import start_together

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOTAL_STEPS = 6
CORRUPT = (3, TOTAL_STEPS + 1)  # the last one: every puller must meet it (none comes after)
TOLERANCE = 1e-5
DEADLINE_S = 600  # a guard against hangs, not a performance assertion


def _start_vllm(model: str, log: Path):
    port = free_port()
    args = ["--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--max-num-seqs", "8", "--seed", "0",
            *FULL_FINETUNING_ARGS]
    return launch_vllm(args, port=port, model=model, log_path=log, env={"VLLM_PLUGINS": ""})


def _start_puller(vllm_url: str, work: Path, port: int, env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncgrpo.cli", "weights", "pull", "--vllm-url", vllm_url,
           "--work-dir", str(work), "--host", "127.0.0.1", "--port", str(port),
           "--poll-seconds", "0.2"]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _puller_status(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
            return json.loads(r.read())
    except OSError:
        return {}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_full_finetuning_through_the_bucket_on_two_replicas(s3_server, tmp_path):
    if vllm_python() is None:
        pytest.skip(f"vLLM venv missing at {vllm_venv()}: run hack/setup-vllm-venv.sh")
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    model = str(save_tiny_checkpoint(tmp_path / "tiny-qwen3-dense", kind="dense", seed=0))
    bucket = f"full-{uuid.uuid4().hex[:8]}"
    s3_server.client().create_bucket(Bucket=bucket)
    run = f"full-{uuid.uuid4().hex[:8]}"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": f"What is {a} + {b}? Answer with a number.", "answer": str(a + b)})
        + "\n" for a in range(1, 6) for b in range(1, 6)))
    doc = {
        "apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun", "metadata": {"name": run},
        "spec": {
            "model": {"name": model, "dtype": "float32", "finetuning": "full",
                      "full": {"anchorInterval": 3, "localDisk": "1Gi"}},
            "trainer": {"numGenerations": 4, "promptsPerStep": 2, "tokenBudgetPerRank": 1024,
                        "maxStaleness": 2, "totalSteps": TOTAL_STEPS, "checkpointInterval": 100,
                        "learningRate": 1e-4},
            "rollout": {"maxModelLen": 1024, "sampling": {"maxCompletionTokens": 12}},
            "adapterStore": {"bucket": bucket,
                             "endpoint": s3_server.endpoint, "retention": 50},
            "data": {"path": str(prompts)},
            "reward": {"functions": [{"name": "numeric_match"}]},
        },
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(doc))

    replicas = start_together(*(lambda i=i: _start_vllm(model, tmp_path / f"vllm-{i}.log")
                                for i in range(2)))
    puller_env = {**os.environ, **s3_server.env(), "ASYNCGRPO_ADAPTER_BUCKET": bucket,
                  "ASYNCGRPO_ADAPTER_RUN": run, "ASYNCGRPO_ADAPTER_PREFIX": "asyncgrpo",
                  "ASYNCGRPO_ADAPTER_ENDPOINT": s3_server.endpoint,
                  "ASYNCGRPO_ADAPTER_ATTEMPTS": "3", "ASYNCGRPO_ADAPTER_BACKOFF_S": "0.2",
                  "OMP_NUM_THREADS": "1"}
    ports = [free_port(), free_port()]
    pullers = [_start_puller(r.base_url, tmp_path / f"pod-{i}", ports[i], puller_env,
                             tmp_path / f"puller-{i}.log") for i, r in enumerate(replicas)]
    work, log = tmp_path / "trainer", tmp_path / "trainer.log"
    trainer = _start(config, _env(replicas[0], s3_server, run, work, free_port(),
                                  ASYNCGRPO_FAULT_CORRUPT_VERSIONS=",".join(map(str, CORRUPT))),
                     log, None)
    histories: list[list[dict]] = [[], []]
    restarted = False
    try:
        deadline = time.monotonic() + DEADLINE_S
        while trainer.poll() is None and time.monotonic() < deadline:
            st = _status(work)
            if not restarted and st.get("policy_version", 0) >= 4:
                # replica B's puller dies mid-run; its pod restarts the container
                histories[1] += _puller_status(ports[1]).get("history", [])
                _stop(pullers[1])
                pullers[1] = _start_puller(replicas[1].base_url, tmp_path / "pod-1", ports[1],
                                           puller_env, tmp_path / "puller-1.log")
                restarted = True
            time.sleep(0.5)
        rc = _wait_or_kill(trainer)
        assert rc == 0, _tail(log)
        st = _status(work)
        assert st["step"] == TOTAL_STEPS >= 5
        last = st["published"][-1]["version"]
        assert [p["version"] for p in st["published"]] == list(range(1, last + 1))
        # fp32 AdamW moves most elements every step, so most versions go out as anchors
        # (a delta would be larger); deltas are held to the same bar in tests/weights
        kinds = [p["kind"] for p in st["published"]]
        assert kinds[0] == kinds[3] == "anchor" and set(kinds) <= {"anchor", "delta"}
        # both replicas refuse the corrupt last version and stay on the one before it; the
        # restarted puller may still be swapping that one in (its predecessor was killed
        # mid-swap, vLLM paused): wait for both, not only for the refusals
        def settled(status: dict) -> bool:
            return str(last) in status.get("refused", {}) and status.get(
                "served_version") == last - 1

        end = time.monotonic() + 120
        while time.monotonic() < end and not all(settled(_puller_status(p)) for p in ports):
            time.sleep(0.5)
        final = [_puller_status(p) for p in ports]
        assert [f["served_version"] for f in final] == [last - 1, last - 1], (final, _tail(
            tmp_path / "puller-1.log"))
        assert all(str(last) in f["refused"] for f in final)
        histories[0] += final[0]["history"]
        histories[1] += final[1]["history"]
        for i, hist in enumerate(histories):
            served = [h["version"] for h in hist]
            assert not set(CORRUPT) & set(served), (i, served)
            assert len(served) >= 2, (i, served)
            for h in hist:
                assert h["probe_max_diff"] <= TOLERANCE, (i, h)
                assert h["probe_cached_diff"] <= TOLERANCE, (i, h)  # generated after a cached prompt
        # the restarted puller came back on the newest version with ready set
        assert final[1]["ready"] is True
        # each sample is tagged with the weights that sampled it, as replica A (which served
        # every rollout) reported them: its base weights (0) or a version it swapped in, never
        # a version only the trainer had (the corrupt 3 no replica served)
        served_a = {h["version"] for h in histories[0]}
        tags = {int(v) for v in st["sample_versions"]}
        assert tags <= served_a | {0}, (tags, served_a)
        assert tags & served_a, (tags, served_a)
        report = {"published": st["published"], "served": histories}
        (Path(os.environ.get("ASYNCGRPO_BENCH_OUT", tmp_path)) / "full_ft_e2e.json").write_text(
            json.dumps(report, indent=1))
    finally:
        if trainer.poll() is None:
            _stop(trainer)
        for p in pullers:
            _stop(p)
        for r in replicas:
            r.stop()

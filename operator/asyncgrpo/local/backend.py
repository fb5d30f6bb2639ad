"""The embedded default: one AsyncGRPORun as local processes on one machine, no cluster.

It runs the pods the operator would create (`asyncgrpo.local.placement.run_pods`, from the
operator's own builders), each container translated to a process by the one documented
translation (`asyncgrpo.local.pods`): first the bucket setup Job's pod (`asyncgrpo bucket
setup`, the one implementation of bucket creation and the folder's ownership marker, which a
cluster runs as a Job), then vLLM from the vLLM venv with the S3 LoRA resolver (or, for
full fine-tuning, with its weights puller sidecar beside it: every container of a pod is a
process, sharing the pod's address and volume directories), sandbox servers and a gateway
when the run has `spec.sandboxes`, and the trainer nodes
(torchrun, as in the StatefulSet). An S3 server is started first when the adapter store
points at loopback and nothing listens there (moto). It follows the trainer until it exits,
stops everything it started, and reports what the run produced.

Differences from a cluster are data of the placement: one pod per Deployment (one vLLM
replica); the operator's part of the sandbox pool (create, replace retired and failed
sandboxes, size by demand) done by `asyncgrpo.local.sandbox_pool` with processes, the gateway
following its members file instead of watching pods; no network policy, no resource
limits (sandbox commands run as an unprivileged uid when started as root, see
docs/sandboxes.md); on a machine with two or more cores vLLM and the trainer are pinned to
different cores, since they starve each other otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.controller import bucketjob, gateway, sandboxes, trainer, vllm
from asyncgrpo.local import progress
from asyncgrpo.local.net import listening
from asyncgrpo.local.placement import (
    Pod,
    bucket_setup_pod,
    build_placement,
    run_pods,
    termination_log,
)
from asyncgrpo.local.pods import LocalPlacement, LocalProcess, PodTranslationError, translate_pod
from asyncgrpo.local.processes import ManagedProcess
from asyncgrpo.local.s3 import S3Server
from asyncgrpo.local.sandbox_pool import LocalSandboxPool, start_sandbox_part
from asyncgrpo.wire import BIND_HOST_ENV, METRICS_PORT_ENV, WORK_DIR_ENV

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
#: Credentials handed to a local S3 server this backend starts (moto accepts any).
LOCAL_S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "asyncgrpo-local",
                        "AWS_SECRET_ACCESS_KEY": "asyncgrpo-local"}


class LocalRunError(RuntimeError):
    """The run cannot be run locally, or a part of it failed; the message says which."""


def _split_cpus() -> dict[str, set[int] | None]:
    """Component -> CPUs its pods are pinned to: trainer and vLLM apart on two cores or more."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    return {trainer.COMPONENT: {cpus[0]}, vllm.COMPONENT: set(cpus[1:])}


@dataclass
class LocalBackend:
    run: AsyncGRPORun
    workdir: Path
    max_steps: int | None = None
    say: Callable[[str], None] = print
    started: list = field(default_factory=list)  # ManagedProcess | S3Server
    #: the trainer's status file: the work dir (WORK_DIR_ENV) of node 0, known once its pod is translated
    status_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: /metrics of vLLM and the gateway, scraped beside the trainer's at each step
    scrape_urls: list[str] = field(default_factory=list)
    #: where the local S3 server keeps its objects between runs (None: `<workdir>/../s3`)
    s3_dir: Path | None = None
    #: run the deep checks (asyncgrpo.preflight) before anything starts
    preflight: bool = True
    #: the run file, for the `asyncgrpo pull` line of final_output
    run_file: Path | None = None
    #: the pods' placement, once `_processes` built it
    placement: LocalPlacement | None = None
    #: the sandbox processes and the gateway's members file (`spec.sandboxes`), once started
    sandbox_pool: LocalSandboxPool | None = None
    _locks: list = field(default_factory=list)
    _stopped_s3: S3Server | None = None

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        s = self.run.spec
        if s.adapter_store.endpoint is None:
            raise LocalRunError("spec.adapterStore.endpoint: the local backend needs an S3 "
                                "endpoint (http://127.0.0.1:PORT starts a local S3 server)")
        if s.harness.tools and s.sandboxes is None:
            raise LocalRunError("spec.sandboxes: tools need sandboxes")
        for at, d in (("spec.data", s.data), ("spec.data.eval", s.data.eval)):
            if d is not None and d.config_map is not None:
                raise LocalRunError(f"{at}.configMap: a ConfigMap lives in a cluster; "
                                    f"locally give the rows as {at}.path")
        if s.trainer.report_to_secret is not None:
            raise LocalRunError("spec.trainer.reportToSecret: a Secret lives in a cluster; "
                                "locally give the loggers' settings in spec.trainer.env")
        if s.sandboxes is not None and s.sandboxes.image_column is not None:
            raise LocalRunError("spec.sandboxes.imageColumn: local sandboxes are processes on "
                                "this machine, not containers of an image; a run whose rows "
                                "name images runs on a cluster")

    def deep_check(self) -> None:
        """The preflight (model, tokenizer, data, modules) before any process starts: each
        problem with its field, in seconds rather than in a vLLM or torchrun traceback."""
        from asyncgrpo.preflight import preflight

        report = preflight(self.run)
        for note in report.notes:
            self.say(f"preflight note: {note}")
        if not report.ok:
            raise LocalRunError("preflight found problems (nothing was started):\n  "
                                + "\n  ".join(str(e) for e in report.errors))

    def _lock(self) -> None:
        """Hold the run's locks for its life: one on its work folder, one on its identity in
        its bucket (endpoint, bucket, namespace, name: the run folder two runs would share).
        A second run while the first still runs is refused here, before it touches S3,
        its folder or the first run's processes."""
        import fcntl
        import tempfile

        store = self.run.spec.adapter_store
        ident = "-".join(x for x in (urlparse(store.endpoint or "").netloc.replace(":", "_"),
                                     store.bucket, self.run.metadata.namespace or "default",
                                     self.run.metadata.name) if x)
        lock_dir = Path(tempfile.gettempdir()) / f"asyncgrpo-local-{os.getuid()}"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        for path, what in ((self.workdir / ".run.lock", f"the work folder {self.workdir}"),
                           (lock_dir / f"{ident}.lock", (f"the run folder of "
                            f"{self.run.metadata.name} in bucket {store.bucket}"))):
            f = open(path, "a+")  # noqa: SIM115 (held until stop)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "?"
                f.close()
                raise LocalRunError(
                    f"another `asyncgrpo local run` ({holder}) is using {what}: wait for it "
                    "to finish (or stop it), or run this one under another metadata.name "
                    "and --workdir") from None
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}")
            f.flush()
            self._locks.append(f)

    def _keep_previous_work(self) -> None:
        """The trainer pods' work folders (TRL's output, status.json, loggers) of the last
        run are moved to `work.previous` instead of being wiped by the fresh emptyDir: a
        rerun resumes from the bucket's checkpoints and the last run's files stay readable."""
        for work in sorted(self.workdir.glob(f"{self.run.metadata.name}-trainer-*/work")):
            if work.is_dir() and any(work.iterdir()):
                previous = work.with_name("work.previous")
                shutil.rmtree(previous, ignore_errors=True)
                os.rename(work, previous)

    def final_output(self) -> dict | None:
        """Where the run's result is, once the trainer wrote it: the bucket record of
        `final/` (bucket, key, kind, step) plus `local_path`, the folder on this machine's
        disk when the local S3 keeps it (`<s3 dir>/<bucket>/<key>`, written when the S3
        server stops), and `pull`, the command that brings it down. None before."""
        outputs = (self.trainer_status() or {}).get("outputs") or []
        if not outputs:
            return None
        out = dict(outputs[0])
        if self._s3_server() is not None:
            out["local_path"] = str(self._s3_data_dir() / out["bucket"] / out["key"])
        run_file = self.run_file or f"{self.run.metadata.name}.yaml"
        s3_dir = f" --s3-dir {self._s3_data_dir()}" if self._s3_server() is not None else ""
        out["pull"] = (f"asyncgrpo pull {run_file}{s3_dir} --dest "
                       f"{self.run.metadata.name}-final")
        return out

    def final_output_line(self) -> str | None:
        """One line for the end of a local run's output (printed by the caller)."""
        out = self.final_output()
        if out is None:
            return None
        where = out.get("local_path") or f"s3://{out['bucket']}/{out['key']}"
        return (f"final {'adapter' if out['kind'] == 'lora' else 'weights'} (step "
                f"{out['step']}): {where}")

    def _s3_data_dir(self) -> Path:
        return self.s3_dir if self.s3_dir is not None else self.workdir.parent / "s3"

    def _s3_server(self) -> S3Server | None:
        return next((p for p in self.started if isinstance(p, S3Server)), self._stopped_s3)

    # ------------------------------------------------------------------ parts
    def _s3(self) -> None:
        """A local S3 server when the endpoint is a free loopback port; the credentials
        every pod gets (the run's Secret values, or the machine's as IRSA would give)."""
        store = self.run.spec.adapter_store
        url = urlparse(store.endpoint)
        host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
        creds = {k: os.environ[k] for k in LOCAL_S3_CREDENTIALS if os.environ.get(k)}
        if host in LOOPBACK and not listening(port):
            data = self._s3_data_dir()
            self.say(f"starting a local S3 server on 127.0.0.1:{port} (objects kept in {data})")
            try:
                server = S3Server.start(self.workdir / "s3.log", port=port, data_dir=data)
            except FileNotFoundError as e:
                raise LocalRunError(f"no local S3 server: {e}") from None
            self.started.append(server)
            if server.restored and server.restored[0]:
                n, size, secs = server.restored
                self.say(f"local S3: {n} objects ({size / 1e6:.1f} MB) loaded in {secs:.1f} s")
            creds = creds or dict(LOCAL_S3_CREDENTIALS)
        elif host in LOOPBACK and not creds:
            raise LocalRunError(
                f"spec.adapterStore.endpoint: something already listens on {host}:{port} "
                "(another local run's S3 server? it stops when that run ends): give this run "
                "another port, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for the "
                "server there")
        if not creds:
            raise LocalRunError("no S3 credentials: set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY for spec.adapterStore.endpoint")
        self.env.update(creds)

    def _setup_bucket(self, pod: Pod, lp: LocalProcess) -> None:
        """Run the bucket setup Job's pod to its end, as the Job controller would: the
        bucket created if missing and allowed, the run folder claimed with its ownership
        marker; a failure stops the run with the command's `Reason: message`."""
        proc = self._start(lp, wait=False)
        try:
            code = proc.proc.wait(timeout=pod.deadline_s)
        except subprocess.TimeoutExpired:
            proc.stop()
            raise LocalRunError(f"the bucket setup ran past its deadline ({pod.deadline_s:.0f}"
                                f" s); see {proc.log_path}") from None
        try:
            message = termination_log(self.workdir, pod).read_text().strip()
        except OSError:
            message = proc.log_tail().strip()
        if code != 0:
            raise LocalRunError(f"the bucket setup failed: {message} (see {proc.log_path})")
        self.say(f"bucket setup: {message}")

    def _start(self, lp: LocalProcess, *, wait: bool) -> ManagedProcess:
        return start_process(lp, self.workdir, started=self.started, wait=wait)

    def _start_pod(self, containers: list[LocalProcess]) -> list[ManagedProcess]:
        """Every container of a pod at once (as a kubelet starts them), then each one's
        readiness probe in turn: the pod is ready when all are."""
        procs = [self._start(lp, wait=False) for lp in containers]
        for proc, lp in zip(procs, containers):
            if lp.ready_url:
                wait_ready(proc, lp.ready_url, lp.ready_timeout_s)
        return procs

    def _processes(self) -> tuple[list[Pod], dict[str, list[LocalProcess]]]:
        """The run's pods, from the operator's builders, as local processes: the bucket
        setup Job's pod first, then the workloads' pods in start order."""
        sb = self.run.spec.sandboxes
        pods = [bucket_setup_pod(self.run),
                *run_pods(self.run, max(1, sb.min_warm) if sb is not None else 0)]
        try:
            placement = build_placement(self.run, pods, self.workdir,
                                        s3_credentials=dict(self.env),
                                        max_steps=self.max_steps, cpus=_split_cpus())
            self.placement = placement
            return pods, {p.name: translate_pod(p.name, p.spec, placement) for p in pods}
        except (ValueError, PodTranslationError) as e:
            raise LocalRunError(f"cannot run this run's pods locally: {e}") from None

    # ------------------------------------------------------------------ the run
    def run_to_completion(self, poll_s: float = 2.0) -> int:
        """Start everything, follow the trainer, stop everything; the trainer's exit code."""
        from asyncgrpo.local.vllm import vllm_python, vllm_venv

        self.check()
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock()
            if self.preflight:
                self.deep_check()
            if vllm_python() is None:
                raise LocalRunError(f"no vLLM venv at {vllm_venv()}: run "
                                    "hack/setup-vllm-venv.sh")
            self._keep_previous_work()
            self._s3()
            pods, procs = self._processes()
            by = {c: [p for p in pods if p.component == c]
                  for c in (bucketjob.SETUP, vllm.COMPONENT, sandboxes.COMPONENT,
                            gateway.COMPONENT, trainer.COMPONENT)}
            for pod in by[bucketjob.SETUP]:
                (setup,) = procs[pod.name]
                self._setup_bucket(pod, setup)
            self.say(f"starting vLLM ({self.run.spec.model.name}); this takes 30-60 s on a CPU")
            vllm_pod = procs[by[vllm.COMPONENT][0].name]
            servers = self._start_pod(vllm_pod)
            self.scrape_urls = [_metrics_url(lp.ready_url) for lp in vllm_pod
                                if lp.container != vllm.PULLER_CONTAINER and lp.ready_url]
            self.say("vLLM ready on " + ", ".join(
                f"{_host_port(lp.ready_url)} ({lp.name})" for lp in vllm_pod))
            if by[gateway.COMPONENT]:
                self._start_sandboxes(pods, procs)
            code = self._train([procs[pod.name][0] for pod in by[trainer.COMPONENT]], servers,
                               poll_s)
            if code == 0:
                self._report_weights([lp for lp in vllm_pod
                                      if lp.container == vllm.PULLER_CONTAINER])
            return code
        finally:
            self.stop()

    def _start_sandboxes(self, pods: list[Pod], procs: dict[str, list[LocalProcess]]) -> None:
        """The sandbox pool's first pods, the gateway, and the pool following the gateway."""
        pool, gw = start_sandbox_part(self.run, pods, procs, self.placement, self.workdir,
                                      started=self.started, say=self.say)
        self.sandbox_pool = pool
        self.scrape_urls.append(_metrics_url(gw.ready_url))
        self.say(f"started {len(pool.sandboxes)} sandbox server(s) behind a gateway on "
                 f"{_host_port(gw.ready_url)} (lifecycle {pool.lifecycle}, at most "
                 f"{pool.cap} at once)")

    def _train(self, nodes: list[LocalProcess], servers: list[ManagedProcess],
               poll_s: float) -> int:
        """Start the trainer nodes and follow them to their end (the vLLM pod's processes
        must stay up); the first failing node's exit code, after stopping the others."""
        self.status_path = Path(nodes[0].env[WORK_DIR_ENV]) / "status.json"
        world = self.run.world_size
        self.say(f"starting the trainer ({world} process{'es' if world > 1 else ''}); "
                 f"metrics on {nodes[0].env[BIND_HOST_ENV]}:{nodes[0].env[METRICS_PORT_ENV]}")
        trainers = [self._start(lp, wait=False) for lp in nodes]
        self.say("waiting for the first step (the trainer loads the model, vLLM samples the "
                 "first rollouts)")
        urls = [(f"http://{nodes[0].env[BIND_HOST_ENV]}:{nodes[0].env[METRICS_PORT_ENV]}"
                "/metrics"), *self.scrape_urls]
        self.progress_path.write_text("")
        follower = _ProgressFollower(self, urls)
        while any(t.running for t in trainers):
            time.sleep(poll_s)
            for server in servers:
                if not server.running:
                    raise LocalRunError(f"{server.name} exited ({server.proc.returncode}); "
                                        f"see {server.log_path}")
            if any(not t.running and t.proc.returncode != 0 for t in trainers):
                break
            follower.poll()
        follower.poll()  # the last step, logged just before the trainer exited
        for t in trainers:  # one node failed: the others cannot go on without it
            if t.running:
                t.stop()
        bad = next((t for t in trainers if t.proc.returncode != 0), None)
        if bad is not None:
            self.say(f"trainer exited with {bad.proc.returncode}; last lines of "
                     f"{bad.log_path}:\n{bad.log_tail()}")
            return bad.proc.returncode
        self.say(self.summary())
        return 0

    def _report_weights(self, pullers: list[LocalProcess], timeout_s: float = 120.0) -> None:
        """Full fine-tuning: wait (bounded) until each puller serves the trainer's newest
        version, keep its `/status` as `<workdir>/<pod>.<container>.status.json` (the
        processes are stopped next) and say what each replica served."""
        published = [p["version"] for p in (self.trainer_status() or {}).get("published", [])]
        if not pullers or not published:
            return
        for lp in pullers:
            url = urlparse(lp.ready_url or "")._replace(path="/status").geturl()
            deadline = time.monotonic() + timeout_s
            status: dict = {}
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        status = json.loads(resp.read())
                except (OSError, ValueError):
                    pass
                if (status.get("served_version") or 0) >= published[-1]:
                    break
                if time.monotonic() > deadline:
                    self.say(f"{lp.name}: v{published[-1]} not served after {timeout_s:.0f} s")
                    break
                time.sleep(1.0)
            (self.workdir / f"{lp.name}.status.json").write_text(json.dumps(status, indent=1))
            self.say(_weights_line(lp.pod, status))

    def trainer_status(self) -> dict | None:
        if self.status_path is None:
            return None
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None

    @property
    def progress_path(self) -> Path:
        """One JSON record per step (`asyncgrpo.local.progress`): what `report --local` draws."""
        return self.workdir / progress.PROGRESS_FILE

    @property
    def total_steps(self) -> int:
        total = self.run.spec.trainer.total_steps
        return min(total, self.max_steps) if self.max_steps else total

    def summary(self) -> str:
        text = progress.summary(self.run.metadata.name, self.trainer_status() or {},
                                progress.load(self.progress_path), self.workdir,
                                self.status_path.parent if self.status_path else None)
        final = self.final_output()
        if final is not None:  # the trained model, in the layout peft/transformers load
            text += f"\n{self.final_output_line()}\nbring it down: {final['pull']}"
        return text

    def stop(self) -> None:
        while self.started:
            part = self.started.pop()
            part.stop()
            if isinstance(part, S3Server):
                self._stopped_s3 = part
                if part.saved:
                    n, size, secs = part.saved
                    self.say(f"local S3: {n} objects ({size / 1e6:.1f} MB) saved to "
                             f"{part.data_dir} in {secs:.1f} s")
        while self._locks:
            self._locks.pop().close()


def start_process(lp: LocalProcess, log_dir: Path, *, started: list, wait: bool = True
                  ) -> ManagedProcess:
    """Start one translated container (log `<log_dir>/<pod>.log`, pinned to its CPUs), add
    it to `started` (what the caller stops), and wait for its readiness probe if asked."""
    proc = ManagedProcess.start(lp.name, lp.argv, env=lp.env, cwd=Path(lp.cwd),
                                log_path=log_dir / f"{lp.name}.log",
                                cpus=set(lp.cpus) if lp.cpus else None)
    started.append(proc)
    if wait and lp.ready_url:
        wait_ready(proc, lp.ready_url, lp.ready_timeout_s)
    return proc


def wait_ready(proc: ManagedProcess, url: str, timeout_s: float) -> None:
    """Poll the container's readiness probe until it answers 200, as a kubelet would."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.running:
            raise LocalRunError(f"{proc.name} exited with {proc.proc.returncode} before it was "
                                f"ready; last lines of {proc.log_path}:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise LocalRunError(f"{proc.name} not ready after {timeout_s:.0f} s ({url}); "
                        f"see {proc.log_path}")


def _host_port(url: str | None) -> str:
    u = urlparse(url or "")
    return f"{u.hostname}:{u.port}"


def _metrics_url(url: str | None) -> str:
    """The /metrics beside a readiness probe (vLLM and the gateway serve both on one port)."""
    return urlparse(url or "")._replace(path="/metrics", query="").geturl()


def _weights_line(pod: str, status: dict) -> str:
    """What one replica's puller served: versions swapped in and the worst probe difference."""
    history = status.get("history") or []
    served = [h["version"] for h in history]
    diffs = [h["probe_max_diff"] for h in history if "probe_max_diff" in h]
    shown = f"v{served[0]}..v{served[-1]} ({len(served)} swaps)" if served else "no version"
    worst = f", probe max diff {max(diffs):.1e}" if diffs else ""
    refused = f", refused {sorted(status['refused'])}" if status.get("refused") else ""
    return f"{pod} served weights {shown}{worst}{refused}"


@dataclass
class _ProgressFollower:
    """Says each new step of the trainer (and once that it resumed), and keeps its record."""

    backend: LocalBackend
    urls: list[str]
    last_step: int = -1
    said_resumed: bool = False

    def poll(self) -> None:
        b = self.backend
        status = b.trainer_status()
        if not status:
            return
        if not self.said_resumed and (line := progress.resumed_line(status)):
            b.say(line)
            self.said_resumed = True
        logged = [h for h in status.get("history") or [] if h.get("reward") is not None]
        new = [i for i, h in enumerate(logged) if h.get("step", -1) > self.last_step]
        if not new:
            return
        self.last_step = logged[-1].get("step", -1)
        for i in new[:-1]:  # steps between two polls: their reward; the endpoint has moved on
            rec = progress.record({"history": logged[:i + 1]}, {})
            b.say(progress.progress_line(rec, b.total_steps))
            progress.append(b.progress_path, rec)
        metrics: dict[str, float] = {}
        for url in self.urls:
            for k, v in progress.scrape(url).items():
                metrics[k] = metrics.get(k, 0.0) + v
        rec = progress.record(status, metrics)
        b.say(progress.progress_line(rec, b.total_steps))
        progress.append(b.progress_path, rec)

"""Starting a real vLLM OpenAI-compatible server from the vLLM venv, on loopback (tests and
benchmarks).

It runs as a process of the vLLM venv's interpreter (`asyncgrpo.local.vllm.vllm_venv`), with
the S3 LoRA resolver plugin enabled: a request for `policy-vN` fetches version N from the
bucket. `asyncgrpo local run` does not use it: it runs the operator's vLLM pod.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.local.vllm import PACKAGE_ROOT, vllm_python, vllm_venv
from asyncgrpo.testing.net import free_port

STARTUP_TIMEOUT_S = float(os.environ.get("ASYNCGRPO_VLLM_STARTUP_TIMEOUT_S", "600"))


def http_json(method: str, url: str, body: dict | None = None,
              headers: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
    """(status, json body) of one HTTP call; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return status, {"raw": raw.decode(errors="replace")}


@dataclass
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server`` process we started."""

    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    bucket: str = ""
    env: dict[str, str] = field(default_factory=dict)
    #: the loopback address it listens on (one per replica where a test needs a host each)
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 300.0) -> tuple[int, dict]:
        """(status, json body) of one HTTP call; HTTP errors are returned, not raised."""
        return http_json(method, self.base_url + path, body, timeout=timeout)

    def completion(self, model: str, prompt, **params) -> tuple[int, dict]:
        """POST /v1/completions; ``prompt`` is a string or a list of token ids."""
        return self.request("POST", "/v1/completions", {"model": model, "prompt": prompt, **params})

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server and the engine processes it spawned (its own process group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # engine core children may outlive the API server process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)


def start_vllm_server(
    model: str | Path,
    *,
    log_path: Path,
    env: dict[str, str] | None = None,
    max_lora_rank: int = 16,
    dtype: str = "float32",
    max_loras: int = 2,
    max_model_len: int = 1024,
    kvcache_gib: int = 1,
    threads: int = 1,
    extra_args: list[str] | None = None,
    bucket: str = "",
    cpus: set[int] | None = None,
    host: str = "127.0.0.1",
) -> VLLMServer:
    """Start vLLM on a free loopback port (of `host`, a loopback address) and wait until
    /health answers.

    ``env`` adds to (and overrides) the environment: pass the resolver's
    ``ASYNCGRPO_ADAPTER_*`` and the S3 credentials there.
    """
    port = free_port(host)
    args = [
        "--model", str(model),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "8",
        "--enable-lora",
        "--max-lora-rank", str(max_lora_rank),
        "--max-loras", str(max_loras),
        "--seed", "0",
        *(extra_args or []),
    ]
    return launch_vllm(args, port=port, model=str(model), log_path=log_path, env=env,
                       kvcache_gib=kvcache_gib, threads=threads, bucket=bucket, cpus=cpus,
                       host=host)


def launch_vllm(args: list[str], *, port: int, model: str, log_path: Path,
                env: dict[str, str] | None = None, kvcache_gib: int = 1, threads: int = 1,
                bucket: str = "", cpus: set[int] | None = None,
                host: str = "127.0.0.1") -> VLLMServer:
    """Start `vllm.entrypoints.openai.api_server ARGS` (which must listen on `host`:`port`)
    from the vLLM venv, with the resolver plugin and CPU settings, and wait for /health."""
    py = vllm_python()
    if py is None:
        raise FileNotFoundError(f"no vLLM venv at {vllm_venv()}; run hack/setup-vllm-venv.sh")
    full_env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_PLUGINS": "asyncgrpo_s3_lora_resolver",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    # The project venv's variables must not leak into the vLLM venv's interpreter.
    for k in ("VIRTUAL_ENV", "PYTHONHOME"):
        full_env.pop(k, None)
    # The vLLM venv is shared by all checkouts and its editable install points at whichever
    # ran the setup last: this checkout's sources go first (the entry point metadata is the
    # same everywhere).
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_ROOT)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True, cwd=str(log_path.parent))
    if cpus:  # before the engine starts its workers, which inherit it
        os.sched_setaffinity(proc.pid, cpus)
    server = VLLMServer(proc=proc, port=port, model=str(model), log_path=log_path,
                        bucket=bucket, env=full_env, host=host)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log_text()[-4000:]
            server.stop()
            raise RuntimeError(f"vLLM exited with {proc.returncode} during startup:\n{tail}")
        if server.healthy():
            return server
        time.sleep(1.0)
    tail = server.log_text()[-4000:]
    server.stop()
    raise TimeoutError(f"vLLM not healthy after {STARTUP_TIMEOUT_S}s:\n{tail}")

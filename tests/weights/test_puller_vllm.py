"""Two real vLLM CPU replicas, each with its own puller, following full weights in a real bucket.

The "trainer" here is a transformers model whose weights change between versions (a few
elements, as a bf16 optimizer step does, and one version where every element changes); its
BucketWeightTransfer publishes them exactly as the trainer does (anchor every 3 versions).
After every version, for each replica: vLLM reports the version (/weight_info), and its
log-probs of a fixed probe equal transformers' on the published weights within 1e-5 (prompt
log-probs, which skip the prefix cache, and a greedy completion of a prompt that was cached
before the swap, which does not). A corrupt delta is refused by both pullers, which keep
serving the previous version and catch up at the next anchor. A replica killed mid-run (a new
pod: fresh vLLM, empty disk) is not ready until it serves the newest version.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from asyncgrpo.adapters.probe import served_prompt_logprobs, trained_prompt_logprobs
from asyncgrpo.controller.vllm import FULL_FINETUNING_ARGS
from asyncgrpo.local.vllm import vllm_python, vllm_venv
from asyncgrpo.testing.net import free_port
from asyncgrpo.testing.vllm import launch_vllm
from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.weights.puller import Puller, VLLMControl
from asyncgrpo.weights.store import WeightStore
from tests.vllm_server import start_together

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOLERANCE = 1e-5
CORRUPT = 3
ANCHOR_EVERY = 3


def start_full_ft_vllm(model: Path, log_path: Path):
    """vLLM as the operator starts it for full fine-tuning (no LoRA, dev routes guarded)."""
    port = free_port()
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--seed", "0",
            *FULL_FINETUNING_ARGS]
    return launch_vllm(args, port=port, model=str(model), log_path=log_path,
                       env={"VLLM_PLUGINS": ""})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("full") / "tiny-qwen3-dense",
                                kind="dense", seed=0)


def _probe_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from asyncgrpo.adapters.probe import probe_token_ids

    return probe_token_ids(AutoTokenizer.from_pretrained(model_dir))


def _greedy_next(model, ids: list[int]) -> dict[int, float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return dict(enumerate(torch.log_softmax(logits, -1).tolist()))


def _served_next(server, name: str, ids: list[int]) -> float:
    """Log-prob of the greedy next token, generated (so through the prefix cache)."""
    status, doc = server.completion(name, ids, max_tokens=1, temperature=0.0, logprobs=1)
    assert status == 200, doc
    return float(doc["choices"][0]["logprobs"]["token_logprobs"][0])


def test_two_replicas_follow_anchors_and_deltas(tiny, s3_server, bucket, s3_env, tmp_path):
    if vllm_python() is None:
        pytest.skip(f"vLLM venv missing at {vllm_venv()}")
    from transformers import AutoModelForCausalLM

    run = f"full-{uuid.uuid4().hex[:6]}"
    store = WeightStore(bucket, run=run, prefix="p", endpoint_url=s3_server.endpoint,
                        attempts=2, backoff_s=0.05)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.eval()
    ids = _probe_ids(tiny)
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=ANCHOR_EVERY,
                               retention=50, fault_corrupt_versions={CORRUPT})
    pub.init_weight_transfer()

    servers = start_together(*(lambda i=i: start_full_ft_vllm(tiny, tmp_path / f"vllm-{i}.log")
                               for i in range(2)))
    pullers = [Puller(store, VLLMControl(s.base_url), tmp_path / f"pod-{i}", poll_s=0.1)
               for i, s in enumerate(servers)]
    names = [VLLMControl(s.base_url).served_model() for s in servers]
    gen = torch.Generator().manual_seed(0)
    trained_by_version: dict[int, list[float]] = {}
    alive = 2
    try:
        for version in range(1, 8):
            with torch.no_grad():
                params = dict(model.named_parameters())
                if version == 5:  # a dense step: every element moves
                    for p in params.values():
                        p.add_(0.01 * torch.randn(p.shape, generator=gen))
                else:  # a sparse step, as most bf16 elements do not change
                    for p in params.values():
                        flat = p.view(-1)
                        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),),
                                            generator=gen)
                        flat[idx] += 0.05 * torch.randn(idx.numel(), generator=gen)
            trained = trained_prompt_logprobs(model, ids)
            trained_by_version[version] = trained
            pub.pending_extra = {"probe": {"token_ids": ids, "logprobs": trained}}
            # cache the probe's prefix under the previous weights on every replica
            for server, name in zip(servers[:alive], names):
                _served_next(server, name, ids)
            pub.send_weights(model.named_parameters())
            for puller in pullers[:alive]:
                puller.round()
            expect = version - 1 if version == CORRUPT else version
            for server, puller, name in zip(servers[:alive], pullers, names):
                st = puller.status()
                assert st["served_version"] == expect, st
                assert VLLMControl(server.base_url).weight_version() == str(expect)
                served = served_prompt_logprobs(server.base_url, name, ids)
                diff = max(abs(a - b) for a, b in zip(served, trained_by_version[expect]))
                assert diff <= TOLERANCE, (version, diff)
                if version != CORRUPT:
                    assert st["history"][-1]["probe_max_diff"] <= TOLERANCE, st["history"][-1]
                    # a prompt cached before the swap: served from fresh KV, not stale
                    lp = _served_next(server, name, ids)
                    want = max(_greedy_next(model, ids).values())
                    assert abs(lp - want) <= TOLERANCE, (version, lp, want)
            if version == CORRUPT:
                assert all(str(CORRUPT) in p.status()["refused"] for p in pullers[:alive])
                # the refused version is served by nobody; the model moves on
            if version == 5:
                # a replica dies (pod deleted: fresh vLLM, empty disk) while v5..v7 go on
                servers[1].stop()
                alive = 1
        # ... it is replaced after the run moved past it
        servers[1] = start_full_ft_vllm(tiny, tmp_path / "vllm-1b.log")
        fresh = Puller(store, VLLMControl(servers[1].base_url), tmp_path / "pod-1b", poll_s=0.1)
        assert fresh.status()["ready"] is False
        fresh.round()
        st = fresh.status()
        assert st["ready"] is True and st["served_version"] == 7, st
        served = served_prompt_logprobs(servers[1].base_url, names[1], ids)
        assert max(abs(a - b) for a, b in zip(served, trained_by_version[7])) <= TOLERANCE
        # it came back from the newest anchor (v7) without touching the corrupt chain
        assert (tmp_path / "pod-1b" / "current" / "STATE.json").read_text() == json.dumps(
            {"version": 7})
    finally:
        for s in servers:
            s.stop()


def test_a_puller_resumes_the_replica_its_predecessor_left_paused(vllm_server, store, tmp_path):
    """A puller killed between /pause and /resume froze every request to its replica; the
    next one resumes it before catching up (here nothing is published: no swap follows)."""
    import threading

    from asyncgrpo.testing.waiting import wait_for

    def paused() -> bool:
        status, doc = vllm_server.request("GET", "/is_paused")
        assert status == 200, doc
        return bool(doc["is_paused"])

    status, doc = vllm_server.request("POST", "/pause?mode=keep")
    assert status == 200 and paused(), doc
    puller = Puller(store, VLLMControl(vllm_server.base_url), tmp_path / "pod", poll_s=0.2)
    thread = threading.Thread(target=puller.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: not paused(), timeout=60, what="the replica resumed")
        # and it generates again
        status, doc = vllm_server.completion(vllm_server.model, [1, 2, 3], max_tokens=2)
        assert status == 200, doc
        wait_for(lambda: puller.ready, timeout=30, what="the puller ready (nothing published)")
    finally:
        puller.stop()
        thread.join(timeout=30)
        vllm_server.request("POST", "/resume")  # the session's server: leave it running

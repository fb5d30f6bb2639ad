"""The real vLLM CPU server serves adapters straight from the bucket.

No `/v1/load_lora_adapter` call is made anywhere here: naming `<run>/policy-v{N}` in a
request is all it takes. The served model is compared with a local peft forward of the
same adapter on the same base checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import uuid

import pytest

from asyncgrpo.adapters import probe
from asyncgrpo.adapters.store import AdapterStore

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: fp32 on both sides; measured differences are ~1e-6 (different kernels, same math).
LOGPROB_TOLERANCE = 1e-3
PROMPT = "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def run_store(vllm_server, s3_server, s3_env):
    """A store for a fresh run in the shared server's bucket (unique names per test)."""
    return AdapterStore(vllm_server.bucket, run=f"t-{uuid.uuid4().hex[:8]}",
                        endpoint_url=s3_server.endpoint, attempts=2, backoff_s=0.1)


def _local_model(vllm_server, adapter_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(vllm_server.model, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out[len(ids):]


def _served_greedy(vllm_server, model: str, ids: list[int], n: int) -> list[int]:
    status, body = vllm_server.completion(model, ids, max_tokens=n, temperature=0.0,
                                          ignore_eos=True, return_token_ids=True)
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


def test_versions_resolved_from_bucket_match_peft(vllm_server, run_store, adapters):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_server.model)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    probe_ids = probe.probe_token_ids(tok)
    for v in (1, 2):
        run_store.publish(adapters[v], v, step=10 * v)

    served_lp = {}
    for v in (1, 2):
        name = f"{run_store.run}/policy-v{v}"
        local = _local_model(vllm_server, adapters[v])
        assert _served_greedy(vllm_server, name, ids, 12) == _greedy(local, ids, 12)
        served_lp[v] = probe.served_prompt_logprobs(vllm_server.base_url, name, probe_ids)
        diff = probe.compare(served_lp[v], probe.trained_prompt_logprobs(local, probe_ids))
        assert diff.within(LOGPROB_TOLERANCE), diff

    # The two versions really are different policies, and both are now listed as served.
    assert probe.compare(served_lp[1], served_lp[2]).max_abs_diff > 0.05
    _, models = vllm_server.request("GET", "/v1/models")
    names = {m["id"] for m in models["data"]}
    assert {f"{run_store.run}/policy-v1", f"{run_store.run}/policy-v2"} <= names


def test_concurrent_first_requests_download_once(vllm_server, run_store, adapters):
    run_store.publish(adapters[1], 1, step=1)
    name = f"{run_store.run}/policy-v1"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda _: vllm_server.completion(name, [1, 2, 3], max_tokens=2, temperature=0.0),
            range(4)))
    assert [status for status, _ in results] == [200] * 4
    assert vllm_server.log_text().count(f"LoRA '{name}' resolved") == 1


def test_corrupt_and_partial_versions_refused_previous_keeps_serving(
        vllm_server, run_store, adapters, s3_server):
    run_store.publish(adapters[1], 1, step=1)
    good = f"{run_store.run}/policy-v1"
    before = _served_greedy(vllm_server, good, [5, 6, 7], 6)

    # v2: complete manifest, weights with one flipped byte (same size).
    run_store.publish(adapters[2], 2, step=2)
    key = run_store.version_prefix(2) + "adapter_model.safetensors"
    data = bytearray((adapters[2] / "adapter_model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    s3_server.client().put_object(Bucket=run_store.bucket, Key=key, Body=bytes(data))
    # v3: files without a manifest (a publish in flight, or one that died).
    s3_server.client().upload_file(str(adapters[2] / "adapter_model.safetensors"),
                                   run_store.bucket,
                                   run_store.version_prefix(3) + "adapter_model.safetensors")

    for v, reason in ((2, "refused: corrupt version"), (3, "no manifest.json")):
        name = f"{run_store.run}/policy-v{v}"
        status, body = vllm_server.completion(name, [5, 6, 7], max_tokens=2)
        assert status == 404, body
        message = body["error"]["message"]
        assert name in message
        for secret in (s3_server.endpoint, f":{s3_server.port}", s3_server.access_key,
                       s3_server.secret_key):
            assert secret not in message
        assert f"LoRA '{name}' {reason}" in vllm_server.log_text() or reason in vllm_server.log_text()

    # The server is unharmed and still serves the previous version, unchanged.
    assert vllm_server.healthy()
    assert _served_greedy(vllm_server, good, [5, 6, 7], 6) == before

    # Once the trainer publishes v3 properly it is served (a refusal is not cached).
    run_store.publish(adapters[2], 3, step=3)
    status, body = vllm_server.completion(f"{run_store.run}/policy-v3", [5, 6, 7], max_tokens=2)
    assert status == 200, body


def test_chat_template_served_with_adapter(vllm_server, run_store, adapters):
    """vLLM (its own older transformers) reads the tiny tokenizer and TRL's Qwen3 template."""
    run_store.publish(adapters[1], 1, step=1)
    status, body = vllm_server.request("POST", "/v1/chat/completions", {
        "model": f"{run_store.run}/policy-v1",
        "messages": [{"role": "user", "content": "What is 7 * 8?"}],
        "max_tokens": 4, "temperature": 0.0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 5

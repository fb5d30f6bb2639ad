"""Served policy == trained policy: compare vLLM's log-probs of a fixed probe with ours.

Why: the adapter crosses a bucket, a manifest, a resolver, vLLM's LoRA layers (packed
qkv/gate-up projections, punica kernels) and possibly another dtype. A bug anywhere there
would let the rollouts come from a policy other than the one being trained, which GRPO's
importance ratios silently absorb. Teacher-forced log-probs of one fixed token sequence
are deterministic on both sides, so their difference is a clean health signal.

The trainer calls :func:`trained_prompt_logprobs` on its peft model right after publishing
version N and :func:`served_prompt_logprobs` with ``policy-v{N}``; :func:`compare` gives the
numbers to export (``asyncgrpo_trainer_served_logprob_diff``) and to raise to the run status.
Only the standard library is used for HTTP so the trainer needs nothing new.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

#: A fixed probe: plain text, digits and chat markup, so most projections see varied input.
DEFAULT_PROBE = (
    "<|im_start|>user\nWhat is 12 + 30? Think step by step.<|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n"
)


class ProbeError(RuntimeError):
    """vLLM did not answer the probe (unreachable, adapter not resolvable, bad response);
    `status` is vLLM's HTTP status when it answered at all."""

    status: int | None = None


def probe_token_ids(tokenizer, text: str = DEFAULT_PROBE) -> list[int]:
    """Token ids of the probe, tokenized once on the trainer side and sent as ids, so both
    sides score exactly the same sequence."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def served_prompt_logprobs(
    base_url: str,
    model: str,
    token_ids: Sequence[int],
    *,
    timeout_s: float = 120.0,
    api_key: str | None = None,
) -> list[float]:
    """log p(token[i] | token[:i]) for i >= 1 as served by vLLM under ``model`` (e.g.
    ``policy-v3``), from the OpenAI-compatible ``/v1/completions`` with ``prompt_logprobs``.

    Naming the adapter makes vLLM resolve it from the bucket if it has not yet.
    """
    if len(token_ids) < 2:
        raise ValueError("the probe needs at least two tokens")
    body = {
        "model": model,
        "prompt": [int(t) for t in token_ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions",
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail)
        except (json.JSONDecodeError, AttributeError):
            pass
        err = ProbeError(f"vLLM answered {e.code} for {model!r}: {detail}")
        err.status = e.code
        raise err from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise ProbeError(f"vLLM unreachable for the probe of {model!r}: {type(e).__name__}") from None
    try:
        entries = doc["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ProbeError(f"vLLM response for {model!r} has no prompt_logprobs") from None
    if len(entries) != len(token_ids):
        raise ProbeError(f"vLLM returned {len(entries)} prompt logprobs for {len(token_ids)} tokens")
    out = []
    for i in range(1, len(token_ids)):
        entry = entries[i] or {}
        hit = entry.get(str(int(token_ids[i])))
        if hit is None:
            raise ProbeError(f"vLLM prompt logprobs miss token {token_ids[i]} at position {i}")
        out.append(float(hit["logprob"] if isinstance(hit, dict) else hit))
    return out


def trained_prompt_logprobs(model, token_ids: Sequence[int]) -> list[float]:
    """The same quantity from a local (peft) causal LM, in float32, with no dropout."""
    return trained_probe(model, token_ids)[0]


def trained_probe(model, token_ids: Sequence[int]) -> tuple[list[float], float]:
    """log p(token[i] | token[:i]) for i >= 1, and the log-prob of the greedy token after the
    whole probe, from one forward (every FSDP2 rank takes part).

    The first is what vLLM serves for prompt log-probs, which skip the prefix cache; the second
    is what it serves when generating after a prompt it has cached (full fine-tuning's puller
    uses it: a replica that kept KV from the previous weights shows up there).

    accelerate wraps `forward` in autocast when the Trainer runs mixed precision (TRL's
    default bf16=True, CPU included): measured, that alone moved the probe by 2.3e-3 on the
    tiny model. vLLM serves the weights in their own dtype, so they are scored unwrapped.

    The model is called, not its `forward`: under FSDP2 the root module's forward hook is what
    gathers and groups the shards (calling `forward` directly left every sharded submodule a
    root of its own: "FSDP requires a single root module", seen with two ranks and expert
    parallel), so accelerate's wrapper is swapped out for the call instead.
    """
    import torch

    original = getattr(model, "_original_forward", None)
    wrapped = model.__dict__.get("forward")
    was_training = model.training
    model.eval()
    try:
        if original is not None:
            model.forward = original
        with torch.no_grad():
            ids = torch.tensor([list(token_ids)], dtype=torch.long,
                               device=next(model.parameters()).device)
            with torch.autocast(ids.device.type, enabled=False):
                logits = model(input_ids=ids).logits
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            picked = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            return [float(x) for x in picked.cpu()], float(logp[-1].max())
    finally:
        if original is not None:
            if wrapped is not None:
                model.forward = wrapped
            else:
                del model.forward
        if was_training:
            model.train()


@dataclass(frozen=True)
class ProbeComparison:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int

    def within(self, tolerance: float) -> bool:
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= tolerance


def compare(served: Sequence[float], trained: Sequence[float]) -> ProbeComparison:
    """Per-token absolute log-prob differences (served vs trained), max and mean."""
    if len(served) != len(trained) or not served:
        raise ValueError(f"length mismatch: served {len(served)} vs trained {len(trained)}")
    diffs = [abs(a - b) for a, b in zip(served, trained)]
    return ProbeComparison(max(diffs), sum(diffs) / len(diffs), len(diffs))

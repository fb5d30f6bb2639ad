"""The seam between our tree packing and TRL 1.16.0's `AsyncGRPOTrainer` (`trl.experimental.async_grpo`).

TRL packs with `packing.TreeRow` and attends with `tree_fa3`, a FlashAttention-3 kernel it
downloads from a hub at run time (Hopper only; no offline cluster or CPU can run it). This
module swaps three pieces and keeps the rest of TRL as is:

| TRL 1.16.0 piece                                   | replaced by                                   |
|----------------------------------------------------|-----------------------------------------------|
| `TokenBudgetBatcher` / `FixedCountBatcher` (plan)  | `TreeBatcher` (`budget.plan`: LPT, no drops)  |
| `DataCollatorForRollout` + `TreeRow.pack` (pack)   | `TreeCollator` (forest rows, explicit gather) |
| `tree_fa3` attention + `shift_labels` scoring      | `asyncgrpo_tree` attention + per-term head    |

TRL's GRPO loss, its metrics and their collectives are kept: `tree_compute_loss` feeds TRL's
own `AsyncGRPOTrainer.compute_loss` per-term log-probs in the shape it indexes (token_index =
0..M-1), so the loss, clipping statistics and step accounting are TRL's code, unchanged.

How the trainer runtime uses it (one of):

    from asyncgrpo.trainer.tree import trl_integration
    trl_integration.install()           # process-wide, before building the trainer

    from asyncgrpo.trainer.tree.trl_integration import TreePackingMixin
    class Trainer(TreePackingMixin, AsyncGRPOTrainer): ...

or, piece by piece from its own subclass:

    install_tree_packing(self.model, temperature=self.temperature)   # after super().__init__()
    batcher = TreeBatcher(dataset, num_processes, token_budget, samples_per_plan)
    collator = TreeCollator(pad_token_id, num_processes, metrics=..., groups_trained=...)
    loss = tree_compute_loss(self, model, inputs)                     # in compute_loss

The pin matters: `tree_compute_loss` relies on which inputs TRL 1.16.0's `compute_loss`
reads; `check_trl_version()` fails fast on any other version.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import install_tree_attention
from .budget import MicroBatch, plan
from .layout import TreeLayout
from .loss import add_tree_lm_head
from .metrics import PackingMetrics
from .rollout import Rollout

TRL_VERSION = "1.16.0"

#: Batch fields `TreeCollator` emits; a trainer listing signature columns must keep them.
BATCH_FIELDS = (
    "input_ids", "attention_mask", "position_ids", "tree_leave", "tree_pred_pos", "tree_targets",
    "old_log_probs", "advantages", "segment_id", "global_n_tokens", "global_n_forward_tokens", "mean_seq_len",
)


#: TRL's own methods, kept by `install()` before it replaces them on the class.
_UPSTREAM: dict[str, Any] = {}


def _trl_compute_loss():
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    return _UPSTREAM.get("compute_loss", AsyncGRPOTrainer.compute_loss)


def check_trl_version() -> None:
    import trl

    if trl.__version__ != TRL_VERSION:
        raise RuntimeError(
            f"asyncgrpo's tree packing is pinned to trl=={TRL_VERSION} (experimental API); found {trl.__version__}"
        )


def install_tree_packing(model, temperature: float = 1.0) -> None:
    """Make `model` (plain or peft-wrapped; before FSDP wrapping) train on packed tree rows.

    Adds the per-term LM head to the underlying causal LM (wrapping TRL's fused head, which
    stays in place for anything called without `tree_pred_pos`) and switches attention to
    `asyncgrpo_tree`, so TRL's hub kernel is never fetched.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_tree_lm_head(base, temperature=temperature)
    install_tree_attention(model)


def rollout_from_sample(sample: dict[str, Any]) -> Rollout:
    """A TRL rollout-queue sample (what `RolloutQueueDataset` yields) as our `Rollout`."""
    return Rollout.make(
        group_id=sample["group_id"],
        input_ids=sample["input_ids"],
        completion_mask=sample["completion_mask"],
        advantage=float(sample["advantage"]),
        old_log_probs=sample.get("old_log_probs"),
        policy_version=sample.get("model_version"),
    )


@dataclass
class TreeMicroBatch:
    """A planned micro-batch plus the TRL samples of each row (their reward metrics ride along)."""

    batch: MicroBatch
    samples: list[list[dict[str, Any]]]


class TreeBatcher(torch.utils.data.IterableDataset):
    """Replaces TRL's batchers: buffers `samples_per_plan` samples, then plans them as a whole.

    Planning a buffer rather than placing samples one by one lets whole groups stay together
    and lets LPT balance the ranks; a rollout over the budget raises (`RolloutError`) instead
    of being dropped with a warning as TRL does. Set `samples_per_plan` to one optimizer
    step's samples (e.g. groups per step x num_generations).
    """

    def __init__(self, dataset: Iterable[dict[str, Any]], num_processes: int, token_budget: int,
                 samples_per_plan: int):
        self.dataset = dataset
        self.num_processes = num_processes
        self.token_budget = token_budget
        self.samples_per_plan = max(samples_per_plan, num_processes)

    def __iter__(self):
        buffer: list[dict[str, Any]] = []
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) >= self.samples_per_plan:
                yield from self.plan(buffer)
                buffer = []
        if buffer:  # a finite source ends: plan what is left rather than drop it
            yield from self.plan(buffer)

    def plan(self, samples: list[dict[str, Any]]) -> list[TreeMicroBatch]:
        rollouts = [rollout_from_sample(s) for s in samples]
        return [
            TreeMicroBatch(mb, [[samples[i] for i in sources] for sources in mb.sources])
            for mb in plan(rollouts, self.num_processes, self.token_budget)
        ]


def _pad(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(max(t.numel() for t in tensors), 1)
    out = torch.full((len(tensors), width), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.numel()] = t
    return out


@dataclass
class TreeCollator:
    """Replaces `DataCollatorForRollout`: one padded [num_processes, T] tensor per field, row i for rank i.

    Padding exists only so the dispatcher can scatter a rectangle; `tree_compute_loss`
    strips it. A filler row (a rank with nothing to train, see `budget`) gets one inert
    term (advantage 0) so that TRL's loss runs the same collectives on every rank.
    """

    pad_token_id: int
    num_processes: int = 1
    metrics: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    groups_trained: set = field(default_factory=set)
    token_budget: int = 0

    def __call__(self, examples: list[TreeMicroBatch]) -> dict[str, torch.Tensor]:
        (micro,) = examples
        rows = micro.batch.rows
        if len(rows) != self.num_processes:
            raise ValueError(f"micro-batch has {len(rows)} rows for {self.num_processes} ranks")
        terms = []
        for row in rows:
            if row.trained:
                terms.append((row.pred_pos, row.target, row.old_log_probs, row.advantage, row.rollout))
            else:
                terms.append((torch.zeros(1, dtype=torch.long), row.input_ids[:1], torch.zeros(1),
                              torch.zeros(1), torch.zeros(1, dtype=torch.long)))
        batch = {
            "input_ids": _pad([r.input_ids for r in rows], self.pad_token_id),
            "attention_mask": _pad([torch.ones_like(r.input_ids) for r in rows], 0),
            "position_ids": _pad([r.position_ids for r in rows], 0),
            "tree_leave": _pad([r.leave for r in rows], -1),
            "tree_pred_pos": _pad([t[0] for t in terms], -1),
            "tree_targets": _pad([t[1] for t in terms], 0),
            "old_log_probs": _pad([t[2] for t in terms], 0.0),
            "advantages": _pad([t[3] for t in terms], 0.0),
            "segment_id": _pad([t[4] for t in terms], 0),
        }
        packing = PackingMetrics.of([micro.batch])
        samples = [s for row in micro.samples for s in row]
        self.groups_trained.update(s["group_id"] for s in samples)
        # Repeated per rank so the dispatcher's dim-0 split hands every rank the batch-wide counts.
        n = self.num_processes
        batch["global_n_tokens"] = torch.full((n,), float(packing.trained_tokens))
        batch["global_n_forward_tokens"] = torch.full((n,), float(packing.forwarded_tokens))
        batch["mean_seq_len"] = torch.full((n,), packing.forwarded_tokens / max(len(samples), 1))
        self._log(packing, samples)
        return batch

    def _log(self, packing: PackingMetrics, samples: list[dict[str, Any]]) -> None:
        """TRL's sample and packing keys (so its dashboards keep working) plus ours under `tree/`."""
        m = self.metrics
        if samples:
            lengths = [len(s["input_ids"]) for s in samples]
            m["sample/forwarded_tokens_mean"].append(sum(lengths) / len(lengths))
            m["sample/forwarded_tokens_max"].append(float(max(lengths)))
        m["batch/packing_ratio"].append((packing.raw_tokens, packing.forwarded_tokens))
        m["batch/row_tokens_max"].append(float(max(packing.rank_tokens)))
        m["batch/row_imbalance"].append(packing.rank_imbalance)
        if self.token_budget:
            m["batch/row_fill_frac"].append((packing.forwarded_tokens, self.token_budget * self.num_processes))
        for key, value in packing.as_scalars().items():
            m[key].append(value)
        keys = dict.fromkeys(k for s in samples for k in s.get("metrics", {}))
        for key in keys:
            values = [s["metrics"][key] for s in samples if key in s.get("metrics", {})]
            valid = [v for v in values if not math.isnan(v)]
            m[key].append(sum(valid) / len(valid) if valid else float("nan"))


def tree_compute_loss(trainer, model, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                      num_items_in_batch=None):
    """`compute_loss` for a `TreeCollator` batch (this rank's row), through TRL's own loss code.

    TRL's `compute_loss` calls the model once and reads `outputs.log_probs.flatten()[token_index]`;
    here the model call is our packed forward, whose log-probs are already one per loss term,
    and `token_index` is 0..M-1. Everything after the forward is TRL's code.
    """
    keep = inputs["attention_mask"][0].bool()
    input_ids = inputs["input_ids"][0][keep]
    position_ids = inputs["position_ids"][0][keep]
    leave = inputs["tree_leave"][0][keep]
    selected = inputs["tree_pred_pos"][0] >= 0
    pred_pos = inputs["tree_pred_pos"][0][selected]
    targets = inputs["tree_targets"][0][selected]
    layout = TreeLayout(position_ids, leave)
    m = int(pred_pos.numel())

    def packed_forward(**kwargs):
        extra = {"output_router_logits": True} if kwargs.get("output_router_logits") else {}
        return model(input_ids=input_ids[None], position_ids=position_ids[None], tree_layout=layout,
                     tree_pred_pos=pred_pos, tree_targets=targets, **extra)

    device = input_ids.device
    trl_inputs = {
        "attention_mask": torch.ones(1, m, dtype=torch.long, device=device),
        "input_ids": torch.zeros(1, m, dtype=torch.long, device=device),
        "position_ids": torch.zeros(1, m, dtype=torch.long, device=device),
        "shift_labels": torch.full((1, m), -100, dtype=torch.long, device=device),
        "token_index": torch.arange(m, device=device)[None],
        "old_log_probs": inputs["old_log_probs"][:, selected],
        "advantages": inputs["advantages"][:, selected],
        "segment_id": inputs["segment_id"][:, selected],
        "tree_kv_index": torch.full((1, 1), -1, dtype=torch.long, device=device),
        "tree_cu_seqlens_q": torch.full((1, 1), -1, dtype=torch.int32, device=device),
        "tree_cu_seqlens_k": torch.full((1, 1), -1, dtype=torch.int32, device=device),
        "tree_max_seqlens": torch.zeros(1, 2, dtype=torch.long, device=device),
        "global_n_tokens": inputs["global_n_tokens"],
        "global_n_forward_tokens": inputs["global_n_forward_tokens"],
        "mean_seq_len": inputs["mean_seq_len"],
    }
    return _trl_compute_loss()(trainer, packed_forward, trl_inputs, return_outputs, num_items_in_batch)


def install() -> None:
    """Process-wide: every `AsyncGRPOTrainer` (and subclass) built afterwards trains on tree rows.

    Puts `TreePackingMixin`'s three methods on TRL's class and wraps its `__init__` to call
    `install_tree_packing` on the finished model. A subclass that overrides one of these
    methods keeps its own. Idempotent.
    """
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    check_trl_version()
    if getattr(AsyncGRPOTrainer, "_asyncgrpo_tree_installed", False):
        return
    upstream_init = AsyncGRPOTrainer.__init__

    def __init__(self, *args, **kwargs):
        upstream_init(self, *args, **kwargs)
        install_tree_packing(self.model, temperature=self.temperature)

    __init__.__wrapped__ = upstream_init
    AsyncGRPOTrainer.__init__ = __init__
    for name in ("get_train_dataloader", "compute_loss", "_set_signature_columns_if_needed"):
        _UPSTREAM[name] = getattr(AsyncGRPOTrainer, name)
        setattr(AsyncGRPOTrainer, name, TreePackingMixin.__dict__[name])
    AsyncGRPOTrainer.samples_per_plan = None
    AsyncGRPOTrainer._asyncgrpo_tree_installed = True


def uninstall() -> None:
    """Undo `install()` (for tests that share a process with code expecting TRL as shipped)."""
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    if not AsyncGRPOTrainer.__dict__.get("_asyncgrpo_tree_installed", False):
        return
    AsyncGRPOTrainer.__init__ = AsyncGRPOTrainer.__init__.__wrapped__
    for name, method in _UPSTREAM.items():
        setattr(AsyncGRPOTrainer, name, method)
    _UPSTREAM.clear()
    del AsyncGRPOTrainer.samples_per_plan
    del AsyncGRPOTrainer._asyncgrpo_tree_installed


class TreePackingMixin:
    """Mix in before `AsyncGRPOTrainer` to train on tree-packed rows with our attention.

    Overrides exactly the three places where TRL 1.16.0 plans, packs and scores; the rollout
    worker, weight sync, optimizer and logging are TRL's. `samples_per_plan` defaults to one
    optimizer step of samples when the subclass does not set it.
    """

    samples_per_plan: int | None = None

    def __init__(self, *args, **kwargs):
        check_trl_version()
        super().__init__(*args, **kwargs)
        install_tree_packing(self.model, temperature=self.temperature)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(BATCH_FIELDS)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return tree_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def get_train_dataloader(self):
        """TRL 1.16.0's `get_train_dataloader` with `TreeBatcher` and `TreeCollator` in place of its own."""
        from torch.utils.data import DataLoader
        from trl.experimental.async_grpo.async_grpo_trainer import (
            RolloutQueueDataset,
            _EmptyIterableDataset,
        )

        num_processes = self.accelerator.num_processes
        if self.accelerator.is_main_process:
            dataset = RolloutQueueDataset(
                rollout_queue=self.rollout_queue,
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = dataset
            if not self.args.token_budget or self.args.token_budget <= 0:
                self.vllm_client.wait_for_server_ready()
                self.args.token_budget = self.vllm_client.get_max_model_len()
            per_step = (self.args.per_device_train_batch_size * num_processes
                        * self.args.gradient_accumulation_steps)
            dataset = TreeBatcher(dataset, num_processes, self.args.token_budget,
                                  self.samples_per_plan or per_step)
        else:
            dataset = _EmptyIterableDataset()
        collator = TreeCollator(
            self.processing_class.pad_token_id,
            num_processes,
            metrics=self._metrics["train"],
            groups_trained=self._trained_groups,
            token_budget=max(self.args.token_budget or 0, 0),
        )
        return self.accelerator.prepare(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=0))

"""The seam between our tree packing and TRL 1.16.0's `AsyncGRPOTrainer` (`trl.experimental.async_grpo`).

TRL packs with `packing.TreeRow` and attends with `tree_fa3`, a FlashAttention-3 kernel it
downloads from a hub at run time (Hopper only; no offline cluster or CPU can run it). This
module swaps these pieces and keeps the rest of TRL as is:

| TRL 1.16.0 piece                                   | replaced by                                    |
|----------------------------------------------------|------------------------------------------------|
| `TokenBudgetBatcher` / `FixedCountBatcher` (plan)  | `TreeBatcher` (`budget.plan`: LPT, no drops)   |
| `DataCollatorForRollout` + `TreeRow.pack` (pack)   | `TreeCollator` (forest rows, explicit gather)  |
| `tree_fa3` attention + `shift_labels` scoring      | `asyncgrpo_tree` attention + per-term head     |
| `compute_loss` (per-micro-batch normalisation)     | `tree_compute_loss` (`objective`: step mean)   |
| transformers' `get_batch_samples` (step prefetch)  | the same, plus the step's totals stamped in    |

`tree_compute_loss` keeps TRL's formulas, metric keys, collectives and step accounting; it
changes the normaliser (the step's trained tokens, not each micro-batch's / GA), keeps a
filler row's inert term out of loss and metrics, and logs mean metrics as (sum, count)
pairs (see `objective`). On a single even micro-batch it equals TRL's `compute_loss`
exactly (tests/tree/test_trl_integration.py).

How the trainer runtime uses it (`asyncgrpo.trainer.grpo.S3AdapterGRPOTrainer`):

    from asyncgrpo.trainer.tree.trl_integration import TreePackingMixin
    class Trainer(TreePackingMixin, AsyncGRPOTrainer): ...

The pin matters: the mixin mirrors TRL 1.16.0's `get_train_dataloader` and the trainer
attributes its `compute_loss` reads; `check_trl_version()` fails fast on any other version.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.trainer.patches import TRL_VERSION

from . import objective
from .attention import install_tree_attention
from .budget import MicroBatch, plan, plan_fixed_count
from .layout import TreeLayout
from .loss import add_tree_lm_head
from .metrics import PackingMetrics
from .rollout import Rollout, RolloutError

#: Batch fields `TreeCollator` emits; a trainer listing signature columns must keep them.
BATCH_FIELDS = (
    "input_ids", "attention_mask", "position_ids", "tree_leave", "tree_pred_pos", "tree_targets",
    "old_log_probs", "advantages", "segment_id", "tree_valid", "tree_filler", "tree_real_rows",
    "global_n_tokens", "global_n_forward_tokens", "mean_seq_len",
)


def _trl_compute_loss():
    """TRL's own `compute_loss` (the parity test compares with it)."""
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    return AsyncGRPOTrainer.compute_loss


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


class LastTaken:
    """The rollout queue, remembering the sample last taken from it.

    TRL 1.16's `RolloutQueueDataset` yields (or drops as stale) each sample right after taking
    it, and the dict it yields leaves out the sample's policy version: paired with
    `WithPolicyVersions`, this puts it back.
    """

    def __init__(self, queue):
        self.queue = queue
        self.last = None

    def get(self, *args, **kwargs):
        self.last = self.queue.get(*args, **kwargs)
        return self.last

    def __getattr__(self, name):
        return getattr(self.queue, name)


@dataclass
class WithPolicyVersions:
    """The dataset's sample dicts with `model_version`: the version that generated each;
    `counts` tallies them (samples trained, by version)."""

    samples: Iterable[dict[str, Any]]
    taken: LastTaken
    counts: Counter = field(default_factory=Counter)

    def __iter__(self):
        for sample in self.samples:
            version = int(self.taken.last.model_version)
            self.counts[version] += 1
            yield {**sample, "model_version": version}


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

    `token_budget <= 0` means what it means in TRL (`FixedCountBatcher`): no budget, a fixed
    `samples_per_micro_batch` samples per micro-batch (TRL: per_device_train_batch_size x
    ranks), balanced across the ranks (`budget.plan_fixed_count`).
    """

    def __init__(self, dataset: Iterable[dict[str, Any]], num_processes: int, token_budget: int,
                 samples_per_plan: int, samples_per_micro_batch: int | None = None):
        self.dataset = dataset
        self.num_processes = num_processes
        self.token_budget = token_budget
        self.samples_per_plan = max(samples_per_plan, num_processes)
        self.samples_per_micro_batch = samples_per_micro_batch
        if token_budget <= 0 and not samples_per_micro_batch:
            raise RolloutError("token_budget <= 0 packs a fixed count of samples per micro-batch (as TRL's "
                             "FixedCountBatcher): pass samples_per_micro_batch, or a positive token_budget")

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
            for mb in self._plan(rollouts)
        ]

    def _plan(self, rollouts: list[Rollout]) -> list[MicroBatch]:
        if self.token_budget > 0:
            return plan(rollouts, self.num_processes, self.token_budget)
        return plan_fixed_count(rollouts, self.num_processes, self.samples_per_micro_batch)


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
                terms.append((row.pred_pos, row.target, row.old_log_probs, row.advantage, row.rollout,
                              torch.ones(row.trained)))
            else:  # one inert term (valid 0): same forward/backward/collectives, weighs nothing
                terms.append((torch.zeros(1, dtype=torch.long), row.input_ids[:1], torch.zeros(1),
                              torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1)))
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
            "tree_valid": _pad([t[5] for t in terms], 0.0),
            "tree_filler": torch.tensor([float(r.filler) for r in rows]),
        }
        packing = PackingMetrics.of([micro.batch])
        samples = [s for row in micro.samples for s in row]
        self.groups_trained.update(s["group_id"] for s in samples)
        # Repeated per rank so the dispatcher's dim-0 split hands every rank the batch-wide counts.
        n = self.num_processes
        batch["global_n_tokens"] = torch.full((n,), float(packing.trained_tokens))
        batch["tree_real_rows"] = torch.full((n,), float(n - packing.filler_rows))
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


@dataclass
class RowTerms:
    """One rank's packed forward, with the per-term fields of its batch row (padding stripped)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    aux_loss: torch.Tensor | None
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    segment_id: torch.Tensor
    valid: torch.Tensor  # 1 for a trained term, 0 for a filler row's inert term
    filler: bool


def forward_row(model, inputs: dict[str, torch.Tensor], router_logits: bool = False) -> RowTerms:
    """Forward this rank's row of a `TreeCollator` batch with tree attention and the per-term head."""
    keep = inputs["attention_mask"][0].bool()
    input_ids = inputs["input_ids"][0][keep]
    position_ids = inputs["position_ids"][0][keep]
    selected = inputs["tree_pred_pos"][0] >= 0
    extra = {"output_router_logits": True} if router_logits else {}
    out = model(input_ids=input_ids[None], position_ids=position_ids[None],
                tree_layout=TreeLayout(position_ids, inputs["tree_leave"][0][keep]),
                tree_pred_pos=inputs["tree_pred_pos"][0][selected], tree_targets=inputs["tree_targets"][0][selected],
                **extra)
    return RowTerms(
        log_probs=out.log_probs, entropy=out.entropy, aux_loss=out.aux_loss,
        old_log_probs=inputs["old_log_probs"][0][selected], advantages=inputs["advantages"][0][selected],
        segment_id=inputs["segment_id"][0][selected], valid=inputs["tree_valid"][0][selected],
        filler=bool(inputs["tree_filler"].reshape(-1)[0]),
    )


def row_loss(row: RowTerms, inputs: dict[str, torch.Tensor], world: int, epsilon_low: float,
             epsilon_high: float, aux_coef: float = 0.0) -> tuple[torch.Tensor, objective.Terms]:
    """This rank's share of the step loss (see `objective`); without step totals the batch is the step."""
    terms = objective.policy_terms(row.log_probs, row.old_log_probs, row.advantages, epsilon_low, epsilon_high)
    step_terms = inputs.get("tree_step_n_tokens", inputs["global_n_tokens"]).reshape(-1)[0]
    loss = objective.step_loss(terms, row.valid, step_terms, world)
    if aux_coef and row.aux_loss is not None:
        # Mean over the step's real rows after FSDP's average; a filler row's copy weighs nothing.
        rows = float(inputs.get("tree_step_rows", inputs["tree_real_rows"]).reshape(-1)[0])
        loss = loss + aux_coef * row.aux_loss * (0.0 if row.filler else world / max(rows, 1.0))
    return loss, terms


def tree_compute_loss(trainer, model, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                      num_items_in_batch=None):
    """`compute_loss` for a `TreeCollator` batch (this rank's row): TRL 1.16.0's loss and metric keys.

    Differs from TRL's `compute_loss` exactly where `objective` says: the loss is normalised by
    the step's trained terms (stamped by `get_batch_samples`), not per micro-batch then divided
    by gradient accumulation; a filler row's inert term enters no loss or metric; the mean
    metrics are logged as (sum, count) so TRL's sink reports token means. The step accounting
    (`_step_*`, read by TRL's `_log_step_metrics`) is TRL's.
    """
    from trl.trainer.utils import nanmax, nanmin

    start = time.time()
    row = forward_row(model, inputs, router_logits=trainer.aux_loss_enabled)
    trainer._last_forward_time_s = time.time() - start
    accelerator = trainer.accelerator
    aux_coef = trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0
    loss, terms = row_loss(row, inputs, accelerator.num_processes, trainer.epsilon_low, trainer.epsilon_high,
                           aux_coef)

    metrics = trainer._metrics["train"]
    sums = objective.local_sums(terms, row.entropy, row.valid, row.aux_loss, real_row=not row.filler)
    sums = accelerator.reduce(sums, reduction="sum")
    for key, value in objective.mean_metrics(sums, with_aux=trainer.aux_loss_enabled).items():
        metrics[key].append(value)
    low_min, high_max = objective.per_sequence_clip(terms, row.valid, row.segment_id)
    metrics["clip_ratio/low_min"].append(nanmin(accelerator.gather(low_min)).item())
    metrics["clip_ratio/high_max"].append(nanmax(accelerator.gather(high_max)).item())

    n_forward_tokens = float(inputs["global_n_forward_tokens"][0])
    mean_seq_len = float(inputs["mean_seq_len"][0])
    trainer._step_forward_tokens += n_forward_tokens
    trainer._step_trained_tokens += float(inputs["global_n_tokens"][0])
    trainer._step_seq_len_weighted += mean_seq_len * n_forward_tokens
    trainer._step_samples += n_forward_tokens / mean_seq_len
    trainer._step_forward_s += trainer._last_forward_time_s
    return loss


class TreePackingMixin:
    """Mix in before `AsyncGRPOTrainer` to train on tree-packed rows with our attention.

    Overrides exactly the places where TRL 1.16.0 plans, packs, scores and groups a step's
    micro-batches (`get_train_dataloader`, `compute_loss`, `_set_signature_columns_if_needed`,
    `get_batch_samples`); the rollout worker, weight sync, optimizer and logging are TRL's. `samples_per_plan` defaults to one
    optimizer step of samples when the subclass does not set it.
    """

    samples_per_plan: int | None = None

    def __init__(self, *args, **kwargs):
        check_trl_version()
        #: samples trained so far, by the policy version that sampled them (rank 0)
        self.trained_sample_versions: Counter = Counter()
        super().__init__(*args, **kwargs)
        install_tree_packing(self.model, temperature=self.temperature)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(BATCH_FIELDS)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return tree_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """transformers' prefetch of one optimizer step's micro-batches, then the step's totals stamped
        into each (`objective.stamp_step`), so every micro-batch is normalised by the whole step."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        objective.stamp_step(batches)
        return batches, num_items

    def get_train_dataloader(self):
        """TRL 1.16.0's `get_train_dataloader` with `TreeBatcher` and `TreeCollator` in place of its own."""
        from torch.utils.data import DataLoader
        from trl.experimental.async_grpo.async_grpo_trainer import (
            RolloutQueueDataset,
            _EmptyIterableDataset,
        )

        num_processes = self.accelerator.num_processes
        if self.accelerator.is_main_process:
            taken = LastTaken(self.rollout_queue)
            dataset = RolloutQueueDataset(
                rollout_queue=taken,
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = dataset
            if self.args.token_budget is None:  # TRL: the server's max_model_len
                self.vllm_client.wait_for_server_ready()
                self.args.token_budget = self.vllm_client.get_max_model_len()
            per_step = (self.args.per_device_train_batch_size * num_processes
                        * self.args.gradient_accumulation_steps)
            # token_budget <= 0 is TRL's fixed count: per_device_train_batch_size x ranks samples per micro-batch.
            dataset = TreeBatcher(WithPolicyVersions(dataset, taken, self.trained_sample_versions),
                                  num_processes, self.args.token_budget,
                                  self.samples_per_plan or per_step,
                                  samples_per_micro_batch=self.args.per_device_train_batch_size * num_processes)
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

"""TRL's AsyncGRPOTrainer with adapters published through the bucket, not the server.

Upstream (1.16.0) syncs a LoRA policy by pausing vLLM, saving the adapter to a directory
the server must see, `/v1/load_lora_adapter`, resume. That needs a shared disk and reaches
one replica. Here a sync saves the adapter (a collective under FSDP2), rank 0 publishes
it to the bucket as version N (manifest last), and every vLLM replica resolves
`policy-vN` from the bucket on its first request (asyncgrpo.adapters.vllm_plugin). No
pause is needed: each version is a new name, so no request ever sees a half-swapped
adapter and the prefix cache never mixes versions.

After each publish the trainer asks vLLM for teacher-forced log-probs of a fixed probe
under `policy-vN` and compares them with its own (asyncgrpo.adapters.probe). Only when
vLLM served the version does the rollout worker move to it: a version vLLM refuses
(corrupt, partial) leaves rollouts on the last good version and raises the
`AdapterServed=False` hint; the next step publishes a fresh version and training goes on.

Version numbers never repeat: a resumed trainer continues after the newest complete
version in the bucket, which may be newer than its checkpoint (versions published after
the checkpoint were served under those names and are immutable).

Full fine-tuning (`plumbing.weight_store`): one process: TRL's `_sync_weight_merged` streams every
parameter into `asyncgrpo.trainer.weights.BucketWeightTransfer` (TRL's `weight_transfer=`
protocol), which publishes `weights/v{N}` (anchor or sparse delta, manifest last) with the
trained log-probs of the probe in the manifest. Several ranks: every rank publishes its own
FSDP2/expert shard of the version (`asyncgrpo.trainer.weights_sharded`), nothing is gathered. Each vLLM replica's puller
swaps it in and checks the served log-probs against those. TRL's NCCL client is never built.
Rollouts then ask vLLM which weights sampled them (asyncgrpo.trainer.served_versions): each
replica swaps on its own schedule, so the trainer's own version is no measure of staleness.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    save_lora_adapter,
    validate_lora_for_vllm_sync,
)
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

from asyncgrpo.adapters.probe import (
    ProbeError,
    compare,
    served_prompt_logprobs,
    trained_prompt_logprobs,
)
from asyncgrpo.adapters.store import AdapterStoreError, StoreUnavailable
from asyncgrpo.storage import retry
from asyncgrpo.trainer.plumbing import TrainerPlumbing
from asyncgrpo.trainer.rollout_gate import RolloutGate
from asyncgrpo.trainer.served_versions import ServedVersionRolloutLoop
from asyncgrpo.trainer.tree.trl_integration import TreePackingMixin
from asyncgrpo.trainer.weights_sharded import ShardedWeightTransfer

log = logging.getLogger(__name__)



def rollouts_move_on(served_ok: bool, served_version: int, vllm_failed: bool) -> bool:
    """Whether rollouts switch to a just-published version after its probe.

    Yes when vLLM served it; also when nothing was served yet (there is nothing to stay on:
    `policy-v0` does not exist) or when vLLM itself failed (5xx, unreachable: the adapter is
    not known to be bad, and a restarted vLLM resolves it from the bucket). Staying behind
    then would stall the run for good. Only a refusal (4xx: corrupt or partial adapter)
    keeps rollouts on the last version vLLM served.
    """
    return served_ok or not served_version or vllm_failed

class _ProbeUnreachable(Exception):
    """One probe request got no answer from vLLM (retried)."""


class VLLMUnreachable(RuntimeError):
    """vLLM stayed unreachable for every try of the probe."""


def publish_until_done(store, local_dir, version: int, *, step: int, extra: dict | None = None,
                       backoff_s: float = 1.0, max_backoff_s: float = 30.0, on_retry=None):
    """Publish a version, retrying through any bucket outage until it is in.

    A step's adapter is never dropped: while the bucket is unreachable the trainer stalls
    here (rollouts keep using the last served version) and `on_retry` reports each failed
    try (metric, `AdapterStoreReachable=False`). Permanent errors (access denied, missing
    bucket) are raised. A publish that died mid-upload is simply redone: a version without
    its manifest does not exist for readers.
    """
    return retry(f"publish v{version}",
                 lambda: store.publish(local_dir, version, step=step, extra=extra),
                 attempts=None, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
                 transient=lambda e: isinstance(e, StoreUnavailable), on_retry=on_retry)


class S3AdapterGRPOTrainer(TreePackingMixin, AsyncGRPOTrainer):
    """AsyncGRPOTrainer + tree packing (the tree engine's mixin: its planner, collator,
    attention and per-term head in place of TRL's hub FA3 kernel) + bucket transport,
    served-policy probe, metrics, bucket checkpoints.

    `plumbing` (trainer.plumbing.TrainerPlumbing) is everything beside TRL's own arguments,
    which all go to TRL.
    """

    def __init__(self, *args, plumbing: TrainerPlumbing, **kwargs):
        p = plumbing
        self.plumbing = p
        self._served_lora_name = p.served_prefix[:-2]
        self.samples_per_plan = p.samples_per_plan
        self._store = p.store
        self._metrics_sink = p.metrics
        self._probe_ids = list(p.probe_ids) if p.probe_ids else None
        self._probe_tolerance = p.probe_tolerance
        self._checkpoints = p.checkpoints
        self._retention = p.retention
        self._keep_staleness = p.max_staleness
        self._retry_attempts = p.retry_attempts
        self._retry_backoff_s = p.retry_backoff_s
        self._fault_versions = {int(v) for v in p.fault_corrupt_versions}
        self._status_file = Path(p.status_file) if p.status_file else None
        self.served_version = 0  # the version rollouts request
        self._probe_failed_transiently = False
        self.published: list[dict] = []  # this process's publishes, for status and tests
        self.outputs: list[dict] = []  # the run's result once written (trainer.final)
        self.resumed_from_step = p.resumed_from_step
        self.history: list[dict] = []  # per logged step: reward, loss (rank 0; bounded)
        self.evals: list[dict] = []  # per eval: step, eval_reward... (rank 0; bounded)
        self._weights = None
        if p.weight_store is not None:
            import torch.distributed as dist

            from asyncgrpo.trainer.weights import BucketWeightTransfer
            from asyncgrpo.trainer.weights_sharded import gloo_group

            work = Path(kwargs["args"].output_dir) / "weights-staging"
            # several ranks: each publishes its own shard (no gather to rank 0)
            sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            cls, where = BucketWeightTransfer, {}
            if sharded:
                cls = ShardedWeightTransfer
                where = {"rank": dist.get_rank(), "world": dist.get_world_size(),
                         "group": gloo_group()}
            self._weights = cls(
                p.weight_store, work, **where, anchor_interval=p.anchor_interval,
                retention=p.retention, max_staleness=p.max_staleness,
                step_fn=lambda: int(self.state.global_step),
                publish=lambda fn: retry("publish weights", fn, attempts=None,
                                         backoff_s=p.retry_backoff_s,
                                         transient=lambda e: isinstance(e, StoreUnavailable),
                                         on_retry=self._on_retry("s3")),
                fault_corrupt_versions=p.fault_corrupt_versions)
            kwargs["weight_transfer"] = self._weights
            self._fault_versions = set()  # the publisher injects them for weights
        super().__init__(*args, **kwargs)
        if self._weights is not None:
            from transformers.core_model_loading import revert_weight_conversion

            hf_model = self.accelerator.unwrap_model(self.model)
            self._weights.to_checkpoint = lambda sd: revert_weight_conversion(hf_model, sd)
        self._eval = p.eval
        if p.eval is not None and p.eval.rows:
            # The transformers Trainer's own schedule (evaluate after every eval_steps steps
            # and after the last). Set after TRL's __init__, which passes no eval_dataset to
            # the Trainer, whose __init__ refuses an eval strategy without one.
            from transformers.trainer_utils import IntervalStrategy

            self.args.eval_strategy = IntervalStrategy.STEPS
            self.args.eval_steps = p.eval.steps
        self._gate = None
        if isinstance(self.rollout_worker, AsyncRolloutWorker):
            if self._weights is not None:  # replicas swap on their own: ask vLLM what sampled
                self.rollout_worker._loop_cls = ServedVersionRolloutLoop
            # routing: each group's requests to one vLLM replica (asyncgrpo.trainer.routing)
            self._gate = RolloutGate(self.rollout_worker, routing=p.routing)

    # TRL assigns `self._lora_name = "trl-policy"` in __init__ and builds the rollout worker's
    # request names from it (f"{lora_name}-v{N}"): a data descriptor keeps ours.
    @property
    def _lora_name(self) -> str:
        return self._served_lora_name

    @_lora_name.setter
    def _lora_name(self, _value: str) -> None:
        pass

    def served_name(self, version: int) -> str:
        return f"{self._served_lora_name}-v{version}"

    # -- sync mode -------------------------------------------------------------------------

    def _init_lora_sync(self, model) -> bool:
        """Adapter sync whenever vLLM can serve the adapter; no server probe is needed (the
        resolver loads by name, no `/server_info` or dev-mode routes)."""
        validate_lora_for_vllm_sync(model)
        if self._store is None:
            raise ValueError("LoRA training publishes adapters to the bucket: pass store=")
        return True

    # -- the sync ------------------------------------------------------------------------

    def _on_retry(self, target: str):
        def on_retry(_what, err):
            if self._metrics_sink is not None:
                self._metrics_sink.inc("retries_total", target=target)
                if target == "s3":
                    self._metrics_sink.hint("AdapterStoreReachable", False, "StoreUnavailable",
                                            str(err)[:300])
        return on_retry

    def _retry(self, what, fn, transient, attempts: int | None = -1,
               gave_up: type[Exception] = StoreUnavailable):
        return retry(what, fn, attempts=self._retry_attempts if attempts == -1 else attempts,
                     backoff_s=self._retry_backoff_s, transient=transient,
                     on_retry=self._on_retry(what), gave_up=gave_up)

    def _next_version(self) -> int:
        # Unbounded: without the bucket's newest version no safe name can be chosen.
        latest = self._retry("s3", self._store.latest,
                             lambda e: isinstance(e, StoreUnavailable), attempts=None) or 0
        return max(self.model_version, latest) + 1

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        from accelerate.utils import broadcast_object_list

        model = self.accelerator.unwrap_model(self.model)
        version = None
        if self.accelerator.is_main_process:
            version = self._next_version()
        version = broadcast_object_list([version], from_process=0)[0]
        adapter_dir = os.path.join(self._lora_dir, f"v{version}")
        t_pause = time.time()  # nothing to pause: a new name never disturbs requests in flight
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        # A collective: every rank gathers its shards, rank 0 writes the files.
        save_lora_adapter(model, self.accelerator, self._adapter_name, adapter_dir)
        trained = None
        if self._probe_ids is not None:
            trained = self._trained_probe(model)  # a forward: every rank takes part under FSDP2
        if self.accelerator.is_main_process:
            self._publish(version, adapter_dir, t0)
            self.model_version = version
            served_ok = self._probe(version, trained)
            if rollouts_move_on(served_ok, self.served_version, self._probe_failed_transiently):
                self.served_version = version if served_ok else self.served_version
                if self.rollout_worker:
                    self.rollout_worker.update_model_version(version)
            self._prune()
            shutil.rmtree(adapter_dir, ignore_errors=True)
            self.write_status()
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        return t_pause, t_barrier, t_transfer

    def _sync_weight_merged(self, t0: float):
        """Full weights through the bucket: the trained probe goes into the manifest (every
        rank takes part in its forward under FSDP2), then TRL streams the parameters into
        BucketWeightTransfer on rank 0, which picks the version number."""
        if self._weights is None:
            return super()._sync_weight_merged(t0)
        from asyncgrpo.adapters.probe import trained_probe

        model = self.accelerator.unwrap_model(self.model)
        trained = None
        if self._probe_ids is not None:
            impl = model.config._attn_implementation
            model.set_attn_implementation("sdpa")  # one causal row, not the tree path
            try:
                trained = trained_probe(model, self._probe_ids)
            finally:
                model.set_attn_implementation(impl)
        main = self.accelerator.is_main_process
        if main:
            if trained is not None:
                self._weights.pending_extra = {"probe": {
                    "token_ids": self._probe_ids, "logprobs": trained[0],
                    "next_logprob": trained[1]}}
            self.model_version = self._weights.version  # TRL adds one after the send
        if isinstance(self._weights, ShardedWeightTransfer):
            marks = self._sync_weight_sharded(t0)
        else:
            marks = super()._sync_weight_merged(t0)
        if main:
            record = dict(self._weights.published[-1])
            self.published.append(record)
            m = self._metrics_sink
            if m is not None:
                m.set("policy_version", record["version"])
                m.observe("adapter_publish_seconds", time.time() - t0)
                m.set("adapter_publish_bytes", record["bytes"])
                m.inc("adapter_published_bytes_total", record["bytes"])
                m.hint("AdapterStoreReachable", True, "Published", f"weights v{record['version']}")
            self.write_status()
        return marks

    def _sync_weight_sharded(self, t0: float):
        """TRL's merged sync with every rank publishing its own shard: TRL hands parameters to
        rank 0's ``send_weights`` only (gathered); here every rank calls it with its local
        DTensors (asyncgrpo.trainer.weights_sharded). Same phases and bookkeeping as TRL's."""
        from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

        t_pause = time.time()  # replicas pause themselves: nothing to pause here
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        self._weights.send_weights(_iter_vllm_named_params(self.accelerator.unwrap_model(self.model)))
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self.model_version += 1
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer

    def _publish(self, version: int, adapter_dir: str, t0: float) -> None:
        step = int(self.state.global_step)
        extra = {"resumed_from_step": self.resumed_from_step}
        manifest = publish_until_done(self._store, adapter_dir, version, step=step, extra=extra,
                                      backoff_s=self._retry_backoff_s,
                                      on_retry=self._on_retry("s3"))
        seconds = time.time() - t0
        if version in self._fault_versions:
            self._corrupt(version, manifest)
        self.published.append({"version": version, "step": step, "bytes": manifest.total_bytes,
                               "seconds": seconds})
        log.info("published %s (step %d, %d bytes, %.2fs)", self.served_name(version), step,
                 manifest.total_bytes, seconds)
        if self._metrics_sink is not None:
            m = self._metrics_sink
            m.set("policy_version", version)
            m.observe("adapter_publish_seconds", seconds)
            m.set("adapter_publish_bytes", manifest.total_bytes)
            m.inc("adapter_published_bytes_total", manifest.total_bytes)
            m.hint("AdapterStoreReachable", True, "Published", f"{self.served_name(version)}")

    def _corrupt(self, version: int, manifest) -> None:
        """Fault injection: overwrite the adapter weights of a complete version in the bucket."""
        rel = next(k for k in manifest.files if k.endswith(".safetensors"))
        key = self._store.overwrite(version, rel, b"corrupted")
        log.warning("fault injection: corrupted %s", self._store.url(key))

    def _trained_probe(self, model) -> list[float]:
        """Our log-probs of the probe, through plain (non-tree) attention: one causal row."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        impl = base.config._attn_implementation
        base.set_attn_implementation("sdpa")
        try:
            return trained_prompt_logprobs(model, self._probe_ids)
        finally:
            base.set_attn_implementation(impl)

    def _probe(self, version: int, trained: list[float] | None) -> bool:
        """Ask vLLM for `policy-vN`; True when it served it (whatever the difference).

        Unreachable: retried with backoff. Refused (4xx: corrupt, partial, rank too high):
        False at once, so rollouts stay on the last version vLLM served.
        """
        self._probe_failed_transiently = False
        if trained is None:
            return True
        name = self.served_name(version)

        def ask():
            try:
                return served_prompt_logprobs(self.args.vllm_server_base_url, name, self._probe_ids)
            except ProbeError as err:
                if "unreachable" in str(err):
                    raise _ProbeUnreachable(str(err)) from None
                raise

        m = self._metrics_sink
        # vLLM's CPU LoRA path dies on a prompt_logprobs request batched with LoRA generation
        # (see rollout_gate): hold the rollouts' requests while the probe runs.
        if self._gate is not None and not self._gate.hold(float(self.args.request_timeout)):
            self._gate.release()
            log.warning("rollout requests did not drain in %ss; probe of %s skipped",
                        self.args.request_timeout, name)
            return True
        try:
            served = self._retry("vllm", ask, lambda e: isinstance(e, _ProbeUnreachable),
                                 gave_up=VLLMUnreachable)
        except Exception as err:  # noqa: BLE001 - refused or still unreachable: training goes on
            status = getattr(err, "status", None)
            self._probe_failed_transiently = not (status is not None and 400 <= status < 500)
            if self._probe_failed_transiently or not self.served_version:
                log.error("vLLM did not serve %s: %s; rollouts move on to it (vLLM failed, "
                          "not the adapter)", name, err)
            else:
                log.error("vLLM refused %s: %s; rollouts stay on %s", name, err,
                          self.served_name(self.served_version))
            if m is not None:
                m.inc("served_logprob_probe_failures_total")
                reason = "VLLMUnreachable" if isinstance(err, VLLMUnreachable) else "AdapterRefused"
                m.hint("AdapterServed", False, reason, f"{name}: {str(err)[:300]}")
            self.published[-1]["served"] = False
            return False
        finally:
            if self._gate is not None:
                self._gate.release()
        cmp = compare(served, trained)
        self.published[-1].update(served=True, logprob_max_diff=cmp.max_abs_diff,
                                  logprob_mean_diff=cmp.mean_abs_diff)
        ok = cmp.within(self._probe_tolerance)
        log.info("probe %s: max |served - trained| = %.2e (mean %.2e)%s", name, cmp.max_abs_diff,
                 cmp.mean_abs_diff, "" if ok else " ABOVE TOLERANCE")
        if m is not None:
            m.set("served_logprob_diff", cmp.max_abs_diff)
            m.hint("AdapterServed", True, "Served", name)
            m.hint("ServedPolicyMatches", ok, "LogProbsAgree" if ok else "LogProbMismatch",
                   f"{name}: max |served - trained| log-prob {cmp.max_abs_diff:.3g} "
                   f"(tolerance {self._probe_tolerance:g})")
        return True

    def _prune(self) -> None:
        try:
            self._retry("s3", lambda: self._store.prune(self._retention, self._keep_staleness),
                        lambda e: isinstance(e, StoreUnavailable))
        except AdapterStoreError as err:  # old versions linger; next sync tries again
            log.warning("pruning adapter versions failed: %s", err)

    def _inner_training_loop(self, *args, **kwargs):
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if self._gate is not None:
                self._gate.close()

    # -- eval ----------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The eval split's reward under the served policy (trainer.evaluation), logged as
        `eval_reward`, `eval_reward_std`, `eval_rewards/<name>`. Every rank calls this (the
        Trainer's schedule); rank 0 rolls out, the others wait for its numbers."""
        from accelerate.utils import broadcast_object_list

        from asyncgrpo.trainer.evaluation import run_eval

        summary = {}
        if self.accelerator.is_main_process and self._eval and self._eval.rows \
                and self.rollout_worker:
            summary = run_eval(self.rollout_worker._loop_kwargs, self._eval.rows,
                               version=self.served_version,
                               num_generations=self._eval.generations,
                               temperature=self._eval.temperature,
                               concurrency=int(self.args.max_inflight_tasks or 16))
        summary = broadcast_object_list([summary], from_process=0)[0]
        summary["policy_version"] = float(self.served_version)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in summary.items()}
        was_training = self.model.training
        self.model.eval()  # TRL's log() reads the mode: eval metrics, not the train window
        try:
            self.log(metrics)
        finally:
            self.model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control,
                                                         metrics)
        return metrics

    # -- metrics, status -----------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if not self.accelerator.is_main_process:
            return
        if "eval_reward" in logs:
            self.evals.append({"step": int(self.state.global_step),
                               **{k: logs[k] for k in logs if k.startswith("eval_")}})
            del self.evals[:-1000]
        if "reward" in logs:
            # the tool metrics TRL's worker stamps on a group's samples (calls per rollout,
            # failed fraction) are in the logs only for steps whose groups called a tool
            self.history.append({k: logs.get(k) for k in ("reward", "reward_std", "loss",
                                                          "perf/step_s")}
                                | {k: logs[k] for k in ("tools/call_frequency",
                                                        "tools/failure_frequency") if k in logs}
                                | {"step": int(self.state.global_step)})
            del self.history[:-1000]
        m = self._metrics_sink
        if m is not None:
            m.update_from_logs(logs)
            m.set("step", self.state.global_step)
            if "eval_reward" in logs:
                m.set("eval_step", self.state.global_step)
            if self.rollout_queue is not None:
                try:
                    m.set("rollout_queue_depth", self.rollout_queue.qsize())
                except NotImplementedError:  # macOS mp queues
                    pass
        self.write_status()

    def record_outputs(self, outputs: list[dict]) -> None:
        """The run's result once written (trainer.final): in status.json and the
        termination message."""
        self.outputs = list(outputs)

    def write_status(self) -> None:
        if self._status_file is None or not self.accelerator.is_main_process:
            return
        doc = {
            "step": int(self.state.global_step),
            "policy_version": self.model_version,
            "served_version": self.served_version,
            "resumed_from_step": self.resumed_from_step,
            "published": self.published,
            "outputs": self.outputs,
            "sample_versions": {str(v): n for v, n in sorted(self.trained_sample_versions.items())},
            "history": self.history,
            "evals": self.evals,
            "conditions": self._metrics_sink.status()["conditions"] if self._metrics_sink else [],
        }
        tmp = self._status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self._status_file)

    # -- checkpoints ---------------------------------------------------------------------

    def _save_replicated_optimizer(self, out: Path) -> None:
        """Optimizer, scheduler and RNG state for a model sharded at load time.

        transformers refuses to checkpoint optimizer state of such a model (it would be
        DTensors on several meshes), so the trainer runs with `save_only_model`. A LoRA
        adapter added after sharding is replicated on every rank, so its optimizer state is
        plain tensors: rank 0 writes it under the names the Trainer loads on resume. Full
        fine-tuning under FSDP2 resumes without optimizer state (warned).
        """
        import torch
        from torch.distributed.tensor import DTensor
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if any(isinstance(p, DTensor) for p in params):
            log.warning("checkpoint %s: optimizer state of sharded parameters is not saved; a "
                        "resume restarts Adam's moments", out.name)
            return
        out.mkdir(parents=True, exist_ok=True)
        if self.accelerator.is_main_process:
            torch.save(self.optimizer.state_dict(), out / OPTIMIZER_NAME)
            torch.save(self.lr_scheduler.state_dict(), out / SCHEDULER_NAME)
        self._save_rng_state(str(out))
        self.accelerator.wait_for_everyone()

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)  # local dir: weights/adapter, optimizer, rollout state
        if self._checkpoints is None:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        step = int(self.state.global_step)
        local = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if self.args.save_only_model:
            self._save_replicated_optimizer(local)
        t0 = time.time()
        ok = self._checkpoints.upload(local, step, rank=self.accelerator.process_index,
                                      is_main=self.accelerator.is_main_process,
                                      agree=self._all_ranks_ok,
                                      meta={"model_version": self.model_version})
        m = self._metrics_sink
        if m is not None and self.accelerator.is_main_process:
            if ok:
                m.set("checkpoint_step", step)
                m.observe("checkpoint_seconds", time.time() - t0)
            m.hint("CheckpointWritten", ok, "Written" if ok else "StoreUnavailable",
                   f"step {step}" if ok else f"step {step} could not be written to the bucket; "
                   "the next interval tries again")

    def _all_ranks_ok(self, ok: bool) -> bool:
        import torch

        flag = torch.tensor([0.0 if ok else 1.0], device=self.accelerator.device)
        return float(self.accelerator.reduce(flag, reduction="sum").item()) == 0.0

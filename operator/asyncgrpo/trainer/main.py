"""One trainer process: the run file in, TRL's AsyncGRPOTrainer configured from it, trained.

Run as `asyncgrpo trainer --config run.yaml`, alone or under torchrun (the operator's
StatefulSet command is `asyncgrpo.controller.trainer.torchrun_command`). The run model is the only configuration; deployment facts
come from the environment (`runtime_env`). The mapping from the run to TRL's config is
`trl_config`, kept pure so it can be read and tested without a model; `run_view` is the
part of the run that mapping (and everything else here) reads.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from asyncgrpo import wire
from asyncgrpo.trainer.runtime_env import RuntimeEnv

log = logging.getLogger(__name__)

#: The part of the run file this process reads, as run-document keys: a spec section in
#: full (None) or the listed fields of it. The operator hashes `run_view` into the trainer
#: pods' template, so a change outside it (vLLM's LoRA slots or replicas, the sandbox pool,
#: bucket creation) never restarts training, and a change inside it always does. Whatever
#: the trainer's code starts reading must be added here; tests/trainer/test_run_view.py
#: checks that a run cut down to this view configures TRL, the harness and the bucket
#: exactly as the whole run does.
READS: dict[str, frozenset[str] | None] = {
    "model": None,
    "trainer": None,
    "data": None,
    "reward": None,
    "harness": None,
    "rollout": frozenset({"sampling"}),
    "sandboxes": frozenset({"execTimeoutSeconds"}),
    "adapterStore": frozenset({"endpoint", "bucket", "prefix", "region", "retention"}),
}


def run_view(run) -> dict:
    """The run's spec as the run document has it (camelCase), cut down to READS."""
    spec = run.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    view = {}
    for section, fields in READS.items():
        value = spec.get(section)
        if isinstance(value, dict) and fields is not None:
            value = {k: v for k, v in value.items() if k in fields}
        if value is not None:
            view[section] = value
    return view


def trl_config(run, env: RuntimeEnv, *, use_cpu: bool):
    """AsyncGRPOConfig for a run.

    Batching: tree packing fills each micro-batch up to `tokenBudgetPerRank` unique tokens
    per rank; `gradientAccumulationSteps` micro-batches make a step. `promptsPerStep` sizes
    the rollout queue (about one step of samples: upstream's default 1024 lets generation
    run far ahead and most samples go stale) and the generation concurrency.
    """
    from trl.experimental.async_grpo import AsyncGRPOConfig

    t, r, m = run.spec.trainer, run.spec.rollout, run.spec.model
    world = env.topology.world_size
    samples_per_step = t.prompts_per_step * t.num_generations
    max_steps = t.total_steps if env.max_steps is None else min(t.total_steps, env.max_steps)
    return AsyncGRPOConfig(
        output_dir=str(env.work_dir / "output"),
        use_cpu=use_cpu,
        dtype=m.dtype,
        # TRL's AsyncGRPOConfig turns bf16 autocast on by default; the run's dtype says what
        # to compute in (a float32 run autocast to bf16 trained log-probs vLLM never serves)
        bf16=m.dtype == "bfloat16",
        fp16=m.dtype == "float16",
        seed=t.seed,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        num_generations=t.num_generations,
        per_device_train_batch_size=max(1, samples_per_step // world),
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        token_budget=t.token_budget_per_rank,
        max_staleness=t.max_staleness,
        queue_maxsize=samples_per_step,
        max_inflight_tasks=max(t.num_generations, min(samples_per_step, 64)),
        max_completion_length=r.sampling.max_completion_tokens,
        temperature=r.sampling.temperature,
        top_p=r.sampling.top_p,
        epsilon=t.clip_epsilon,
        epsilon_high=t.clip_epsilon_high,
        top_k=r.sampling.top_k,
        min_p=r.sampling.min_p,
        repetition_penalty=r.sampling.repetition_penalty,
        vllm_server_base_url=env.require_vllm(),
        weight_sync_steps=1,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=t.checkpoint_interval,
        save_total_limit=1,
        # A model sharded at load time (more than one rank) cannot go through the Trainer's
        # optimizer checkpointing; S3AdapterGRPOTrainer saves a LoRA's optimizer itself.
        save_only_model=world > 1,
        logging_steps=1,
        # TRL's own loggers (trackio, wandb, ...) beside the Prometheus endpoint, which
        # every run has; "none" alone means none. Their settings come from the environment.
        report_to=report_to(run),
        run_name=run.metadata.name,
        # trackio's project (its database file): the runs of a namespace side by side; the
        # prefix keeps a namespace named registry-* off trackio's reserved names
        project=f"asyncgrpo-{run.metadata.namespace or 'default'}",
        disable_tqdm=True,
        log_completions=False,
        # the rest of AsyncGRPOConfig, checked at validate time (asyncgrpo.api.trl_args)
        **t.trl_args,
    )


def report_to(run) -> list[str]:
    """spec.trainer.reportTo as TRL takes it: the loggers named, without "none"."""
    return [x for x in run.spec.trainer.report_to if x != "none"]


#: the variable each offline logger reads its directory from (trackio at import time, which
#: TRL's profiling does early: so it is the process's environment, set by the pod)
LOGGER_DIR_ENV = {"trackio": "TRACKIO_DIR", "tensorboard": "TENSORBOARD_LOGGING_DIR"}


def logger_env(run) -> dict[str, str]:
    """Where the offline loggers the run names write: a folder each under wire.LOGGER_DIR.
    Without it trackio writes under HF_HOME (a cache) and tensorboard under TRL's output
    dir, mixed with checkpoints. Nothing here reaches the network: trackio goes online
    only when TRACKIO_SPACE_ID or TRACKIO_SERVER_URL is set (reportToSecret, trainer.env)."""
    return {LOGGER_DIR_ENV[x]: f"{wire.LOGGER_DIR}/{x}"
            for x in report_to(run) if x in LOGGER_DIR_ENV}


def environment_factory(run, env: RuntimeEnv):
    """TRL's `environment_factory` for a multi-turn run: the sandbox component's harness
    (tools through the gateway, one lease per group); None for single-turn."""
    h = run.spec.harness
    if h.type != "multi-turn":
        return None
    from asyncgrpo.sandbox.client.environment import SandboxEnvConfig, SandboxEnvironmentFactory

    kw = {}
    if h.tools:
        kw["tools"] = tuple(h.tools)
    if run.spec.sandboxes is not None:
        kw["timeout_seconds"] = float(run.spec.sandboxes.exec_timeout_seconds)
        if run.spec.sandboxes.image_column is not None:
            kw["image_column"] = run.spec.sandboxes.image_column
            kw["default_image"] = run.spec.sandboxes.image
    if env.gateway_url:
        kw["gateway_url"] = env.gateway_url
    if h.environment is not None:  # the user's class; the group's sandbox when there is one
        from asyncgrpo.trainer.environments import UserEnvironmentFactory

        sandbox = None
        if run.spec.sandboxes is not None:
            sandbox = SandboxEnvConfig(num_generations=run.spec.trainer.num_generations, **kw)
        return UserEnvironmentFactory(h.environment.module, h.environment.args,
                                      path=h.environment.path, sandbox=sandbox)
    return SandboxEnvironmentFactory(num_generations=run.spec.trainer.num_generations, **kw)


def lora_config(spec):
    from peft import LoraConfig

    lora = spec.model.lora
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=lora.target_modules, task_type="CAUSAL_LM", bias="none")


def _bucket_parts(run, env: RuntimeEnv, metrics):
    """The adapter store, the checkpoints and the whole bucket (data), on one S3 client."""
    from asyncgrpo import storage
    from asyncgrpo.adapters.store import AdapterStore
    from asyncgrpo.trainer.checkpoint import CheckpointStore

    s = run.spec.adapter_store
    # few tries per call: publish_until_done retries a publish until it is in
    store = AdapterStore(s.bucket, run=env.run_name or run.metadata.name, prefix=s.prefix,
                         namespace=run.metadata.namespace, region=s.region, attempts=3,
                         backoff_s=env.retry_backoff_s,
                         client=storage.client(env.s3_endpoint or s.endpoint, s.region))

    def on_retry(_what, _err):
        if metrics is not None:
            metrics.inc("retries_total", target="s3")

    def bucket(root: str) -> storage.Bucket:
        return storage.Bucket(s.bucket, root, store.client, attempts=env.retry_attempts,
                              backoff_s=env.retry_backoff_s, on_retry=on_retry)

    return store, CheckpointStore(bucket(store.folder)), bucket("")


def _weight_store(store):
    """The run's weights folder, beside its adapters (same bucket, client and run folder)."""
    from asyncgrpo.weights.store import WeightStore

    return WeightStore(store.bucket, run=store.run, prefix=store.prefix,
                       namespace=store.namespace, client=store.client,
                       attempts=store.attempts, backoff_s=store.backoff_s)


def run_trainer(run, env: RuntimeEnv | None = None) -> int:
    """Train the run to its last step (or ASYNCGRPO_MAX_STEPS); returns an exit code."""
    from asyncgrpo.trainer import patches
    from asyncgrpo.trainer.distributed import init_process_group

    env = env or RuntimeEnv.from_env()
    patches.apply()
    cuda = _cuda()
    top = init_process_group(env.topology, "cuda" if cuda else "cpu")
    if top.world_size != run.world_size:
        log.warning("torchrun started %d processes but the run asks for %d (replicas x "
                    "gpusPerReplica); sharding follows torchrun", top.world_size, run.world_size)
    env.work_dir.mkdir(parents=True, exist_ok=True)
    metrics, pod_endpoint = _endpoints(run, env, top)

    store, checkpoints, data_bucket = _bucket_parts(run, env, metrics)
    latest = checkpoints.latest()
    resume_dir = None
    if latest is not None:
        resume_dir = str(checkpoints.download(latest, env.work_dir / "resume"))
        log.info("resuming from checkpoint step %d", latest)
    trainer = _build_trainer(run, env, top.world_size, cuda, store, checkpoints, data_bucket,
                             metrics, latest)
    try:
        trainer.train(resume_from_checkpoint=resume_dir)
        if top.is_main:
            from asyncgrpo.trainer.final import write_final

            record = write_final(trainer, run, getattr(trainer, "processing_class", None))
            trainer.record_outputs([record] if record else [])
            write_termination_message(int(trainer.state.global_step), int(trainer.model_version),
                                      outputs=trainer.outputs)
    finally:
        trainer.write_status()
        if pod_endpoint is not None:
            pod_endpoint.close()
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _endpoints(run, env: RuntimeEnv, top):
    """(the training metrics, on global rank 0 only; this pod's HTTP endpoint, if this
    process serves it). One endpoint per pod (local rank 0): rank 0's has the training
    numbers, the others answer their pod's readiness probe and a scrape."""
    from asyncgrpo.trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics() if top.is_main else None
    pod_endpoint = metrics if metrics is not None else (
        TrainerMetrics.for_node(top.rank) if top.local_rank == 0 else None)
    port = run.spec.trainer.metrics_port if env.metrics_port is None else env.metrics_port
    if pod_endpoint is not None and port:
        bound = pod_endpoint.serve(port)
        log.info("metrics on :%d/metrics, hints on :%d/status", bound, bound)
    return metrics, pod_endpoint


def _build_trainer(run, env: RuntimeEnv, world_size: int, cuda: bool, store, checkpoints,
                   data_bucket, metrics, resumed_from_step: int | None):
    """The TRL trainer with our tree packing, S3 adapters and checkpoints, from the run."""
    from transformers import AutoTokenizer

    from asyncgrpo.adapters.probe import probe_token_ids
    from asyncgrpo.trainer.data import apply_chat_template, load_dataset, load_eval_rows
    from asyncgrpo.trainer.distributed import distributed_config
    from asyncgrpo.trainer.grpo import S3AdapterGRPOTrainer
    from asyncgrpo.trainer.plumbing import EvalSplit, TrainerPlumbing
    from asyncgrpo.trainer.rewards import build_rewards

    spec = run.spec
    tokenizer = apply_chat_template(AutoTokenizer.from_pretrained(spec.model.name), spec.model)
    args = trl_config(run, env, use_cpu=not cuda)
    dist_cfg = distributed_config(world_size, spec.trainer.fsdp_size,
                                  spec.trainer.expert_parallel_size, spec.model.moe)
    if dist_cfg is not None:
        args.model_init_kwargs = {"distributed_config": dist_cfg}
    env_factory = environment_factory(run, env)
    if env_factory is not None:
        args.max_tool_calling_iterations = spec.harness.max_turns
    lora = spec.model.finetuning == "lora"
    ev = spec.data.eval
    plumbing = TrainerPlumbing(
        store=store,
        served_prefix=env.adapter_name_prefix,
        samples_per_plan=spec.trainer.prompts_per_step * spec.trainer.num_generations,
        retention=spec.adapter_store.retention,
        max_staleness=spec.trainer.max_staleness,
        anchor_interval=spec.model.full.anchor_interval,
        retry_attempts=env.retry_attempts,
        retry_backoff_s=env.retry_backoff_s,
        probe_ids=probe_token_ids(tokenizer),
        probe_tolerance=env.probe_tolerance,
        metrics=metrics,
        checkpoints=checkpoints,
        weight_store=None if lora else _weight_store(store),
        routing=env.routing,
        status_file=env.work_dir / "status.json",
        fault_corrupt_versions=tuple(env.fault_corrupt_versions),
        eval=None if ev is None else EvalSplit(
            rows=load_eval_rows(run, bucket=data_bucket, workdir=env.work_dir),
            steps=ev.eval_steps, generations=ev.num_generations, temperature=ev.temperature),
        resumed_from_step=resumed_from_step,
    )
    return S3AdapterGRPOTrainer(
        model=spec.model.name,
        reward_funcs=build_rewards(spec.reward, spec.sandboxes.image_column if spec.sandboxes else None),
        args=args,
        train_dataset=load_dataset(run, bucket=data_bucket, workdir=env.work_dir),
        processing_class=tokenizer,
        peft_config=lora_config(spec) if lora else None,
        environment_factory=env_factory,
        plumbing=plumbing,
    )


def write_termination_message(step: int, policy_version: int,
                              path: str = wire.TERMINATION_LOG,
                              outputs: list[dict] | None = None) -> bool:
    """Leave the final numbers where Kubernetes keeps them after the container exits (its
    termination message): the operator's last scrape may predate the last step. `outputs`:
    where the run's result is (`final/`: bucket, key, kind, step), which the operator
    copies into `status.outputs`. Outside a pod there is no such file and nothing is
    written."""
    target = Path(os.environ.get(wire.TERMINATION_LOG_ENV, path))
    if not target.exists():
        return False
    doc: dict = {"step": step, "policyVersion": policy_version}
    if outputs:
        doc["outputs"] = outputs
    try:
        target.write_text(json.dumps(doc))
    except OSError:
        return False
    return True


def main_from_file(path: str | Path) -> int:
    from asyncgrpo.api import load_run

    logging.basicConfig(level=os.environ.get(wire.LOG_LEVEL_ENV, "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_trainer(load_run(path))

"""The eval split: held-out prompts rolled out under the served policy and scored.

TRL 1.16's AsyncGRPOTrainer takes no `eval_dataset` (its rollout worker only feeds
training), so the transformers Trainer's own schedule is used instead: `eval_strategy=
"steps"` and `eval_steps` (spec.data.eval.evalSteps) make it call `evaluate()` after every
evalSteps steps and after the last; `S3AdapterGRPOTrainer.evaluate` runs this module on
rank 0 and logs `eval_reward`, `eval_reward_std` and `eval_rewards/<name>` through the
Trainer's `log` (so TRL's loggers, trackio, wandb..., get them as eval metrics) and the
Prometheus gauges `asyncgrpo_trainer_eval_reward_mean` / `_std`.

A rollout here is TRL's: the rollout worker's own loop object (`_AsyncRolloutLoop`, built
from the worker's kwargs with the eval rows in place of the training set) renders the
prompt with the same chat template, calls vLLM `/v1/completions` under the served policy's
name (`policy-vN`), runs tools through the same environment factory, and `_score_group`
scores with the same reward functions. Only the driver is ours: a finite pass over the
rows (TRL's generate loop cycles its data forever); its reset/tool wiring mirrors TRL's
`_generate_loop`. Eval rollouts are never trained on, and the trainer waits for them
(keep maxRows small: each eval costs maxRows x numGenerations rollouts).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import logging
import math
import queue
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class _Version:
    """Stands in for the worker's shared `mp.Value`: the version eval requests name."""

    value: int


def eval_loop_kwargs(worker_kwargs: dict[str, Any], dataset, *, num_generations: int,
                     temperature: float | None, loop_cls) -> dict[str, Any]:
    """The rollout worker's loop kwargs for an eval pass over `dataset`, less those only a
    subclass of the worker's loop takes (the rollout gate's shared-memory name)."""
    accepted = set(inspect.signature(loop_cls.__init__).parameters)
    kw = {k: v for k, v in worker_kwargs.items() if k in accepted and k != "queue_maxsize"}
    kw.update(dataset=dataset, num_generations=num_generations, dataset_start_index=0,
              log_completions=False,
              # the loop sets TRL's response schema on its tokenizer in place: a copy keeps
              # the trainer's own (saved into checkpoints and final/) as it was
              processing_class=copy.deepcopy(worker_kwargs["processing_class"]))
    if temperature is not None:
        kw["temperature"] = temperature
    return kw


def summarize(rollouts: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the rollouts (NaN = unscored, left out); `reward_std` is the
    spread of the rollouts' rewards, `scored_ratio` the share any reward function scored."""
    out: dict[str, float] = {}
    keys = sorted({k for r in rollouts for k in r if k == "reward" or k.startswith("rewards/")})
    for k in keys:
        vals = [r[k] for r in rollouts if k in r and not math.isnan(r[k])]
        out[k] = sum(vals) / len(vals) if vals else float("nan")
    rewards = [r["reward"] for r in rollouts if not math.isnan(r.get("reward", math.nan))]
    if rewards:
        mean = sum(rewards) / len(rewards)
        out["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    out["scored_ratio"] = len(rewards) / len(rollouts) if rollouts else 0.0
    out["rollouts"] = float(len(rollouts))
    return out


async def _rollout(loop_obj, row: dict[str, Any], group_id: int, ev_loop):
    """One rollout of `row`, as TRL's `_generate_loop` plays it: environment reset with the
    row, its tools, the conversation, the environment's reward."""
    environment = None
    observation = None
    if loop_obj.environment_factories is not None:
        pool = loop_obj._environment_pool[None]
        environment = pool.pop() if pool else loop_obj.environment_factories[None]()
        observation = await ev_loop.run_in_executor(
            loop_obj._tool_pool, functools.partial(environment.reset, **row))
    prompt = row["prompt"]
    if observation is not None:
        last = prompt[-1]
        content = last["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        prompt = prompt[:-1] + [{**last, "content": content + observation}]
    tools = loop_obj._env_tools[None] if loop_obj.environment_factories is not None \
        else loop_obj.tools
    methods = []
    if environment is not None:
        methods = [getattr(environment, n) for n, _ in
                   inspect.getmembers(type(environment), predicate=inspect.isfunction)
                   if n not in ("reset", "get_reward") and not n.startswith("_")]
    tool_dict = {t.__name__: t for t in loop_obj._standalone_tools + methods}
    try:
        result = await loop_obj._generate_one(prompt, tool_dict=tool_dict, tools=tools,
                                              group_id=group_id)
        env_reward = None
        if environment is not None and type(environment) in loop_obj._env_reward_types:
            get_reward = environment.get_reward
            if inspect.iscoroutinefunction(get_reward):
                r = await get_reward()
            else:
                r = await ev_loop.run_in_executor(loop_obj._tool_pool, get_reward)
            env_reward = (type(environment), r)
    finally:
        if environment is not None:
            loop_obj._environment_pool[None].append(environment)
    return prompt, result, env_reward


async def _evaluate(loop_obj, rows: list[dict[str, Any]], concurrency: int
                    ) -> list[dict[str, float]]:
    import aiohttp
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup

    ev_loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(max(1, concurrency))
    n = loop_obj.num_generations

    async def group(gid: int, row: dict[str, Any]) -> list[dict[str, float]]:
        async def one():
            async with gate:
                return await _rollout(loop_obj, row, gid, ev_loop)

        done = await asyncio.gather(*[one() for _ in range(n)])
        g = RolloutGroup(
            prompts=[p for p, _, _ in done],
            reward_kwargs={k: [row[k]] * n for k in row
                           if k not in {"prompt", "completion", "completion_ids"}},
            completions=[r[0] for _, r, _ in done], completions_ids=[r[1] for _, r, _ in done],
            completions_sequences=[r[2] for _, r, _ in done],
            tool_call_counts=[r[3] for _, r, _ in done],
            tool_failure_counts=[r[4] for _, r, _ in done],
            model_version=loop_obj.model_version, group_id=gid,
            env_rewards=[e for _, _, e in done], rollout_rewards=[r[5] for _, r, _ in done])
        samples = await loop_obj._score_group(g)
        seen, out = set(), []
        for s in samples:  # a multi-turn rollout may be several training rows: count it once
            if id(s.completion) not in seen:
                seen.add(id(s.completion))
                out.append({k: float(v) for k, v in s.metrics.items()
                            if k == "reward" or k.startswith("rewards/")})
        return out

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(1, concurrency))
                                     ) as session:
        loop_obj.session = session
        groups = await asyncio.gather(*[group(i, row) for i, row in enumerate(rows)])
    return [r for g in groups for r in g]


def run_eval(worker_kwargs: dict[str, Any], rows: list[dict[str, Any]], *, version: int,
             num_generations: int = 1, temperature: float | None = None,
             concurrency: int = 16, loop_cls=None) -> dict[str, float]:
    """Roll out and score every eval row `num_generations` times under policy version
    `version`; the summary (`summarize`)."""
    from datasets import Dataset
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    loop_cls = loop_cls or _AsyncRolloutLoop
    kw = eval_loop_kwargs(worker_kwargs, Dataset.from_list(rows),
                          num_generations=num_generations, temperature=temperature,
                          loop_cls=loop_cls)
    failed = type("_Flag", (), {"set": lambda self: None, "is_set": lambda self: False})()
    loop_obj = loop_cls(**kw, rollout_buffer=queue.Queue(), model_version_value=_Version(version),
                        heartbeat_value=_Version(0), failed_event=failed,
                        exception_info_queue=queue.Queue(), metrics_queue=queue.Queue())
    try:
        rollouts = loop_obj._loop.run_until_complete(_evaluate(loop_obj, rows, concurrency))
    finally:
        loop_obj._tool_pool.shutdown(wait=True, cancel_futures=True)
        loop_obj._loop.close()
    summary = summarize(rollouts)
    log.info("eval under version %d: reward %.4f over %d rollouts", version,
             summary.get("reward", float("nan")), len(rollouts))
    return summary

"""Prompt data: JSON Lines from a path in the image, a mounted ConfigMap, or the bucket.

Each line is one JSON object; `spec.data.promptField` holds the prompt, a string (becomes
one user message) or a list of chat messages. Every other field rides along to the reward
functions as a column (`answer`, `tests`...). A malformed line is an error naming its line
number: a silently dropped prompt would shift the data position a resumed run restores.

Order: with `shuffle`, the rollout worker sees epoch after epoch, each a permutation seeded
by (seed, epoch); without it, the file order repeated. The order is a pure function of the
file and the seed, so the checkpoint's data position (an index into this order, kept by
TRL as `prompt_index`) means the same prompt after a restart.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

from asyncgrpo.wire import DATA_DIR, DATA_DIR_ENV


class DataError(ValueError):
    """The data set cannot be used as given; the message says where."""


def parse_jsonl(text: str, prompt_field: str = "prompt", source: str = "data") -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{source}:{n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{source}:{n}: expected a JSON object, got {type(obj).__name__}")
        if prompt_field not in obj:
            raise DataError(f"{source}:{n}: no field {prompt_field!r}")
        prompt = obj.pop(prompt_field)
        if isinstance(prompt, str):
            if not prompt:
                raise DataError(f"{source}:{n}: empty prompt")
            prompt = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            prompt = [dict(m) for m in prompt]
        else:
            raise DataError(f"{source}:{n}: {prompt_field!r} must be a string or a non-empty "
                            "list of {role, content} messages")
        if "prompt" in obj and prompt_field != "prompt":
            raise DataError(f"{source}:{n}: has both {prompt_field!r} and 'prompt'")
        rows.append({"prompt": prompt, **obj})
    if not rows:
        raise DataError(f"{source}: no prompts")
    return rows


def read_source(spec, bucket=None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(text, source name) of `run.spec.data`."""
    env = os.environ if env is None else env
    if spec.path:
        p = Path(spec.path)
        if not p.is_file():
            raise DataError(f"data.path {spec.path} does not exist in this container")
        return p.read_text(encoding="utf-8"), spec.path
    if spec.config_map is not None:
        p = Path(env.get(DATA_DIR_ENV) or DATA_DIR) / spec.config_map.key
        if not p.is_file():
            raise DataError(f"data.configMap {spec.config_map.name}/{spec.config_map.key} is not "
                            f"mounted at {p}")
        return p.read_text(encoding="utf-8"), f"configmap:{spec.config_map.name}/{spec.config_map.key}"
    if spec.bucket_path:
        if bucket is None:
            raise DataError("data.bucketPath needs the adapter store's bucket")
        key = spec.bucket_path.lstrip("/")
        return bucket.get_bytes(key).decode("utf-8"), bucket.url(key)
    raise DataError("data: give one of path, configMap, bucketPath")


def epoch_order(n: int, epochs: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices for `epochs` passes; each pass a (seed, epoch)-seeded permutation."""
    order: list[int] = []
    for epoch in range(epochs):
        idx = list(range(n))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(idx)
        order.extend(idx)
    return order


def epochs_needed(n_prompts: int, total_steps: int, prompts_per_step: int, max_staleness: int) -> int:
    """Passes that cover the prompts a run can draw: each step consumes `prompts_per_step`
    groups and generation runs at most `max_staleness + 1` steps ahead; one spare pass."""
    draws = (total_steps + max_staleness + 2) * prompts_per_step
    return max(1, math.ceil(draws / n_prompts)) + 1


def load_dataset(run, bucket=None, env: dict[str, str] | None = None):
    """The `datasets.Dataset` TRL's rollout worker iterates, in training order."""
    from datasets import Dataset

    spec = run.spec.data
    text, source = read_source(spec, bucket, env)
    rows = parse_jsonl(text, spec.prompt_field, source)
    t = run.spec.trainer
    order = epoch_order(len(rows), epochs_needed(len(rows), t.total_steps, t.prompts_per_step,
                                                 t.max_staleness), t.seed, spec.shuffle)
    return Dataset.from_list(rows).select(order)

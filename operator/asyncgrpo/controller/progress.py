"""Training progress, read from the trainer's Prometheus endpoint and mirrored into status.

The contract with the trainer is the metric names below (rank 0's endpoint on
spec.trainer.metricsPort; `asyncgrpo.trainer.metrics` defines them, a test keeps the two
in step). A missing metric leaves the field as it was: the trainer may not
have finished a step yet, and status must never go backwards because of a failed scrape.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

METRICS = {
    "asyncgrpo_trainer_step": "step",
    "asyncgrpo_trainer_policy_version": "policy_version",
    "asyncgrpo_trainer_raw_tokens_per_second": "raw_tokens_per_second",
    "asyncgrpo_trainer_forwarded_tokens_per_second": "unique_tokens_per_second",
    "asyncgrpo_trainer_tree_compression_ratio": "tree_compression_ratio",
    "asyncgrpo_trainer_served_logprob_diff": "served_logprob_diff",
    "asyncgrpo_trainer_reward_mean": "reward_mean",
}


@dataclass
class Progress:
    step: int | None = None
    policy_version: int | None = None
    served_logprob_diff: float | None = None
    raw_tokens_per_second: float | None = None
    unique_tokens_per_second: float | None = None
    tree_compression_ratio: float | None = None
    reward_mean: float | None = None
    #: the run's result (`final/`), from the termination message: bucket, key, kind, step
    outputs: list[dict] | None = None


def parse(text: str) -> Progress:
    out = Progress()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = METRICS.get(sample.name)
            if attr is None:
                continue
            value = sample.value
            setattr(out, attr, int(value) if attr in ("step", "policy_version")
                    else float(value))
    return out


def from_termination_message(message: str) -> Progress | None:
    """The trainer's final numbers from its termination message (JSON written at exit by
    asyncgrpo.trainer.main), or None when there is none or it is not ours."""
    import json

    try:
        doc = json.loads(message) if message.strip().startswith("{") else None
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("step"), int):
        return None
    version = doc.get("policyVersion")
    outputs = [o for o in doc.get("outputs") or [] if isinstance(o, dict)
               and isinstance(o.get("bucket"), str) and isinstance(o.get("key"), str)]
    return Progress(step=doc["step"], policy_version=version if isinstance(version, int) else None,
                    outputs=[{k: o[k] for k in ("bucket", "key", "kind", "step") if k in o}
                             for o in outputs] or None)


def scrape(url: str, timeout: float = 2.0) -> Progress | None:
    """The trainer's numbers, or None if its endpoint does not answer (not started yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse(resp.read(1 << 22).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None

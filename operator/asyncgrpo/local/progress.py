"""What a local run says as it goes, and what it keeps for `asyncgrpo report --local`.

The trainer writes its status file (step, policy version, resume point, per-step reward
history) and serves its Prometheus metrics (tokens/s raw and forwarded, tree compression,
staleness, step-time histograms); vLLM and the sandbox gateway serve theirs. At each new
step the local backend scrapes those endpoints once and turns status + scrape into one
record: printed as a progress line, and appended to `<workdir>/progress.jsonl` so the run can
be drawn after its processes are gone (`asyncgrpo.report.local_panels`).

Pure functions apart from `scrape` (one GET): the backend decides when to call them.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

PROGRESS_FILE = "progress.jsonl"

#: metric names (prefixes) a record keeps from the scrapes; histograms as _sum and _count
KEPT = ("asyncgrpo_trainer_", "asyncgrpo_gateway_", "vllm:generation_tokens",
        "vllm:kv_cache_usage_perc", "vllm:num_requests_", "vllm:prefix_cache_")
#: labels a kept sample stays apart by; every other label is summed over (pods, replicas)
KEPT_LABELS = ("state",)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{state="..."}: value}, summed over other labels;
    only the names of KEPT, no histogram buckets and no `_created` samples."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(KEPT) or s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f'{k}="{s.labels[k]}"' for k in KEPT_LABELS if k in s.labels)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def scrape(url: str, timeout: float = 3.0) -> dict[str, float]:
    """One endpoint's kept samples; {} when it does not answer (a scrape is never fatal)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse_metrics(resp.read().decode())
    except (OSError, ValueError):
        return {}


def record(status: dict, metrics: dict[str, float], now: float | None = None) -> dict | None:
    """One step's record from the trainer's status and the scraped samples; None until the
    trainer has logged a step (its status is first written at the base policy's publish,
    before any reward exists)."""
    history = [h for h in status.get("history") or [] if h.get("reward") is not None]
    if not history:
        return None
    last = history[-1]
    trainer = "asyncgrpo_trainer_"
    return {
        "time": time.time() if now is None else now,
        "step": int(last.get("step") or status.get("step") or 0),
        "policy_version": status.get("policy_version"),
        "reward": last.get("reward"),
        "reward_std": last.get("reward_std"),
        "step_seconds": last.get("perf/step_s"),
        "raw_tokens_per_second": metrics.get(trainer + "raw_tokens_per_second"),
        "unique_tokens_per_second": metrics.get(trainer + "forwarded_tokens_per_second"),
        "tree_compression_ratio": metrics.get(trainer + "tree_compression_ratio"),
        "metrics": metrics,
    }


def _num(v: Any, fmt: str) -> str:
    return "?" if v is None else format(v, fmt)


def progress_line(rec: dict, total_steps: int | None = None) -> str:
    """`step 7/20: reward 0.131 ± 0.092, policy v7, 412 tokens/s raw, 151 unique,
    tree compression 2.73x` (figures the scrape did not get are left out)."""
    step = f"{rec['step']}/{total_steps}" if total_steps else str(rec["step"])
    std = f" ± {rec['reward_std']:.3f}" if rec.get("reward_std") is not None else ""
    parts = [f"step {step}: reward {_num(rec.get('reward'), '.3f')}{std}"]
    if rec.get("policy_version") is not None:
        parts.append(f"policy v{rec['policy_version']}")
    raw, unique = rec.get("raw_tokens_per_second"), rec.get("unique_tokens_per_second")
    if raw is not None:
        parts.append(f"{raw:.0f} tokens/s raw"
                     + (f", {unique:.0f} unique" if unique is not None else ""))
    if rec.get("tree_compression_ratio") is not None:
        parts.append(f"tree compression {rec['tree_compression_ratio']:.2f}x")
    return ", ".join(parts)


def resumed_line(status: dict) -> str | None:
    """`resumed from step N` when the trainer restored a checkpoint, else None."""
    step = status.get("resumed_from_step")
    return None if step is None else f"resumed from step {step} (checkpoint in the bucket)"


def append(path: Path, rec: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def load(path: Path) -> list[dict]:
    """The records of a progress file; a torn last line (a killed run) is skipped."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def last_checkpoint(trainer_work: Path | None) -> Path | None:
    """The newest HF checkpoint the trainer left in its work folder (`output/checkpoint-N`;
    the same files are in the bucket under the run's checkpoints/ folder)."""
    if trainer_work is None:
        return None
    found = [(int(p.name.split("-")[-1]), p) for p in (trainer_work / "output").glob(
        "checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return max(found)[1] if found else None


def summary(run_name: str, status: dict, records: list[dict], workdir: Path,
            trainer_work: Path | None = None) -> str:
    """The last words of a local run: steps, reward first/last, tokens/s, compression, and
    where its checkpoint, logs and progress are. Each line is its own, to extend (e.g. with
    a final model folder once the trainer writes one)."""
    rewards = [h["reward"] for h in status.get("history", []) if h.get("reward") is not None]
    versions = [p["version"] for p in status.get("published", [])]
    shown = f"v{versions[0]}..v{versions[-1]}" if versions else "none"
    lines = [(f"run {run_name} finished: step {status.get('step', '?')}, policy versions "
             f"published: {shown}")]
    if status.get("resumed_from_step") is not None:
        lines.append(f"resumed from step {status['resumed_from_step']}")
    if len(rewards) >= 2:
        k = max(1, min(5, len(rewards) // 2))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        lines.append(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}")
    evals = [e for e in status.get("evals", []) if e.get("eval_reward") is not None]
    if evals:
        shown_evals = ", ".join(f"step {e['step']} {e['eval_reward']:.3f}" for e in evals[-5:])
        lines.append(f"eval reward ({int(evals[-1].get('eval_rollouts', 0))} rollouts each): "
                     f"{shown_evals}")
    raw = _mean([r.get("raw_tokens_per_second") for r in records])
    unique = _mean([r.get("unique_tokens_per_second") for r in records])
    ratio = _mean([r.get("tree_compression_ratio") for r in records])
    if raw is not None or ratio is not None:
        lines.append(f"mean over {len(records)} steps: {_num(raw, '.0f')} tokens/s raw, "
                     f"{_num(unique, '.0f')} unique, tree compression {_num(ratio, '.2f')}x")
    checkpoint = last_checkpoint(trainer_work)
    if checkpoint is not None:
        lines.append(f"last checkpoint: {checkpoint}")
    lines.append(f"logs and trainer status in {workdir}")
    if records:
        lines.append(f"progress in {workdir / PROGRESS_FILE} "
                     f"(draw it: asyncgrpo report --local {workdir})")
    return "\n".join(lines)

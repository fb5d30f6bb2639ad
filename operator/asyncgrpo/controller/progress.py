"""Training progress, read from the trainer's Prometheus endpoint and mirrored into status.

The contract with the trainer is the metric names below (rank 0's endpoint on
spec.trainer.metricsPort; `asyncgrpo.trainer.metrics` defines them, a test keeps the two
in step). A missing metric leaves the field as it was: the trainer may not
have finished a step yet, and status must never go backwards because of a failed scrape.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.controller import untrusted

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
    #: per vLLM replica (`ip:port`) the router counts: {"requests": n, "version": v}
    #: (controller.rollout_replicas)
    replicas: dict[str, dict[str, int]] | None = None
    #: the run's result (`final/`), from the termination message: bucket, key, kind, step
    outputs: list[dict] | None = None


#: the router's per-replica series (asyncgrpo.trainer.routed_loop) -> the key in `replicas`
REPLICA_METRICS = {
    "asyncgrpo_trainer_rollout_routed_requests_total": "requests",
    "asyncgrpo_trainer_rollout_replica_served_version": "version",
}
#: most replicas read from one page (the labels are the tenant's)
MAX_REPLICAS = 64


def _replica_sample(out: Progress, sample) -> None:
    key = REPLICA_METRICS[sample.name]
    replica = untrusted.short_text(sample.labels.get("replica"), "replica", most=64)
    replicas = out.replicas if out.replicas is not None else {}
    if replica not in replicas and len(replicas) >= MAX_REPLICAS:
        return
    replicas.setdefault(replica, {})[key] = untrusted.count(sample.value, sample.name)
    out.replicas = replicas


def parse(text: str) -> Progress:
    out = Progress()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in REPLICA_METRICS:
                _replica_sample(out, sample)
                continue
            attr = METRICS.get(sample.name)
            if attr is None:
                continue
            # typed and bounded (controller.untrusted): a step of +Inf or -1 is a bad answer,
            # never an OverflowError in the reconcile
            setattr(out, attr, untrusted.count(sample.value, sample.name)
                    if attr in ("step", "policy_version")
                    else untrusted.real(sample.value, sample.name))
    return out


def from_termination_message(message: str) -> Progress | None:
    """The trainer's final numbers from its termination message (JSON written at exit by
    asyncgrpo.trainer.main), or None when there is none or it is not ours."""
    import json

    try:
        doc = json.loads(message) if message.strip().startswith("{") else None
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    try:
        step = untrusted.count(doc.get("step"), "step")
    except ValueError:
        return None
    try:
        version = untrusted.count(doc.get("policyVersion"), "policyVersion")
    except ValueError:
        version = None
    return Progress(step=step, policy_version=version, outputs=_outputs(doc.get("outputs")))


def _outputs(value) -> list[dict] | None:
    """The trainer's `final/` records (bucket, key, kind, step), typed and bounded: a tenant's
    image writes the termination message, so anything else is dropped, never raised."""
    if not isinstance(value, list):
        return None
    out = []
    for o in value[:8]:
        if not isinstance(o, dict):
            continue
        try:
            record = {"bucket": untrusted.short_text(o.get("bucket"), "bucket"),
                      "key": untrusted.short_text(o.get("key"), "key", most=1024)}
            if "kind" in o:
                record["kind"] = untrusted.short_text(o.get("kind"), "kind", most=16)
            if "step" in o:
                record["step"] = untrusted.count(o.get("step"), "step")
        except ValueError:
            continue
        out.append(record)
    return out or None


#: most bytes of a trainer's metrics page the operator reads (the read: controller.tenant_io)
MAX_METRICS_BYTES = 1 << 20

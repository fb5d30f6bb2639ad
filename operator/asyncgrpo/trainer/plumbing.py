"""What the trainer needs beside TRL's own arguments, as one value built from the run.

`S3AdapterGRPOTrainer` takes TRL's arguments plus one `TrainerPlumbing`: where versions are
published and how they are checked, kept and retried, and the run's side outputs. Built by
`trainer.main` from the run and the pod's environment, so no default here repeats one of the
model's (`spec.adapterStore.retention`, `spec.trainer.maxStaleness`, ...): the fields that
come from the spec have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo import wire


@dataclass(frozen=True)
class EvalSplit:
    """The eval split (`spec.data.eval`, trainer.evaluation): scored under the served
    policy every `steps` steps."""

    rows: list[dict]
    steps: int
    generations: int
    temperature: float | None


@dataclass(frozen=True)
class TrainerPlumbing:
    #: AdapterStore of the run (rank 0 publishes; the other ranks may hold None)
    store: Any
    #: served names are f"{served_prefix}{N}"; must end in "-v" (TRL's scheme)
    served_prefix: str
    #: samples the tree planner packs at once (one step's worth)
    samples_per_plan: int
    #: adapter (and weight) versions kept in the bucket: spec.adapterStore.retention and
    #: spec.trainer.maxStaleness
    retention: int
    max_staleness: int
    #: full fine-tuning's anchor every K versions (spec.model.full.anchorInterval)
    anchor_interval: int
    #: for S3 and the vLLM probe
    retry_attempts: int
    retry_backoff_s: float
    #: token ids of the served-policy probe (None: no probe) and its tolerance
    probe_ids: list[int] | None = None
    probe_tolerance: float = wire.DEFAULT_PROBE_TOLERANCE
    #: TrainerMetrics (rank 0) or None
    metrics: Any = None
    #: CheckpointStore or None: uploads each HF checkpoint, COMPLETE last
    checkpoints: Any = None
    #: WeightStore for full fine-tuning (None: LoRA)
    weight_store: Any = None
    #: group-affine routing over the vLLM replicas (trainer.routing) or None
    routing: Any = None
    #: JSON written at each step end (rank 0), for the local backend and tests
    status_file: Path | None = None
    #: versions corrupted in the bucket right after publishing (fault injection for tests
    #: and drills: exercises the refusal path for real)
    fault_corrupt_versions: tuple[int, ...] = ()
    eval: EvalSplit | None = None
    #: the checkpoint step this process resumed from (None: a fresh start)
    resumed_from_step: int | None = None

    def __post_init__(self) -> None:
        if not self.served_prefix.endswith("-v"):
            raise ValueError(f"served_prefix {self.served_prefix!r} must end in '-v'")

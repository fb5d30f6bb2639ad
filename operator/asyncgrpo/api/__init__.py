"""The AsyncGRPORun API: the one model of a run that the CRD, operator, trainer and local
backend all read. Import from here, not from the version module."""

from asyncgrpo.api.v1alpha1 import (
    BUILTIN_REWARDS,
    AdapterStoreSpec,
    AsyncGRPORun,
    AsyncGRPORunSpec,
    AsyncGRPORunStatus,
    Condition,
    DataSpec,
    HarnessSpec,
    LoraSpec,
    ModelSpec,
    RewardFunction,
    RewardSpec,
    RolloutSpec,
    SandboxSpec,
    TrainerSpec,
)
from asyncgrpo.api.validation import (
    FieldError,
    RunValidationError,
    load_run,
    parse_run,
    validate_run,
)

__all__ = [
    "BUILTIN_REWARDS",
    "AdapterStoreSpec",
    "AsyncGRPORun",
    "AsyncGRPORunSpec",
    "AsyncGRPORunStatus",
    "Condition",
    "DataSpec",
    "FieldError",
    "HarnessSpec",
    "LoraSpec",
    "ModelSpec",
    "RewardFunction",
    "RewardSpec",
    "RolloutSpec",
    "RunValidationError",
    "SandboxSpec",
    "TrainerSpec",
    "load_run",
    "parse_run",
    "validate_run",
]

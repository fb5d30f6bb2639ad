"""What the trainer learns from its environment rather than from the run file.

The run file (the AsyncGRPORun YAML, mounted from a ConfigMap) says what to train. Where
things are at run time (the vLLM Service, the sandbox gateway, a local S3 endpoint), the
credentials, and the rank of this process are facts of the deployment, so the operator (or
the local backend) sets them as environment variables. This module is the one list of
them (the names themselves are spelled once, in `asyncgrpo.wire`, which the builders
import too); docs/trainer.md repeats it for users.

=============================  ==========================================================
Variable                       Meaning
=============================  ==========================================================
ASYNCGRPO_VLLM_URL             vLLM OpenAI-compatible root, e.g. http://run-vllm:8000
                               (required; the Service in front of every replica)
ASYNCGRPO_VLLM_REPLICAS        the replicas for group-affine routing: a DNS name whose
                               records are the Ready replicas (the operator's headless
                               Service <run>-vllm-replicas) or comma-separated roots;
                               unset: every request goes to ASYNCGRPO_VLLM_URL
ASYNCGRPO_VLLM_PULLER_PORT     full fine-tuning: the replicas' puller port; new groups go
                               to replicas serving the newest version, none mid-swap
ASYNCGRPO_GATEWAY_URL          sandbox gateway root (multi-turn tools, sandbox_tests)
ASYNCGRPO_GATEWAY_TOKEN        gateway bearer token (read by asyncgrpo.sandbox.client.gateway_client)
ASYNCGRPO_S3_ENDPOINT          overrides spec.adapterStore.endpoint (else
                               AWS_ENDPOINT_URL_S3, else the spec)
AWS_ACCESS_KEY_ID,             bucket credentials (from spec.adapterStore.credentialsSecret);
AWS_SECRET_ACCESS_KEY          unset: boto3's ambient chain (IRSA, instance profile)
ASYNCGRPO_RUN_NAME             run name in bucket keys (default metadata.name)
ASYNCGRPO_ADAPTER_NAME_PREFIX  served adapter name prefix, must end in "-v" (default
                               "policy-v": version N is served as policy-vN)
ASYNCGRPO_WORK_DIR             local scratch: TRL output dir, checkpoint staging
                               (default /tmp/asyncgrpo-trainer; give it an emptyDir)
ASYNCGRPO_METRICS_PORT         overrides spec.trainer.metricsPort (0: no endpoint)
ASYNCGRPO_BIND_HOST            address the metrics endpoint binds (default: every
                               interface; the local backend gives each pod its own)
ASYNCGRPO_PROBE_TOLERANCE      max |served - trained| log-prob on the probe before the
                               ServedPolicyMatches hint turns False (default 0.05)
ASYNCGRPO_RETRY_ATTEMPTS       tries of each S3 / vLLM call before the step fails
                               (default 8; backoff doubles from ASYNCGRPO_RETRY_BACKOFF_S,
                               default 1.0, capped at 30 s)
ASYNCGRPO_MAX_STEPS            stop after this step even if spec.trainer.totalSteps is
                               larger (tests, benchmarks; default: totalSteps)
ASYNCGRPO_DATA_DIR             where a data.configMap source is mounted (default
                               /etc/asyncgrpo/data; the key is the file name)
ASYNCGRPO_FAULT_CORRUPT_VERSIONS  fault injection for tests and drills: comma-separated
                               versions overwritten in the bucket right after publishing
ASYNCGRPO_LOG_LEVEL            Python log level (default INFO)
RANK, WORLD_SIZE, LOCAL_RANK,  set by torchrun (the operator's StatefulSet command is
MASTER_ADDR, MASTER_PORT       asyncgrpo.controller.trainer.torchrun_command)
=============================  ==========================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo import wire
from asyncgrpo.trainer.distributed import Topology
from asyncgrpo.trainer.routing import RoutingConfig

DEFAULT_WORK_DIR = "/tmp/asyncgrpo-trainer"


class RuntimeEnvError(ValueError):
    """A variable is missing or malformed; the message names it."""


def _float(env: dict[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise RuntimeEnvError(f"{key}={raw!r} is not a number") from None


def _int(env: dict[str, str], key: str, default: int | None) -> int | None:
    raw = env.get(key)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeEnvError(f"{key}={raw!r} is not an integer") from None


def _versions(env: dict[str, str], key: str) -> tuple[int, ...]:
    raw = env.get(key) or ""
    try:
        return tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise RuntimeEnvError(f"{key}={raw!r} is not a comma-separated list of versions") from None


def _routing(env: dict[str, str]) -> RoutingConfig | None:
    _int(env, wire.VLLM_PULLER_PORT_ENV, None)  # a clear error for a malformed port
    return RoutingConfig.from_env(env)


@dataclass(frozen=True)
class RuntimeEnv:
    vllm_url: str | None
    gateway_url: str | None = None
    s3_endpoint: str | None = None
    run_name: str | None = None
    adapter_name_prefix: str = wire.DEFAULT_NAME_PREFIX
    work_dir: Path = Path(DEFAULT_WORK_DIR)
    metrics_port: int | None = None
    probe_tolerance: float = wire.DEFAULT_PROBE_TOLERANCE
    retry_attempts: int = 8
    retry_backoff_s: float = 1.0
    max_steps: int | None = None
    fault_corrupt_versions: tuple[int, ...] = ()
    routing: RoutingConfig | None = None
    topology: Topology = field(default_factory=Topology)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RuntimeEnv:
        env = dict(os.environ if env is None else env)
        prefix = env.get(wire.ADAPTER_NAME_PREFIX_ENV) or wire.DEFAULT_NAME_PREFIX
        if not prefix.endswith("-v"):
            raise RuntimeEnvError(
                f"{wire.ADAPTER_NAME_PREFIX_ENV}={prefix!r} must end in '-v' (version N is "
                "served as <prefix>N, the name TRL's rollout worker requests)")
        attempts = _int(env, wire.RETRY_ATTEMPTS_ENV, 8)
        if attempts < 1:
            raise RuntimeEnvError(f"{wire.RETRY_ATTEMPTS_ENV} must be >= 1")
        try:
            probe_tolerance = wire.probe_tolerance(env)
        except ValueError as e:
            raise RuntimeEnvError(str(e)) from None
        return cls(
            vllm_url=(env.get(wire.VLLM_URL_ENV) or "").rstrip("/") or None,
            gateway_url=(env.get(wire.GATEWAY_URL_ENV) or "").rstrip("/") or None,
            s3_endpoint=env.get(wire.S3_ENDPOINT_ENV) or env.get("AWS_ENDPOINT_URL_S3") or None,
            run_name=env.get(wire.RUN_NAME_ENV) or None,
            adapter_name_prefix=prefix,
            work_dir=Path(env.get(wire.WORK_DIR_ENV) or DEFAULT_WORK_DIR),
            metrics_port=_int(env, wire.METRICS_PORT_ENV, None),
            probe_tolerance=probe_tolerance,
            retry_attempts=attempts,
            retry_backoff_s=_float(env, wire.RETRY_BACKOFF_ENV, 1.0),
            max_steps=_int(env, wire.MAX_STEPS_ENV, None),
            fault_corrupt_versions=_versions(env, wire.FAULT_CORRUPT_VERSIONS_ENV),
            routing=_routing(env),
            topology=Topology.from_env(env),
        )

    def require_vllm(self) -> str:
        if not self.vllm_url:
            raise RuntimeEnvError(f"{wire.VLLM_URL_ENV} is not set: the trainer needs the vLLM "
                                  f"server's root URL (e.g. http://<run>-vllm:{wire.VLLM_PORT})")
        return self.vllm_url

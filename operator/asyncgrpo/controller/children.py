"""Every child of a run, in start order, as the builders make them.

The one place that knows which children a spec implies and how suspension, the trainer's
start gate and a finished run change them. The sandbox pods are not here: the pool scaler
owns them (`pool`).
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller import configmap, gateway, network, rbac, trainer, vllm


def build_children(run: AsyncGRPORun, *, stopped: bool = False, start_trainer: bool = True,
                   resolved_hosts: list[str] | None = None,
                   scrapers: list[dict[str, Any]] | None = None,
                   hold: bool = False) -> list[dict[str, Any]]:
    """`stopped`: suspended or finished, every workload at zero. `start_trainer`: vLLM (and
    the gateway) are ready, so the trainer may scale up (ordered start). `hold`: vLLM and
    the trainer stay at zero (the preflight has not passed)."""
    out: list[dict[str, Any]] = [*rbac.build_rbac(run), configmap.build_config_map(run)]
    out += network.build_policies(run, resolved_hosts, scrapers)
    out += [vllm.build_service(run), vllm.build_deployment(run, 0 if stopped or hold else None)]
    if (replicas := vllm.build_replicas_service(run)) is not None:
        out.append(replicas)
    if run.spec.sandboxes is not None:
        out += [gateway.build_service(run), gateway.build_deployment(run, 0 if stopped else 1)]
    out += [trainer.build_service(run),
            trainer.build_statefulset(run, 0 if stopped or hold or not start_trainer else None)]
    return out

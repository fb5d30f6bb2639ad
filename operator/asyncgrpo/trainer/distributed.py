"""Process group, FSDP2 and expert parallel for the trainer, through transformers' own support.

Why transformers' `DistributedConfig` rather than our own `fully_shard` calls: transformers
5.24 shards a model at load time (`from_pretrained(..., distributed_config=...)`) with
FSDP2 (`fully_shard` per its `fsdp_plan`) and, for MoE models, expert parallel (experts
split over an expert mesh, tokens exchanged with all-to-all). Its Trainer, which TRL's
AsyncGRPOTrainer builds on, already knows such a model: accelerate does not wrap it again,
the optimizer gets one param group per device mesh, gradients of parameters added after
sharding (a peft adapter) are broadcast and averaged. Writing our own sharding would mean
re-doing all of that inside the Trainer.

Invariants:
* World size, rank and rendezvous come from torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR, MASTER_PORT); one process per GPU, or per CPU pod.
* `ep_size` divides `fsdp_size` (transformers: `ep_size` divides `fsdp_size * tp_size`).
* LoRA targets dense projections only: peft on EP-sharded experts (`target_parameters`)
  fails after sharding (measured), and vLLM cannot serve it as a plain adapter either.
* Gradient norms over dense and expert parameters cannot go through one
  `clip_grad_norm_` (different meshes): `grad_norm` takes the norm per mesh and combines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Where this process sits; from torchrun's variables, or a single process without them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Topology:
        env = os.environ if env is None else env
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
        )


def backend_for(device_type: str) -> str:
    """gloo on CPU (tests, CPU pods), nccl on CUDA."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(topology: Topology | None = None, device_type: str | None = None) -> Topology:
    """Join torchrun's rendezvous (env://) once; a no-op for one process or if already joined."""
    import torch
    import torch.distributed as dist

    topology = topology or Topology.from_env()
    if not topology.distributed or dist.is_initialized():
        return topology
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(topology.local_rank)
    dist.init_process_group(backend=backend_for(device_type), init_method="env://",
                            rank=topology.rank, world_size=topology.world_size)
    return topology


def parallel_sizes(world_size: int, fsdp_size: int | None, ep_size: int, moe: bool) -> tuple[int, int]:
    """(fsdp_size, ep_size) for this world, checked: the run model validates the spec, this
    re-checks against the world torchrun actually gave us (a mis-set StatefulSet shows here)."""
    fsdp = fsdp_size or world_size
    if world_size % fsdp:
        raise ValueError(f"fsdpSize {fsdp} does not divide the world size {world_size}")
    if ep_size > 1 and not moe:
        raise ValueError("expertParallelSize > 1 needs a mixture-of-experts model (model.moe: true)")
    if fsdp % ep_size:
        raise ValueError(f"expertParallelSize {ep_size} does not divide fsdpSize {fsdp}")
    return fsdp, ep_size


def distributed_config(world_size: int, fsdp_size: int | None = None, ep_size: int = 1,
                       moe: bool = False):
    """transformers' DistributedConfig for FSDP2 (+ EP), or None for one process.

    Replication (HSDP) covers the ranks FSDP does not: world = dp_replicate * fsdp.
    """
    if world_size <= 1:
        return None
    from transformers.distributed import DistributedConfig

    fsdp, ep = parallel_sizes(world_size, fsdp_size, ep_size, moe)
    kwargs = {"fsdp_size": fsdp, "dp_replicate_size": world_size // fsdp}
    if ep > 1:
        kwargs.update(ep_size=ep, ep_implementation="all_to_all")
    return DistributedConfig(**kwargs)


def load_causal_lm(path: str, *, dtype=None, world_size: int = 1, fsdp_size: int | None = None,
                   ep_size: int = 1, moe: bool = False, attn_implementation: str | None = None):
    """The base model, sharded at load time when there is more than one rank."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype or torch.float32}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    cfg = distributed_config(world_size, fsdp_size, ep_size, moe)
    if cfg is not None:
        kwargs["distributed_config"] = cfg
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


def full_tensor(t):
    """A DTensor gathered to its full value (a collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(parameters) -> float:
    """Global L2 norm of the gradients, one partial norm per device mesh, then combined.

    `torch.nn.utils.clip_grad_norm_` refuses DTensors on different meshes (dense FSDP mesh vs
    expert mesh), which is exactly what EP produces.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import get_total_norm

    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        n = get_total_norm(grads)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms)))

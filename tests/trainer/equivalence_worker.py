"""One rank of the FSDP2 / expert-parallel equivalence check (run under torchrun, or alone).

Each rank takes its share of a fixed batch (rows rank::world), computes the GRPO token loss
normalised the way TRL does (divide by tokens-per-rank, the FSDP reduce averages over ranks),
backpropagates, gathers every gradient to its full value, takes one AdamW step and gathers
the parameters. Rank 0 writes everything to OUT for the test to compare with a 1-process run.

    worker.py MODEL_DIR OUT [--moe] [--fsdp N] [--ep N] [--lora]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from asyncgrpo.testing.ranks import leave_after_barrier
from asyncgrpo.trainer.distributed import (
    Topology,
    full_tensor,
    grad_norm,
    init_process_group,
    load_causal_lm,
)
from asyncgrpo.trainer.tree.loss import grpo_loss

ROWS, LEN, VOCAB = 4, 24, 512


def batch():
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (ROWS, LEN), generator=g)
    mask = torch.zeros(ROWS, LEN)
    mask[:, LEN // 2:] = 1  # completion half
    adv = torch.randn(ROWS, generator=g)
    old = -torch.rand(ROWS, LEN, generator=g) * 6 - 3
    return ids, mask, adv, old


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--moe", action="store_true")
    p.add_argument("--fsdp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--lora", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    top = init_process_group(Topology.from_env(), device_type="cpu")
    model = load_causal_lm(a.model, world_size=top.world_size, fsdp_size=a.fsdp, ep_size=a.ep,
                           moe=a.moe, attn_implementation="sdpa")
    if a.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)  # same adapter init on every rank and in the 1-process run
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj"]))
    model.train()
    ids, mask, adv, old = batch()
    rows = list(range(top.rank, ROWS, top.world_size))
    global_tokens = mask[:, 1:].sum()
    logits = model(input_ids=ids[rows]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[rows, 1:, None])[..., 0]
    sel = mask[rows, 1:].bool()
    # The policy loss of the tree engine (TRL's formula), summed over this rank's terms.
    loss_sum = grpo_loss(logp[sel], old[rows, 1:][sel], adv[rows, None].expand_as(logp)[sel],
                         normalizer=1.0)
    # TRL's normalisation: sum / tokens-per-rank; the data-parallel gradient reduce averages.
    loss = loss_sum / (global_tokens / top.world_size)
    loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if top.distributed:
        from torch.distributed.tensor import DTensor

        # Parameters FSDP2 does not manage (an adapter added after sharding) are averaged by
        # transformers' Trainer; do the same here.
        for _, p in trainable:
            if p.grad is not None and not isinstance(p.grad, DTensor):
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    global_loss = loss_sum.detach() / global_tokens
    if top.distributed:
        dist.all_reduce(global_loss)
    grads = {n: full_tensor(p.grad).detach().clone() for n, p in trainable if p.grad is not None}
    norm = grad_norm([p for _, p in trainable])
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-3, weight_decay=0.0)
    opt.step()
    params = {n: full_tensor(p.detach()).clone() for n, p in trainable}
    if top.is_main:
        torch.save({"loss": float(global_loss), "grads": grads, "grad_norm": norm,
                    "params": params}, a.out)
    if top.distributed:
        leave_after_barrier()


if __name__ == "__main__":
    main()

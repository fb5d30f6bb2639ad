"""One trainer rank publishing full weights per rank (run by test_sharded.py under torchrun,
gloo on CPU, world 2), beside today's gather-to-rank-0 path on the same model.

For each model in argv[3:] (``dense``: FSDP 2; ``moe``: FSDP 2 + expert parallel 2), loaded
sharded by the trainer's own ``load_causal_lm``: versions 1..N, each after a sparse change of
every rank's local blocks. Every version is published twice, to two runs of the same bucket:
``sharded-<model>`` by :class:`ShardedWeightTransfer` on every rank, ``gathered-<model>`` by
:class:`BucketWeightTransfer` on rank 0 fed one gathered parameter at a time (TRL's
``_streaming_iter``). Rank 0 also writes the full checkpoint-named state of each version
(``expected-<model>-v<N>.safetensors``), gathered independently, for the bit-for-bit check.
Every rank records its S3 puts (key, bytes, start, end) and its publish records in
``rank-<r>.json``. Rank 1's puts are slowed (``SLOW_RANK1_S``) so that a manifest written
before every rank's object would show in the records.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers.core_model_loading import revert_weight_conversion

from asyncgrpo.testing.ranks import leave_after_barrier
from asyncgrpo.trainer.distributed import full_tensor, init_process_group, load_causal_lm
from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.trainer.weights_sharded import ShardedWeightTransfer
from asyncgrpo.weights.store import WeightStore

VERSIONS = int(os.environ.get("SHARD_VERSIONS", "5"))
ANCHOR_EVERY = 3
SLOW_RANK1_S = float(os.environ.get("SLOW_RANK1_S", "0.3"))


class Recording:
    """The S3 client, recording this rank's puts."""

    def __init__(self, client, rank, puts):
        self._c, self.rank, self.puts = client, rank, puts

    def __getattr__(self, name):
        fn = getattr(self._c, name)
        if name not in ("put_object", "upload_file"):
            return fn

        def call(*a, **kw):
            key = kw.get("Key") or a[2]
            size = len(kw["Body"]) if name == "put_object" else Path(a[0]).stat().st_size
            if self.rank == 1:
                time.sleep(SLOW_RANK1_S)
            t0 = time.time()
            out = fn(*a, **kw)
            self.puts.append({"key": key, "bytes": size, "start": t0, "end": time.time()})
            return out

        return call


def sparse_change(model, version, rank):
    """A few elements of every local block move (as most bf16 elements do not per step)."""
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(1000 * version + rank)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            flat = local.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
            flat[idx] += 0.05 * torch.randn(idx.numel(), generator=g)
            if not isinstance(p, DTensor):  # replicated: keep the ranks equal
                dist.broadcast(p.data, src=0)


def gathered(model, rank):
    """TRL's ``_streaming_iter``: one full parameter at a time, every rank takes part."""
    for name, p in model.named_parameters():
        full = full_tensor(p)
        if rank == 0:
            yield name, full.detach()


def main():
    out, endpoint, bucket = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    top = init_process_group(device_type="cpu")
    rank, world = top.rank, top.world_size
    torch.set_num_threads(1)
    puts: list = []
    records: dict = {}
    for kind in sys.argv[4:]:
        ckpt = out / f"tiny-{kind}"
        model = load_causal_lm(ckpt, world_size=world, fsdp_size=world,
                               ep_size=2 if kind == "moe" else 1, moe=kind == "moe")
        conv = (lambda sd, m=model: revert_weight_conversion(m, sd))
        stores = {}
        for how in ("sharded", "gathered"):
            s = WeightStore(bucket, run=f"{how}-{kind}", endpoint_url=endpoint, attempts=2,
                            backoff_s=0.05)
            s.client = Recording(s.client, rank, puts)
            stores[how] = s
        sharded = ShardedWeightTransfer(stores["sharded"], out / f"stage-s-{kind}", rank=rank,
                                        world=world, anchor_interval=ANCHOR_EVERY,
                                        retention=100, to_checkpoint=conv)
        sharded.init_weight_transfer()
        gather = BucketWeightTransfer(stores["gathered"], out / f"stage-g-{kind}",
                                      anchor_interval=ANCHOR_EVERY, retention=100,
                                      to_checkpoint=conv)
        if rank == 0:
            gather.init_weight_transfer()
        for version in range(1, VERSIONS + 1):
            if version > 1:
                sparse_change(model, version, rank)
            sharded.send_weights(model.named_parameters())
            if rank == 0:
                gather.send_weights(gathered(model, rank))
            else:
                for _ in gathered(model, rank):
                    pass
            dist.barrier()
            # the expected checkpoint, gathered on its own
            full = {}
            for name, p in model.named_parameters():
                t = full_tensor(p).detach().clone()
                if rank == 0:
                    full.update({k: v.contiguous() for k, v in conv({name: t}).items()})
            if rank == 0:
                save_file(full, str(out / f"expected-{kind}-v{version}.safetensors"))
            dist.barrier()
        records[kind] = {"sharded": sharded.published, "gathered": gather.published}
    (out / f"rank-{rank}.json").write_text(json.dumps({"puts": puts, "records": records}))
    leave_after_barrier()


if __name__ == "__main__":
    main()

"""One trainer rank of the sharded-vs-gathered publication benchmark (bench/weights_bench.py
runs it under torchrun, gloo on CPU, world 2).

The model (dense: FSDP 2; moe: FSDP 2 + expert parallel 2), loaded sharded by the trainer's
``load_causal_lm``, is trained with AdamW (fp32 master weights) on random tokens; after each
optimizer step the version is published in bf16 twice, side by side on the same weights: by
:class:`ShardedWeightTransfer` on every rank, and by today's :class:`BucketWeightTransfer` on
rank 0 fed one gathered parameter at a time (TRL's ``_streaming_iter``; the other rank takes
part in each gather). Per rank and publisher: wall time of the call, the peak RSS above the
RSS just before it (sampled every 2 ms), and the bytes of the base it keeps for the next delta.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from transformers.core_model_loading import revert_weight_conversion

from asyncgrpo.trainer.distributed import full_tensor, init_process_group, load_causal_lm
from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.trainer.weights_sharded import ShardedWeightTransfer
from asyncgrpo.weights.store import WeightStore


class PeakRSS:
    """Peak resident set size above the start, sampled on a thread."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.above = self.peak - self.start


def gathered(model, rank):
    for name, p in model.named_parameters():
        full = full_tensor(p)
        if rank == 0:
            yield name, full.detach()


def base_bytes(pub) -> int:
    return sum(t.numel() * t.element_size() for t in (pub._prev or {}).values())


def main():
    out, endpoint, bucket, kind, steps, lr = (Path(sys.argv[1]), sys.argv[2], sys.argv[3],
                                              sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
    top = init_process_group(device_type="cpu")
    rank, world = top.rank, top.world_size
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = load_causal_lm(out / f"model-{kind}", world_size=world, fsdp_size=world,
                           ep_size=2 if kind == "moe" else 1, moe=kind == "moe")
    conv = (lambda sd: revert_weight_conversion(model, sd))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    common = {"anchor_interval": 1000, "retention": 1000, "dtype": torch.bfloat16,
              "to_checkpoint": conv}

    def store(run):
        return WeightStore(bucket, run=f"{run}-{kind}", endpoint_url=endpoint)

    sharded = ShardedWeightTransfer(store("sharded"), out / f"s-{kind}", rank=rank, world=world,
                                    **common)
    sharded.init_weight_transfer()
    gather = BucketWeightTransfer(store("gathered"), out / f"g-{kind}", **common)
    if rank == 0:
        gather.init_weight_transfer()
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    rows = []
    for version in range(1, steps + 2):
        if version > 1:
            ids = torch.randint(0, vocab, (4, 64), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        with PeakRSS() as m_s:
            t0 = time.perf_counter()
            sharded.send_weights(model.named_parameters())
            s_time = time.perf_counter() - t0
        dist.barrier()
        with PeakRSS() as m_g:
            t0 = time.perf_counter()
            if rank == 0:
                gather.send_weights(gathered(model, rank))
            else:
                for _ in gathered(model, rank):
                    pass
            g_time = time.perf_counter() - t0
        dist.barrier()
        rec = sharded.published[-1]
        row = {"version": version, "kind": rec["kind"], "rank": rank,
               "sharded": {"seconds": s_time, "peak_rss_above": m_s.above,
                           "base_bytes": base_bytes(sharded), "rank_bytes": rec["rank_bytes"],
                           "bytes": rec["bytes"], "changed": rec["changed_elements"],
                           "elements": rec["elements"]},
               "gathered": {"seconds": g_time, "peak_rss_above": m_g.above,
                            "base_bytes": base_bytes(gather)}}
        if rank == 0:
            grec = gather.published[-1]
            row["gathered"].update(rank_bytes=grec["bytes"], bytes=grec["bytes"],
                                   kind=grec["kind"], changed=grec["changed_elements"])
        else:
            row["gathered"].update(rank_bytes=0)
        rows.append(row)
    (out / f"{kind}-rank-{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

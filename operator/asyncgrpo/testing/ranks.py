"""How a test's torchrun rank ends: after every rank has done its work, without the
interpreter's teardown, so that its exit status is about the work.

torch leaves gloo's process groups alive after `destroy_process_group()` while DTensor state
still refers to their device meshes: in the expert-parallel equivalence worker 7 gloo I/O
threads and 14 gloo work threads are still running after it. The groups are then destroyed
while the interpreter clears its modules, and that teardown sometimes aborts the process
("terminate called without an active exception", SIGABRT). Here it happened in 1 of 30 runs
with the CPU busy and 1 in about 300 overall (and once in CI's
`test_expert_parallel_two_ranks_equal_one`), after the last collective of the work. torch's
tests show the same abort with `_PyModule_ClearDict` on the stack (pytorch/pytorch#60998).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave_after_barrier() -> NoReturn:
    """Wait for every rank, destroy the process group, and exit 0 without running Python's
    finalization (where torch tears the leftover gloo groups down).

    Call it last, once the rank's results are written: nothing after the barrier runs, and
    atexit handlers do not run either."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

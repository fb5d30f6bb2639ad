"""A gate the trainer can close on the rollout worker's requests to vLLM.

Why: vLLM 0.32's CPU LoRA path crashes the engine (EngineDeadError, `einsum(): subscript b
has size 8 ... 34` in `punica_cpu.add_lora_logits`) when a `prompt_logprobs` request, which
the served-vs-trained probe is, shares a batch with LoRA generation requests (measured
here). The probe alone is fine. So around each probe the trainer closes the gate, waits
for the requests in flight to finish, probes, and opens it again; rollouts only pause for
that long. It is also the hook through which rollouts could be held during any
maintenance that needs a quiet server.

Plugged in through TRL's documented hook `AsyncRolloutWorker._loop_cls`: the child process
runs `GatedRolloutLoop`, which wraps `_post` (every HTTP call the loop makes to vLLM); below
it, `RoutedRolloutLoop` picks the replica each call goes to (`asyncgrpo.trainer.routed_loop`).
"""

from __future__ import annotations

import asyncio
import struct
import time
from multiprocessing import shared_memory

from asyncgrpo.trainer.routed_loop import RoutedRolloutLoop, RoutingConfig

# Shared block: byte 0 = gate open (1) or closed (0), written by the trainer only;
# bytes 4..8 = int32 requests in flight, written by the rollout child only (one asyncio
# thread, so check-then-increment has no await in between). A name, not an mp.Event,
# crosses to the child: TRL pickles the loop's kwargs to validate them, and mp
# synchronisation objects refuse that.
_SIZE = 8


class GatedRolloutLoop(RoutedRolloutLoop):
    def __init__(self, *args, gate_name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._gate_shm = None
        if gate_name:
            # The trainer owns and unlinks the block. The child shares the trainer's
            # resource tracker (spawn), so attaching adds nothing it would clean up.
            self._gate_shm = shared_memory.SharedMemory(name=gate_name)

    def _inflight_add(self, delta: int) -> None:
        buf = self._gate_shm.buf
        (n,) = struct.unpack_from("i", buf, 4)
        struct.pack_into("i", buf, 4, n + delta)

    async def _post(self, path, payload, timeout, max_retries: int = 3):
        if self._gate_shm is None:
            return await super()._post(path, payload, timeout, max_retries)
        while self._gate_shm.buf[0] != 1:
            await asyncio.sleep(0.02)
        self._inflight_add(1)
        try:
            return await super()._post(path, payload, timeout, max_retries)
        finally:
            self._inflight_add(-1)


class RolloutGate:
    """Trainer side: install on a TRL AsyncRolloutWorker before it starts."""

    def __init__(self, worker, routing: RoutingConfig | None = None):
        self._shm = shared_memory.SharedMemory(create=True, size=_SIZE)
        self._shm.buf[:_SIZE] = bytes(_SIZE)
        self._shm.buf[0] = 1
        if not issubclass(worker._loop_cls, GatedRolloutLoop):
            worker._loop_cls = GatedRolloutLoop
        worker._loop_kwargs["gate_name"] = self._shm.name
        if routing is not None:
            worker._loop_kwargs["routing"] = routing

    def _inflight(self) -> int:
        return struct.unpack_from("i", self._shm.buf, 4)[0]

    def hold(self, timeout_s: float) -> bool:
        """Close the gate and wait until no request is in flight; False on timeout (the
        gate stays closed; call release())."""
        self._shm.buf[0] = 0
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline:
            # Twice in a row, 20 ms apart: a request that read "open" just before the close
            # has incremented by then.
            quiet = quiet + 1 if self._inflight() == 0 else 0
            if quiet >= 2:
                return True
            time.sleep(0.02)
        return False

    def release(self) -> None:
        self._shm.buf[0] = 1

    def close(self) -> None:
        try:
            self._shm.close()
            self._shm.unlink()
        except FileNotFoundError:
            pass

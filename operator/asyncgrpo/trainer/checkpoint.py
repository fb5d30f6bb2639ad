"""Checkpoints in the bucket: `<run folder>/checkpoints/step-00000012/...` (the run folder
is `asyncgrpo.api.layout.run_folder`: `<prefix>/<namespace>/<run>/`), COMPLETE last.

The local checkpoint is the Hugging Face Trainer's own directory (adapter or weights,
optimizer, scheduler, RNG states, trainer_state.json with the step, and TRL's
rollout_state.json with the data position and policy version); it is uploaded file by
file and a `COMPLETE` object (JSON: step, policy version, file list) is written last, so
a trainer killed mid-upload leaves nothing anyone resumes from. A restarted trainer takes
the newest checkpoint with COMPLETE and hands the downloaded directory to
`trainer.train(resume_from_checkpoint=...)`.

Multi-node: each rank uploads the files only it has (its `rng_state_<rank>.pth`), rank 0
the rest, then rank 0 writes COMPLETE after a barrier. Every rank downloads the whole
checkpoint into its own pod on resume.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

from asyncgrpo.storage import Bucket, CompleteVersions, StoreUnavailable

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
_RANK_FILE = re.compile(r"^rng_state_(\d+)\.pth$")


def step_dir(step: int) -> str:
    return f"step-{int(step):08d}"


class CheckpointStore:
    """The run's checkpoints: `checkpoints/step-<N>/` folders, complete once COMPLETE is in."""

    def __init__(self, bucket: Bucket, keep: int = 2):
        self.bucket = bucket
        self.keep = max(1, int(keep))
        self.steps = CompleteVersions(bucket, "checkpoints", COMPLETE, r"^step-(\d+)$", step_dir)

    @property
    def root(self) -> str:
        return self.steps.root

    def latest(self) -> int | None:
        return self.steps.latest()

    def info(self, step: int) -> dict:
        return json.loads(self.bucket.get_bytes(self.steps.prefix(step) + COMPLETE))

    def upload(self, local: Path, step: int, *, rank: int = 0, is_main: bool = True,
               barrier: Callable[[], None] | None = None,
               agree: Callable[[bool], bool] | None = None, meta: dict | None = None) -> bool:
        """Upload this rank's share; rank 0 marks it COMPLETE when every rank's share is in.

        An unreachable bucket (after the retries) does not fail training: the checkpoint is
        left incomplete (nobody resumes from it) and False is returned; the next interval
        tries again. `agree(ok)` must return True only if `ok` on every rank (a collective);
        `barrier` is used when it is not given.
        """
        local = Path(local)
        prefix = self.steps.prefix(step)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        mine = []
        for p in files:
            m = _RANK_FILE.match(p.name)
            if (int(m.group(1)) == rank) if m else is_main:
                mine.append(p)
        ok = True
        try:
            for p in mine:
                self.bucket.upload(p, prefix + p.relative_to(local).as_posix())
        except StoreUnavailable as err:
            log.error("checkpoint step %d not written: %s", step, err)
            ok = False
        if agree is not None:
            ok = agree(ok)
        elif barrier is not None:
            barrier()
        if not is_main or not ok:
            return ok
        try:
            listed = sorted(k[len(prefix):] for k in self.bucket.list(prefix))
            doc = {"step": int(step), "files": listed, **(meta or {})}
            self.bucket.put_bytes(prefix + COMPLETE, json.dumps(doc, indent=1).encode())
            log.info("checkpoint step %d in %s (%d files)", step, self.bucket.url(prefix),
                     len(listed))
            self.prune()
        except StoreUnavailable as err:
            log.error("checkpoint step %d not completed: %s", step, err)
            return False
        return True

    def download(self, step: int, dest: Path) -> Path:
        """The checkpoint's files under dest/checkpoint-<step> (the name HF's Trainer reads)."""
        prefix = self.steps.prefix(step)
        target = Path(dest) / f"checkpoint-{int(step)}"
        for key in self.bucket.list(prefix):
            rel = key[len(prefix):]
            if rel == COMPLETE:
                continue
            self.bucket.download(key, target / rel)
        return target

    def prune(self) -> list[int]:
        """Keep the newest `keep` complete checkpoints; drop older ones and dead partials."""
        return self.steps.prune(self.keep)[0]

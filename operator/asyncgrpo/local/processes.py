"""Child processes of the local backend: each in its own session, logged to a file, ended by
its process group so that engine workers and shells it spawned end with it."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ManagedProcess:
    name: str
    proc: subprocess.Popen
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], *, env: dict[str, str], log_path: Path,
              cwd: Path | None = None, cpus: set[int] | None = None) -> ManagedProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:  # a fresh log per start, as a new container's
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=cwd, start_new_session=True)
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)  # children inherit it
        return cls(name, proc, log_path)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                # the leader is gone; its group may still hold children: end them too
                os.killpg(self.proc.pid, signal.SIGKILL)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return

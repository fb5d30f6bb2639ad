"""A memory and process-count bound on all of a sandbox's commands together, via a cgroup.

RLIMIT_AS bounds one process's address space, not what three processes use together, and
RLIMIT_NPROC counts per uid. A cgroup bounds the sum: every command is born inside it, so its
children are too, and `memory.max`/`pids.max` (v2) or `memory.limit_in_bytes`/`pids.max`
(v1) hold for all of them at once; the kernel's OOM killer picks a victim inside the group,
never the server.

Where it works: the server must be able to create a cgroup, i.e. run as root with a writable
cgroup file system. On the development machines here the layout is hybrid (the unified v2
tree carries no memory or pids controller; both are v1 hierarchies), so v1 is what works.
In a pod the cgroup file system is read-only and the pod's own limits (which the operator's
builder always sets) are the bound; `create` then returns None and the server says so.

How commands are born inside it without a helper process or a preexec function (which
would forbid vfork): v1 cgroups hold threads, so the event-loop thread joins the cgroup for
the instant of the fork (under the spawn lock) and leaves it right after; the child starts
inside, before it can run anything.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("asyncgrpo.sandbox.server.cgroup")


def _v1_mounts() -> dict[str, str]:
    """controller -> mount point of its v1 hierarchy."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, extra = left.split(), right.split()
            if len(extra) >= 3 and extra[0] == "cgroup":
                for opt in extra[2].split(","):
                    if opt in ("memory", "pids"):
                        out[opt] = fields[4]
    return out


def _own_paths() -> dict[str, str]:
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                out[c] = path
    return out


@dataclass
class CommandCgroup:
    """The v1 memory and pids cgroups commands are born in; `spawning()` wraps the fork."""

    memory_dir: str
    pids_dir: str
    home_memory: str
    home_pids: str
    memory_bytes: int
    pids: int

    @classmethod
    def create(cls, memory_bytes: int, pids: int, name: str | None = None) -> CommandCgroup | None:
        if memory_bytes <= 0 and pids <= 0:
            return None
        try:
            mounts, own = _v1_mounts(), _own_paths()
            if "memory" not in mounts or "pids" not in mounts:
                log.info("no v1 memory/pids cgroup hierarchy: commands are bounded by the pod's limits")
                return None
            name = name or f"asyncgrpo-sandbox-{os.getpid()}"
            dirs = {}
            for c in ("memory", "pids"):
                home = os.path.join(mounts[c], own.get(c, "/").lstrip("/"))
                _remove_stale(home)
                d = os.path.join(home, name)
                os.makedirs(d, exist_ok=True)
                dirs[c] = (d, home)
            if memory_bytes > 0:
                _write(os.path.join(dirs["memory"][0], "memory.limit_in_bytes"), memory_bytes)
                memsw = os.path.join(dirs["memory"][0], "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # swap too, or a command pages out past the limit
                    _write(memsw, memory_bytes)
            if pids > 0:
                _write(os.path.join(dirs["pids"][0], "pids.max"), pids)
            return cls(dirs["memory"][0], dirs["pids"][0], dirs["memory"][1], dirs["pids"][1], memory_bytes, pids)
        except OSError as err:
            log.info("cannot create a cgroup for commands (%s): commands are bounded by the pod's limits", err)
            return None

    @contextmanager
    def spawning(self):
        """This thread sits in the commands' cgroups while the body forks, and only then."""
        tid = threading.get_native_id()
        _write(os.path.join(self.memory_dir, "tasks"), tid)
        try:
            _write(os.path.join(self.pids_dir, "tasks"), tid)
            try:
                yield
            finally:
                _write(os.path.join(self.home_pids, "tasks"), tid)
        finally:
            _write(os.path.join(self.home_memory, "tasks"), tid)

    def describe(self) -> dict:
        return {"memory_bytes": self.memory_bytes, "pids": self.pids, "memory_cgroup": self.memory_dir}

    def remove(self) -> None:
        for d in (self.memory_dir, self.pids_dir):
            try:
                os.rmdir(d)
            except OSError as err:
                log.warning("could not remove cgroup %s: %s", d, err)


def _remove_stale(home: str) -> None:
    """Remove the empty cgroups of servers that were killed (SIGKILL skips their cleanup)."""
    for entry in os.listdir(home):
        pid = entry.rpartition("-")[2]
        if entry.startswith("asyncgrpo-sandbox-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(home, entry))
            except OSError:
                pass  # still holds a process: not stale


def _write(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(str(value))

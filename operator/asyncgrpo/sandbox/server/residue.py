"""What a command can leave outside the workspace, and its removal at every reset.

Wiping the workspace is not enough: a group could write to /tmp or /dev/shm, or create a
SysV shared memory segment, semaphore set or message queue, and the next group on the same
sandbox read it (in a pod /tmp is an emptyDir that lives as long as the pod, and the IPC
namespace is the pod's). A reset therefore also removes, after every process of the sandbox
is dead:

- from each directory of `--wipe-dirs` (/tmp, /dev/shm, /dev/mqueue), every entry owned by
  the sandbox's uid, whole trees, without following symlinks (`workspace.remove_entry`);
  entries that hold the workspace or the template are kept;
- every SysV IPC object whose owner or creator is that uid (`/proc/sysvipc/*`, IPC_RMID).

Whose uid: in root mode the server's own command uid (no one else has it). A non-root
server shares its uid with its commands, so "owned by the server's uid" means commands only
where nothing else runs as that uid: as PID 1 of its own PID namespace (a pod). A non-root
server outside one (a developer's local run) cannot tell its commands' files in /tmp from
the user's own, and wipes none (said in its log and in docs/sandboxes.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from asyncgrpo.sandbox.server.workspace import _DIR_FLAGS, remove_entry

log = logging.getLogger("asyncgrpo.sandbox.server.residue")
_IPC_RMID = 0


@dataclass
class Residue:
    """Scratch directories and IPC objects of one uid, removed together."""

    uid: int | None  # None: wipe nothing (non-root server outside a PID namespace of its own)
    wipe_dirs: tuple[str, ...] = ("/tmp", "/dev/shm", "/dev/mqueue")
    keep: tuple[str, ...] = ()  # paths (the workspace, the template) whose ancestors stay

    def remove(self) -> dict[str, int]:
        if self.uid is None:
            return {"files": 0, "ipc": 0}
        return {"files": sum(self._wipe(d) for d in self.wipe_dirs), "ipc": remove_ipc(self.uid)}

    def _wipe(self, directory: str) -> int:
        try:
            fd = os.open(directory, _DIR_FLAGS)
        except OSError:
            return 0  # not there (no /dev/mqueue mounted): nothing to wipe
        removed = 0
        try:
            with os.scandir(fd) as it:
                names = [e.name for e in it]
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_uid != self.uid or self._holds_kept(os.path.join(directory, name)):
                    continue
                try:
                    remove_entry(fd, name)
                    removed += 1
                except OSError as err:
                    log.warning("could not remove %s/%s: %s", directory, name, err)
        finally:
            os.close(fd)
        return removed

    def _holds_kept(self, path: str) -> bool:
        path = os.path.realpath(path)
        return any(os.path.realpath(k) == path or os.path.realpath(k).startswith(path + os.sep)
                   for k in self.keep if k)


def _sysvipc(kind: str) -> list[tuple[int, int, int]]:
    """(id, owner uid, creator uid) of every SysV IPC object of a kind (shm, sem, msg)."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = f.read().splitlines()
    except OSError:
        return []
    cols = header.split()
    ident, uid, cuid = cols.index({"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind]), cols.index("uid"), \
        cols.index("cuid")
    out = []
    for row in rows:
        f = row.split()
        if len(f) > max(ident, uid, cuid):
            out.append((int(f[ident]), int(f[uid]), int(f[cuid])))
    return out


def remove_ipc(uid: int) -> int:
    """IPC_RMID every SysV segment, semaphore set and message queue `uid` owns or created."""
    libc = ctypes.CDLL(None, use_errno=True)
    calls = {
        "shm": lambda i: libc.shmctl(i, _IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, _IPC_RMID),
        "msg": lambda i: libc.msgctl(i, _IPC_RMID, None),
    }
    removed = 0
    for kind, rm in calls.items():
        for ident, owner, creator in _sysvipc(kind):
            if uid in (owner, creator):
                if rm(ident) == 0:
                    removed += 1
                else:
                    log.warning("could not remove %s %d of uid %d: errno %d", kind, ident, uid, ctypes.get_errno())
    return removed

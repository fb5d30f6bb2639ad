"""How much disk a sandbox's workspace uses, measured, so a cap holds outside pods too.

In a pod the workspace is an emptyDir with a size limit, but the kubelet enforces it by
evicting the pod (the sandbox is lost) and only every few seconds; run as a local process
(the local backend, a developer's machine) nothing bounds it at all, and RLIMIT_FSIZE caps
one file, not the sum: two 1 GiB files filled a disk. The server therefore measures its
workspace itself, du-style: blocks actually allocated (a sparse file costs what it stores),
each inode once (hardlinks), without following symlinks. It measures after every exec and
every file write, and once a second while any exec runs, so a command that writes
without stopping is caught mid-run.

Why measure and not mount a size-limited file system (tmpfs or a loop device with
`size=`): that needs CAP_SYS_ADMIN, which the sandbox image (non-root, no capabilities)
never has, tmpfs would count the files against the pod's memory, and loop devices are
rarely available inside containers. The cost of measuring is a walk of the workspace
(about 3 us of CPU per file, in a thread: the event loop keeps serving); the bound it
gives is the cap plus what a command writes between two measurements.

A directory the server cannot list (a command's `chmod 000`) is made listable again
(the server owns the workspace, or runs as root); one that stays unreadable counts as
over the cap: what cannot be measured is not trusted. So does every other error of the walk:
a tree nested ~2,100 deep has paths longer than PATH_MAX (ENAMETOOLONG), and ignoring that
error let a 64 MiB quota hold 100 MB. The walk is a loop over a list, never recursion.
"""

from __future__ import annotations

import asyncio
import os
import stat

#: below the pod's 2 GiB workspace emptyDir, so the server's wipe comes before the kubelet's eviction
DEFAULT_MAX_WORKSPACE_BYTES = 1536 << 20


class Unmeasurable(OSError):
    """A directory of the workspace could not be listed even after restoring its mode."""


def disk_usage(root: str) -> int:
    """Bytes allocated under `root` (st_blocks), each inode once, symlinks not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [root]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except FileNotFoundError:
            continue  # removed while we walked
        except PermissionError:
            try:
                os.chmod(top, stat.S_IRWXU)
                entries = list(os.scandir(top))
            except FileNotFoundError:
                continue
            except OSError as err:
                raise Unmeasurable(err.errno, f"cannot list {top}: {err.strerror}") from err
        except OSError as err:  # ENAMETOOLONG, ELOOP, EMFILE, ...: not measurable is over
            raise Unmeasurable(err.errno, f"cannot list {top[:200]}...: {err.strerror}") from err
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as err:
                raise Unmeasurable(err.errno, f"cannot stat in {top[:200]}...: {err.strerror}") from err
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
    return total


class WorkspaceMeter:
    """Fresh measurements of one workspace, one walk at a time, shared by everyone waiting.

    `measure()` always returns a walk that started after it was called (a write or an exec
    that just ended is included), but callers that arrive while a walk is under way share
    the next one: 16 execs ending together cost two walks, not sixteen.
    """

    def __init__(self, root: str, max_bytes: int):
        self.root = root
        self.max_bytes = max_bytes
        self.last_bytes = 0
        self._running: asyncio.Future | None = None
        self._next: asyncio.Future | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    async def measure(self) -> int:
        """Bytes used now; `Unmeasurable` counts as over the cap (returned as cap + 1)."""
        if self._running is None:
            self._running = asyncio.ensure_future(self._walk())
            return await asyncio.shield(self._running)
        if self._next is None:
            self._next = asyncio.ensure_future(self._after(self._running))
        return await asyncio.shield(self._next)

    async def _after(self, running: asyncio.Future) -> int:
        try:
            await running
        except Exception:  # noqa: BLE001, S110 - its own callers saw it; ours is a new walk
            pass
        self._next = None
        self._running = asyncio.ensure_future(self._walk())
        return await self._running

    async def _walk(self) -> int:
        try:
            used = await asyncio.to_thread(disk_usage, self.root)
        except Exception:  # noqa: BLE001 - Unmeasurable, or anything else: what cannot be measured is over
            used = self.max_bytes + 1
        finally:
            self._running = None
        self.last_bytes = used
        return used

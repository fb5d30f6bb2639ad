"""Run one untrusted command and always get control back.

The server runs whatever a policy model writes, so every exec must end on time, with bounded
memory in this process, and leave nothing behind:

- the command starts in a new session (its own process group), so a timeout can kill the
  whole group at once with one `killpg`, and the children it forked die with it;
- before the kill, the descendants of the command are collected from /proc, so a child that
  called `setsid` to leave the group is killed too; the server is a child subreaper
  (`PR_SET_CHILD_SUBREAPER`), so an orphan that escaped both is still our descendant and the
  reset sweep (`kill_all_descendants`) finds it;
- resource limits are set in the child before exec: RLIMIT_NPROC caps a fork bomb (it
  counts every process of the command's uid, which is why commands get their own uid when
  the server starts as root), RLIMIT_FSIZE caps one file, RLIMIT_AS optionally caps memory;
- output is read in fixed chunks into `CappedBuffer`, which keeps a head and a tail and
  drops the middle, so 100 MB of output costs the server the cap, not 100 MB; the tail is
  kept because test runners print their summary last.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncgrpo.sandbox.common.prctl import PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE, prctl

if TYPE_CHECKING:
    from asyncgrpo.sandbox.server.cgroup import CommandCgroup

_READ_CHUNK = 64 * 1024


#: the signals that stop the server; blocked in every server thread (`stopping.StopSignals`
#: reads them with their sender) and unblocked again in every command by its launcher
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class Revoked(Exception):
    """The call's lease ended before the call could start (or the server is stopping)."""


def find_launcher() -> str | None:
    """GNU env, if it can start a command the way the server needs (`launch_argv`), else None."""
    env = shutil.which("env")
    if env is None:
        return None
    try:
        ok = subprocess.run([env, "-C", "/", "--default-signal=TERM,INT", "true"], capture_output=True,
                            timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return env if ok else None


def launch_argv(launcher: str, argv: list[str], cwd: str | None) -> list[str]:
    """argv run through `env`, which, in the child and after the uid drop, unblocks the stop
    signals (the server keeps them blocked) and changes into `cwd` (root mode).

    The chdir must come after the drop: CPython's child changes directory before it calls
    setuid, so as root it followed a symlink a command swapped in after the server checked the
    path, into a directory only root may enter. Done by env as the command's uid, the kernel
    checks the command's own rights. `env` takes leading NAME=VALUE words as assignments, so
    a program whose name contains '=' is started through the shell's exec.
    """
    prefix = [launcher, *(["-C", cwd] if cwd is not None else []), "--default-signal=TERM,INT", "--"]
    if "=" in argv[0]:
        return [*prefix, "/bin/sh", "-c", 'exec "$0" "$@"', *argv]
    return [*prefix, *argv]


def check_executable(argv0: str, path: str | None) -> None:
    """FileNotFoundError (400 spawn_failed) for a program that is not there, as a direct spawn gives."""
    if "/" in argv0:
        if not os.path.exists(argv0):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv0)
    elif shutil.which(argv0, path=path) is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv0)


@dataclass(frozen=True)
class CommandLimits:
    """Per-exec limits; set once by the server from its flags, never by a request."""

    max_procs: int = 512
    max_file_bytes: int = 1 << 30
    max_memory_bytes: int = 0  # 0: left to the pod's cgroup limit
    uid: int | None = None  # drop to this uid/gid in the child (server started as root)
    gid: int | None = None
    # True once `inherit_limits` set them on the server process itself: children inherit
    # them and no preexec_fn is needed, which lets CPython spawn with vfork (non-root mode)
    inherited: bool = False
    # GNU env (`find_launcher`): starts each command (stop signals unblocked; in root mode
    # the chdir after the uid drop). None: spawned directly, cwd by CPython (tests, old images)
    launcher: str | None = None


@dataclass
class ExecResult:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_seconds: float
    killed_processes: int = 0


class CappedBuffer:
    """Keeps at most `cap` bytes of a stream: the first half and the last half.

    Memory stays under about twice the cap no matter how much is written: the tail is a
    bytearray trimmed whenever it passes twice its share, so trimming is amortised.
    """

    def __init__(self, cap: int):
        self.cap = max(0, cap)
        self._head_cap = self.cap // 2
        self._tail_cap = self.cap - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or self._tail_cap == 0:
            return
        if len(data) >= self._tail_cap:
            self._tail = bytearray(data[-self._tail_cap :])
            return
        self._tail += data
        if len(self._tail) > 2 * self._tail_cap:
            del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    def getvalue(self, marker: bytes = b"") -> bytes:
        tail = bytes(self._tail[-self._tail_cap :]) if self._tail_cap else b""
        if not self.truncated:
            return bytes(self._head) + tail
        dropped = self.total - len(self._head) - len(tail)
        note = marker.replace(b"{n}", str(dropped).encode()) if marker else b""
        return bytes(self._head) + note + tail


def use_pidfd_child_watcher() -> bool:
    """Python 3.11 watches each child from its own thread; pidfds need none.

    Threads count against RLIMIT_NPROC like processes, so with threads a fork bomb that
    fills the budget could stop the server from even noticing its children exit.
    (3.12+ uses pidfds by itself.)
    """
    import sys
    import warnings

    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        watcher = asyncio.PidfdChildWatcher()
        asyncio.set_child_watcher(watcher)
        watcher.attach_loop(asyncio.get_running_loop())
    return True


#: root mode: each server takes a block of uids of its own (the first is its command uid;
#: the rest are reserved for per-session uids), held by a lock file for the server's life
COMMAND_UID_BASE = 1_900_000_000
COMMAND_UID_BLOCK = 64
COMMAND_UID_BLOCKS = 4096
UID_LOCK_DIR = "/run/asyncgrpo-sandbox-uids"
_held_uid_locks: list[int] = []


def allocate_command_uid(lock_dir: str = UID_LOCK_DIR) -> int:
    """The first uid of a block no other live server on this machine holds (root only).

    A lock file per block, flock'ed and kept open (close-on-exec: commands do not inherit
    it); the kernel drops the lock when the server dies, so a crashed server's block is
    free again, and its leftover processes are killed by the next holder (`kill_uid`).
    """
    import fcntl

    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    for k in range(COMMAND_UID_BLOCKS):
        uid = COMMAND_UID_BASE + k * COMMAND_UID_BLOCK
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held_uid_locks.append(fd)
        return uid
    raise SystemExit(f"sandbox: all {COMMAND_UID_BLOCKS} command uid blocks are held by running servers")


def harden_server_process() -> dict[str, bool]:
    """Make this process a subreaper and non-dumpable.

    Non-dumpable makes /proc/<server>/environ and /proc/<server>/mem owned by root and
    refuses ptrace, so a command running under the server's own uid (server not root)
    cannot read the token the server was started with.
    """
    return {
        "subreaper": prctl(PR_SET_CHILD_SUBREAPER, 1),
        "non_dumpable": prctl(PR_SET_DUMPABLE, 0),
    }


def _set_limits(limits: CommandLimits, memory: bool) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.max_procs > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
    if limits.max_file_bytes > 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    if memory and limits.max_memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limits.max_memory_bytes, limits.max_memory_bytes))


def inherit_limits(limits: CommandLimits) -> CommandLimits:
    """Set the command limits on this (server) process so every child inherits them.

    RLIMIT_NPROC does not bind a root server (CAP_SYS_RESOURCE) but binds its children
    once they drop to the command uid; a non-root server shares the budget with its
    commands, which is what a pod's pid limit does anyway. RLIMIT_AS stays per child:
    it would cap the server's own memory.
    """
    _set_limits(limits, memory=False)
    return dataclasses.replace(limits, inherited=True)


def _child_setup(limits: CommandLimits, chdir: str | None = None) -> None:
    """Runs in the child between fork and exec, after CPython dropped the uid (no launcher)."""
    _set_limits(limits, memory=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if chdir is not None:
        os.chdir(chdir)


def _proc_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, state letter) for every process visible in /proc."""
    table: dict[int, tuple[int, bytes]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name is in parentheses and may itself contain spaces or parentheses
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) >= 2:
            table[int(name)] = (int(rest[1]), rest[0])
    return table


def descendants(root: int, table: dict[int, tuple[int, bytes]] | None = None) -> list[int]:
    """Live (non-zombie) descendants of `root`."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if table[child][1] != b"Z":
                out.append(child)
            stack.append(child)
    return out


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_tree(pid: int, rounds: int = 5) -> int:
    """SIGKILL the process group of `pid` and every descendant of `pid`; return how many.

    Repeated a few rounds because a fork bomb can fork between the scan and the kill;
    RLIMIT_NPROC bounds how many it can make, so a few rounds empty it.
    """
    killed: set[int] = set()
    for _ in range(rounds):
        found = descendants(pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        killed.update(p for p in [pid, *found] if _kill(p))
        if not found:
            break
    return len(killed)


def kill_group(pgid: int) -> int:
    """SIGKILL what is left of a finished command's process group (its background jobs).

    Only the group, never the pid itself: the leader was reaped and its pid may be reused,
    but a process group id stays reserved while any member lives.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
        return 1
    except (ProcessLookupError, PermissionError):
        return 0


def kill_all_descendants(tracked: set[int] | frozenset[int] = frozenset(), rounds: int = 10) -> int:
    """Kill every process below this server (orphans were re-parented to us: subreaper).

    Killed direct children of ours stay zombies until asyncio's watcher reaps them; only
    orphans are reaped here.
    """
    me = os.getpid()
    killed: set[int] = set()
    for _ in range(rounds):
        found = descendants(me)
        if not found:
            break
        killed.update(p for p in found if _kill(p))
    reap_orphans(tracked)
    return len(killed)


def _uids(pid: int) -> tuple[int, ...]:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def processes_of_uid(uid: int) -> list[int]:
    """Live processes whose real, effective, saved or file-system uid is `uid`."""
    me = os.getpid()
    return [pid for pid, (_ppid, state) in _proc_table().items()
            if pid != me and state != b"Z" and uid in _uids(pid)]


def kill_uid(uid: int, rounds: int = 10) -> int:
    """SIGKILL every process of `uid` (root mode: the sandbox's own command uid), wherever it is.

    A command's process that is no longer below the server (a server restarted after a
    crash, or a double fork before the subreaper was set) is still found by its uid. Each
    kill goes through a pidfd taken after the uid was read again, so a pid reused by
    another process between the scan and the kill is never signalled.
    """
    killed: set[int] = set()
    for _ in range(rounds):
        found = processes_of_uid(uid)
        if not found:
            break
        for pid in found:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if uid in _uids(pid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed.add(pid)
            except OSError:
                pass
            finally:
                os.close(fd)
    return len(killed)


def reap_orphans(tracked: set[int] | frozenset[int] = frozenset()) -> int:
    """Reap zombie children we did not spawn ourselves (re-parented orphans).

    asyncio waits only for the pids it started; waiting for any pid would steal their exit
    status, so zombies are found by parent pid and state in /proc and reaped one by one.
    """
    me = os.getpid()
    reaped = 0
    for pid, (ppid, state) in _proc_table().items():
        if ppid != me or pid in tracked:
            continue
        if state == b"Z":
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
            except ChildProcessError:
                pass
    return reaped


@dataclass
class Runner:
    """Starts commands under `limits` and remembers which pids are its own direct children."""

    limits: CommandLimits
    cgroup: CommandCgroup | None = None  # commands are born inside it (memory, pids of all together)
    live: set[int] = field(default_factory=set)
    # held from fork until the pid is in `live`, so the orphan reaper never mistakes a
    # just-spawned child of ours (not yet tracked) for an orphan and steals its exit status
    _spawn_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False  # the server is stopping: no command starts any more

    def _kill_everything(self) -> int:
        killed = kill_all_descendants(frozenset(self.live))
        if self.limits.uid is not None:
            killed += kill_uid(self.limits.uid)
        return killed

    def _anything_left(self) -> bool:
        if descendants(os.getpid()):
            return True
        return self.limits.uid is not None and bool(processes_of_uid(self.limits.uid))

    async def close(self, wait_seconds: float = 10.0) -> int:
        """Stop for good: no command starts after this, and every one that ran is dead."""
        async with self._spawn_lock:
            self.closed = True
        return await self.sweep(wait_seconds)

    async def reap(self) -> int:
        async with self._spawn_lock:
            return reap_orphans(frozenset(self.live))

    async def sweep(self, wait_seconds: float = 10.0) -> int:
        """Kill every process any command left behind, and wait until they are dead (reset).

        Holds the spawn lock throughout, so no command starts while the sweep runs; a
        command admitted before it is one of the processes killed. "Dead" means no live
        (non-zombie) descendant is left: a process killed mid-write finishes that one
        system call before it dies, so the workspace is wiped only after this returns.
        """
        async with self._spawn_lock:
            killed = self._kill_everything()
            deadline = time.monotonic() + wait_seconds
            while self._anything_left() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
                killed += self._kill_everything()
            return killed

    async def run(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: dict[str, str],
        stdin: bytes | AsyncIterable[bytes] | None,
        timeout: float,
        max_output_bytes: int,
        admit: Callable[[], bool] = lambda: True,
    ) -> ExecResult:
        """Run `argv`; `admit()` is asked under the spawn lock, right before the fork.

        The sandbox passes "is this call's lease still the current one": a call that waited
        for a slot while its lease was revoked and the sandbox reset never starts (`Revoked`).
        """
        started = time.monotonic()
        lim = self.limits
        loop = asyncio.get_running_loop()
        async with self._spawn_lock:
            if self.closed:
                raise Revoked("the sandbox server is stopping")
            if not admit():
                raise Revoked("the lease this call was made under has ended")
            with self.cgroup.spawning() if self.cgroup else contextlib.nullcontext():
                transport, protocol = await _spawn(loop, argv, cwd, env, stdin, lim)
            proc = asyncio.subprocess.Process(transport, protocol, loop)
            self.live.add(proc.pid)
        out, err = CappedBuffer(max_output_bytes), CappedBuffer(max_output_bytes)
        readers = [
            asyncio.create_task(_drain(proc.stdout, out)),
            asyncio.create_task(_drain(proc.stderr, err)),
        ]
        feeder = asyncio.create_task(_feed(proc.stdin, stdin)) if stdin is not None else None
        timed_out = False
        killed = 0
        try:
            try:
                # not proc.wait(): in 3.11 it also waits for the pipes, which a background
                # job of the command can hold open for as long as it likes
                await asyncio.wait_for(protocol.exited.wait(), timeout)
            except TimeoutError:
                timed_out = True
                killed = kill_tree(proc.pid)
                await protocol.exited.wait()
            if feeder is not None:  # the command is gone: what it did not read stays unread
                feeder.cancel()
            # Background jobs of the command share its process group: they end with it, and
            # their end closes the pipes so the readers below see EOF.
            if not timed_out:
                killed += kill_group(proc.pid)
            remaining = max(0.5, timeout - (time.monotonic() - started))
            _done, pending = await asyncio.wait(readers, timeout=min(remaining, 5.0))
            for task in pending:  # an escaped process still holds a pipe: stop reading
                task.cancel()
            if pending:
                transport.close()
            await proc.wait()
        except BaseException:
            kill_tree(proc.pid)
            for task in [*readers, feeder] if feeder else readers:
                task.cancel()
            raise
        finally:
            self.live.discard(proc.pid)
        marker = b"\n...[{n} bytes truncated]...\n"
        return ExecResult(
            exit_code=proc.returncode,
            stdout=out.getvalue(marker),
            stderr=err.getvalue(marker),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            timed_out=timed_out,
            duration_seconds=time.monotonic() - started,
            killed_processes=killed,
        )


async def _spawn(loop, argv, cwd, env, stdin, lim: CommandLimits):
    check_executable(argv[0], env.get("PATH"))
    root = lim.uid is not None
    if lim.launcher is not None:
        # root: env changes directory as the command's uid (CPython's cwd= would do it as root)
        argv, cwd = launch_argv(lim.launcher, argv, cwd if root else None), ("/" if root else cwd)
        chdir_after_drop = None
    else:
        chdir_after_drop, cwd = (cwd, "/") if root else (None, cwd)
    # without a launcher the child itself must unblock the stop signals it inherited
    needs_preexec = lim.launcher is None or not lim.inherited or lim.max_memory_bytes > 0
    return await loop.subprocess_exec(
        lambda: _ExitAwareProtocol(loop),
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        user=lim.uid,
        group=lim.gid,
        extra_groups=[] if root else None,
        preexec_fn=(lambda: _child_setup(lim, chdir_after_drop)) if needs_preexec else None,
    )


class _ExitAwareProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Signals the process's exit on its own, apart from its pipes closing."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(limit=_READ_CHUNK, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def _drain(stream: asyncio.StreamReader, sink: CappedBuffer) -> None:
    while True:
        chunk = await stream.read(_READ_CHUNK)
        if not chunk:
            return
        sink.write(chunk)


async def _feed(stream: asyncio.StreamWriter, data: bytes | AsyncIterable[bytes]) -> None:
    """Write stdin, then close it; chunk by chunk for a stream, each written once the pipe
    has room (drain), so a streamed stdin costs the server about one chunk, not its size."""
    try:
        if isinstance(data, bytes):
            stream.write(data)
            await stream.drain()
        else:
            async for chunk in data:
                stream.write(chunk)
                await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        try:
            stream.close()
        except Exception:  # noqa: BLE001, S110 - the child is gone; nothing to close
            pass

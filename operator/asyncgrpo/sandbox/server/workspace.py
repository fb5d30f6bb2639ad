"""The sandbox's workspace: sessions, confined file access, and reset to the initial state.

Layout: `<root>/<session>/` per session (default session `main`), each created on first
use as a copy of the template directory (the task's initial files, baked into the image
read-only). The G rollouts of a group share one sandbox but each uses its own session, so
their files never collide; reset wipes every session, and the next use copies the
template again.

Confinement of the files API does not trust path strings: a path is split into plain
components (no `..`, no absolute paths, no NUL) and opened one component at a time with
`openat(..., O_NOFOLLOW)` from the session directory, so a symlink anywhere on the path is
refused, and a symlink swapped in after a check cannot redirect the open (no check-then-use
race). Commands themselves are not confined by this: the pod is their boundary.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from dataclasses import dataclass

SESSION_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
DEFAULT_SESSION = "main"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathRefused(ValueError):
    """The path leaves the workspace, goes through a symlink, or is malformed."""


class QuotaExceeded(Exception):
    """A write would take the workspace over its quota."""


def split_path(path: str) -> list[str]:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise PathRefused("path must be a non-empty string without NUL bytes")
    if path.startswith("/"):
        raise PathRefused("path must be relative to the workspace")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise PathRefused("path must not contain '..'")
    if not parts:
        raise PathRefused("path names the workspace itself")
    return parts


@dataclass
class Workspace:
    root: str
    template: str | None = None
    uid: int | None = None  # owner of session files when the server runs as root
    gid: int | None = None

    def __post_init__(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self._chown(self.root)
        if self.uid is not None:  # root mode: no other uid (another sandbox's) may enter
            os.chmod(self.root, 0o700)

    # sessions ---------------------------------------------------------------
    def session_dir(self, session: str | None) -> str:
        name = session or DEFAULT_SESSION
        if not SESSION_RE.match(name) or name in (".", ".."):
            raise PathRefused(f"invalid session name {name!r}")
        path = os.path.join(self.root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):  # a command replaced it with a symlink or file
                raise PathRefused(f"session {name!r} is not a directory")
        except FileNotFoundError:
            self._create_session(path)
        return path

    def _create_session(self, path: str) -> None:
        staging = f"{path}.creating-{os.getpid()}"
        _remove(staging)
        if self.template and os.path.isdir(self.template):
            shutil.copytree(self.template, staging, symlinks=True)
        else:
            os.makedirs(staging)
        self._chown_tree(staging)
        try:
            os.rename(staging, path)
        except OSError as err:  # a concurrent request created it first
            _remove(staging)
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise

    def reset(self) -> None:
        """Remove everything under the root; sessions come back from the template on use."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            clear_directory(fd)
        finally:
            os.close(fd)

    # confined file access ----------------------------------------------------
    def _open_parent(self, session: str | None, parts: list[str], create: bool) -> int:
        fd = os.open(self.session_dir(session), _DIR_FLAGS)
        try:
            for part in parts[:-1]:
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    self._fchown(nfd)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise PathRefused(f"{part!r} is a symlink or not a directory") from err
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def confined_dir(self, session: str | None, path: str | None) -> str:
        """The session directory, or a directory below it reached without any symlink.

        Used for an exec's cwd: `a/link` pointing elsewhere would start the command outside
        its session. (The command may `cd` anywhere afterwards: the pod is its boundary;
        this keeps the request's meaning exact.)
        """
        home = self.session_dir(session)
        if not path:
            return home
        parts = split_path(path)
        fd = self._open_parent(session, [*parts, "."], create=False)
        os.close(fd)
        return os.path.join(home, *parts)

    def _check_owned(self, fd: int, path: str) -> os.stat_result:
        """Root mode: refuse a file the commands' uid does not own, or one with other names.

        The server opens files as root: a hardlink a command made to a root-owned file
        outside the workspace (`ln /etc/shadow x`) would otherwise be read, written and
        chowned with root's rights.
        """
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"{path!r} is not a regular file")
        if self.uid is not None and (st.st_uid != self.uid or st.st_nlink != 1):
            raise PathRefused(f"{path!r} is hardlinked or not owned by the sandbox's user")
        return st

    def read(self, session: str | None, path: str, max_bytes: int) -> tuple[bytes, int]:
        """Return (up to max_bytes of the file, its full size)."""
        parts = split_path(path)
        dfd = self._open_parent(session, parts, create=False)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise PathRefused(f"{path!r} is a symlink") from err
            raise
        finally:
            os.close(dfd)
        try:
            st = self._check_owned(fd, path)
            chunks, got = [], 0
            while got < max_bytes:
                chunk = os.read(fd, min(1 << 20, max_bytes - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks), st.st_size
        finally:
            os.close(fd)

    def write(self, session: str | None, path: str, data: bytes, mode: int = 0o644,
              max_growth: int | None = None) -> int:
        """Write `data` to `path` (replacing it); `max_growth`: bytes the workspace may still grow.

        The growth is the new size less the file's old one, checked once the file is open
        and before anything changes, so a refused write leaves the old contents.
        """
        parts = split_path(path)
        dfd = self._open_parent(session, parts, create=True)
        # never O_TRUNC: the file is checked (regular, ours, one name) before it is changed
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            try:
                fd = os.open(parts[-1], flags | os.O_CREAT | os.O_EXCL, mode & 0o777, dir_fd=dfd)
                created = True
            except FileExistsError:
                fd = os.open(parts[-1], flags, dir_fd=dfd)
                created = False
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise PathRefused(f"{path!r} is a symlink") from err
            if err.errno in (errno.EISDIR, errno.ENXIO):  # ENXIO: a FIFO nobody reads
                raise PathRefused(f"{path!r} is a directory or not a regular file") from err
            raise
        finally:
            os.close(dfd)
        try:
            if created:
                self._fchown(fd)
            st = self._check_owned(fd, path)
            if max_growth is not None and len(data) - st.st_size > max_growth:
                if created:  # leave no empty file behind
                    pfd = self._open_parent(session, parts, create=False)
                    try:
                        os.unlink(parts[-1], dir_fd=pfd)
                    except FileNotFoundError:
                        pass
                    finally:
                        os.close(pfd)
                raise QuotaExceeded(f"writing {len(data)} bytes to {path!r} would take the workspace over its "
                                    f"quota ({max(0, max_growth)} bytes left)")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            return len(data)
        finally:
            os.close(fd)

    # ownership when running as root -------------------------------------------
    def _chown(self, path: str) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.gid if self.gid is not None else -1, follow_symlinks=False)

    def _fchown(self, fd: int) -> None:
        if self.uid is not None:
            os.fchown(fd, self.uid, self.gid if self.gid is not None else -1)

    def _chown_tree(self, top: str) -> None:
        if self.uid is None:
            return
        self._chown(top)
        for base, dirs, files in os.walk(top):
            for name in dirs + files:
                self._chown(os.path.join(base, name))


def _remove(path: str) -> None:
    """Delete a file or a tree a hostile command made (see `remove_entry`)."""
    parent, name = os.path.split(os.path.abspath(path))
    pfd = os.open(parent, _DIR_FLAGS)
    try:
        remove_entry(pfd, name)
    finally:
        os.close(pfd)


def _open_subdir(dfd: int, name: str) -> int:
    """Open a subdirectory without following a symlink; one a command made unlistable
    (`chmod 000`, owned by the server's uid or any as root) is made listable first."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except PermissionError:
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                raise
            os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # the inode itself: an O_PATH fd never follows
        finally:
            os.close(pfd)
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)


def _unlink(dfd: int, name: str, directory: bool = False) -> None:
    op = (lambda: os.rmdir(name, dir_fd=dfd)) if directory else (lambda: os.unlink(name, dir_fd=dfd))
    try:
        op()
    except FileNotFoundError:
        pass
    except PermissionError:  # the directory holding it was made read-only (chmod 500)
        os.fchmod(dfd, 0o700)
        try:
            op()
        except FileNotFoundError:
            pass


def _scan(dfd: int) -> list[str]:
    """Unlink every non-directory in the open directory; return its subdirectories' names."""
    subdirs = []
    with os.scandir(dfd) as it:
        entries = list(it)
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if is_dir:
            subdirs.append(entry.name)
        else:
            _unlink(dfd, entry.name)
    return subdirs


def clear_directory(top_fd: int) -> None:
    """Remove everything inside the open directory `top_fd`, however deep, with O(1) fds.

    Iterative, on a list rather than Python's stack (1,100 nested directories made the
    recursive walks of `os.walk`/`shutil.rmtree` raise RecursionError and every reset
    answer 500), by file descriptor rather than path (past ~2,000 levels a path is longer
    than PATH_MAX), and with one directory open at a time: it goes back up through `..`,
    checked against the parent's device and inode, so nothing a command could move
    redirects it. Symlinks are unlinked, never followed.
    """
    top = os.fstat(top_fd)
    cur, cur_id = os.dup(top_fd), (top.st_dev, top.st_ino)
    above: list[tuple[str, tuple[int, int]]] = []  # (name in parent, parent's id) per level below top
    pending = [_scan(cur)]  # subdirectories still to clear, per level
    try:
        while True:
            if pending[-1]:
                name = pending[-1].pop()
                try:
                    child = _open_subdir(cur, name)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    if err.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    _unlink(cur, name)  # no longer a directory
                    continue
                st = os.fstat(child)
                above.append((name, cur_id))
                os.close(cur)
                cur, cur_id = child, (st.st_dev, st.st_ino)
                pending.append(_scan(cur))
                continue
            if not above:
                return
            name, parent_id = above.pop()
            pending.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=cur)
            pst = os.fstat(parent)
            os.close(cur)
            cur = parent
            if (pst.st_dev, pst.st_ino) != parent_id:
                raise OSError(errno.ESTALE, "a directory was moved while it was being removed")
            cur_id = parent_id
            try:
                _unlink(cur, name, directory=True)
            except OSError as err:
                if err.errno != errno.ENOTEMPTY:  # something was added meanwhile: go again
                    raise
                pending[-1].append(name)
    finally:
        os.close(cur)


def remove_entry(dfd: int, name: str) -> None:
    """Remove `name` in the open directory `dfd`: a file, a symlink (not its target) or a tree."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _unlink(dfd, name)
        return
    fd = _open_subdir(dfd, name)
    try:
        clear_directory(fd)
    finally:
        os.close(fd)
    _unlink(dfd, name, directory=True)

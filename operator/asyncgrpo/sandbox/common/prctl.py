"""prctl(2) from Python: the server's hardening (`server.process`) and the gateway's."""

from __future__ import annotations

import ctypes

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def make_non_dumpable() -> bool:
    """/proc/<pid>/environ and /mem become root's and ptrace is refused (same-uid readers)."""
    return prctl(PR_SET_DUMPABLE, 0)

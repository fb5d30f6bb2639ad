"""Ports on this machine: what `asyncgrpo local run` needs to place the run's pods (a free
port for each one that must move, whether a local S3 server already listens) and to wait for
the servers it starts. Tests and benchmarks use the same helpers (`asyncgrpo.testing.net`)."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (loopback by default) right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None,
                  host: str = "127.0.0.1") -> None:
    """Wait until something accepts connections on `host`:`port`; fail early if `proc`
    (the server being waited for) exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        if listening(port, host):
            return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on `host`:`port` now."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0

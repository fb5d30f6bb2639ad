"""Sandbox servers and gateways as real processes on loopback, started and ended here."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from asyncgrpo.testing.waiting import wait_for
from tests.conftest import free_port, wait_for_port

TOKEN = "sandbox-test-token-0123456789"
# the secret of the lease tests install with `reset(sb)`: data calls need it, not TOKEN
LEASE = "lease-secret-for-tests-0123456789"
_BASES: list[Path] = []
#: the interpreter another uid can run (the venv's lives in the checkout, maybe under /root)
SYSTEM_PYTHON = "/usr/bin/python3.11"
#: a python3 with no packages at all, as a task's own image has: the bundle's servers run on it
FOREIGN_PYTHON = "/usr/bin/python3"
#: how a test's sandbox server starts: `venv` (`asyncgrpo sandbox serve`, the test venv's
#: Python) or `bundle` (what a task's own image runs: FOREIGN_PYTHON -I -S on the bundle that
#: `asyncgrpo sandbox bundle` writes); `@pytest.mark.parametrize("sandbox", SERVER_KINDS,
#: indirect=True)` runs a test on both
SERVER_KINDS = ("venv", "bundle")


def _first_path_closed_to_others(path: Path) -> Path | None:
    """The first folder on the way to `path` that other users cannot enter, or None."""
    for folder in [*reversed(path.parents), path]:
        if not folder.stat().st_mode & 0o001:
            return folder
    return None


def pythonpath_for_another_uid(uid: int, *tools: str) -> str:
    """The PYTHONPATH (the checkout's operator/ and the venv's site-packages) under which the
    unprivileged-server tests start the project's code as `uid` (with `tools`: setpriv,
    unshare) and the system Python. Skips unless that can work: root, that Python, the
    tools, and every folder on the way open to others (a mode-700 temporary clone, or a
    checkout under /root, is not)."""
    if os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) \
            or not all(shutil.which(t) for t in tools):
        pytest.skip(f"needs root, {', '.join(tools)} and {SYSTEM_PYTHON} to start a server "
                    f"as uid {uid}")
    paths = [Path(__file__).resolve().parents[2] / "operator",
             Path(next(p for p in sys.path if p.endswith("site-packages")))]
    for path in paths:
        closed = _first_path_closed_to_others(path)
        if closed is not None:
            pytest.skip(f"uid {uid} cannot import the code: {closed} is not world-searchable")
    return ":".join(map(str, paths))


@pytest.fixture(autouse=True, scope="session")
def _remove_workspaces():
    yield
    from asyncgrpo.sandbox.server.workspace import _remove

    for base in _BASES:  # iterative: a test may leave a tree nested thousands deep
        try:
            _remove(str(base))
        except OSError:
            shutil.rmtree(base, ignore_errors=True)
GW_TOKEN = "gateway-test-token-9876543210"


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path, port: int, host: str = "127.0.0.1", **popen):
        self.args, self.env, self.log_path, self.port, self.popen = args, env, log, port, popen
        self.host = host
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, **self.popen)
        if self.host == "127.0.0.1":
            wait_for_port(self.port, proc=self.proc)
        else:
            def listening():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with {self.proc.returncode}: {self.logs()}")
                with socket.socket() as s:
                    return s.connect_ex((self.host, self.port)) == 0
            wait_until(listening, 30, what=f"{self.host}:{self.port} listening")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server and everything it started (its session)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.log.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def logs(self) -> str:
        return self.log_path.read_text()


def _cli() -> list[str]:
    return [sys.executable, "-m", "asyncgrpo.cli"]


@pytest.fixture(scope="session")
def server_bundle() -> Path:
    """The server's bundle (`asyncgrpo sandbox bundle`), written once, in a folder every uid
    can read (as the init container's emptyDir); skips without FOREIGN_PYTHON."""
    if not os.access(FOREIGN_PYTHON, os.X_OK):
        pytest.skip(f"no {FOREIGN_PYTHON} to run the bundle with")
    from asyncgrpo.sandbox.server.portable import write_bundle

    base = Path(tempfile.mkdtemp(prefix="asyncgrpo-bundle-"))
    base.chmod(0o755)
    _BASES.append(base)
    return write_bundle(base / "server")


def start_sandbox(tmp: Path, name: str = "sb", *extra: str, port: int | None = None, env: dict | None = None,
                  host: str = "127.0.0.1", bundle: Path | None = None, python: str = FOREIGN_PYTHON,
                  **popen) -> Proc:
    """A sandbox server on `port`; `bundle`: started from that bundle entry with `python`
    (`python3 -I -S <entry> serve`, as in a task's own image), else `asyncgrpo sandbox serve`."""
    port = port or free_port()
    # commands run as another uid (server as root): the workspace must be reachable by path,
    # and pytest's tmp_path lives under a root-only directory
    base = Path(tempfile.mkdtemp(prefix=f"asyncgrpo-{name}-"))
    base.chmod(0o711)
    _BASES.append(base)
    ws = base / "ws"
    serve = [python, "-I", "-S", str(bundle), "serve"] if bundle else [*_cli(), "sandbox", "serve"]
    args = [*serve, "--host", host, "--port", str(port), "--workspace", str(ws), *extra]
    e = {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, **(env or {})}
    p = Proc(args, e, tmp / f"{name}.log", port, host=host, **popen)
    p.workspace = ws
    return p


def start_gateway(tmp: Path, members: list[str] | None, *extra: str, name: str = "gw",
                  env: dict | None = None) -> Proc:
    port = free_port()
    args = [*_cli(), "gateway", "--host", "127.0.0.1", "--port", str(port), *extra]
    if members is not None:
        args += ["--members", ",".join(members)]
    e = {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "ASYNCGRPO_GATEWAY_TOKEN": GW_TOKEN, **(env or {})}
    return Proc(args, e, tmp / f"{name}.log", port)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """asyncgrpo.testing.waiting.wait_for with this suite's argument order; errors in the
    predicate are not retried (a refused call is a failure here, not "not yet")."""
    return wait_for(predicate, timeout, interval, what, retry_on=())


def reset(sb: Proc, secret: str | None = LEASE) -> dict:
    """The gateway's control call: revoke the lease, wipe, install `secret` as the next one
    (sealed in the reset credential); the answer must prove the server knows the token."""
    from asyncgrpo.sandbox.common.challenge import reset_call

    call = reset_call(TOKEN, sb.url, secret)
    r = httpx.post(f"{sb.url}/v1/reset", content=call.body, headers=call.headers, timeout=120)
    r.raise_for_status()
    assert call.proven_by(r.content), r.text
    return r.json()


def lease_client(sb: Proc, secret: str = LEASE) -> httpx.Client:
    return httpx.Client(base_url=sb.url, headers={"authorization": f"Bearer {secret}"}, timeout=120)


@pytest.fixture
def sandbox(tmp_path, request):
    """A server as `asyncgrpo sandbox serve` runs it, or (indirect parameter "bundle", see
    SERVER_KINDS) from the bundle with a packageless python3."""
    kind = getattr(request, "param", "venv")
    bundle = request.getfixturevalue("server_bundle") if kind == "bundle" else None
    p = start_sandbox(tmp_path, "sb", "--max-procs", "128", "--max-output-bytes", "65536", bundle=bundle)
    yield p
    p.stop()


@pytest.fixture
def client(sandbox):
    reset(sandbox)
    with lease_client(sandbox) as c:
        yield c


@pytest.fixture
def pool_of_three(tmp_path):
    sbs = [start_sandbox(tmp_path, f"sb{i}") for i in range(3)]
    gw = start_gateway(tmp_path, [s.url for s in sbs], "--lease-ttl-seconds", "30",
                       "--health-interval-seconds", "0.3", "--health-failures", "2")
    yield gw, sbs
    gw.stop()
    for s in sbs:
        s.stop()


def gw_client(gw: Proc) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {GW_TOKEN}"}, timeout=120)


def warm_count(gw: Proc) -> int:
    return httpx.get(f"{gw.url}/v1/demand", timeout=10).json()["idle"]


def holder(gw: Proc, lease: dict) -> httpx.Client:
    """A client of the gateway holding `lease`: its secret is the credential of its calls."""
    return httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {lease['secret']}"}, timeout=120)

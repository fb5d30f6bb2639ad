"""The sandbox server as a real process, attacked the way a policy model might attack it."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from asyncgrpo.sandbox.server.process import COMMAND_UID_BASE
from tests.sandbox.conftest import LEASE, TOKEN, lease_client, reset, start_sandbox, wait_until

# the classic bomb, kept alive by its first shell so the exec runs into its timeout
BOMB = "bomb(){ bomb | bomb & }; bomb; sleep 60"


def descendants_of(pid: int) -> list[int]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            rest = stat[stat.rfind(b")") + 2 :].split()
            if rest[0] != b"Z":
                table[int(name)] = int(rest[1])
    out, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for child, ppid in table.items():
            if ppid == parent:
                out.append(child)
                stack.append(child)
    return out


def cmdlines_containing(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_exec_returns_exit_code_output_stdin_env_and_cwd(client):
    client.post("/v1/files/write", json={"path": "sub/marker.txt", "content": "here"}).raise_for_status()
    r = client.post("/v1/exec", json={
        "command": "cat; echo \"$GREETING\"; ls; echo oops >&2; exit 3",
        "stdin": "from stdin\n", "env": {"GREETING": "hello"}, "cwd": "sub",
    }).json()
    assert r["exit_code"] == 3
    assert r["stdout"] == "from stdin\nhello\nmarker.txt\n"
    assert r["stderr"] == "oops\n"
    assert r["timed_out"] is False and r["stdout_truncated"] is False
    argv = client.post("/v1/exec", json={"command": ["printf", "%s|", "a b", "$HOME"]}).json()
    assert argv["stdout"] == "a b|$HOME|"


def test_commands_run_unprivileged_without_the_token(client, sandbox):
    r = client.post("/v1/exec", json={"command": "id -u; env; cat /proc/$PPID/environ"}).json()
    lines = r["stdout"].splitlines()
    if os.geteuid() == 0:
        assert int(lines[0]) >= COMMAND_UID_BASE  # a uid of this server's own, never a shared one
    assert TOKEN not in r["stdout"] + r["stderr"]
    assert "ASYNCGRPO" not in r["stdout"]
    # the server's parent environment held the token; the command cannot read the server's
    assert "Permission denied" in r["stderr"]


def test_timeout_kills_the_loop_and_its_children(client, sandbox):
    r = client.post("/v1/exec", json={
        "command": "sleep 317.25 & sleep 317.25 & setsid sleep 317.25 & while :; do :; done",
        "timeout_seconds": 1,
    }).json()
    assert r["timed_out"] is True
    assert r["exit_code"] == -9
    # the setsid child left the process group; it is found as a descendant and killed too
    wait_until(lambda: not cmdlines_containing("317.25"), 10, what="all sleeps killed")
    assert client.get("/healthz").json()["execs_in_flight"] == 0


def test_background_jobs_end_with_the_exec_and_escapees_end_at_reset(client, sandbox):
    # the escapee writes its pid once it has left the group; the exec waits for that
    r = client.post("/v1/exec", json={"command": "sleep 318.5 & setsid sh -c 'echo $$ > pid; exec sleep 319.5' "
                                                 "> /dev/null 2>&1 & while [ ! -s pid ]; do :; done; echo started"})
    assert r.json()["stdout"] == "started\n" and r.json()["timed_out"] is False
    wait_until(lambda: not cmdlines_containing("318.5"), 10, what="background job killed with its exec")
    assert cmdlines_containing("319.5"), "setsid escapee should survive the exec (it left the group)"
    assert reset(sandbox)["killed_processes"] >= 1
    wait_until(lambda: not cmdlines_containing("319.5"), 10, what="escapee killed by reset")


@pytest.mark.slow
def test_fork_bomb_is_contained(client, sandbox):
    r = client.post("/v1/exec", json={"command": BOMB, "timeout_seconds": 4}).json()
    assert r["timed_out"] is True  # the bomb ran into RLIMIT_NPROC, then the timeout took it all
    assert "Resource temporarily unavailable" in r["stderr"]
    reset(sandbox)
    wait_until(lambda: not descendants_of(sandbox.pid), 20, what="no process left after reset")
    after = client.post("/v1/exec", json={"command": "echo alive"}).json()
    assert after["stdout"] == "alive\n"
    assert client.get("/healthz").status_code == 200


def test_output_of_100_mb_is_truncated_with_flat_memory(client, sandbox):
    client.post("/v1/exec", json={"command": "head -c 1000000 /dev/zero | tr '\\0' a"}).raise_for_status()
    before = peak_rss_kib(sandbox.pid)
    r = client.post("/v1/exec", json={
        "command": "head -c 100000000 /dev/zero | tr '\\0' a; echo; echo THE-END", "timeout_seconds": 120,
    }).json()
    growth_mib = (peak_rss_kib(sandbox.pid) - before) / 1024
    assert r["exit_code"] == 0 and r["stdout_truncated"] is True
    assert r["stdout_bytes"] == 100_000_000 + 9
    assert len(r["stdout"]) <= 65536 + 100  # the cap, plus the marker line
    assert r["stdout"].startswith("a" * 100) and r["stdout"].endswith("THE-END\n")
    assert "bytes truncated" in r["stdout"]
    assert growth_mib < 32, f"server peak RSS grew {growth_mib:.1f} MiB for 100 MB of output"


@pytest.mark.parametrize("path", [
    "../outside.txt", "/etc/passwd", "a/../../outside.txt", "a/b/../../../outside.txt", "a\x00b", "", ".",
])
def test_path_traversal_is_refused(client, sandbox, path):
    for route, body in (("/v1/files/read", {"path": path}), ("/v1/files/write", {"path": path, "content": "x"})):
        r = client.post(route, json=body)
        assert r.status_code == 400, (route, path, r.text)
        assert r.json()["detail"]["error"] == "path_refused"
    assert not (sandbox.workspace / "outside.txt").exists()


def test_symlink_escape_is_refused(client, sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    secret.chmod(0o644)
    outside = tmp_path / "outside-dir"
    outside.mkdir()
    client.post("/v1/exec", json={"command": f"ln -s {secret} leak; ln -s {outside} door; mkdir -p d; "
                                             f"ln -s ../leak d/leak2"}).raise_for_status()
    for path in ("leak", "door/x.txt", "d/leak2"):
        r = client.post("/v1/files/read", json={"path": path})
        assert r.status_code == 400 and r.json()["detail"]["error"] == "path_refused", r.text
        w = client.post("/v1/files/write", json={"path": path, "content": "pwned"})
        assert w.status_code == 400 and w.json()["detail"]["error"] == "path_refused", w.text
    assert secret.read_text() == "top secret"
    assert list(outside.iterdir()) == []


def test_missing_or_wrong_token_is_refused(sandbox):
    routes = [("post", "/v1/exec", {"command": "true"}), ("post", "/v1/files/read", {"path": "x"}),
              ("post", "/v1/files/write", {"path": "x", "content": "y"}), ("post", "/v1/reset", None)]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                    {"authorization": f"Bearer {TOKEN}x"}, {"authorization": f"Basic {TOKEN}"}):
        for method, route, body in routes:
            r = httpx.request(method, sandbox.url + route, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (headers, route)
    assert not (sandbox.workspace / "main" / "x").exists()
    assert httpx.get(sandbox.url + "/healthz").status_code == 200
    metrics = httpx.get(sandbox.url + "/metrics").text
    assert 'asyncgrpo_sandbox_requests_rejected_total{reason="unauthorized"} 20.0' in metrics


def test_huge_and_malformed_bodies_are_refused(client, sandbox):
    auth = {"authorization": f"Bearer {LEASE}"}
    # declared too large: refused before the body is read
    with socket.create_connection(("127.0.0.1", sandbox.port)) as s:
        s.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + LEASE.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")

    def chunks():
        for _ in range(40):
            yield b"x" * (1 << 20)

    r = httpx.post(sandbox.url + "/v1/files/write", content=chunks(), headers=auth, timeout=60)
    assert r.status_code == 413  # chunked, no Content-Length: counted while read
    big = {"path": "big.txt", "content": "y" * (5 << 20)}
    assert client.post("/v1/files/write", json=big).status_code == 413
    assert client.post("/v1/exec", content=b"{not json").status_code == 400
    assert client.post("/v1/exec", content=b"\xff\xfe\x00").status_code == 400
    assert client.post("/v1/exec", json=[1, 2]).status_code == 422
    assert client.post("/v1/exec", json={"command": 5}).status_code == 422
    assert client.post("/v1/exec", json={"command": "true", "surprise": 1}).status_code == 422
    assert client.post("/v1/exec", json={"command": ""}).status_code == 422
    assert client.post("/v1/exec", json={"command": "true", "env": {"A=B": "x"}}).status_code == 422
    assert client.post("/v1/exec", json={"command": "true", "timeout_seconds": -1}).status_code == 422
    assert client.post("/v1/exec", json={"command": "true", "session": "../x"}).status_code == 400
    bad_header = socket.create_connection(("127.0.0.1", sandbox.port))
    bad_header.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 * 1024) + b"\r\n\r\n")
    reply = bad_header.recv(4096)
    bad_header.close()
    assert not reply.startswith(b"HTTP/1.1 200")
    assert client.post("/v1/exec", json={"command": "echo still fine"}).json()["stdout"] == "still fine\n"


def test_reset_restores_the_template_and_sessions_are_apart(tmp_path):
    template = tmp_path / "template"
    (template / "pkg").mkdir(parents=True)
    (template / "pkg" / "mod.py").write_text("VALUE = 1\n")
    sb = start_sandbox(tmp_path, "tpl", "--template", str(template))
    try:
        reset(sb)
        with lease_client(sb) as c:
            c.post("/v1/files/write", json={"path": "pkg/mod.py", "content": "VALUE = 2\n", "session": "r0"})
            c.post("/v1/exec", json={"command": "rm -rf pkg; mkdir -p junk; chmod 000 junk; touch new",
                                     "session": "r1"}).raise_for_status()
            r0 = c.post("/v1/files/read", json={"path": "pkg/mod.py", "session": "r0"}).json()
            r2 = c.post("/v1/files/read", json={"path": "pkg/mod.py", "session": "r2"}).json()
            assert (r0["content"], r2["content"]) == ("VALUE = 2\n", "VALUE = 1\n")
            assert c.post("/v1/files/read", json={"path": "pkg/mod.py", "session": "r1"}).status_code == 404
            reset(sb)
            for session in ("r0", "r1"):
                again = c.post("/v1/exec", json={"command": "cat pkg/mod.py; ls", "session": session}).json()
                assert again["stdout"] == "VALUE = 1\npkg\n"
        assert (template / "pkg" / "mod.py").read_text() == "VALUE = 1\n"
    finally:
        sb.stop()


@pytest.mark.slow
def test_500_concurrent_execs_are_served(tmp_path):
    sb = start_sandbox(tmp_path, "many", "--max-concurrent-execs", "32")
    reset(sb)

    async def run_all():
        limits = httpx.Limits(max_connections=500)
        async with httpx.AsyncClient(base_url=sb.url, headers={"authorization": f"Bearer {LEASE}"},
                                     timeout=300, limits=limits) as c:
            async def one(i):
                r = await c.post("/v1/exec", json={"command": f"echo {i}", "timeout_seconds": 120})
                return r.status_code, r.json()
            return await asyncio.gather(*(one(i) for i in range(500)))

    try:
        results = asyncio.run(run_all())
        assert [status for status, _ in results] == [200] * 500
        assert [body["stdout"] for _, body in results] == [f"{i}\n" for i in range(500)]
        metrics = httpx.get(sb.url + "/metrics").text
        assert 'asyncgrpo_sandbox_execs_total{outcome="ok"} 500.0' in metrics
    finally:
        sb.stop()


def test_server_refuses_to_start_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGRPO_SANDBOX_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "sandbox", "serve", "--port", "1",
                        "--workspace", str(tmp_path / "w")], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "no token" in r.stderr


def test_metrics_names_carry_units(client, sandbox):
    client.post("/v1/exec", json={"command": "true"})
    text = httpx.get(sandbox.url + "/metrics").text
    for name in ("asyncgrpo_sandbox_exec_seconds_bucket", "asyncgrpo_sandbox_execs_total",
                 "asyncgrpo_sandbox_output_bytes_total", "asyncgrpo_sandbox_execs_in_flight",
                 "asyncgrpo_sandbox_reset_seconds_count"):
        assert name in text


@pytest.fixture
def nonroot_sandbox(tmp_path):
    """The image's mode: the server itself runs as an unprivileged uid, commands under the same uid.

    Started with `setpriv` and the system Python (the venv's interpreter lives under /root),
    importing the venv's packages by PYTHONPATH.
    """
    from tests.conftest import free_port
    from tests.sandbox.conftest import (
        SYSTEM_PYTHON,
        Proc,
        pythonpath_for_another_uid,
    )

    pythonpath = pythonpath_for_another_uid(65534, "setpriv")

    home = tempfile.mkdtemp(prefix="asyncgrpo-nonroot-")
    os.chown(home, 65534, 65534)
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "PYTHONPATH": pythonpath}
    args = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-m", "asyncgrpo.cli",
            "sandbox", "serve", "--host", "127.0.0.1", "--port", str(port), "--workspace", f"{home}/ws",
            "--max-procs", "128"]
    p = Proc(args, env, tmp_path / "nonroot.log", port, cwd=home)
    try:
        yield p
    finally:
        p.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_non_root_server_hides_its_token_from_same_uid_commands(nonroot_sandbox):
    """Non-dumpable keeps /proc/<server> root-owned, so a same-uid command cannot read its environ."""
    reset(nonroot_sandbox)
    r = httpx.post(f"{nonroot_sandbox.url}/v1/exec", headers={"authorization": f"Bearer {LEASE}"}, timeout=30,
                   json={"command": "id -u; env; cat /proc/$PPID/environ; ls -ln /proc/$PPID/environ"}).json()
    assert r["stdout"].splitlines()[0] == "65534"
    assert TOKEN not in r["stdout"] + r["stderr"]
    assert "Permission denied" in r["stderr"]


@pytest.mark.slow
def test_fork_bomb_is_contained_when_the_server_is_not_root(nonroot_sandbox):
    reset(nonroot_sandbox)
    with lease_client(nonroot_sandbox) as c:
        r = c.post("/v1/exec", json={"command": BOMB, "timeout_seconds": 4}).json()
        assert r["timed_out"] is True
        assert "Resource temporarily unavailable" in r["stderr"]
        reset(nonroot_sandbox)
        wait_until(lambda: not descendants_of(nonroot_sandbox.pid), 20, what="no process left after reset")
        assert c.post("/v1/exec", json={"command": "echo alive"}).json()["stdout"] == "alive\n"

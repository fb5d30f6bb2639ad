"""State a command or a client can create never gives a 500, and the connection stays usable.

Each case came out of attacking a real server as a hostile rollout would; each asserts the
4xx with its reason, then that the same keep-alive connection still serves an exec. The
cases marked `on_both` run on a server from the bundle too (a packageless python3 -I -S, as
in a task's own image; `SERVER_KINDS`).
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.sandbox.conftest import SERVER_KINDS, gw_client, holder, start_gateway, start_sandbox
from tests.sandbox.test_gateway import all_warm

#: the case runs on the venv's server and on one from the bundle (see the module docstring)
on_both = pytest.mark.parametrize("sandbox", SERVER_KINDS, indirect=True)


def still_serves(client: httpx.Client, path: str = "/v1/exec") -> None:
    assert client.post(path, json={"command": "echo fine"}).json()["stdout"] == "fine\n"


@on_both
def test_writing_to_a_fifo_the_command_made_is_a_4xx(client):
    client.post("/v1/exec", json={"command": "mkfifo pipe"}).raise_for_status()
    for _ in range(5):
        w = client.post("/v1/files/write", json={"path": "pipe", "content": "x"})
        assert w.status_code == 400 and w.json()["detail"]["error"] == "path_refused", w.text
        r = client.post("/v1/files/read", json={"path": "pipe"})
        assert r.status_code == 400 and r.json()["detail"]["error"] == "path_refused", r.text
        still_serves(client)


@on_both
def test_writes_racing_a_symlink_swap_never_500(client, sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    swapper = client.post("/v1/exec", json={
        "command": f"(for i in $(seq 4000); do rm -rf d; mkdir d; rm -rf d; ln -s {outside} d; done) "
                   "> /dev/null 2>&1 & echo started", "timeout_seconds": 120})
    assert swapper.json()["stdout"] == "started\n"
    statuses = []
    for i in range(200):
        r = client.post("/v1/files/write", json={"path": f"d/sub/f{i}.txt", "content": "x"})
        statuses.append(r.status_code)
        assert r.status_code in (200, 400, 404, 409), r.text
    assert list(outside.iterdir()) == []  # never written through the symlink
    assert 500 not in statuses
    still_serves(client)


@on_both
@pytest.mark.parametrize("depth", [1000, 200_000])
def test_deeply_nested_json_is_a_400_in_server_and_gateway(client, sandbox, tmp_path, depth):
    deep = b'{"command": ' + b"[" * depth + b"]" * depth + b"}"
    r = client.post("/v1/exec", content=deep)
    assert r.status_code in (400, 422), r.text
    still_serves(client)
    gw = start_gateway(tmp_path, [sandbox.url], "--health-interval-seconds", "0.3", "--data-path", "proxied")
    try:
        all_warm(gw, 1)
        with gw_client(gw) as c:
            lease = c.post("/v1/leases", json={"group_id": "deep"}).json()
            assert c.post("/v1/leases", content=b'{"group_id": ' + b"[" * depth + b"]" * depth + b"}"
                          ).status_code in (400, 422)
            h = holder(gw, lease)
            r = h.post(f"/v1/leases/{lease['lease_id']}/exec", content=deep)
            assert r.status_code in (400, 422), r.text
            still_serves(h, f"/v1/leases/{lease['lease_id']}/exec")
    finally:
        gw.stop()


@on_both
def test_exec_cwd_through_a_symlink_is_refused(client, tmp_path):
    client.post("/v1/exec", json={"command": f"mkdir -p real; ln -s {tmp_path} out; ln -s real inside"})
    for cwd in ("out", "inside", "missing", "real/../.."):
        r = client.post("/v1/exec", json={"command": "pwd", "cwd": cwd})
        assert r.status_code == 400 and r.json()["detail"]["error"] in ("bad_cwd", "path_refused"), (cwd, r.text)
    assert client.post("/v1/exec", json={"command": "pwd", "cwd": "real"}).json()["stdout"].endswith("/main/real\n")


@on_both
def test_binary_output_comes_back_exact_in_base64(client):
    raw = bytes(range(256)) * 4
    client.post("/v1/files/write", json={"path": "blob", "content": base64.b64encode(raw).decode(),
                                         "encoding": "base64"}).raise_for_status()
    r = client.post("/v1/exec", json={"command": "cat blob; printf '\\377' >&2", "output_encoding": "base64"}).json()
    assert base64.b64decode(r["stdout"]) == raw and base64.b64decode(r["stderr"]) == b"\xff"
    assert r["output_encoding"] == "base64"
    cut = client.post("/v1/exec", json={"command": "head -c 10000 /dev/zero", "max_output_bytes": 100,
                                        "output_encoding": "base64"}).json()
    out = base64.b64decode(cut["stdout"])
    assert cut["stdout_truncated"] and out.startswith(b"\0" * 50) and out.endswith(b"\0" * 50)
    assert b"...[9900 bytes truncated]..." in out  # the marker survives the encoding
    text = client.post("/v1/exec", json={"command": "printf '\\377'"}).json()
    assert text["stdout"] == "\ufffd"  # the default stays text, invalid bytes replaced


def test_slow_request_heads_are_cut_off(sandbox, client):
    slow = [socket.create_connection(("127.0.0.1", sandbox.port)) for _ in range(20)]
    for s in slow:
        s.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\n")  # ... and never finishes the head
    for s in slow:
        s.settimeout(60)
        assert s.recv(100) == b""  # closed by the server (header timeout), not left open
        s.close()
    still_serves(client)


def test_a_stalled_body_gets_408(sandbox, client):
    from tests.sandbox.conftest import LEASE

    s = socket.create_connection(("127.0.0.1", sandbox.port))
    s.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + LEASE.encode()
              + b"\r\nContent-Length: 100\r\n\r\n{\"comm")
    s.settimeout(120)
    assert s.recv(4096).startswith(b"HTTP/1.1 408")
    s.close()
    still_serves(client)


def test_refuses_command_uid_0(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the uid flags matter only when the server starts as root")
    env = {**os.environ, "ASYNCGRPO_SANDBOX_TOKEN": "t"}
    for flag in ("--command-uid", "--command-gid"):
        r = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "sandbox", "serve", "--port", "1",
                            "--workspace", str(tmp_path / "w"), flag, "0"], env=env, capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode != 0 and "unprivileged" in r.stderr


@on_both
def test_root_mode_refuses_hardlinked_and_foreign_files(client, sandbox):
    if os.geteuid() != 0:
        pytest.skip("the server opens files with root's rights only when it runs as root")
    # a root-owned file anyone may write, on the workspace's file system (hardlinks need that)
    target = Path(sandbox.workspace).parent / "root-owned.txt"
    target.write_text("root's\n")
    target.chmod(0o666)
    client.post("/v1/exec", json={"command": f"ln {target} h; echo mine > own; ln own own2"}).raise_for_status()
    for path in ("h", "own"):
        r = client.post("/v1/files/read", json={"path": path})
        w = client.post("/v1/files/write", json={"path": path, "content": "pwned"})
        assert r.status_code == w.status_code == 400, (path, r.text, w.text)
    assert target.read_text() == "root's\n" and target.stat().st_uid == 0
    assert client.post("/v1/files/read", json={"path": "own2"}).status_code == 400  # own file, 2 names
    assert client.post("/v1/files/write", json={"path": "fresh", "content": "ok"}).status_code == 200
    assert client.post("/v1/files/read", json={"path": "fresh"}).json()["content"] == "ok"


@on_both
def test_concurrent_clients_after_errors_keep_their_connections(client):
    errors: list[str] = []

    def hammer():
        with httpx.Client(base_url=str(client.base_url), headers=dict(client.headers), timeout=60) as c:
            for _ in range(20):
                for body in ({"path": "../x"}, {"path": "nope"}):
                    if c.post("/v1/files/read", json=body).status_code >= 500:
                        errors.append("5xx")
                if c.post("/v1/exec", json={"command": "echo ok"}).json()["stdout"] != "ok\n":
                    errors.append("exec")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_commands_memory_together_is_bounded_by_a_cgroup(tmp_path):
    from tests.sandbox.conftest import lease_client, reset

    sb = start_sandbox(tmp_path, "cg", "--cgroup-memory-bytes", str(256 << 20), "--cgroup-pids", "64")
    try:
        cgroup = httpx.get(f"{sb.url}/healthz").json()["cgroup"]
        if cgroup is None:
            pytest.skip("this machine lets the server create no memory/pids cgroup (see docs/sandboxes.md)")
        reset(sb)
        with lease_client(sb) as c:
            # three processes of 150 MB each: each under any per-process cap, 450 MB together
            hog = ("python3 -c 'import time; b = bytearray(150 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
                   "time.sleep(3)' & ")
            r = c.post("/v1/exec", json={"command": hog * 3 + "wait; echo done", "timeout_seconds": 60}).json()
            assert r["stdout"] == "done\n"
            assert "Killed" in r["stderr"] or "MemoryError" in r["stderr"], r["stderr"]
            bomb = c.post("/v1/exec", json={"command": "for i in $(seq 200); do sleep 30 & done; wait",
                                            "timeout_seconds": 5}).json()
            assert "Resource temporarily unavailable" in bomb["stderr"]  # pids.max, not RLIMIT_NPROC (512)
            reset(sb)
            still_serves(c)
    finally:
        sb.stop()
    assert not os.path.exists(cgroup["memory_cgroup"])  # removed when the server ends

"""Attacks that reached the next group through a reused sandbox (issue 23), each run through a
real server; the PID-1 cases run it as PID 1 of its own PID namespace, as a pod does."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from asyncgrpo.sandbox.common.challenge import reset_call
from tests.sandbox.conftest import (
    LEASE,
    SYSTEM_PYTHON,
    TOKEN,
    Proc,
    lease_client,
    pythonpath_for_another_uid,
    reset,
    start_sandbox,
    wait_until,
)

UID = 65533  # the unprivileged server's uid in the PID-1 tests


def test_reset_never_takes_the_token_and_proves_the_server(sandbox):
    bearer = httpx.post(f"{sandbox.url}/v1/reset", json={"lease_secret": LEASE},
                        headers={"authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 401 and bearer.headers["connection"] == "close"
    call = reset_call(TOKEN, sandbox.url, LEASE)
    ok = httpx.post(f"{sandbox.url}/v1/reset", content=call.body, headers=call.headers)
    assert ok.status_code == 200 and call.proven_by(ok.content) and ok.json()["leased"]
    assert TOKEN not in str(call.headers)  # the secret is sealed: neither travels in clear
    assert LEASE not in str(call.headers)
    again = httpx.post(f"{sandbox.url}/v1/reset", content=call.body, headers=call.headers)
    assert again.status_code == 401  # a captured credential opens once
    other = reset_call(TOKEN, "http://127.0.0.1:1", LEASE)  # made for another sandbox
    assert httpx.post(f"{sandbox.url}/v1/reset", content=other.body, headers=other.headers).status_code == 401
    assert not call.proven_by(b'{"proof": "made-up"}')
    assert "authorization" not in {k.lower() for k in httpx.get(f"{sandbox.url}/healthz").request.headers}


def test_unauthenticated_connections_close_at_once_without_reading_the_body(sandbox):
    s = socket.create_connection(("127.0.0.1", sandbox.port))
    s.sendall(b"POST /v1/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
              b"Content-Length: 100000000\r\n\r\n" + b"x" * 65536)
    s.settimeout(30)
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
    s.close()  # recv returned b"": the server closed, it did not wait for the 100 MB


def test_a_streamed_body_stops_being_read_when_the_answer_is_sent(client, sandbox):
    s = socket.create_connection(("127.0.0.1", sandbox.port))
    head = b'{"command": "head -c 10 >/dev/null; echo done"}\n'
    s.sendall(b"POST /v1/exec/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + LEASE.encode()
              + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(head) + head + b"\r\n")
    s.settimeout(30)
    sent = 0
    try:
        for _ in range(20000):  # keeps streaming stdin the command never reads
            s.sendall(b"10000\r\n" + b"y" * 0x10000 + b"\r\n")
            sent += 0x10000
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    assert sent < 20000 * 0x10000  # the server stopped reading and closed
    s.close()


def _nested_dirs(depth: int, then: str = "") -> str:
    """A command that makes `d/d/.../d`, `depth` deep, and runs the Python `then` at its
    bottom. One python3 makes the whole tree: a shell's `mkdir d; cd d` loop forks a mkdir
    a level, each resolving the ever deeper cwd (21 s for 1,100 levels, about 4x that for
    2,200, against 0.2 s here); the attack is the tree, not the shell."""
    return ("python3 -c 'import os\n"
            f"for _ in range({depth}):\n    os.mkdir(\"d\"); os.chdir(\"d\")\n{then}'")


def test_deep_trees_neither_break_reset_nor_escape_the_quota(tmp_path):
    sb = start_sandbox(tmp_path, "deep", "--max-workspace-bytes", str(64 << 20), "--max-timeout-seconds", "300")
    try:
        reset(sb)
        with lease_client(sb) as c:
            deep = c.post("/v1/exec", json={"command": _nested_dirs(1100) + " && echo ok",
                                            "timeout_seconds": 300}, timeout=330).json()
            assert deep["stdout"] == "ok\n", deep  # every level made
            r = reset(sb)  # was 500 (RecursionError) for every reset after this
            assert r["leased"] and list(Path(sb.workspace).iterdir()) == []
            big = ("with open(\"big\", \"wb\") as f:\n"  # 100 MB at the bottom, as head -c 100000000 /dev/zero
                   "    for _ in range(100):\n        f.write(bytes(10 ** 6))\n")
            deeper = c.post("/v1/exec", json={"command": _nested_dirs(2200, big), "timeout_seconds": 300},
                            timeout=330)
            assert deeper.status_code == 507, deeper.text  # unmeasurable counts as over: wiped
            w = c.post("/v1/files/write", json={"path": "f", "content": "x"})
            assert w.status_code == 200, w.text  # never a 500
            assert reset(sb)["leased"]
    finally:
        sb.stop()


def test_reset_wipes_tmp_shm_and_ipc_of_the_sandbox_uid(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("root mode: the sandbox has a uid of its own whose leftovers are found by owner")
    sb = start_sandbox(tmp_path, "residue")
    try:
        reset(sb, "group-a-secret-0123456789")
        a = lease_client(sb, "group-a-secret-0123456789")
        mark = f"asyncgrpo-{os.getpid()}-{time.monotonic_ns()}"
        made = a.post("/v1/exec", json={"command": (
            f"echo a-was-here > /tmp/{mark}; mkdir -p /tmp/{mark}.d/x; echo a > /dev/shm/{mark}; "
            "python3 -c 'import sys; from multiprocessing import shared_memory as s; "
            "m = s.SharedMemory(create=True, size=4096); m.close()' ; ipcmk -M 4096 >/dev/null; ipcmk -S 1 >/dev/null; "
            "ipcmk -Q >/dev/null; ipcs -c | grep -c \"$(id -u)\"")}).json()
        assert int(made["stdout"].strip() or 0) >= 3, made
        removed = reset(sb, "group-b-secret-0123456789")["removed"]
        assert removed["files"] >= 3 and removed["ipc"] >= 3, removed
        b = lease_client(sb, "group-b-secret-0123456789")
        seen = b.post("/v1/exec", json={"command": f"cat /tmp/{mark} /dev/shm/{mark}; ls -d /tmp/{mark}.d; "
                                                   "ipcs -c | grep -c \"$(id -u)\""}).json()
        assert "a-was-here" not in seen["stdout"] and seen["stdout"].strip().splitlines()[-1] == "0", seen
    finally:
        sb.stop()


def test_scoring_sees_nothing_the_rollout_left_in_tmp_or_shm(tmp_path):
    """A rollout's leftovers outside its workspace (a file in /tmp the tests would pick up)
    are gone before the row's tests run in the scoring session."""
    if os.geteuid() != 0:
        pytest.skip("root mode: the sandbox has a uid of its own whose leftovers are found by owner")
    sb = start_sandbox(tmp_path, "score-residue")
    try:
        reset(sb, "rollout-secret-0123456789ab")
        c = lease_client(sb, "rollout-secret-0123456789ab")
        mark = f"asyncgrpo-{os.getpid()}-{time.monotonic_ns()}"
        c.post("/v1/exec", json={"command": f"echo 1 > /tmp/{mark}; echo 1 > /dev/shm/{mark}"}
               ).raise_for_status()
        scored = c.post("/v1/score", json={
            "command": f"test ! -e /tmp/{mark} && test ! -e /dev/shm/{mark}",
            "files": {"check.txt": "x"}, "editable": []}).json()
        assert scored["exit_code"] == 0, scored
    finally:
        sb.stop()


def test_root_mode_changes_directory_as_the_command_uid(tmp_path):
    """A cwd checked while it was a directory, swapped for a symlink to a root-only place
    before the command started: the chdir is done with the command's rights, so it fails."""
    if os.geteuid() != 0:
        pytest.skip("only a root server changes uid")
    secret = Path(tempfile.mkdtemp(prefix="asyncgrpo-rootonly-"))
    try:
        secret.chmod(0o700)
        (secret / "pub").mkdir(mode=0o755)
        (secret / "pub" / "flag").write_text("root-only-flag\n")
        (secret / "pub" / "flag").chmod(0o644)
        sb = start_sandbox(tmp_path, "chdir", "--max-concurrent-execs", "1")
        try:
            reset(sb)
            with lease_client(sb) as c:
                c.post("/v1/exec", json={"command": "mkdir d"}).raise_for_status()
                import threading

                holder = threading.Thread(target=lambda: c.post("/v1/exec", json={
                    "command": f"touch started; sleep 2; rmdir d; ln -s {secret}/pub d", "timeout_seconds": 30}))
                holder.start()
                # the holder has the only slot (file calls need none); the next exec's cwd is checked now
                wait_until(lambda: c.post("/v1/files/read", json={"path": "started"}).status_code == 200, 30,
                           what="the holder runs")
                with lease_client(sb) as c2:
                    r = c2.post("/v1/exec", json={"command": "cat flag; pwd", "cwd": "d"}).json()
                holder.join()
                assert "root-only-flag" not in r["stdout"], r
        finally:
            sb.stop()
    finally:
        shutil.rmtree(secret, ignore_errors=True)


def test_each_root_server_has_its_own_command_uid(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("root mode only")
    a, b = start_sandbox(tmp_path, "ua"), start_sandbox(tmp_path, "ub")
    try:
        reset(a)
        reset(b)
        with lease_client(a) as ca, lease_client(b) as cb:
            ua = ca.post("/v1/exec", json={"command": "id -u; echo secret-of-a > mine"}).json()["stdout"].split()[0]
            ub = cb.post("/v1/exec", json={"command": "id -u; sleep 30 & echo $! > pid"}).json()["stdout"].split()[0]
            assert ua != ub
            probe = cb.post("/v1/exec", json={"command": f"cat {a.workspace}/main/mine; "
                                                        f"kill $(cat {b.workspace}/main/pid) 2>&1; echo rc=$?"}).json()
            assert "secret-of-a" not in probe["stdout"]
    finally:
        a.stop()
        b.stop()


# --- the server as PID 1 of its own PID namespace, unprivileged (a pod's mode) -------------

FAKE = """
import socket, sys, time
port, mark = int(sys.argv[1]), sys.argv[2]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
deadline = time.time() + 30
while time.time() < deadline:
    try:
        s.bind(("127.0.0.1", port))
        break
    except OSError:
        time.sleep(0.001)
else:
    sys.exit(0)
open(mark, "w").write("bound")
s.listen(16)
while True:
    conn, _ = s.accept()
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 15\\r\\n\\r\\n{\\"status\\":\\"ok\\"}")
    conn.close()
"""


@pytest.fixture
def pid1_sandbox(tmp_path):
    pythonpath = pythonpath_for_another_uid(UID, "unshare", "setpriv")
    from tests.conftest import free_port

    home = Path(tempfile.mkdtemp(prefix="asyncgrpo-pid1-"))
    home.chmod(0o755)
    os.chown(home, UID, UID)
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "PYTHONPATH": pythonpath}
    args = ["unshare", "--pid", "--fork", "--mount-proc", "setpriv", f"--reuid={UID}", f"--regid={UID}",
            "--clear-groups", SYSTEM_PYTHON, "-m", "asyncgrpo.cli", "sandbox", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--workspace", f"{home}/ws", "--wipe-dirs", ""]
    p = Proc(args, env, tmp_path / "pid1.log", port, cwd=home)
    p.home = home
    try:
        yield p
    finally:
        p.kill()
        shutil.rmtree(home, ignore_errors=True)


def _fake_setup(sb) -> tuple[Path, str]:
    fake = sb.home / "fake.py"
    fake.write_text(FAKE)
    mark = sb.home / "ws" / "bound"
    return fake, f"setsid sh -c 'python3 {fake} {sb.port} {mark} &'; sleep 0.2"


def test_a_command_cannot_stop_a_pid1_server_or_take_its_port(pid1_sandbox):
    sb = pid1_sandbox
    reset(sb)
    _, start_fake = _fake_setup(sb)
    with lease_client(sb) as c:
        r = c.post("/v1/exec", json={"command": f"{start_fake}; kill -TERM 1; kill -INT 1; kill -KILL 1; "
                                                "sleep 2; echo survived", "timeout_seconds": 30}).json()
        assert r["stdout"].endswith("survived\n"), r
    time.sleep(1)
    assert sb.proc.poll() is None, sb.logs()
    call = reset_call(TOKEN, sb.url, LEASE)  # the real server answers: it proves the token
    answer = httpx.post(f"{sb.url}/v1/reset", content=call.body, headers=call.headers, timeout=60)
    assert answer.status_code == 200 and call.proven_by(answer.content)
    assert not (sb.home / "ws" / "bound").exists()


def test_sigterm_kills_every_command_before_the_listener_closes(pid1_sandbox):
    sb = pid1_sandbox
    reset(sb)
    fake, start_fake = _fake_setup(sb)
    mark = sb.home / "bound"  # outside the workspace: survives whatever the server does to it
    start_fake = f"setsid sh -c 'python3 {fake} {sb.port} {mark} &'; sleep 0.2"
    with lease_client(sb) as c:
        c.post("/v1/exec", json={"command": start_fake}).raise_for_status()
    # the kubelet's SIGTERM: from outside the namespace (sent to unshare's child, the server)
    server_pid = int(subprocess.run(["pgrep", "-P", str(sb.pid)], capture_output=True, text=True, check=False).stdout.split()[0])
    os.kill(server_pid, signal.SIGTERM)
    sb.proc.wait(timeout=60)
    time.sleep(1)
    assert not mark.exists(), "an escaped command bound the server's port"
    with socket.socket() as s:  # and nothing listens there any more
        assert s.connect_ex(("127.0.0.1", sb.port)) != 0
    wait_until(lambda: not subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, check=False).stdout, 10,
               what="the escaped command is gone")


IMPOSTOR = """
import http.server, sys
log = open(sys.argv[2], "ab")
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        log.write(bytes(self.requestline, "latin-1") + b"\\n" + bytes(str(self.headers), "latin-1")
                  + self.rfile.read(n) + b"\\n"); log.flush()
        body = b'{"status": "ok", "leased": true, "killed_processes": 0}'
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_the_gateway_gives_an_impostor_neither_token_nor_secret_nor_a_group(tmp_path):
    from tests.conftest import free_port, wait_for_port
    from tests.sandbox.conftest import gw_client, start_gateway

    port, log = free_port(), tmp_path / "impostor.log"
    (tmp_path / "impostor.py").write_text(IMPOSTOR)
    fake = subprocess.Popen([sys.executable, str(tmp_path / "impostor.py"), str(port), str(log)])
    gw = None
    try:
        wait_for_port(port, proc=fake)
        gw = start_gateway(tmp_path, [f"http://127.0.0.1:{port}"], "--health-interval-seconds", "0.2")
        wait_until(lambda: log.exists() and b"/v1/reset" in log.read_bytes(), 30, what="a reset reached the fake")
        time.sleep(1)
        with gw_client(gw) as c:
            r = c.post("/v1/leases", json={"group_id": "victim", "wait_seconds": 1})
        assert r.status_code == 503, r.text  # never handed to a group
        seen = log.read_bytes()
        assert TOKEN.encode() not in seen  # neither on health checks nor on resets
        assert b"lease_secret" not in seen
        assert httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 0
    finally:
        if gw is not None:
            gw.stop()
        fake.kill()
        fake.wait()


def test_a_same_uid_command_cannot_read_the_gateways_environment(tmp_path):
    """Non-root local mode: the gateway, the sandbox server and commands share one uid."""
    pythonpath = pythonpath_for_another_uid(UID, "setpriv")
    from tests.conftest import free_port, wait_for_port
    from tests.sandbox.conftest import GW_TOKEN

    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "ASYNCGRPO_SANDBOX_TOKEN": TOKEN, "ASYNCGRPO_GATEWAY_TOKEN": GW_TOKEN,
           "PYTHONPATH": pythonpath}
    as_user = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"]
    gw = subprocess.Popen([*as_user, SYSTEM_PYTHON, "-m", "asyncgrpo.cli", "gateway", "--host", "127.0.0.1",
                           "--port", str(port), "--members", "http://127.0.0.1:1"], env=env, cwd="/")
    try:
        wait_for_port(port, proc=gw)
        r = subprocess.run([*as_user, "cat", f"/proc/{gw.pid}/environ"], capture_output=True, check=False)
        assert GW_TOKEN.encode() not in r.stdout and TOKEN.encode() not in r.stdout
        assert b"Permission denied" in r.stderr
    finally:
        gw.kill()
        gw.wait()

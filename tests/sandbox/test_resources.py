"""Bounded resources against real sandbox servers: the workspace quota and streamed stdin.

The caps are small here (MiB, not GiB) so the tests are quick; the mechanism is the same
at the defaults.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path

import httpx
import pytest

from asyncgrpo.sandbox.client.gateway_client import GatewayClient
from asyncgrpo.sandbox.common.messages import EXEC_STREAM_TYPE, ExecRequest
from asyncgrpo.sandbox.server.quota import disk_usage
from tests.sandbox.conftest import (
    GW_TOKEN,
    lease_client,
    reset,
    start_gateway,
    start_sandbox,
    wait_until,
)

MiB = 1 << 20


@pytest.fixture
def small_quota(tmp_path):
    p = start_sandbox(tmp_path, "quota", "--max-workspace-bytes", str(8 * MiB))
    reset(p)
    yield p
    p.stop()


def _error(r: httpx.Response) -> str:
    return r.json()["detail"]["error"]


def test_two_big_files_cannot_fill_the_workspace(small_quota):
    """The issue's case scaled down: two files of 5 MiB each (each under RLIMIT_FSIZE) against
    an 8 MiB quota. The exec that crosses it is refused, the workspace is back to its initial
    files, and the lease still works."""
    with lease_client(small_quota) as c:
        r = c.post("/v1/exec", json={"command": "head -c 5M /dev/urandom > a && head -c 5M /dev/urandom > b"})
        assert r.status_code == 507 and _error(r) == "workspace_full", r.text
        assert disk_usage(str(small_quota.workspace)) < 8 * MiB
        after = c.post("/v1/exec", json={"command": "ls"}).json()
        assert after["exit_code"] == 0 and after["stdout"] == "", after  # sessions are back to the template
        health = httpx.get(f"{small_quota.url}/healthz").json()
        assert health["workspace_bytes"] < 8 * MiB
        metrics = httpx.get(f"{small_quota.url}/metrics").text
        assert "asyncgrpo_sandbox_quota_wipes_total 1.0" in metrics


def test_a_command_that_keeps_writing_is_stopped_mid_run(small_quota):
    """No exit to wait for: the server's periodic check kills it long before its timeout."""
    with lease_client(small_quota) as c:
        r = c.post("/v1/exec", json={"command": "while true; do head -c 1M /dev/urandom >> grow; sleep 0.01; done",
                                     "timeout_seconds": 300})
        assert r.status_code == 507 and _error(r) == "workspace_full", r.text
        assert disk_usage(str(small_quota.workspace)) < 8 * MiB


def test_execs_in_other_sessions_learn_of_the_wipe(small_quota):
    with lease_client(small_quota) as c:
        out: dict = {}
        bystander = threading.Thread(target=lambda: out.update(r=c.post("/v1/exec", json={
            "command": "sleep 60", "session": "other", "timeout_seconds": 120})))
        bystander.start()
        wait_until(lambda: httpx.get(f"{small_quota.url}/healthz").json()["execs_in_flight"] == 1, 30,
                   what="the bystander running")
        r = c.post("/v1/exec", json={"command": "head -c 9M /dev/urandom > big"})
        assert r.status_code == 507
        bystander.join(timeout=120)
        assert out["r"].status_code == 507 and _error(out["r"]) == "workspace_full", out["r"].text


def test_a_write_over_the_quota_is_refused_before_anything_is_written(small_quota):
    with lease_client(small_quota) as c:
        assert c.post("/v1/exec", json={"command": "head -c 7680K /dev/urandom > base"}).json()["exit_code"] == 0
        big = base64.b64encode(os.urandom(700 * 1024)).decode()
        w = c.post("/v1/files/write", json={"path": "x.bin", "content": big, "encoding": "base64"})
        assert w.status_code == 507 and _error(w) == "workspace_full", w.text
        assert c.post("/v1/files/read", json={"path": "x.bin"}).status_code == 404  # no empty file left
        # the base file is still there: a refused write wipes nothing
        assert c.post("/v1/exec", json={"command": "stat -c %s base"}).json()["stdout"].strip() == str(7680 * 1024)
        small = c.post("/v1/files/write", json={"path": "y.txt", "content": "fits"})
        assert small.status_code == 200, small.text


def test_unlistable_directories_do_not_hide_usage(small_quota):
    """`chmod 000` on a directory full of data: the meter restores the mode and counts it."""
    with lease_client(small_quota) as c:
        r = c.post("/v1/exec", json={"command": "mkdir d && head -c 9M /dev/urandom > d/f && chmod 000 d"})
        assert r.status_code == 507 and _error(r) == "workspace_full", r.text


def test_sparse_files_and_hardlinks_count_what_they_store(small_quota):
    with lease_client(small_quota) as c:
        r = c.post("/v1/exec", json={"command": "truncate -s 1G sparse && head -c 3M /dev/urandom > f && "
                                                "ln f g && ln f h && echo ok"})
        assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text


# streamed stdin -----------------------------------------------------------------------------
@pytest.fixture
def streaming_sandbox(tmp_path):
    p = start_sandbox(tmp_path, "stream", "--max-body-bytes", str(64 * 1024))
    reset(p)
    yield p
    p.stop()


def _stream(c: httpx.Client, data: bytes, command: str = "sha256sum", **fields) -> httpx.Response:
    head = ExecRequest.unchecked(command=command, **fields).stream_head()
    return c.post("/v1/exec/stream", content=head + data, headers={"content-type": EXEC_STREAM_TYPE})


def test_large_stdin_is_streamed_to_the_command_exactly(streaming_sandbox):
    data = os.urandom(3 * MiB) + b"\x00\xff\n"
    with lease_client(streaming_sandbox) as c:
        inline = c.post("/v1/exec", json={"command": "wc -c", "stdin": "x" * (128 * 1024)})
        assert inline.status_code == 413  # over the (here 64 KiB) JSON cap
        r = _stream(c, data)
        assert r.status_code == 200, r.text
        assert r.json()["stdout"].split()[0] == hashlib.sha256(data).hexdigest()
        # a command that reads nothing: the rest of stdin is dropped, the answer comes
        quick = _stream(c, data, command="echo done")
        assert quick.status_code == 200 and quick.json()["stdout"] == "done\n", quick.text
        bad = c.post("/v1/exec/stream", content=b"x" * (200 * 1024), headers={"content-type": EXEC_STREAM_TYPE})
        assert bad.status_code == 413, bad.text
        assert c.post("/v1/exec/stream", content=b'{"command": "cat", "stdin": "x"}\n').status_code == 422


def test_the_gateway_client_streams_large_stdin_both_data_paths(tmp_path):
    modes = ("direct", "proxied")
    sbs = [start_sandbox(tmp_path, f"sb-{mode}", "--max-body-bytes", str(64 * 1024)) for mode in modes]
    gws = [start_gateway(tmp_path, [sb.url], "--data-path", mode, "--max-body-bytes", str(64 * 1024),
                         name=f"gw-{mode}") for mode, sb in zip(modes, sbs, strict=True)]
    try:
        data = os.urandom(2 * MiB)
        for gw in gws:
            client = GatewayClient(gw.url, GW_TOKEN)
            lease = client.lease("g-stream", wait_seconds=60)
            r = client.exec(lease, "sha256sum", stdin=data)
            assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
            text = "line\n" * 30000  # a str over the inline limit goes streamed too
            assert client.exec(lease, "wc -l", stdin=text).stdout.strip() == "30000"
            assert client.exec(lease, "cat", stdin="small").stdout == "small"
            client.release(lease)
            client.close()
            wait_until(lambda g=gw: httpx.get(f"{g.url}/v1/demand").json()["idle"] == 1, 60, what="sandbox idle")
    finally:
        for p in (*gws, *sbs):
            p.stop()


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_sixteen_large_stdin_clients_keep_the_server_small(streaming_sandbox):
    """16 clients at once, 24 MiB of stdin each (384 MiB in all): buffered whole, the server
    would hold at least that; streamed, its peak stays within a generous 100 MiB of its start."""
    size, clients = 24 * MiB, 16
    chunk = os.urandom(MiB)
    expected = hashlib.sha256(chunk * (size // MiB)).hexdigest()
    before = _rss_kib(streaming_sandbox.pid, "VmRSS")
    results: list = [None] * clients

    def one(i: int) -> None:
        with lease_client(streaming_sandbox) as c:
            head = ExecRequest.unchecked(command="sha256sum", timeout_seconds=300).stream_head()
            body = iter([head, *(chunk for _ in range(size // MiB))])
            results[i] = c.post("/v1/exec/stream", content=body, headers={"content-type": EXEC_STREAM_TYPE},
                                timeout=600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r.status_code == 200 and r.json()["stdout"].split()[0] == expected, r.text[:300]
    peak = _rss_kib(streaming_sandbox.pid, "VmHWM")
    assert peak - before < 100 * 1024, (before, peak)

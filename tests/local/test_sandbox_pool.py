"""The local backend's sandbox part, started as `asyncgrpo local run` starts it
(`asyncgrpo.local.sandbox_pool.start_sandbox_part`: the builders' sandbox pods and gateway,
translated, as real processes): `spec.sandboxes.lifecycle` holds locally as on a cluster.
FreshPerGroup: no two groups' leases share a sandbox process, a workspace or a file, and the
pool replaces each sandbox a group used. Reuse: the gateway resets and leases the same
process again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from asyncgrpo.api import load_run
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, secret_name
from asyncgrpo.local.placement import build_placement, members_file, run_pods
from asyncgrpo.local.pods import translate_pod
from asyncgrpo.local.sandbox_pool import start_sandbox_part
from asyncgrpo.sandbox.client.gateway_client import GatewayClient
from tests.api.invalid_specs import REPO


@contextlib.contextmanager
def sandbox_part(lifecycle: str, min_warm: int, max_size: int):
    run = load_run(REPO / "examples" / "multi-turn-sandboxes.yaml")
    sb = run.spec.sandboxes.model_copy(update={"lifecycle": lifecycle, "min_warm": min_warm,
                                               "max": max_size})
    run = run.model_copy(update={"spec": run.spec.model_copy(update={"sandboxes": sb})})
    pods = [p for p in run_pods(run, max(1, min_warm)) if p.component in ("sandbox", "gateway")]
    # commands run as another uid when the server is root: the workspace must be reachable
    # by path, and pytest's tmp_path lives under a root-only directory
    workdir = Path(tempfile.mkdtemp(prefix="asyncgrpo-local-pool-"))
    workdir.chmod(0o711)
    placement = build_placement(run, pods, workdir, s3_credentials={
        "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"})
    procs = {p.name: translate_pod(p.name, p.spec, placement) for p in pods}
    started: list = []
    client = None
    try:
        pool, gw = start_sandbox_part(run, pods, procs, placement, workdir, started=started)
        client = GatewayClient(gw.ready_url.rsplit("/", 1)[0], token=placement.secrets[
            (secret_name(run), GATEWAY_TOKEN_KEY)])
        yield pool, client, workdir
    finally:
        if client is not None:
            client.close()
        while started:
            started.pop().stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _in_group(client: GatewayClient, pool, group: str) -> dict:
    """One group's lease: which sandbox and server process, its session directory, whether
    it sees a file a group before it wrote, then a file of its own written and a process
    left behind in a session of its own (as a hostile command would); released."""
    lease = client.lease(group, wait_seconds=60)
    try:
        pid = pool.pid(lease.sandbox)
        out = client.exec(lease.lease_id, "pwd; cat mark.txt 2>/dev/null || echo no-mark; "
                          f"echo {group} > mark.txt; "
                          "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")
        assert out["exit_code"] == 0, out
        cwd, seen, left = out["stdout"].split()
        return {"sandbox": lease.sandbox, "pid": pid, "cwd": cwd, "seen": seen,
                "left": int(left), "lease": lease}
    finally:
        client.release(lease.lease_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.2)


def test_fresh_per_group_gives_each_group_a_new_sandbox_process_and_workspace():
    with sandbox_part("FreshPerGroup", min_warm=2, max_size=3) as (pool, client, workdir):
        first_members = pool.members()
        assert len(first_members) == 2
        # the gateway follows the pool's file, named by pod as a pod watch names them
        assert json.loads(members_file(workdir).read_text()) == first_members

        groups = [_in_group(client, pool, g) for g in ("group-a", "group-b", "group-c")]
        a = groups[0]
        print("groups:", [(g["sandbox"], g["pid"], g["cwd"]) for g in groups])
        assert len({g["sandbox"] for g in groups}) == 3
        assert len({g["pid"] for g in groups}) == 3 and None not in {g["pid"] for g in groups}
        assert len({g["cwd"] for g in groups}) == 3
        for g in groups:  # each session lives in its own pod's workspace directory
            assert g["cwd"].startswith(str(workdir / g["sandbox"] / "workspace")), g
            assert g["seen"] == "no-mark", g  # no group finds a file a group before wrote

        # the sandbox a group used is discarded: its process stopped (reaped), its pod's
        # directories deleted, its name gone from the members file; and replaced
        def discarded(g):
            return (pool.pid(g["sandbox"]) is None and not (workdir / g["sandbox"]).exists()
                    and g["sandbox"] not in json.loads(members_file(workdir).read_text()))
        _until(lambda: all(discarded(g) for g in groups))
        for g in groups:  # the server, and what the group's command left running
            for pid in (g["pid"], g["left"]):
                _until(lambda pid=pid: not _alive(pid), timeout=20)
        # group A's file, looked for by its absolute path from a later group's sandbox
        d = _in_group(client, pool, "group-d")
        probe = client.lease("group-e", wait_seconds=60)
        try:
            out = client.exec(probe.lease_id, f"test -e {a['cwd']}/mark.txt && echo there "
                              "|| echo gone")
            assert out["stdout"].strip() == "gone", out
        finally:
            client.release(probe.lease_id)
        used = {g["sandbox"] for g in groups} | {d["sandbox"], probe.sandbox}
        assert len(used) == 5
        # the pool refills: warm ones kept beside what is busy, never a used one again
        _until(lambda: not set(pool.members()) & used and len(pool.members()) >= 2)
        _until(lambda: pool.discarded == 5)  # each used one stopped and deleted, no other
        assert pool.created >= 7


def test_reuse_resets_and_leases_the_same_sandbox_process_again():
    with sandbox_part("Reuse", min_warm=1, max_size=1) as (pool, client, workdir):
        a = _in_group(client, pool, "group-a")
        b = _in_group(client, pool, "group-b")
        print("groups:", [(g["sandbox"], g["pid"], g["cwd"]) for g in (a, b)])
        assert (a["sandbox"], a["pid"]) == (b["sandbox"], b["pid"])  # the same process
        assert b["seen"] == "no-mark"  # the reset wiped group A's session
        assert pool.discarded == 0 and list(pool.members()) == [a["sandbox"]]
        assert (workdir / a["sandbox"] / "workspace").is_dir()

        # a sandbox process that dies is replaced (its log kept), as a failed pod would be
        os.kill(a["pid"], signal.SIGKILL)
        _until(lambda: a["sandbox"] not in pool.members() and len(pool.members()) == 1)
        c = _in_group(client, pool, "group-c")
        assert c["sandbox"] != a["sandbox"] and c["pid"] != a["pid"]
        assert (workdir / f"{a['sandbox']}.log").exists()
        d = _in_group(client, pool, "group-d")
        assert (d["sandbox"], d["pid"]) == (c["sandbox"], c["pid"])  # and reused in turn

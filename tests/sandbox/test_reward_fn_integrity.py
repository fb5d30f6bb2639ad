"""The plain `sandbox_tests` reward: each completion scored in a sandbox of its own, cleanly.

The completions of one group are scored at once. Before, they shared one sandbox (a
session each, one uid), and the code under test ran where its siblings' did: a completion
could copy a sibling's solution, kill a sibling's test run, or fill the quota so the
reward raised into TRL. Here each completion gets its own lease (servers in root mode:
each has a command uid of its own, as each pod has its own filesystem) and is scored
through `/v1/score`: a fresh copy of the row's files, only `solution_path` kept from the
completion, a clean environment. Real sandbox servers and a real gateway.
"""

from __future__ import annotations

import httpx
import pytest

from asyncgrpo.rewards import SandboxTestsArgs
from asyncgrpo.sandbox.client import rewards
from asyncgrpo.sandbox.client.rewards import sandbox_tests
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

UT_TESTS = ("import unittest\nfrom solution import square\n\n"
            "class T(unittest.TestCase):\n"
            "    def test_2(self):\n        self.assertEqual(square(2), 4)\n"
            "    def test_3(self):\n        self.assertEqual(square(3), 9)\n")
# a suite that takes a while (its second test sleeps): a sibling's run is alive meanwhile
SLOW_TESTS = UT_TESTS + "    def test_slow(self):\n        import time; time.sleep(3)\n"
COMMAND = "python3 -m unittest -v 2>&1"
HONEST = "```python\ndef square(x):\n    return x * x\n```"
WRONG = "def square(x):\n    return 4\n"  # scores 0.5 (square(2) == 4)


def fenced(code: str) -> str:
    return f"```python\n{code}```"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward-fn")
    sbs = [start_sandbox(tmp, f"rf{i}", "--max-workspace-bytes", str(16 << 20), "--max-procs", "256")
           for i in range(3)]
    gw = start_gateway(tmp, [s.url for s in sbs], "--lease-ttl-seconds", "20", "--health-interval-seconds", "0.3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
        idle(gw, 3)
        yield gw
    gw.stop()
    for s in sbs:
        s.stop()


def idle(gw, n: int = 3) -> None:
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == n, 60, what="sandboxes warm")


def score(gw, completions: list[str], tests: str = UT_TESTS) -> list[float | None]:
    out = sandbox_tests(completions, SandboxTestsArgs(
        test_command=COMMAND, files={"test_square.py": tests}, timeout_seconds=30,
        gateway_url=gw.url), prompts=["p"] * len(completions))
    idle(gw)
    return out


def test_honest_and_wrong_solutions_score_as_before(gateway):
    assert score(gateway, [HONEST, fenced(WRONG), "no code at all"]) == [1.0, 0.5, 0.0]


COPIER = WRONG + (
    "import glob, os, time\n"
    "_end = time.time() + 4\n"
    "while time.time() < _end:\n"
    "    for _p in glob.glob('../*/solution.py') + glob.glob('../../*/*/solution.py'):\n"
    "        try:\n"
    "            _src = open(_p).read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        if 'return x ' + '* x' in _src:\n"
    "            exec(_src)\n"
    "            _end = 0\n"
    "            break\n"
    "    time.sleep(0.05)\n")


def test_a_completion_cannot_copy_its_siblings_solution(gateway):
    """The copier's code looks for a sibling's solution while its tests import it."""
    assert score(gateway, [HONEST, fenced(COPIER)]) == [1.0, 0.5]


KILLER = WRONG + (
    "import os, signal, time\n"
    "_mine = set()\n"
    "_p = os.getpid()\n"
    "while _p > 1:\n"
    "    _mine.add(_p)\n"
    "    _p = int(open(f'/proc/{_p}/stat').read().rsplit(')', 1)[1].split()[1])\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        _end = time.time() + 10\n"
    "        while time.time() < _end:\n"
    "            for _d in os.listdir('/proc'):\n"
    "                if not _d.isdigit() or int(_d) in _mine or int(_d) == os.getpid():\n"
    "                    continue\n"
    "                try:\n"
    "                    if b'unittest' in open(f'/proc/{_d}/cmdline', 'rb').read():\n"
    "                        os.kill(int(_d), signal.SIGKILL)\n"
    "                except OSError:\n"
    "                    pass\n"
    "            time.sleep(0.005)\n"
    "    os._exit(0)\n")


def test_a_completion_cannot_kill_its_siblings_test_run(gateway):
    """The killer's code leaves a process that SIGKILLs every other test run it can see."""
    assert score(gateway, [HONEST, fenced(KILLER)], tests=SLOW_TESTS) == [1.0, 2 / 3]


FILLER = WRONG + "open('big', 'wb').write(b'0' * (40 << 20))\n"


def test_a_completion_filling_the_quota_scores_zero_and_never_raises(gateway):
    """Its run goes over the workspace quota (507 from the sandbox): counted, scored 0.0,
    and its sibling is scored as if it were alone."""
    before = rewards.reward_failures("workspace_full")
    assert score(gateway, [HONEST, fenced(FILLER)]) == [1.0, 0.0]
    assert rewards.reward_failures("workspace_full") == before + 1


def test_scoring_through_a_proxied_gateway(tmp_path, monkeypatch):
    """`data_path=proxied`: `/v1/leases/{id}/score` is forwarded with the lease's secret, under
    the same credential and fencing as an exec; the reward and the client use it."""
    from asyncgrpo.sandbox.client.gateway_client import GatewayClient, LeaseLost

    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    sb = start_sandbox(tmp_path, "px")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3", "--data-path", "proxied")
    try:
        idle(gw, 1)
        c = GatewayClient(gw.url, GW_TOKEN)
        lease = c.lease("px-group")
        assert lease.sandbox_url is None  # every call goes through the gateway
        c.write_file(lease, "solution.py", "def square(x):\n    return x * x\n", session="work")
        c.write_file(lease, "test_square.py", "import unittest\n", session="work")  # restored by the score
        body = {"command": COMMAND, "files": {"test_square.py": UT_TESTS}, "editable": ["solution.py"],
                "session": "work", "timeout_seconds": 30}
        url = f"{gw.url}/v1/leases/{lease.lease_id}/score"
        for token in (GW_TOKEN, "not-the-secret-of-this-lease"):  # only the lease's secret opens it
            assert httpx.post(url, json=body, headers={"authorization": f"Bearer {token}"}).status_code == 401
        r = c.score(lease, COMMAND, files={"test_square.py": UT_TESTS}, editable=["solution.py"],
                    session="work", timeout_seconds=30)
        assert r["editable_found"] == ["solution.py"]
        assert rewards.score_test_run(r["exit_code"], r["stdout"], r["stderr"], r["timed_out"]).reward == 1.0
        secret = lease.secret
        c.release(lease, all_holders=True)
        late = httpx.post(url, json=body, headers={"authorization": f"Bearer {secret}"})
        assert (late.status_code, late.json()["error"]) == (410, "lease_released")
        with pytest.raises(LeaseLost):
            c.score(lease, COMMAND, files={}, editable=[])
        idle(gw, 1)
        assert sandbox_tests([HONEST, fenced(WRONG)], SandboxTestsArgs(
            test_command=COMMAND, files={"test_square.py": UT_TESTS}, timeout_seconds=30,
            gateway_url=gw.url)) == [1.0, 0.5]
    finally:
        gw.stop()
        sb.stop()

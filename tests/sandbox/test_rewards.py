"""The "tests pass in a sandbox" reward: parsing real runner output, then end to end."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from asyncgrpo.rewards import SandboxTestsArgs
from asyncgrpo.sandbox.client.rewards import (
    count_tests,
    extract_code,
    sandbox_tests,
    score_test_run,
)
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

PYTEST_FILE = (
    "def test_a():\n    assert 1\n\ndef test_b():\n    assert 1\n\n"
    "def test_c():\n    assert 1\n\ndef test_d():\n    assert 0\n"
)


def test_counts_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_x.py").write_text(PYTEST_FILE)
    for flags in (["-q"], ["-v"], []):
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *flags, str(tmp_path)],
                           capture_output=True, text=True, cwd=tmp_path, check=False)
        assert count_tests(r.stdout) == (3, 1), r.stdout
        s = score_test_run(r.returncode, r.stdout, r.stderr)
        assert (s.passed, s.failed, s.reward, s.exit_code) == (3, 1, 0.75, 1)


def test_counts_from_a_real_unittest_run(tmp_path):
    (tmp_path / "test_u.py").write_text(
        "import unittest\nclass T(unittest.TestCase):\n"
        "    def test_ok(self): pass\n    def test_ok2(self): pass\n"
        "    def test_bad(self): self.fail('no')\n    def test_err(self): raise KeyError()\n")
    r = subprocess.run([sys.executable, "-m", "unittest", "-v"], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert count_tests(r.stderr) == (2, 2)
    assert score_test_run(r.returncode, r.stdout, r.stderr).reward == 0.5
    ok = subprocess.run([sys.executable, "-m", "unittest", "test_u.T.test_ok"], capture_output=True, text=True,
                        cwd=tmp_path, check=False)
    assert score_test_run(ok.returncode, ok.stdout, ok.stderr).reward == 1.0


def test_without_counts_the_exit_code_decides_and_a_timeout_scores_zero():
    assert score_test_run(0, "all good").reward == 1.0
    assert score_test_run(2, "boom").reward == 0.0
    assert score_test_run(None, "3 passed in 0.1s", timed_out=True).reward == 0.0


def test_code_is_taken_from_the_last_fence():
    text = "first\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\n"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("no fences") == "no fences"


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    sb = start_sandbox(tmp_path, "rw")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_URL", gw.url)
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 1, 30, what="pool warm")
    yield gw
    gw.stop()
    sb.stop()


def test_sandbox_tests_reward_end_to_end(gateway):
    tests = ("import unittest\nfrom solution import square\nclass T(unittest.TestCase):\n"
             "    def test_2(self): self.assertEqual(square(2), 4)\n"
             "    def test_3(self): self.assertEqual(square(3), 9)\n")
    completions = [
        [{"role": "assistant", "content": "Here:\n```python\ndef square(x):\n    return x * x\n```"}],
        [{"role": "assistant", "content": "```python\ndef square(x):\n    return 4\n```"}],
        [{"role": "assistant", "content": "```python\ndef square(x) return\n```"}],
        [{"role": "assistant", "content": "```python\nwhile True: pass\n```"}],
        [{"role": "assistant", "content": "no tests for this row"}],
    ]
    rewards = sandbox_tests(  # test_command and files as data set columns, one per row
        completions,
        SandboxTestsArgs(timeout_seconds=2),
        test_command=["python3 -m unittest -v"] * 4 + [None],
        files=[{"test_square.py": tests}] * 5,
        prompts=["p"] * 5,
    )
    assert rewards == [1.0, 0.5, 0.0, 0.0, None]
    wait_until(lambda: httpx.get(f"{gateway.url}/v1/demand").json()["leases_active"] == 0, 20, what="released")


def test_without_a_sandbox_the_group_is_left_unscored(gateway):
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {GW_TOKEN}"}) as c:
        held = c.post("/v1/leases", json={"group_id": "hog"}).json()
        rewards = sandbox_tests(["```python\nx = 1\n```"] * 2,
                                SandboxTestsArgs(test_command="true", lease_wait_seconds=0.2))
        assert rewards == [None, None]
        c.delete(f"/v1/leases/{held['lease_id']}", headers={"authorization": f"Bearer {held['secret']}"})


def test_a_test_run_longer_than_the_lease_ttl_keeps_its_lease(tmp_path, monkeypatch):
    """Direct data path: the gateway sees no exec, so the reward heartbeats its lease."""
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    sb = start_sandbox(tmp_path, "long")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3", "--lease-ttl-seconds", "1")
    try:
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 1, 30, what="pool warm")
        rewards = sandbox_tests(["```python\nx = 1\n```"], SandboxTestsArgs(
            test_command="sleep 3 && echo '1 passed'", timeout_seconds=30, gateway_url=gw.url),
            prompts=["p"])
        assert rewards == [1.0]
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'leases_ended_total{how="expired"}' not in metrics
    finally:
        gw.stop()
        sb.stop()

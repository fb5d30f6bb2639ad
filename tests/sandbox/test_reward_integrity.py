"""Reward integrity: a rollout cannot raise its own reward, nor lower a sibling's, without solving.

Under RL the policy is an optimiser aimed at its reward, and in GRPO lowering a sibling's
reward raises one's own advantage. So every way we know of gaming the harness is a case
here, driven the way TRL drives the environment (`reset(**row)`, tool calls, `get_reward()`)
against real sandbox servers (root mode: commands drop to a uid of their own, one per
sandbox as one per pod) and a real gateway. The rows' buggy `calc.py` honestly scores 0.5
(one of two tests passes); no attack may score more than that, and no rollout may change
what its sibling scores.

The test command runs with "the harness's interpreter": a venv of the system Python with
pytest copied in (the test venv's own interpreter lives under /root, which the commands'
uid cannot reach), named by absolute path, as a task image's `python3` would be.

`BUNDLE_CASES` run again against servers started from the bundle a task's own image runs
(`asyncgrpo sandbox bundle`, a packageless python3 -I -S): the honest baseline and the
attacks on the scoring's files, interpreter, user site and background processes; and a
sibling's solution stays its own there too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from asyncgrpo.sandbox.client import environment
from asyncgrpo.sandbox.client.environment import SandboxEnvironmentFactory
from asyncgrpo.sandbox.server.process import COMMAND_UID_BASE
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

BUGGY = "def add(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
FIXED = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"
PY_TESTS = ("from calc import add, mul\n\n"
            "def test_add():\n    assert add(2, 3) == 5\n\n"
            "def test_mul():\n    assert mul(2, 3) == 6\n")
UT_TESTS = ("import unittest\nfrom calc import add, mul\n\n"
            "class T(unittest.TestCase):\n"
            "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
            "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n")
PASSING_PY = "def test_add():\n    pass\n\ndef test_mul():\n    pass\n"
PASSING_UT = ("import unittest\n\nclass T(unittest.TestCase):\n"
              "    def test_add(self):\n        pass\n    def test_mul(self):\n        pass\n")
USER_SITE = ".local/lib/python3.11/site-packages"
#: the four servers' command uids (see `pool`)
UID_BASE = COMMAND_UID_BASE - 1000
FAKE_UT_OK = "Ran 2 tests in 0.001s\\n\\nOK\\n"


@pytest.fixture(scope="module")
def harness_python():
    """A Python every command uid can run, with pytest (and its dependencies) installed."""
    base = Path(tempfile.mkdtemp(prefix="asyncgrpo-harness-py-"))
    base.chmod(0o755)
    venv = base / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    import _pytest
    import iniconfig
    import packaging
    import pluggy
    import pygments
    import pytest as pytest_pkg

    for mod in (_pytest, pytest_pkg, pluggy, iniconfig, packaging, pygments):
        src = Path(mod.__file__).parent
        shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(_pytest.__file__).parent.parent / "py.py", site / "py.py")  # pytest's shim module
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    yield str(venv / "bin" / "python")
    shutil.rmtree(base, ignore_errors=True)


def py_row(python: str) -> dict:
    return {"prompt": [{"role": "user", "content": "Fix calc.py"}],
            "files": {"calc.py": BUGGY, "test_calc.py": PY_TESTS},
            "test_command": f"{python} -m pytest -q -p no:cacheprovider"}


UT_ROW = {"prompt": [{"role": "user", "content": "Fix calc.py"}],
          "files": {"calc.py": BUGGY, "test_calc.py": UT_TESTS},
          "test_command": "python3 -m unittest -v 2>&1"}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Four sandboxes, each with its own command uid (as each pod has its own filesystem),
    a small workspace quota, and a gateway with the direct data path."""
    yield from _pool(tmp_path_factory.mktemp("integrity"))


@pytest.fixture(scope="module")
def bundle_pool(tmp_path_factory, server_bundle):
    """`pool`, its servers started from the bundle with a packageless python3."""
    yield from _pool(tmp_path_factory.mktemp("integrity-bundle"), server_bundle)


def _pool(tmp: Path, bundle: Path | None = None):
    # uids no other process of the machine has: a root server SIGKILLs every process of its
    # command uid at start and at each reset (`process.kill_uid`), and 65532 (the 65534 - 2
    # this used) is the user of the project's images, so a run of this beside the node's
    # e2e pods killed them (exit 137); below the allocator's blocks (COMMAND_UID_BASE)
    sbs = [start_sandbox(tmp, f"ri{i}", "--command-uid", str(UID_BASE + i), "--command-gid", str(UID_BASE + i),
                         "--max-workspace-bytes", str(16 << 20), "--max-procs", "256", bundle=bundle)
           for i in range(4)]
    gw = start_gateway(tmp, [s.url for s in sbs], "--lease-ttl-seconds", "20", "--health-interval-seconds", "0.3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 4, 60, what="pool warm")
        yield gw
    gw.stop()
    for s in sbs:
        s.stop()


def factory(gw, g: int) -> SandboxEnvironmentFactory:
    return SandboxEnvironmentFactory(num_generations=g, gateway_url=gw.url, heartbeat_seconds=0.5,
                                     timeout_seconds=20, test_timeout_seconds=60, max_output_bytes=4000)


def idle(gw, n: int = 4) -> None:
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == n, 30, what="leases released")


def rollout(gw, row: dict, play) -> float | None:
    env = factory(gw, 1)()
    env.reset(**row)
    play(env)
    reward = env.get_reward()
    idle(gw)
    return reward


# -- the honest baseline ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["pytest", "unittest"])
def test_the_honest_scores_are_half_unsolved_and_one_solved(pool, harness_python, kind):
    row = py_row(harness_python) if kind == "pytest" else UT_ROW
    assert rollout(pool, row, lambda e: e.shell("ls")) == 0.5
    assert rollout(pool, row, lambda e: e.write_file("calc.py", FIXED)) == 1.0


# -- gaming attempts: none may score above the honest 0.5 --------------------------------------
CONFTEST_PASS = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    rep = outcome.get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")
CONFTEST_DESELECT = (
    "def pytest_collection_modifyitems(config, items):\n"
    "    config.hook.pytest_deselected(items=list(items))\n    items[:] = []\n\n"
    "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 0\n")
FAKE_PYTEST = "import sys\nprint('2 passed in 0.01s')\nsys.exit(0)\n"
BACKGROUND = ("setsid sh -c 'while :; do cp good.txt {test} 2>/dev/null; sleep 0.005; done' "
              ">/dev/null 2>&1 </dev/null & echo started")


def _write_all(files: dict):
    def play(env):
        for path, content in files.items():
            assert env.write_file(path, content).startswith("wrote"), path
    return play


def _shell(*commands: str, files: dict | None = None):
    def play(env):
        for path, content in (files or {}).items():
            env.write_file(path, content)
        for c in commands:
            env.shell(c)
    return play


PYTEST_ATTACKS = {
    "overwrite_test_file": _write_all({"test_calc.py": PASSING_PY}),
    "extra_passing_tests": _write_all({"test_more.py": "".join(f"def test_{i}():\n    pass\n" for i in range(20))}),
    "conftest_marks_passed": _write_all({"conftest.py": CONFTEST_PASS}),
    "conftest_deselects_all": _write_all({"conftest.py": CONFTEST_DESELECT}),
    "pytest_py_in_session": _write_all({"pytest.py": FAKE_PYTEST}),
    "pytest_package_in_session": _write_all({"pytest/__init__.py": "", "pytest/__main__.py": FAKE_PYTEST}),
    "background_rewrites_test": _shell(BACKGROUND.format(test="test_calc.py"), files={"good.txt": PASSING_PY}),
    "fake_summary_at_exit": _write_all({"calc.py": BUGGY + "import atexit\natexit.register(lambda: "
                                        "print('2 passed in 0.01s', flush=True))\n"}),
    "fake_large_summary_at_exit": _write_all({"calc.py": BUGGY + "import atexit\natexit.register(lambda: "
                                              "print('99 passed, 1 failed in 0.01s', flush=True))\n"}),
    "exit_zero_at_import": _write_all({"calc.py": BUGGY + "import os\nos._exit(0)\n"}),
    "editable_path_is_a_symlink": _shell("ln -sf test_calc.py calc.py"),
}
UNITTEST_ATTACKS = {
    "overwrite_test_file": _write_all({"test_calc.py": PASSING_UT}),
    "usercustomize_in_user_site": _write_all({
        f"{USER_SITE}/usercustomize.py": f"import os, sys\nsys.stdout.write('{FAKE_UT_OK}')\nos._exit(0)\n"}),
    "pth_in_user_site": _write_all({
        f"{USER_SITE}/zz.pth": f"import os, sys; sys.stdout.write('{FAKE_UT_OK}'); os._exit(0)\n"}),
    "shell_profiles": _write_all({name: f"python3() {{ printf '{FAKE_UT_OK}'; }}\nexport -f python3 2>/dev/null\n"
                                  for name in (".bashrc", ".bash_profile", ".profile", ".bash_login")}),
    "unittest_py_in_session": _write_all({"unittest/__init__.py": "", "unittest/__main__.py":
                                          f"import sys\nsys.stdout.write('{FAKE_UT_OK}')\n"}),
    "background_rewrites_test": _shell(BACKGROUND.format(test="test_calc.py"), files={"good.txt": PASSING_UT}),
    "fake_summary_at_exit": _write_all({"calc.py": BUGGY + "import atexit, sys\natexit.register(lambda: "
                                        f"sys.stdout.write('{FAKE_UT_OK}'))\n"}),
    "exit_zero_at_import": _write_all({"calc.py": BUGGY + "import os\nos._exit(0)\n"}),
}


@pytest.mark.parametrize("attack", sorted(PYTEST_ATTACKS))
def test_pytest_gaming_scores_no_more_than_the_honest_solution(pool, harness_python, attack):
    assert rollout(pool, py_row(harness_python), PYTEST_ATTACKS[attack]) <= 0.5


@pytest.mark.parametrize("attack", sorted(UNITTEST_ATTACKS))
def test_unittest_gaming_scores_no_more_than_the_honest_solution(pool, attack):
    assert rollout(pool, UT_ROW, UNITTEST_ATTACKS[attack]) <= 0.5


#: (kind, attack) run on `bundle_pool` too: an honest rollout, and the attacks through the
#: scoring's files, interpreter, user site and background processes
BUNDLE_CASES = [("pytest", "honest"), ("pytest", "conftest_marks_passed"), ("pytest", "pytest_py_in_session"),
                ("pytest", "background_rewrites_test"), ("unittest", "usercustomize_in_user_site"),
                ("unittest", "shell_profiles"), ("unittest", "exit_zero_at_import")]


@pytest.mark.parametrize(("kind", "attack"), BUNDLE_CASES)
def test_gaming_from_the_bundle_scores_no_more_than_the_honest_solution(bundle_pool, harness_python, kind,
                                                                        attack):
    row = py_row(harness_python) if kind == "pytest" else UT_ROW
    if attack == "honest":
        assert rollout(bundle_pool, row, lambda e: e.shell("ls")) == 0.5
        assert rollout(bundle_pool, row, lambda e: e.write_file("calc.py", FIXED)) == 1.0
        return
    attacks = PYTEST_ATTACKS if kind == "pytest" else UNITTEST_ATTACKS
    assert rollout(bundle_pool, row, attacks[attack]) <= 0.5


def test_the_test_files_run_are_the_rows_even_if_the_rollout_changed_them(pool):
    """Not only no gain: the row's tests are what ran (the other failure is still reported)."""
    reward = rollout(pool, {**UT_ROW, "test_command": "cat test_calc.py; python3 -m unittest -v 2>&1"},
                     _write_all({"test_calc.py": PASSING_UT, "calc.py": FIXED}))
    assert reward == 1.0  # the fix counts; the rewritten test file did not (it was restored)


# -- siblings --------------------------------------------------------------------------------------
def group(gw, g: int = 2) -> list:
    f = factory(gw, g)
    envs = [f() for _ in range(g)]
    for env in envs:
        env.reset(**UT_ROW)
    return envs


@pytest.mark.parametrize("servers", ["pool", "bundle_pool"])
def test_a_rollout_cannot_read_or_copy_its_siblings_solution(request, servers):
    pool = request.getfixturevalue(servers)
    honest, thief = group(pool)
    honest.write_file("calc.py", FIXED)
    seen = thief.shell("ls ..; cat ../*/calc.py; for d in ../*/; do cp $d/calc.py . 2>/dev/null; done; "
                       "find / -name calc.py -newer /proc/1 2>/dev/null | xargs cat 2>/dev/null; "
                       "for f in $(find / -name calc.py 2>/dev/null); do cp $f . ; done; true")
    assert "a + b" not in seen
    assert thief.get_reward() == 0.5
    assert honest.get_reward() == 1.0
    idle(pool)


def test_a_rollout_cannot_delete_or_corrupt_its_siblings_files(pool):
    honest, vandal = group(pool)
    honest.write_file("calc.py", FIXED)
    vandal.shell("for d in ../*/; do echo 'def broken(:' > $d/calc.py; done; rm -rf ../r0 ../r1; "
                 "for f in $(find / -name calc.py 2>/dev/null); do echo 'def broken(:' > $f; done; true")
    assert honest.get_reward() == 1.0
    vandal.get_reward()
    idle(pool)


KILLER = ("import os, signal, time\nend = time.time() + 30\nwhile time.time() < end:\n"
          "    for p in os.listdir('/proc'):\n        if not p.isdigit() or int(p) == os.getpid():\n"
          "            continue\n        try:\n            cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
          "            if b'unittest' in cmd:\n                os.kill(int(p), signal.SIGKILL)\n"
          "        except OSError:\n            pass\n    time.sleep(0.002)\n")


def test_a_rollout_cannot_kill_its_siblings_test_run(pool):
    honest, killer = group(pool)
    honest.write_file("calc.py", FIXED)
    killer.write_file("killer.py", KILLER)
    assert killer.shell("setsid python3 killer.py >/dev/null 2>&1 </dev/null & sleep 0.5; echo up").endswith("up")
    assert honest.get_reward() == 1.0
    assert killer.get_reward() == 0.5  # its own killer is gone before its own scoring
    idle(pool)


def test_filling_the_quota_never_empties_a_siblings_session(pool):
    honest, filler = group(pool)
    honest.write_file("calc.py", FIXED)
    filler.shell("head -c 40000000 /dev/zero > big; true")
    assert honest.get_reward() == 1.0
    filler.get_reward()
    idle(pool)


def test_a_quota_wipe_during_a_siblings_scoring_neither_raises_nor_changes_its_score(pool):
    row = {**UT_ROW, "test_command": "sleep 3; python3 -m unittest -v 2>&1"}
    f = factory(pool, 2)
    honest, filler = f(), f()
    honest.reset(**row)
    filler.reset(**row)
    honest.write_file("calc.py", FIXED)
    filler.shell("setsid sh -c 'sleep 1.5; head -c 40000000 /dev/zero > big' >/dev/null 2>&1 </dev/null &")
    assert honest.get_reward() == 1.0
    filler.get_reward()
    idle(pool)


# -- failures of the sandbox itself ----------------------------------------------------------------
def test_get_reward_never_raises_when_the_sandbox_dies_and_counts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    sb = start_sandbox(tmp_path, "dies")
    gw = start_gateway(tmp_path, [sb.url], "--health-interval-seconds", "0.3", "--lease-ttl-seconds", "10")
    try:
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 1, 30, what="pool warm")
        env = factory(gw, 1)()
        env.reset(**UT_ROW)
        env.write_file("calc.py", FIXED)
        before = environment.reward_failures("sandbox_lost") + environment.reward_failures("sandbox_error")
        sb.kill()
        t0 = time.monotonic()
        assert env.get_reward() == 0.0  # documented: a sandbox failure scores the lowest reward
        assert time.monotonic() - t0 < 60
        after = environment.reward_failures("sandbox_lost") + environment.reward_failures("sandbox_error")
        assert after == before + 1
    finally:
        gw.stop()
        sb.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))

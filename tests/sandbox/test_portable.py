"""The server in a task's own image: the bundle (`asyncgrpo sandbox bundle`) run by a python3
that has no package at all (this machine's /usr/bin/python3), with `-I -S` as the pod runs it.

The isolation cases of test_hostile.py run on such a server too (`SERVER_KINDS`), and so do
some of test_reward_integrity.py's gaming attempts (`test_gaming_from_the_bundle_...`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asyncgrpo.sandbox.server import portable
from asyncgrpo.sandbox.server.portable import (
    CODE_MINIMUM,
    DEPENDENCIES,
    BundleError,
    lower_bound,
    write_bundle,
)
from tests.sandbox.conftest import FOREIGN_PYTHON, TOKEN, lease_client, reset, start_sandbox

PYENV = Path.home() / ".pyenv" / "versions"


def _entry_module(entry: Path):
    """The entry script as a module (its functions, without running `main`)."""
    spec = importlib.util.spec_from_file_location("asyncgrpo_sandbox_entry", entry)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _other_pythons(newer: bool) -> list[str]:
    """This machine's other CPythons (pyenv's), at least or below the bundle's minimum."""
    found = []
    for folder in sorted(PYENV.glob("3.*")) if PYENV.is_dir() else ():
        m = re.fullmatch(r"(\d+)\.(\d+)\.\d+", folder.name)
        python = folder / "bin" / "python3"
        if m and python.exists() and ((int(m[1]), int(m[2])) >= CODE_MINIMUM) == newer:
            found.append(str(python))
    return found


@pytest.fixture
def bundle_sandbox(tmp_path, server_bundle):
    # the image's own PYTHONPATH must not reach the server (-I): a poisoned starlette on it
    poisoned = tmp_path / "poisoned" / "starlette"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise SystemExit('the image PYTHONPATH was used')\n")
    sb = start_sandbox(tmp_path, "bundled", "--max-procs", "128", bundle=server_bundle,
                       env={"PYTHONPATH": str(poisoned.parent), "PYTHONHOME": "/nonexistent"})
    yield sb
    sb.stop()


def test_a_server_from_the_bundle_serves_execs_files_resets_and_scores(bundle_sandbox):
    sb = bundle_sandbox
    # the packageless interpreter runs it, isolated, and nothing compiled of the venv is loaded
    assert os.path.realpath(f"/proc/{sb.pid}/exe") == os.path.realpath(FOREIGN_PYTHON)
    assert Path(f"/proc/{sb.pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-I", b"-S"]
    maps = Path(f"/proc/{sb.pid}/maps").read_text()
    assert sys.prefix not in maps and "site-packages" not in maps
    assert httpx.get(f"{sb.url}/healthz").json()["status"] == "ok"
    assert "sandbox_execs_total" in httpx.get(f"{sb.url}/metrics").text
    reset(sb)  # the lease's secret sealed in the reset credential; the answer proves the token
    with lease_client(sb) as c:
        r = c.post("/v1/exec", json={"command": 'printf "%s|" "$X"; cat; pwd', "stdin": "in", "env": {"X": "x"}})
        assert r.status_code == 200 and r.json()["stdout"].startswith("x|in/") and r.json()["exit_code"] == 0
        argv = c.post("/v1/exec", json={"command": ["sh", "-c", "exit 7"]}).json()
        assert argv["exit_code"] == 7 and not argv["timed_out"]
        assert c.post("/v1/files/write", json={"path": "d/a.txt", "content": "héllo"}).json()["bytes"] == 6
        assert c.post("/v1/files/read", json={"path": "d/a.txt"}).json()["content"] == "héllo"
        # the wire shapes of refusals, as from the venv's server
        bad = c.post("/v1/exec", json={"command": "true", "surprise": 1, "timeout_seconds": "5"})
        assert bad.status_code == 422 and bad.json()["detail"]["error"] == "invalid_request"
        assert [e["loc"] for e in bad.json()["detail"]["detail"]] == [["timeout_seconds"], ["surprise"]]
        assert c.post("/v1/exec", content=b"{nope").json() == {"detail": {"error": "bad_json", "detail": (
            "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")}}
        assert c.post("/v1/files/read", json={"path": "../x"}).json()["detail"]["error"] == "path_refused"
        scored = c.post("/v1/score", json={"command": "cat d/a.txt t.txt; ls", "files": {"t.txt": "-row\n"},
                                           "editable": ["d/a.txt", "missing"]}).json()
        assert scored["exit_code"] == 0 and scored["stdout"].startswith("héllo-row\n")
        assert scored["editable_found"] == ["d/a.txt"]
        reset(sb, "the-next-lease-secret-0123456789")
        assert c.post("/v1/exec", json={"command": "true"}).json()["error"] == "lease_revoked"  # the guard's
    with lease_client(sb, "the-next-lease-secret-0123456789") as c:
        assert c.post("/v1/files/read", json={"path": "d/a.txt"}).status_code == 404  # wiped
        assert c.post("/v1/exec", json={"command": "echo next"}).json()["stdout"] == "next\n"
    assert "image PYTHONPATH" not in sb.logs()


@pytest.mark.parametrize("python", _other_pythons(newer=True) or [pytest.param("", marks=pytest.mark.skip(
    reason="no other CPython >= the minimum on this machine"))])
def test_the_bundle_serves_on_each_newer_python_here(tmp_path, server_bundle, python):
    sb = start_sandbox(tmp_path, "other", bundle=server_bundle, python=python)
    try:
        assert os.path.realpath(f"/proc/{sb.pid}/exe") == os.path.realpath(python)
        reset(sb)
        with lease_client(sb) as c:
            assert c.post("/v1/exec", json={"command": "echo up"}).json()["stdout"] == "up\n"
            scored = c.post("/v1/score", json={"command": "true", "files": {}, "editable": []}).json()
            assert scored["exit_code"] == 0
    finally:
        sb.stop()


# -- the interpreter check -------------------------------------------------------------------------
def test_the_entry_names_an_unfit_interpreter_in_one_line(server_bundle):
    entry = _entry_module(server_bundle)
    assert entry.MINIMUM == (3, 11) and entry.EXIT_UNFIT == 3
    assert entry.unfit((3, 8, 10, "final", 0), "/usr/bin/python3") == (
        "this image's python3 is 3.8.10 (/usr/bin/python3); the sandbox server needs 3.11 or newer")
    assert entry.unfit((3, 10, 13), "") == (
        "this image's python3 is 3.10.13 (python3); the sandbox server needs 3.11 or newer")
    for fit in ((3, 11, 0), (3, 12, 1), (3, 13, 0), (4, 0, 0)):
        assert entry.unfit(fit, "/usr/bin/python3") is None
    assert entry.unfit((3, 12, 9), "x", minimum=(3, 13)).endswith("needs 3.13 or newer")


def test_a_too_old_python_is_refused_with_exit_code_3(server_bundle):
    """Under the real interpreter: a copy of the entry that asks for 3.99 (the shipped entry has
    no switch for it), and every older CPython this machine has."""
    raised = server_bundle.parent / "too-old-for-this.py"
    raised.write_text(server_bundle.read_text().replace("MINIMUM = (3, 11)", "MINIMUM = (3, 99)", 1))
    runs = [(FOREIGN_PYTHON, raised), *((p, server_bundle) for p in _other_pythons(newer=False))]
    try:
        for python, entry in runs:
            r = subprocess.run([python, "-I", "-S", str(entry), "serve"], capture_output=True, text=True,
                               timeout=60, check=False, env={"ASYNCGRPO_SANDBOX_TOKEN": TOKEN})
            assert r.returncode == 3 and r.stdout == "", (python, r)
            assert re.fullmatch(r"asyncgrpo sandbox: this image's python3 is 3\.\d+\.\d+ \(\S+\); the sandbox "
                                r"server needs 3\.(99|11) or newer\n", r.stderr), (python, r.stderr)
            assert python in r.stderr
    finally:
        raised.unlink()


# -- writing it ------------------------------------------------------------------------------------
def test_the_minimum_python_is_the_highest_requires_python_and_the_codes(server_bundle):
    bounds = [CODE_MINIMUM]
    for name in ("asyncgrpo", *DEPENDENCIES):
        try:
            bounds.append(lower_bound(importlib.metadata.metadata(name)["Requires-Python"]))
        except importlib.metadata.PackageNotFoundError:
            assert name in portable.OPTIONAL or name == "asyncgrpo", name
    manifest = json.loads((server_bundle.parent / "bundle.json").read_text())
    assert manifest["python_minimum"] == ".".join(map(str, max(bounds)[:2])) == "3.11"
    assert set(manifest["distributions"]) >= {"starlette", "uvicorn", "anyio", "h11", "click"}
    assert lower_bound(">=3.11") == (3, 11) and lower_bound(">3.8") == (3, 8, 1)
    assert lower_bound("!=3.0.*, >=3.7 ,<4") == (3, 7) and lower_bound(None) == (0,)
    assert lower_bound("~=3.9.2") == (3, 9, 2) and lower_bound("<3.14") == (0,)


def test_the_bundle_is_small_quick_readable_by_all_and_rewritten_over_a_crashed_run(tmp_path):
    dest = tmp_path / "opt" / "asyncgrpo-server"
    t0 = time.perf_counter()
    entry = write_bundle(dest)
    took = time.perf_counter() - t0
    files = [p for p in dest.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert entry == dest / "asyncgrpo-sandbox.py" and (dest / "lib" / "asyncgrpo" / "wire.py").is_file()
    assert took < 2.0 and size < 8 << 20, (took, size, len(files))  # docstring: ~0.1 s, 3.2 MB
    assert not [p for p in files if p.name.endswith((".so", ".pyc"))]
    assert not [p for p in (dest / "lib").iterdir() if p.name.startswith(("pydantic", "fastapi"))]
    # an init container that crashed: a stage left behind, no entry, lib half there
    (dest / ".asyncgrpo-bundle-crashed" / "lib").mkdir(parents=True)
    entry.unlink()
    shutil.rmtree(dest / "lib" / "uvicorn")
    old = os.umask(0o077)
    try:
        assert write_bundle(dest) == entry
    finally:
        os.umask(old)
    assert (dest / "lib" / "uvicorn" / "__init__.py").is_file()
    assert sorted(p.name for p in dest.iterdir()) == ["asyncgrpo-sandbox.py", "bundle.json", "lib"]
    for p in dest.rglob("*"):  # whatever the umask: folders 0755, files 0644 (the entry 0755)
        want = 0o755 if p.is_dir() or p == entry else 0o644
        assert p.stat().st_mode & 0o777 == want, p


def test_a_dependency_with_a_compiled_file_is_refused(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "speedy").mkdir(parents=True)
    (site / "speedy" / "__init__.py").write_text("")
    (site / "speedy" / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(BundleError, match=r"compiled extensions .*speedy/_core\.cpython-311-x86_64-linux-gnu\.so"):
        write_bundle(tmp_path / "out", packages=(*DEPENDENCIES, "speedy"))
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(BundleError, match="'absent_package', which is not installed"):
        write_bundle(tmp_path / "out", packages=("absent_package",))


def test_the_cli_writes_the_bundle(tmp_path):
    r = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "sandbox", "bundle", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and re.search(r"wrote \S+/b/asyncgrpo-sandbox.py in \d+\.\d+s", r.stderr), r
    help_ = subprocess.run([FOREIGN_PYTHON, "-I", "-S", str(tmp_path / "b" / "asyncgrpo-sandbox.py"), "--help"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert "serve" in help_.stdout


def test_the_bundles_server_refuses_to_start_without_a_token(tmp_path, server_bundle):
    r = subprocess.run([FOREIGN_PYTHON, "-I", "-S", str(server_bundle), "serve", "--workspace", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=60, check=False, env={"PATH": os.environ["PATH"]})
    assert r.returncode != 0 and "no token" in r.stderr, r

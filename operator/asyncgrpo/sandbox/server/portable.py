"""The sandbox server as a self-contained folder that runs in a task's own image
(`asyncgrpo sandbox bundle DEST`; docs/sandboxes.md, "The server in a task's own image").

SWE-style data sets name a prebuilt image per row. Such an image has a `python3` but none
of the server's packages, and cannot be rebuilt for every row. An init container from the
project's sandbox image writes this bundle into an emptyDir; the row's image then runs

    python3 -I -S DEST/asyncgrpo-sandbox.py serve [the flags of `asyncgrpo sandbox serve`]

with its own interpreter: `-I` keeps out the image's PYTHON* variables, user site and the
script's folder, `-S` its site-packages, so nothing of the image shadows the bundle.

`write_bundle` copies, from the running environment, asyncgrpo's server modules (`OWN`) and
the server's pure-Python dependencies (`DEPENDENCIES`, found by their import names) into
`DEST/lib/`, and refuses with `BundleError` if any of them holds a compiled extension (a
`.so` is built for one interpreter and libc: it cannot run in a foreign image). It writes
`DEST/asyncgrpo-sandbox.py`, the entry, last: it checks the interpreter (version, `ctypes`,
the standard library modules the server imports) and answers an unfit one with one line on
stderr and exit code 3 (`EXIT_UNFIT`), before anything else is imported; then it puts
`DEST/lib` first on sys.path and runs `commands.portable_main`, the same server as
`asyncgrpo sandbox serve`. The entry itself is old-Python syntax (no f-strings), so even
a python3 from 2015 reads it far enough to say that it is too old.

The minimum Python (`minimum_python`) is the highest `Requires-Python` lower bound of the
bundled distributions and of asyncgrpo itself, and `CODE_MINIMUM`: the server's code needs
3.11 (`asyncio.timeout` in `common.http_guard`; `except TimeoutError` catching asyncio's
timeouts, which are the builtin only since 3.11; `zip(strict=True)`, 3.10). With the tested
pins (starlette 1.10 and uvicorn 0.55 require 3.11 too) that is 3.11.

Atomic enough for an init container that crashed and is run again: everything is built in
`DEST/.asyncgrpo-bundle-*` (DEST itself may be the emptyDir's mount point, which cannot be
renamed), then the old entry and lib are moved out, the new lib and entry renamed in (the
entry last: while it exists, its lib is complete), and leftovers of an earlier run are
removed first. Files are 0644 and folders 0755 whatever the umask (the server runs as
65532, the init container maybe as another uid); mount the folder read-only in the main
container, so that no command can change the code a restarted server would run.

No bytecode is copied: a `.pyc` is for one Python version, the row's rarely matches the
sandbox image's, and compiling the bundle in memory at the server's start costs about
0.2 s. Measured here (2 shared cores, page cache warm, 7 runs): `write_bundle` takes 0.09 s
(median 0.14 s, at most 0.24 s) for 257 files, 2.8 MB (3.2 MB on disk); the whole
`asyncgrpo sandbox bundle` command 0.4 s. test_portable.py holds it under 2 s and 8 MB.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import asyncgrpo
from asyncgrpo import wire

#: the server's dependencies by import name (each also a distribution of that name); the
#: import closure of the server is held to these by tests/test_layers.py
DEPENDENCIES = ("starlette", "anyio", "sniffio", "idna", "uvicorn", "h11", "click", "prometheus_client",
                "typing_extensions")
#: copied where installed, skipped where not (anyio dropped sniffio in 4.10)
OPTIONAL = frozenset({"sniffio"})
#: asyncgrpo's own modules the server runs, under the package's folder (a folder: its .py files)
OWN = ("__init__.py", "wire.py", "sandbox/__init__.py", "sandbox/common", "sandbox/server")
#: what the server's own code needs (see the module docstring)
CODE_MINIMUM = (3, 11)
#: the entry's file name in DEST (the pods run wire.SANDBOX_SERVER_BUNDLE_ENTRY)
ENTRY = os.path.basename(wire.SANDBOX_SERVER_BUNDLE_ENTRY)
#: the entry's exit code for an interpreter that cannot run the server
EXIT_UNFIT = 3
#: the modules the server imports at its start, imported by the entry before it serves: a
#: standard library module the image's Python lacks is then one clear line, not a traceback
SERVER_MODULES = ("asyncgrpo.sandbox.server.commands", "asyncgrpo.sandbox.server.app",
                  "asyncgrpo.sandbox.server.process", "asyncgrpo.sandbox.server.stopping",
                  "asyncgrpo.sandbox.server.cgroup", "uvicorn", "uvicorn.protocols.http.h11_impl",
                  "uvicorn.lifespan.on", "h11")
COMPILED_SUFFIXES = (".so", ".pyd", ".dylib", ".dll")
_STAGE_PREFIX = ".asyncgrpo-bundle-"
_SKIPPED_DIST_FILES = frozenset({"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"})


class BundleError(RuntimeError):
    """The running environment cannot make a bundle (a compiled or missing dependency)."""


def lower_bound(requires_python: str | None) -> tuple[int, ...]:
    """The lowest Python a `Requires-Python` specifier admits, as a tuple ((0,) for none).

    Only the clauses that bound from below count (`>=`, `>`, `~=`, `==`); `>3.8` is read as
    3.8.1, `==3.11.*` as 3.11.
    """
    low: tuple[int, ...] = (0,)
    for clause in (requires_python or "").split(","):
        m = re.match(r"\s*(>=|~=|==|>)\s*v?(\d+(?:\.\d+)*)", clause)
        if m is None:
            continue
        version = tuple(int(p) for p in m.group(2).split("."))
        if m.group(1) == ">":
            version = (*version, 1) if len(version) < 3 else (*version[:-1], version[-1] + 1)
        low = max(low, version)
    return low


def _package_files(name: str) -> tuple[Path, list[Path]]:
    """(the folder the import name lives in, its files relative to that folder)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise BundleError(f"the sandbox server needs {name!r}, which is not installed here")
    if spec.submodule_search_locations:  # a package: its whole folder
        top = Path(next(iter(spec.submodule_search_locations)))
        files = []
        for folder, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            base = Path(folder).relative_to(top.parent)
            files += [base / n for n in names if not n.endswith((".pyc", ".pyo"))]
        return top.parent, files
    origin = Path(spec.origin)
    return origin.parent, [Path(origin.name)]


def _own_files() -> tuple[Path, list[Path]]:
    package = Path(asyncgrpo.__file__).resolve().parent
    files = []
    for item in OWN:
        path = package / item
        found = [path] if path.is_file() else sorted(path.glob("*.py"))
        files += [Path("asyncgrpo") / p.relative_to(package) for p in found]
    return package.parent, files


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(packages: tuple[str, ...] = DEPENDENCIES) -> tuple[list[tuple[Path, Path]], dict, tuple[int, ...]]:
    """What a bundle holds: ((source, path in lib) for each file, {distribution: version},
    minimum Python). BundleError names every compiled file found."""
    copies: list[tuple[Path, Path]] = []
    versions: dict[str, str] = {"asyncgrpo": asyncgrpo.__version__}
    minimum = CODE_MINIMUM
    own_root, own = _own_files()
    copies += [(own_root / f, f) for f in own]
    own_dist = _distribution("asyncgrpo")
    if own_dist is not None:
        minimum = max(minimum, lower_bound(own_dist.metadata["Requires-Python"]))
    compiled: list[str] = []
    for name in packages:
        if name in OPTIONAL and importlib.util.find_spec(name) is None:
            continue
        root, files = _package_files(name)
        compiled += [str(root / f) for f in files if f.name.endswith(COMPILED_SUFFIXES)]
        copies += [(root / f, f) for f in files]
        dist = _distribution(name)
        if dist is None:
            continue  # not installed as a distribution (e.g. on sys.path by hand): no metadata
        compiled += [str(dist.locate_file(f)) for f in dist.files or () if f.name.endswith(COMPILED_SUFFIXES)]
        versions[dist.metadata["Name"]] = dist.version
        minimum = max(minimum, lower_bound(dist.metadata["Requires-Python"]))
        # its .dist-info: METADATA (importlib.metadata.version works in the bundle) and licences
        copies += [(Path(dist.locate_file(f)), Path(*f.parts)) for f in dist.files or ()
                   if f.parts[0].endswith(".dist-info") and f.name not in _SKIPPED_DIST_FILES]
    if compiled:
        raise BundleError("the sandbox server's bundle takes pure Python only, and these are compiled "
                          "extensions (built for one interpreter, they cannot run in a task's image): "
                          + ", ".join(sorted(set(compiled))))
    return copies, versions, minimum


def write_bundle(dest: str | os.PathLike, *, packages: tuple[str, ...] = DEPENDENCIES) -> Path:
    """Write the bundle into `dest` (made if missing, replaced if there); returns the entry's path."""
    copies, versions, minimum = collect(packages)
    dest = Path(dest).absolute()
    dest.mkdir(parents=True, exist_ok=True)
    for leftover in dest.glob(_STAGE_PREFIX + "*"):  # of a run that crashed
        shutil.rmtree(leftover, ignore_errors=True)
    stage = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=dest))
    try:
        folders: set[Path] = set()
        for source, rel in copies:
            target = stage / "lib" / rel
            if target.parent not in folders:
                target.parent.mkdir(parents=True, exist_ok=True)
                folders.update(p for p in target.parents if p.is_relative_to(stage) and p != stage)
            shutil.copyfile(source, target)
            os.chmod(target, 0o644)
        for folder in folders:
            os.chmod(folder, 0o755)
        manifest = {"python_minimum": ".".join(map(str, minimum[:2])),
                    "distributions": versions}
        _write(stage / "bundle.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n", 0o644)
        _write(stage / ENTRY, entry_source(minimum), 0o755)
        os.chmod(stage, 0o755)
        old = Path(tempfile.mkdtemp(prefix=_STAGE_PREFIX + "old-", dir=dest))
        for name in (ENTRY, "lib", "bundle.json"):  # the entry out first, in last
            if (dest / name).exists() or (dest / name).is_symlink():
                os.rename(dest / name, old / name)
        for name in ("lib", "bundle.json", ENTRY):
            os.rename(stage / name, dest / name)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    try:
        os.chmod(dest, 0o755)
    except PermissionError:
        pass  # an emptyDir's mount point belongs to root: readable by all already
    return dest / ENTRY


def _write(path: Path, text: str, mode: int) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def minimum_python(packages: tuple[str, ...] = DEPENDENCIES) -> tuple[int, ...]:
    """The Python a bundle written here needs, at least."""
    return collect(packages)[2]


def preload() -> None:
    """Import what the server imports at its start (the entry calls it before serving)."""
    import importlib

    for name in SERVER_MODULES:
        importlib.import_module(name)


def entry_source(minimum: tuple[int, ...]) -> str:
    """The entry script: plain enough for any python3 to reach its version check."""
    return _ENTRY_TEMPLATE.replace("@MINIMUM@", repr(tuple(minimum[:2]))).replace(
        "@EXIT_UNFIT@", str(EXIT_UNFIT)).replace("@VERSION@", asyncgrpo.__version__)


_ENTRY_TEMPLATE = '''\
# The asyncgrpo sandbox server (asyncgrpo @VERSION@), written by `asyncgrpo sandbox bundle`.
# Run with the image's own interpreter:  python3 -I -S <this file> serve [flags]
# (the flags and ASYNCGRPO_SANDBOX_* variables of `asyncgrpo sandbox serve`).
# Written for any python3: nothing newer than 3.0 before the version check.
import os
import sys

MINIMUM = @MINIMUM@
EXIT_UNFIT = @EXIT_UNFIT@


def _dotted(version):
    return ".".join(str(part) for part in tuple(version)[:3])


def unfit(version, executable, minimum=MINIMUM):
    """Why an interpreter of `version` (a tuple, sys.version_info) cannot run the server, or None."""
    if tuple(version)[:len(minimum)] < tuple(minimum):
        return ("this image's python3 is %s (%s); the sandbox server needs %s or newer"
                % (_dotted(version), executable or "python3", _dotted(minimum)))
    return None


def _missing_stdlib(err):
    name = (getattr(err, "name", None) or "").split(".")[0]
    if name and name in getattr(sys, "stdlib_module_names", ()):
        return name
    return None


def main(argv):
    where = sys.executable or "python3"
    problem = unfit(sys.version_info, where)
    if problem is None:
        try:
            import ctypes  # noqa: F401 - prctl(2): the server's hardening
        except ImportError as err:
            problem = ("this image's python3 %s (%s) cannot import ctypes (%s); the sandbox server needs it"
                       % (_dotted(sys.version_info), where, err))
    if problem is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
        try:
            from asyncgrpo.sandbox.server.portable import preload
            preload()
        except ImportError as err:
            missing = _missing_stdlib(err)
            if missing is None:
                raise
            problem = ("this image's python3 %s (%s) lacks the standard library module %r (%s); "
                       "the sandbox server needs it" % (_dotted(sys.version_info), where, missing, err))
    if problem is not None:
        sys.stderr.write("asyncgrpo sandbox: " + problem + "\\n")
        return EXIT_UNFIT
    from asyncgrpo.sandbox.server.commands import portable_main
    return portable_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
'''

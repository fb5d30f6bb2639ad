"""The import graph's layers (issue 27): rewards is a leaf; the API and the sandbox component
never reach up into the trainer. Read from the source (every import, also those inside
functions), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "operator" / "asyncgrpo"


def imports_of(folder: str) -> dict[str, set[str]]:
    """file -> every module it imports (import x, from x import y, import_module("x"))."""
    out: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names.add(str(node.args[0].value))
        out[str(path.relative_to(PACKAGE))] = names
    return out


def test_rewards_is_a_stdlib_leaf():
    for path, names in imports_of("rewards").items():
        for name in names:
            top = name.split(".")[0]
            if top == "asyncgrpo":
                assert name.startswith("asyncgrpo.rewards"), f"{path} imports {name}"
            else:
                assert top in sys.stdlib_module_names or top == "__future__", f"{path} imports {name}"


@pytest.mark.parametrize("folder", ["api", "sandbox", "rewards"])
def test_lower_layers_never_import_the_trainer(folder):
    for path, names in imports_of(folder).items():
        assert not any(n.startswith("asyncgrpo.trainer") for n in names), (path, names)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("asyncgrpo", *parts)).removesuffix(".__init__")


def _top_level(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names a module defines at top level, names it only imports)."""
    defined: set[str] = set()
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    return defined, imported - defined


def test_controller_modules_take_names_from_where_they_live():
    """Issue 27: the handlers reached `validate_run` and `checkpoint_identity` (asyncgrpo.api)
    through `reconcile`, which only imported them. A controller module takes a name from a
    module of the package only where that module defines it (packages' __init__ aside)."""
    trees = {_module_name(p): ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    names = {m: _top_level(t) for m, t in trees.items() if not m.endswith("__init__")}
    leaks = []
    for path in sorted((PACKAGE / "controller").glob("*.py")):
        tree, here = ast.parse(path.read_text()), path.name
        modules: dict[str, str] = {}   # local alias -> module of the package
        taken: list[tuple[str, str]] = []   # (module, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if f"{node.module}.{a.name}" in trees:
                        modules[a.asname or a.name] = f"{node.module}.{a.name}"
                    else:
                        taken.append((node.module, a.name))
            elif isinstance(node, ast.Import):
                modules.update({a.asname or a.name: a.name for a in node.names
                                if a.name in trees})
        taken += [(modules[n.value.id], n.attr) for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id in modules]
        leaks += [(here, f"{m}.{name}") for m, name in taken
                  if m in names and name not in names[m][0] and name in names[m][1]]
    assert not leaks, leaks


def test_controller_never_reaches_into_another_objects_private_state():
    """Issue 27: the sandbox pool's scaling took `rt._lock` (the Runtime's) to reserve room
    under the namespace cap; the Runtime has public methods for it now
    (`reserve_sandboxes`, `release_sandbox`, `end_reservation`)."""
    allowed = {"os._exit"}
    found = []
    for path in sorted((PACKAGE / "controller").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and ast.unparse(node) not in allowed:
                found.append((path.name, node.lineno, ast.unparse(node)))
    assert not found, found


def test_reconcile_leaves_the_sandbox_pool_to_sandbox_io():
    """Issue 27: the last hundred lines of reconcile.py were the pool's I/O (the gateway's
    demand, drains, the namespace cap's reservations, pod writes). Its plan
    (`sandbox_scaling`) is now read and carried out by `sandbox_io`; reconcile calls it."""
    tree = ast.parse((PACKAGE / "controller" / "reconcile.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.update(f"{node.module}.{a.name}" for a in node.names)
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not any(n.startswith("asyncgrpo.controller.sandbox_scaling") for n in imported)
    assert "asyncgrpo.controller.sandbox_io" in imported
# ------------------------------------------------ sandbox: one subpackage per process

#: asyncgrpo.sandbox's subpackages, named for the process their code runs in, and the ones of
#: them each may import: `common` is what they share; none reaches into another's process.
SANDBOX_MAY_IMPORT = {
    "common": set(),                 # wire types, reset challenge, HTTP hardening, serving helpers
    "server": {"common"},            # the sandbox server, in each sandbox pod
    "gateway": {"common"},           # the per-run gateway
    "client": {"common"},            # the trainer side: gateway client, environment, reward
    "operator": set(),               # the pool-sizing rule the operator applies
}


def sandbox_import_violations(imports: dict[str, set[str]]) -> list[str]:
    """`file imports module` for each import of a sandbox subpackage it may not import."""
    bad = []
    for path, names in imports.items():
        parts = path.split("/")
        if len(parts) < 3:   # sandbox/__init__.py
            continue
        own = parts[1]
        allowed = SANDBOX_MAY_IMPORT.get(own)
        for name in names:
            if not name.startswith("asyncgrpo.sandbox"):
                continue
            target = name.split(".")[2] if name.count(".") >= 2 else None
            if allowed is None or target is None or (target != own and target not in allowed):
                bad.append(f"{path} imports {name}")
    return bad


def test_sandbox_subpackages_keep_to_their_process():
    """Issue 27: asyncgrpo.sandbox held four processes' code side by side (server, gateway,
    client, the operator's sizing). Each is a subpackage now; the server never imports the
    gateway or the client, the client neither the server nor the gateway, and so on."""
    imports = imports_of("sandbox")
    found = {p.split("/")[1] for p in imports if p.count("/") >= 2}
    assert found == set(SANDBOX_MAY_IMPORT), found
    assert [p for p in imports if p.count("/") < 2] == ["sandbox/__init__.py"], imports
    assert not sandbox_import_violations(imports)


def test_sandbox_import_rule_catches_a_wrong_import():
    """The rule above, on imports it must refuse (and one it must allow)."""
    assert sandbox_import_violations({
        "sandbox/server/app.py": {"asyncgrpo.sandbox.gateway.pool"},
        "sandbox/client/environment.py": {"asyncgrpo.sandbox.server.process"},
        "sandbox/gateway/app.py": {"asyncgrpo.sandbox.client.gateway_client"},
        "sandbox/common/messages.py": {"asyncgrpo.sandbox.server"},
        "sandbox/operator/sizing.py": {"asyncgrpo.sandbox.common.messages"},
        "sandbox/server/quota.py": {"asyncgrpo.sandbox"},
        "sandbox/server/residue.py": {"asyncgrpo.sandbox.server.workspace",
                                      "asyncgrpo.sandbox.common.messages"},
    }) == [
        "sandbox/server/app.py imports asyncgrpo.sandbox.gateway.pool",
        "sandbox/client/environment.py imports asyncgrpo.sandbox.server.process",
        "sandbox/gateway/app.py imports asyncgrpo.sandbox.client.gateway_client",
        "sandbox/common/messages.py imports asyncgrpo.sandbox.server",
        "sandbox/operator/sizing.py imports asyncgrpo.sandbox.common.messages",
        "sandbox/server/quota.py imports asyncgrpo.sandbox",
    ]


def test_operator_side_takes_only_the_sizing_rule_of_the_sandbox_package():
    """The operator (`controller/`) runs none of the sandbox processes' code: of
    asyncgrpo.sandbox it imports only `operator` (the pool-sizing rule)."""
    bad = [f"{path} imports {name}" for path, names in imports_of("controller").items()
           for name in names if name.startswith("asyncgrpo.sandbox")
           and not name.startswith("asyncgrpo.sandbox.operator")]
    assert not bad, bad


# ------------------------------------------------ storage: the one S3 layer and versioned store

#: The S3 client's request methods: only `asyncgrpo.storage` calls them. Besides it, the
#: local S3 server's own loader (`local/s3.py`, the server side: it seeds and saves the moto
#: server it runs) and the test harness.
S3_REQUESTS = {"put_object", "get_object", "head_object", "delete_object", "delete_objects",
               "list_objects_v2", "list_objects", "upload_file", "download_file",
               "upload_fileobj", "download_fileobj", "head_bucket", "create_bucket",
               "copy_object", "get_paginator"}
S3_SERVER_SIDE = ("local/s3.py", "testing/")


def _top(path: str) -> str:
    """The package a file of asyncgrpo belongs to (a top-level module is its own)."""
    return path.split("/")[0].removesuffix(".py")


def _sources() -> dict[str, ast.AST]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text())
            for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_private_name_is_imported_across_packages():
    """A `_name` is its package's own: another package that needs it gets a public one (the
    weights store once imported the adapter store's `_check_relpath`)."""
    bad = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.startswith("asyncgrpo.")):
                continue
            owner = node.module.split(".")[1]
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") \
                        and owner != _top(path):
                    bad.append(f"{path}: from {node.module} import {alias.name}")
    assert not bad, bad


def test_only_storage_sends_s3_requests():
    """Every S3 request goes through `asyncgrpo.storage` (retries, error codes, the
    missing-key codes in one place): no module calls a boto3 client's request method itself
    (the bucket Job once did, fault injection wrote raw put_object)."""
    bad = []
    for path, tree in _sources().items():
        if path.startswith("storage/") or path.startswith(S3_SERVER_SIDE):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in S3_REQUESTS:
                bad.append(f"{path}:{node.lineno}: .{node.func.attr}(...)")
    assert not bad, bad


def test_controller_holds_no_job_side_code():
    """The operator (`controller/`) builds the bucket Job but never does its work: no module
    of it is the Job's code, talks S3 or imports the Job's S3 side; of `asyncgrpo.bucket` it
    imports only `policy` (what operator and Job agree on)."""
    bad = []
    for path, names in imports_of("controller").items():
        for name in names:
            if name.startswith(("botocore", "asyncgrpo.storage", "asyncgrpo.bucket.")) \
                    and name != "asyncgrpo.bucket.policy":
                bad.append(f"{path} imports {name}")
    for path, tree in _sources().items():
        if not path.startswith("controller/"):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module == "asyncgrpo.bucket":
                bad += [f"{path} imports asyncgrpo.bucket.{a.name}" for a in n.names
                        if a.name != "policy"]
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in S3_REQUESTS:
                bad.append(f"{path}:{n.lineno} sends an S3 request")
    assert not bad, bad
    # the Job's command, `asyncgrpo bucket`, runs a module outside the operator's package
    commands = {k.value: v.value for node in ast.walk(ast.parse((PACKAGE / "cli.py").read_text()))
                if isinstance(node, ast.Dict)
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    assert commands["bucket"] == "asyncgrpo.bucket.command", commands.get("bucket")
    for name in imports_of("bucket").get("bucket/policy.py", set()):
        assert not name.startswith(("boto", "asyncgrpo.storage")), name


def test_adapters_and_weights_are_siblings_on_the_versioned_store():
    """One versioned store (`storage.versions.VersionedStore`); adapters and weights are
    kinds of it, neither built on the other, with no override silenced by a type: ignore."""
    from asyncgrpo.adapters.store import AdapterStore
    from asyncgrpo.storage.versions import VersionedStore
    from asyncgrpo.weights.store import WeightStore

    assert issubclass(AdapterStore, VersionedStore) and issubclass(WeightStore, VersionedStore)
    assert not issubclass(WeightStore, AdapterStore) and not issubclass(AdapterStore, WeightStore)
    for path, names in imports_of("weights").items():
        assert "asyncgrpo.adapters.store" not in names, (path, names)
    for folder in ("storage", "adapters", "weights"):
        for p in sorted((PACKAGE / folder).rglob("*.py")):
            assert "type: ignore[override]" not in p.read_text(), p


# ------------------------------------------------ the sandbox server: nothing compiled, nothing else

#: what the sandbox server may import besides the standard library and `SERVER_OWN`: it also
#: runs from a bundle in a task's own image, with that image's python3 (docs/sandboxes.md, "The
#: server in a task's own image"), where only pure-Python code the bundle copies can come along
SERVER_DEPENDENCIES = frozenset({"starlette", "anyio", "sniffio", "idna", "uvicorn", "h11", "click",
                                 "prometheus_client", "typing_extensions"})
#: asyncgrpo's modules in the server (a trailing ".": that package and its modules)
SERVER_OWN = ("asyncgrpo", "asyncgrpo.wire", "asyncgrpo.sandbox", "asyncgrpo.sandbox.common.",
              "asyncgrpo.sandbox.server.")
#: optional imports of those packages that the test venv happens to satisfy and a bundle does
#: not: blocked while the closure is read, as absent as in a task's image
ABSENT_IN_A_BUNDLE = ("watchfiles", "python_multipart", "multipart", "uvloop", "httptools", "websockets",
                      "wsproto", "exceptiongroup", "orjson", "ujson")
_CLOSURE = r"""
import json, sys, tempfile
sys.path[:0] = sys.argv[1].split(":")
for name in sys.argv[2].split(","):
    sys.modules[name] = None
from asyncgrpo.sandbox.server import portable
portable.preload()
from asyncgrpo.sandbox.common.serving import uvicorn_config
from asyncgrpo.sandbox.server.app import SandboxServer, ServerSettings
app = SandboxServer(ServerSettings(workspace=tempfile.mkdtemp(), token="t")).asgi()
uvicorn_config(app, "127.0.0.1", 0).load()
print(json.dumps({n: getattr(m, "__file__", None) for n, m in sys.modules.items() if m is not None}))
"""


def server_closure_violations(modules: dict[str, str | None]) -> list[str]:
    """`module (file)` for each module the server may not import: not the standard library,
    `SERVER_OWN` or `SERVER_DEPENDENCIES`, or compiled (outside the standard library)."""
    bad = []
    for name, file in sorted(modules.items()):
        top = name.split(".")[0]
        if top.startswith("__") or (top in sys.stdlib_module_names and "site-packages" not in (file or "")):
            continue
        if top == "asyncgrpo":
            ok = any(name == own.rstrip(".") or (own.endswith(".") and name.startswith(own)) for own in SERVER_OWN)
        else:
            ok = top in SERVER_DEPENDENCIES
        if not ok or not (file or "").endswith(".py"):
            bad.append(f"{name} ({file})")
    return bad


def test_the_sandbox_servers_import_closure_is_pure_python_it_may_bundle():
    """Everything the server imports at its start and when its uvicorn config loads, read from a
    fresh interpreter with no site-packages but the venv's folder: the standard library, the
    pure-Python packages of SERVER_DEPENDENCIES and the server's own modules, nothing else (no
    pydantic, FastAPI, or any compiled module), and the bundle copies exactly those packages."""
    import json
    import subprocess

    from asyncgrpo.sandbox.server import portable

    assert set(portable.DEPENDENCIES) == SERVER_DEPENDENCIES
    site = next(p for p in sys.path if p.endswith("site-packages"))
    out = subprocess.run([sys.executable, "-I", "-S", "-c", _CLOSURE, f"{PACKAGE.parent}:{site}",
                          ",".join(ABSENT_IN_A_BUNDLE)], capture_output=True, text=True, timeout=120, check=True)
    modules = json.loads(out.stdout)
    assert "starlette.applications" in modules and "asyncgrpo.sandbox.server.app" in modules
    assert not server_closure_violations(modules)


def test_the_server_closure_rule_catches_what_a_bundle_cannot_hold():
    assert server_closure_violations({
        "json": "/usr/lib/python3.11/json/__init__.py",
        "_json": None,
        "_ssl": "/usr/lib/python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so",
        "starlette.routing": "/v/site-packages/starlette/routing.py",
        "asyncgrpo.sandbox.server.app": "/o/asyncgrpo/sandbox/server/app.py",
        "asyncgrpo.wire": "/o/asyncgrpo/wire.py",
        "pydantic": "/v/site-packages/pydantic/__init__.py",
        "pydantic_core._pydantic_core": "/v/site-packages/pydantic_core/_pydantic_core.cpython-311.so",
        "h11._speedups": "/v/site-packages/h11/_speedups.cpython-311.so",
        "asyncgrpo.sandbox.gateway.pool": "/o/asyncgrpo/sandbox/gateway/pool.py",
        "asyncgrpo.api": "/o/asyncgrpo/api/__init__.py",
        "typing_extensions": "/v/site-packages/typing_extensions.py",
    }) == [
        "asyncgrpo.api (/o/asyncgrpo/api/__init__.py)",
        "asyncgrpo.sandbox.gateway.pool (/o/asyncgrpo/sandbox/gateway/pool.py)",
        "h11._speedups (/v/site-packages/h11/_speedups.cpython-311.so)",
        "pydantic (/v/site-packages/pydantic/__init__.py)",
        "pydantic_core._pydantic_core (/v/site-packages/pydantic_core/_pydantic_core.cpython-311.so)",
    ]

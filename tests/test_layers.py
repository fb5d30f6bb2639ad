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

"""The wire contract keeps one home: no module but `asyncgrpo/wire.py` spells a variable name.

A name spelled on both sides (a builder that sets it, a program that reads it) drifts the day
one side is renamed and the other is not; the pod then reads a variable nobody sets. Names in
docstrings (documentation) and the test harness's own knobs (`asyncgrpo.testing`, read by
nothing in a pod) are not the contract.
"""

from __future__ import annotations

import ast
from pathlib import Path

from asyncgrpo import wire

PACKAGE = Path(__file__).resolve().parents[1] / "operator" / "asyncgrpo"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def spelled_outside_wire(package: Path = PACKAGE) -> list[str]:
    """`path:line: name` of every string literal naming an ASYNCGRPO_ variable elsewhere."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel == Path("wire.py") or rel.parts[0] == "testing":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith(wire.ENV_PREFIX) and id(node) not in docs):
                found.append(f"{rel}:{node.lineno}: {node.value}")
    return found


def test_no_module_but_wire_spells_a_variable_name():
    assert spelled_outside_wire() == []


def test_the_check_finds_a_name_spelled_elsewhere(tmp_path):
    (tmp_path / "wire.py").write_text('A_ENV = "ASYNCGRPO_A"\n')
    (tmp_path / "reader.py").write_text('"""Reads ASYNCGRPO_A."""\nimport os\n'
                                        'a = os.environ.get("ASYNCGRPO_A")\n')
    assert spelled_outside_wire(tmp_path) == ["reader.py:3: ASYNCGRPO_A"]

"""Statements of docs/operator.md that a test can hold to the code: its metrics table lists
every metric the operator exports, and its RBAC table is the chart's rules."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from asyncgrpo.controller.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[1]
OPERATOR_MD = (REPO / "docs" / "operator.md").read_text()


def _section(doc: str, title: str) -> str:
    return doc.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]


def test_the_metrics_table_lists_every_operator_metric():
    names = {m.name + ("_total" if m.type == "counter" else "")
             for m in OperatorMetrics().registry.collect()}
    table = _section(OPERATOR_MD, "Metrics")
    listed = {row[0].strip("`") for row in _rows(table) if row[0].startswith("`")}
    assert listed == names, (names - listed, listed - names)


def _chart_rules() -> set[tuple[str, str, tuple[str, ...]]]:
    text = (REPO / "charts/asyncgrpo/templates/_helpers.tpl").read_text()
    body = text.split('{{- define "asyncgrpo.rules" -}}', 1)[1].split("{{- end -}}", 1)[0]
    out = set()
    for rule in yaml.safe_load(body):
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.add((group or "core", resource, tuple(sorted(rule["verbs"]))))
    return out


def test_the_rbac_table_is_the_charts_rules():
    table = _section(OPERATOR_MD, "RBAC")
    documented = set()
    for group, resources, verbs, _why in _rows(table)[1:]:
        if set(group) == {"-"}:
            continue
        verbs = tuple(sorted(re.sub(r"\*|only", "", verbs).replace(" ", "").split(",")))
        for resource in resources.split(","):
            documented.add((group, resource.strip(), verbs))
    assert documented == _chart_rules()


def test_rbac_says_the_credentials_secret_is_never_read():
    """docs/security.md: the operator never reads a run's credentials Secret; operator.md
    once said it did."""
    table = _section(OPERATOR_MD, "RBAC")
    assert "never reads a run's credentials Secret" in table
    assert "reads the\ncredentials Secret" not in table and "reads the credentials" not in table

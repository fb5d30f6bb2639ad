"""Every example run file made for this machine (a local model under .cache/demo) passes the
deep checks against its own data with its own tokenizer (`asyncgrpo.preflight`, the same
checks as `validate --deep`, the start of `local run` and the cluster preflight Job): above
all, each prompt of its first rows, rendered as TRL's rollout worker renders it (chat
template, tools' schemas, generation prompt), leaves room in rollout.maxModelLen for the
run's generations. The code-fix run once had maxModelLen 1024: its 940-token first prompt
and 4 generations of 48 tokens did not fit, and vLLM answered the rollout with a 400."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncgrpo.api import load_run
from asyncgrpo.preflight import preflight

REPO = Path(__file__).resolve().parents[2]
DEMO = ".cache/demo"


def run_files() -> list[Path]:
    """The example files holding an AsyncGRPORun whose model is the local demo model."""
    out = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if (doc or {}).get("kind") == "AsyncGRPORun" \
                    and doc["spec"]["model"]["name"].startswith(DEMO):
                out.append(path)
    return out


LOCAL = run_files()


def test_the_local_examples_are_all_found():
    names = {str(p.relative_to(REPO)) for p in LOCAL}
    assert {"examples/local-tiny.yaml", "examples/tasks/calculator-math/run.yaml",
            "examples/tasks/code-fix/run.yaml"} <= names


@pytest.fixture
def at_repo(monkeypatch):
    """The demo model (as `asyncgrpo local demo-assets .cache/demo` writes it), and the
    repository root as the current directory: the run files' relative paths resolve there."""
    from asyncgrpo.local.demo import prepare_demo

    prepare_demo(REPO / DEMO)
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("path", LOCAL, ids=[str(p.relative_to(REPO)) for p in LOCAL])
def test_an_example_run_file_passes_the_deep_checks_against_its_data(path, at_repo):
    run = load_run(path)
    report = preflight(run)
    assert report.errors == [], [str(e) for e in report.errors]
    assert "prompt lengths" in report.seconds   # the tokenizer and the rows were at hand


def _changed(tmp_path: Path, source: str, **rollout) -> object:
    doc = yaml.safe_load((REPO / source).read_text())
    doc["spec"]["rollout"].update(rollout)
    out = tmp_path / "run.yaml"
    out.write_text(yaml.safe_dump(doc))
    return load_run(out)


def test_a_prompt_that_does_not_fit_max_model_len_is_an_error_naming_it(tmp_path, at_repo):
    # the code-fix run as it was: 1024 tokens for a 940-token prompt and 4 generations of 48
    run = _changed(tmp_path, "examples/tasks/code-fix/run.yaml", maxModelLen=1024)
    (err,) = [e for e in preflight(run).errors]
    assert err.path == "spec.rollout.maxModelLen"
    assert "with the schemas of 3 tools" in err.message and "> maxModelLen 1024" in err.message
    # single-turn: the prompt plus maxCompletionTokens
    run = _changed(tmp_path, "examples/local-tiny.yaml", maxModelLen=60,
                   sampling={"maxCompletionTokens": 50})
    (err,) = [e for e in preflight(run).errors]
    assert err.path == "spec.rollout.maxModelLen" and "maxCompletionTokens 50" in err.message

"""The run model: defaults, round trips, and every invalid case named by its field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.api import AsyncGRPORun, load_run, parse_run, validate_run
from asyncgrpo.api.v1alpha1 import BUILTIN_REWARDS
from asyncgrpo.api.validation import RunValidationError

from .invalid_specs import NAME_INVALID, REPO, SCHEMA_INVALID, SEMANTIC_INVALID, base_run

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_examples_exist_and_are_valid():
    assert len(EXAMPLES) >= 4
    for path in EXAMPLES:
        run = load_run(path)
        assert run.metadata.name


def test_defaults_fill_a_minimal_run():
    run = parse_run({
        "apiVersion": "asyncgrpo.dev/v1alpha1",
        "kind": "AsyncGRPORun",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B"},
            "adapterStore": {"bucket": "runs"},
            "data": {"path": "/data/p.jsonl"},
            "reward": {"functions": [{"name": "exact_match"}]},
        },
    })
    t = run.spec.trainer
    assert (t.replicas, t.gpus_per_replica, t.num_generations, t.max_staleness) == (1, 1, 8, 4)
    assert run.spec.model.finetuning == "lora" and run.spec.model.lora.rank == 16
    assert run.spec.sandboxes is None
    assert run.spec.adapter_store.retention >= t.max_staleness + 2
    assert run.world_size == 1


def test_round_trip_keeps_camel_case_and_values():
    doc = base_run()
    run = parse_run(doc)
    dumped = run.model_dump(by_alias=True, exclude_none=True)
    assert dumped["spec"]["trainer"]["numGenerations"] == doc["spec"]["trainer"]["numGenerations"]
    assert "num_generations" not in yaml.safe_dump(dumped)
    assert parse_run(dumped) == run


def test_world_size_counts_cpu_nodes_as_one_process():
    doc = base_run()
    doc["spec"]["trainer"].update(replicas=3, gpusPerReplica=0)
    doc["spec"]["model"]["attention"] = "tree-sdpa"
    assert parse_run(doc).world_size == 3


@pytest.mark.parametrize("case", SCHEMA_INVALID + SEMANTIC_INVALID + NAME_INVALID,
                         ids=lambda c: c[0])
def test_invalid_run_names_the_field(case):
    _, make, field = case
    _, errors = validate_run(make())
    assert errors, "expected the run to be refused"
    paths = [e.path for e in errors]
    assert any(p == field or p.startswith((field + ".", field + "[")) for p in paths), paths


def test_there_are_at_least_ten_distinct_invalid_cases_of_each_kind():
    assert len({c[2] for c in SCHEMA_INVALID}) >= 10
    assert len({c[2] for c in SEMANTIC_INVALID}) >= 10


def test_semantic_cases_pass_the_schema_layer():
    # They must be refused by the cross-field rules, not by a typo in the case itself.
    for name, make, _ in SEMANTIC_INVALID:
        run = AsyncGRPORun.model_validate(make())
        assert run is not None, name


def test_unknown_field_is_refused_with_its_path():
    doc = base_run()
    doc["spec"]["trainer"]["learningrate"] = 1.0
    _, errors = validate_run(doc)
    assert [str(e) for e in errors] == ["spec.trainer.learningrate: unknown field"]


def test_parse_run_raises_with_every_error():
    doc = base_run()
    doc["spec"]["trainer"]["expertParallelSize"] = 2
    doc["spec"]["adapterStore"]["retention"] = 1
    with pytest.raises(RunValidationError) as info:
        parse_run(doc)
    assert {e.path for e in info.value.errors} == {
        "spec.trainer.expertParallelSize", "spec.adapterStore.retention"}


def test_reward_enum_matches_builtin_names():
    from asyncgrpo.api.v1alpha1 import RewardFunction

    enum = RewardFunction.model_json_schema()["properties"]["name"]["enum"]
    assert tuple(enum) == BUILTIN_REWARDS


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncgrpo.cli", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_validate_cli_accepts_examples():
    result = _cli("validate", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": valid") == len(EXAMPLES)


def test_validate_cli_prints_every_error_with_its_path(tmp_path: Path):
    bad = base_run()
    bad["spec"]["trainer"]["numGenerations"] = 1
    bad["spec"]["trainer"]["expertParallelSize"] = 2
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = _cli("validate", str(path), *map(str, EXAMPLES[:1]))
    assert result.returncode == 1
    assert f"{path}: qwen3-math: spec.trainer.numGenerations:" in result.stderr
    assert "valid" in result.stdout  # the good file is still checked and reported


def test_validate_cli_reports_unreadable_and_foreign_files(tmp_path: Path):
    (tmp_path / "broken.yaml").write_text("spec: [unclosed\n")
    (tmp_path / "pod.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    result = _cli("validate", str(tmp_path / "broken.yaml"), str(tmp_path / "pod.yaml"),
                  str(tmp_path / "missing.yaml"))
    assert result.returncode == 1
    assert "broken.yaml: cannot read" in result.stderr
    assert "pod.yaml: no AsyncGRPORun" in result.stderr
    assert "missing.yaml: cannot read" in result.stderr


def test_longest_name_is_44_and_derived_from_the_revision_hash_label():
    from asyncgrpo.api.v1alpha1 import MAX_RUN_NAME

    doc = base_run()
    doc["metadata"]["name"] = "r" * MAX_RUN_NAME
    assert validate_run(doc)[1] == []
    # controller-revision-hash = "<run>-trainer-<hash of up to 10>": a label value (<= 63)
    assert len(f"{'r' * MAX_RUN_NAME}-trainer-{'h' * 10}") == 63


def test_run_folder_is_namespaced_and_refuses_escaping_segments():
    from asyncgrpo.api.layout import ancestors, run_folder

    assert run_folder("asyncgrpo", "team-a", "shared") == "asyncgrpo/team-a/shared/"
    assert run_folder("asyncgrpo", "team-a", "shared") != run_folder("asyncgrpo", "team-b",
                                                                     "shared")
    assert run_folder("p", None, "r") == "p/default/r/"
    for bad in (("/", "a", "r"), ("a/../b", "a", "r"), ("", "a", "r"), ("p", "../x", "r"),
                ("p", "a", "r/../../x"), ("p", "a", "")):
        with pytest.raises(ValueError):
            run_folder(*bad)
    assert ancestors("a/b/c/") == ["a/", "a/b/"]


def test_checkpoint_identity_names_each_changed_field():
    from asyncgrpo.api.validation import checkpoint_identity, immutable_errors

    run = parse_run(base_run())
    fixed = checkpoint_identity(run.spec)
    assert immutable_errors(fixed, run.spec) == []
    doc = base_run()
    doc["spec"]["model"]["name"] = "other/model"
    doc["spec"]["model"]["lora"]["rank"] = 8
    paths = [e.path for e in immutable_errors(fixed, parse_run(doc).spec)]
    assert paths == ["spec.model.lora.rank", "spec.model.name"]
    doc = base_run()
    doc["spec"]["trainer"]["learningRate"] = 0.5   # not part of the identity
    assert immutable_errors(fixed, parse_run(doc).spec) == []


def test_docs_show_the_gpu_cluster_example_as_it_is():
    example = (REPO / "examples" / "gpu-cluster.yaml").read_text()
    for page in ("api.md", "operator.md"):
        assert example in (REPO / "docs" / page).read_text(), (
            f"docs/{page} shows another GPU-cluster run than examples/gpu-cluster.yaml")

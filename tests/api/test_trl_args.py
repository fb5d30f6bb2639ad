"""spec.trainer.trlArgs and TRL's typed settings: checked without trl (the generated
table), the table kept equal to the installed trl, and passed through to AsyncGRPOConfig."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.api.trl_args import OWNED
from asyncgrpo.api.trl_fields import FIELDS
from asyncgrpo.api.validation import semantic_errors

TABLE = Path(__file__).parents[2] / "operator" / "asyncgrpo" / "api" / "trl_fields.py"


def run_with(trainer: dict, sampling: dict | None = None) -> AsyncGRPORun:
    spec = {"model": {"name": "m"}, "data": {"path": "p.jsonl"}, "adapterStore": {"bucket": "bucket"},
            "reward": {"functions": [{"name": "exact_match"}]}, "trainer": trainer,
            "rollout": {"sampling": sampling or {}}}
    return AsyncGRPORun.model_validate({"apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
                                        "metadata": {"name": "r"}, "spec": spec})


def errors(run) -> dict[str, str]:
    return {e.path: e.message for e in semantic_errors(run)}


def test_the_checked_in_table_is_the_installed_trls():
    out = subprocess.run([sys.executable, "-m", "asyncgrpo.api.trl_fields_gen"], capture_output=True, text=True,
                         check=True, env={"TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(TABLE.parents[2]),
                                          "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert out.stdout == TABLE.read_text(), "regenerate: python -m asyncgrpo.api.trl_fields_gen > " + str(TABLE)


def test_every_owned_key_is_a_real_field_and_every_key_the_trainer_sets_is_owned():
    import ast
    import inspect

    from asyncgrpo.trainer import main

    assert set(OWNED) <= set(FIELDS)
    call = next(n for n in ast.walk(ast.parse(inspect.getsource(main.trl_config)))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "AsyncGRPOConfig")
    set_by_trainer = {k.arg for k in call.keywords if k.arg}
    assert set_by_trainer - set(OWNED) == set()  # else trlArgs could pass the same key twice


def test_unknown_keys_wrong_types_and_owned_keys_are_refused_by_name():
    e = errors(run_with({"trlArgs": {"beta": 0.04, "vllm_server_timeout": "soon", "output_dir": "/x",
                                     "vllm_server_base_url": "http://evil", "epsilon_high": 0.3}}))
    assert e["spec.trainer.trlArgs.beta"] == "not a field of TRL's AsyncGRPOConfig"
    assert "takes number, got string" in e["spec.trainer.trlArgs.vllm_server_timeout"]
    assert "the operator" in e["spec.trainer.trlArgs.output_dir"]
    assert "the operator" in e["spec.trainer.trlArgs.vllm_server_base_url"]
    assert e["spec.trainer.trlArgs.epsilon_high"] == "set by spec.trainer.clipEpsilonHigh, not by trlArgs"
    assert not errors(run_with({"trlArgs": {"vllm_server_timeout": 30, "num_completions_to_print": 2}}))


def test_the_module_checking_trl_args_imports_no_trl():
    code = ("import sys; import asyncgrpo.api.validation, asyncgrpo.api.trl_args; "
            "assert 'trl' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(TABLE.parents[2])})


def test_typed_settings_and_trl_args_reach_async_grpo_config():
    pytest.importorskip("trl")
    from asyncgrpo.trainer.main import trl_config
    from asyncgrpo.trainer.runtime_env import RuntimeEnv

    run = run_with({"clipEpsilonHigh": 0.28, "trlArgs": {"vllm_server_timeout": 33.0, "fork_threshold_tokens": 7}},
                   {"topK": 20, "minP": 0.05, "repetitionPenalty": 1.1})
    c = trl_config(run, RuntimeEnv(vllm_url="http://v:8000"), use_cpu=True)
    assert (c.epsilon_high, c.top_k, c.min_p, c.repetition_penalty) == (0.28, 20, 0.05, 1.1)
    assert (c.vllm_server_timeout, c.fork_threshold_tokens) == (33.0, 7)

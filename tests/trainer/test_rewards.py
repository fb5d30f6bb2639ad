"""The reward registry: names match the API, each built-in scores what its docstring says."""

from __future__ import annotations

import pickle

import pytest

from asyncgrpo.api import BUILTIN_REWARDS, parse_run
from asyncgrpo.rewards import BUILTINS, completion_text
from asyncgrpo.trainer import rewards
from asyncgrpo.trainer.rewards import RewardTerm, build_rewards


def msg(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def user_reward(completions, *, bonus: float = 0.0, **kwargs):
    """A user reward for the `python` entry (importable as tests.trainer.test_rewards:...)."""
    return [len(completion_text(c)) + bonus for c in completions]


def test_every_built_in_names_an_importable_function_and_the_api_its_names():
    """The API's names are the table's; every built-in's function loads from its path."""
    assert BUILTIN_REWARDS == (*BUILTINS, "python")
    for name, builtin in BUILTINS.items():
        assert callable(rewards.load_user_function(builtin.function)), name


def test_unknown_or_ill_typed_args_are_refused_at_build():
    with pytest.raises(ValueError, match="unknown args \\['feild'\\]"):
        RewardTerm("exact_match", args={"feild": "answer"})
    with pytest.raises(ValueError, match="flags takes"):
        RewardTerm("regex_match", args={"pattern": "x", "flags": "q"})
    with pytest.raises(ValueError, match="pattern"):
        RewardTerm("regex_match")


def test_exact_match_with_extract_and_case():
    comps = [msg("The answer is 42."), msg("the answer is  hello "), "42", msg("nothing")]
    out = RewardTerm("exact_match", args={"extract": r"answer is\s+(\S+?)\.?\s*$"})(
        comps, answer=["42", "Hello", "42", "1"])
    assert out == [1.0, 0.0, 0.0, 0.0]  # "42" has no "answer is": no extraction, 0
    out = RewardTerm("exact_match", args={"case_sensitive": False})(
        [msg(" Hello "), msg("hello!")], answer=["hello", "hello"])
    assert out == [1.0, 0.0]


def test_regex_match_is_a_format_reward():
    term = RewardTerm("regex_match", weight=0.5, args={"pattern": r"answer is \d+\.$"})
    assert term([msg("so the answer is 7."), msg("answer: 7")]) == [0.5, 0.0]
    full = RewardTerm("regex_match", args={"pattern": "ab+", "full": True, "flags": "i"})
    assert full(["ABB", "abbc"]) == [1.0, 0.0]


def test_numeric_match_takes_the_last_number_and_skips_bad_gold():
    term = RewardTerm("numeric_match", args={"tolerance": 0.01})
    out = term([msg("12 + 30 = 42"), msg("about 3.14159"), msg("1,000 apples"), msg("no"),
                msg("7")], answer=["42", 3.14, "1000", "5", "n/a"])
    assert out == [1.0, 1.0, 1.0, 0.0, None]


def test_python_user_function_weight_and_args():
    term = RewardTerm("python", weight=2.0, module="tests.trainer.test_rewards:user_reward",
                      args={"bonus": 1.0})
    assert term.__name__ == "user_reward"
    assert term(["abc", msg("de")]) == [8.0, 6.0]
    with pytest.raises(ValueError, match="cannot be loaded"):
        RewardTerm("python", module="tests.trainer.test_rewards:missing")
    with pytest.raises(ValueError, match="needs module"):
        RewardTerm("python")


def test_terms_pickle_for_trls_scoring_child():
    term = RewardTerm("python", module="tests.trainer.test_rewards:user_reward")
    again = pickle.loads(pickle.dumps(term))
    assert again(["xy"]) == [2.0]


def test_missing_column_names_the_columns():
    with pytest.raises(KeyError, match="no column 'answer'"):
        RewardTerm("exact_match")(["x"], solution=["x"])


def test_sandbox_tests_delegates_to_the_sandbox_component():
    """Rows without a test command are not scored (None) by the sandbox component's
    function; this checks the delegation and the weighting without a gateway."""
    term = RewardTerm("sandbox_tests", weight=2.0)
    assert term(["print(1)", "x"], test_command=[None, ""]) == [None, None]


def test_build_from_run():
    run = parse_run({
        "metadata": {"name": "r"},
        "spec": {"model": {"name": "m"}, "adapterStore": {"bucket": "bkt"},
                 "data": {"path": "/d.jsonl"},
                 "reward": {"functions": [{"name": "numeric_match", "weight": 2},
                                          {"name": "regex_match", "args": {"pattern": "x"}}]}},
    })
    terms = build_rewards(run.spec.reward)
    assert [t.__name__ for t in terms] == ["numeric_match", "regex_match"]
    assert terms[0](["x 3"], answer=["3"]) == [2.0]

"""The call `asyncgrpo.testing.tool_caller` teaches is the text TRL's own parser reads as
that call (the end-to-end task tests rely on it: tests/tasks/test_example_tasks_train.py)."""

from __future__ import annotations

import sys

import pytest

from tests.api.invalid_specs import REPO


@pytest.mark.parametrize("call", [{"name": "calculator", "arguments": {"expression": "1 + 1"}},
                                  {"name": "calculator", "arguments": {}}])  # as run_tests()
def test_the_taught_call_is_what_trls_parser_reads(call):
    from trl.chat_template_utils import add_response_schema, parse_response

    from asyncgrpo.testing.tool_caller import _first_turn_ids
    from asyncgrpo.trainer.tiny_tokenizer import tiny_tokenizer

    folder = str(REPO / "examples" / "tasks" / "calculator-math")
    sys.path.insert(0, folder)
    try:
        from calculator_math.env import Calculator
    finally:
        sys.path.remove(folder)
    tools = [Calculator().calculator]
    tokenizer = add_response_schema(tiny_tokenizer())
    ids, mask = _first_turn_ids(tokenizer, "What is 1 + 1?", tools, call)
    start = mask.index(True)
    assert all(mask[start:]) and not any(mask[:start])  # only the call is learned
    # the prompt is the template's, tool schema included, as TRL's worker renders it
    assert "calculator" in tokenizer.decode(ids[:start])
    message = parse_response(tokenizer, ids[start:], prefix=ids[:start], tools=tools)
    (tool_call,) = message["tool_calls"]
    function = tool_call.get("function", tool_call)
    assert function["name"] == call["name"]
    assert function["arguments"] == call["arguments"]

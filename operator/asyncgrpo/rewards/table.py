"""The reward names a run may use, each built-in with its arguments and its function.

Adding a built-in: its args dataclass (`args.py`), its function, one row here and a test.
The API's `name` enum, the CRD's rule on `args`, validation and the trainer's lookup all
read this table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from asyncgrpo.rewards.args import (
    ExactMatchArgs,
    NumericMatchArgs,
    RegexMatchArgs,
    SandboxTestsArgs,
)


@dataclass(frozen=True)
class Builtin:
    args: type
    #: 'module:function' the trainer imports: the functions that lease sandboxes live with the
    #: sandbox client, so this package stays a leaf.
    function: str


BUILTINS: dict[str, Builtin] = {
    "exact_match": Builtin(ExactMatchArgs, "asyncgrpo.rewards.builtin:exact_match"),
    "regex_match": Builtin(RegexMatchArgs, "asyncgrpo.rewards.builtin:regex_match"),
    "numeric_match": Builtin(NumericMatchArgs, "asyncgrpo.rewards.builtin:numeric_match"),
    "sandbox_tests": Builtin(SandboxTestsArgs, "asyncgrpo.sandbox.client.rewards:sandbox_tests"),
}

#: `name: python` loads the user's function named by `module`; its args are its own.
USER_FUNCTION = "python"

NAMES: tuple[str, ...] = (*BUILTINS, USER_FUNCTION)


def arg_names(name: str) -> tuple[str, ...] | None:
    """The `args` a built-in takes; None for the user's function."""
    builtin = BUILTINS.get(name)
    return None if builtin is None else tuple(f.name for f in fields(builtin.args))

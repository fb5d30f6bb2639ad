"""Rewards: the calling convention, the built-in functions and their table.

A leaf of the import graph (standard library only): the API (names, argument rules), the
sandbox component (`sandbox_tests`) and the trainer (`RewardTerm`) all import it, and it
imports none of them.

A reward function is called once per group with TRL's keyword arguments: `completions` (one
per rollout: a string, or a list of chat messages whose last one is the assistant's),
`prompts`, `completion_ids`, and every other column of the data set as a list aligned with
`completions` (e.g. `answer`). It returns one float (or None: "not applicable") per
completion. A user's function (`name: python`) takes its `args` as keyword arguments beside
the columns; a built-in takes them as its args dataclass, positionally.
"""

from asyncgrpo.rewards.args import (
    ExactMatchArgs,
    NumericMatchArgs,
    RegexMatchArgs,
    SandboxTestsArgs,
)
from asyncgrpo.rewards.table import BUILTINS, NAMES, USER_FUNCTION, Builtin, arg_names
from asyncgrpo.rewards.text import column, completion_text, per_row

__all__ = [
    "BUILTINS",
    "NAMES",
    "USER_FUNCTION",
    "Builtin",
    "ExactMatchArgs",
    "NumericMatchArgs",
    "RegexMatchArgs",
    "SandboxTestsArgs",
    "arg_names",
    "column",
    "completion_text",
    "per_row",
]

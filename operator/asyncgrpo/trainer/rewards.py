"""Named reward functions with arguments: what `spec.reward.functions` refers to.

Each term becomes one TRL reward function (a `RewardTerm`); TRL sums the terms of a
rollout, normalises rewards within its group and logs each term as `rewards/<name>`.
Terms are module-level callable objects, not closures, because TRL scores rewards in a
spawned child process and pickles them there.

The calling convention, the built-ins and their arguments are `asyncgrpo.rewards`'s (its
table names each built-in's function; `sandbox_tests` lives with the sandbox client, in
`asyncgrpo.sandbox.client.rewards`, imported when the first group is scored). `python` loads a user
function, `module="pkg.mod:fn"`, with the same calling convention and its `args` as keyword
arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from asyncgrpo.rewards import BUILTINS, USER_FUNCTION, arg_names

Reward = float | None
RewardFn = Callable[..., list[Reward]]


def load_user_function(module: str) -> RewardFn:
    """'package.module:function' -> the function (imported in the trainer image)."""
    mod_name, _, attr = module.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"reward module must be 'package.module:function', got {module!r}")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward module {module!r} cannot be loaded: {err}") from err
    if not callable(fn):
        raise TypeError(f"reward module {module!r} is not callable")
    return fn


class RewardTerm:
    """One weighted term: `weight * fn(completions, **row columns)`, with the term's `args`
    as the built-in's options (or, for a user function, as keyword arguments).

    Picklable (TRL's scoring child unpickles it): holds the function's path, not the
    function. `__name__` is what TRL logs the term under.
    """

    def __init__(self, name: str, weight: float = 1.0, args: dict[str, Any] | None = None,
                 module: str | None = None):
        args = dict(args or {})
        if name == USER_FUNCTION:
            if not module:
                raise ValueError("reward python needs module: 'package.module:function'")
            load_user_function(module)  # fail at startup, not in the scoring child
            self.options = None
            self.function = module
        elif name in BUILTINS:
            unknown = set(args) - set(arg_names(name))
            if unknown:
                raise ValueError(f"reward {name}: unknown args {sorted(unknown)}; it takes "
                                 f"{sorted(arg_names(name))}")
            try:
                self.options = BUILTINS[name].args(**args)
            except (TypeError, ValueError) as err:
                raise ValueError(f"reward {name}: {err}") from err
            self.function = BUILTINS[name].function
        else:
            raise ValueError(f"unknown reward {name!r}; expected one of "
                             f"{sorted([*BUILTINS, USER_FUNCTION])}")
        self.name = name
        self.weight = float(weight)
        self.args = args
        self.module = module
        self.__name__ = module.rpartition(":")[2] if name == USER_FUNCTION else name

    def __call__(self, completions, **columns) -> list[Reward]:
        fn = load_user_function(self.function)
        if self.options is None:
            rewards = fn(completions, **{**columns, **self.args})
        else:
            rewards = fn(completions, self.options, **columns)
        if len(rewards) != len(completions):
            raise ValueError(f"reward {self.__name__} returned {len(rewards)} values for "
                             f"{len(completions)} completions")
        return [None if r is None else self.weight * float(r) for r in rewards]

    def __repr__(self) -> str:
        return f"RewardTerm({self.__name__}, weight={self.weight}, args={self.args})"


def build_rewards(spec, image_column: str | None = None) -> list[RewardTerm]:
    """TRL reward functions for `run.spec.reward`; `image_column` (spec.sandboxes.imageColumn)
    reaches `sandbox_tests` so each completion is scored in a sandbox of its row's image."""
    return [RewardTerm(f.name, f.weight, _with_image_column(f.name, f.args, image_column), f.module)
            for f in spec.functions]


def _with_image_column(name: str, args: dict[str, Any], column: str | None) -> dict[str, Any]:
    if column is None or name != "sandbox_tests" or "image_column" in args:
        return args
    return {**args, "image_column": column}

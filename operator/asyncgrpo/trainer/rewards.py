"""Named reward functions with arguments: what `spec.reward.functions` refers to.

Each term becomes one TRL reward function (a `RewardTerm`); TRL sums the terms of a
rollout, normalises rewards within its group and logs each term as `rewards/<name>`.
Terms are module-level callable objects, not closures, because TRL scores rewards in a
spawned child process and pickles them there.

A reward function is called once per group with TRL's keyword arguments: `completions`
(one per rollout: a string, or a list of chat messages whose last one is the assistant's),
`prompts`, `completion_ids`, and every other column of the data set as a list aligned with
`completions` (e.g. `answer`). It returns one float (or None: "not applicable") per
completion. The registry's functions take their options as keyword-only arguments, given
in the run as `args`.

Built-ins:
- `exact_match(field="answer", strip=True, case_sensitive=True, extract=None)`: 1.0 when
  the completion (or the regex `extract`'s first group in it) equals the row's `field`.
- `regex_match(pattern, flags="", full=False)`: 1.0 when the pattern matches (a format
  reward: "ends with 'The answer is N.'").
- `numeric_match(field="answer", tolerance=1e-6, pattern=None)`: 1.0 when the last number
  in the completion (or `pattern`'s first group) is within `tolerance` of the row's field.
- `sandbox_tests(...)`: the share of a row's tests that pass when the completion's code
  runs in a sandbox; delegated to `asyncgrpo.sandbox.rewards.sandbox_tests`, which owns
  sandbox leasing (imported when the first group is scored, so runs that do not use it
  need no sandbox code).
- `python(module="pkg.mod:fn", ...)`: a user function with the same calling convention.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

Reward = float | None
RewardFn = Callable[..., list[Reward]]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def completion_text(completion: Any) -> str:
    """The text a completion ends with: the string itself, or the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence) and completion:
        last = completion[-1]
        if isinstance(last, dict):
            content = last.get("content") or ""
            if isinstance(content, list):  # multimodal parts: keep the text ones
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
        return str(last)
    return ""


def _column(kwargs: dict[str, Any], field: str, n: int, fn: str) -> list[Any]:
    if field not in kwargs:
        raise KeyError(f"reward {fn}: the data set has no column {field!r} "
                       f"(columns: {sorted(k for k in kwargs if k not in ('prompts', 'completion_ids'))})")
    values = kwargs[field]
    if isinstance(values, (list, tuple)) and len(values) == n:
        return list(values)
    return [values] * n


def _extract(text: str, pattern: str | None) -> str | None:
    if pattern is None:
        return text
    m = re.search(pattern, text, flags=re.DOTALL)
    if m is None:
        return None
    return m.group(1) if m.groups() else m.group(0)


def _number(s: Any) -> float | None:
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return float(s)
    found = _NUMBER.findall(str(s))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def exact_match(completions, *, field: str = "answer", strip: bool = True,
                case_sensitive: bool = True, extract: str | None = None, **kwargs) -> list[Reward]:
    expected = _column(kwargs, field, len(completions), "exact_match")
    out: list[Reward] = []
    for c, want in zip(completions, expected):
        if want is None:
            out.append(None)
            continue
        got = _extract(completion_text(c), extract)
        if got is None:
            out.append(0.0)
            continue
        a, b = str(got), str(want)
        if strip:
            a, b = a.strip(), b.strip()
        if not case_sensitive:
            a, b = a.casefold(), b.casefold()
        out.append(1.0 if a == b else 0.0)
    return out


def regex_match(completions, *, pattern: str, flags: str = "", full: bool = False,
                **kwargs) -> list[Reward]:
    fl = 0
    for ch in flags:
        fl |= {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}[ch]
    rx = re.compile(pattern, fl)
    match = rx.fullmatch if full else rx.search
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


def numeric_match(completions, *, field: str = "answer", tolerance: float = 1e-6,
                  pattern: str | None = None, **kwargs) -> list[Reward]:
    expected = _column(kwargs, field, len(completions), "numeric_match")
    out: list[Reward] = []
    for c, want in zip(completions, expected):
        target = _number(want)
        if target is None:
            out.append(None)  # unparseable gold: not this function's call
            continue
        got_text = _extract(completion_text(c), pattern)
        got = None if got_text is None else _number(got_text)
        ok = got is not None and math.isfinite(got) and abs(got - target) <= tolerance
        out.append(1.0 if ok else 0.0)
    return out


def sandbox_tests(completions, **kwargs) -> list[Reward]:
    try:
        module = importlib.import_module("asyncgrpo.sandbox.rewards")
    except ImportError as err:
        raise RuntimeError(
            "reward sandbox_tests needs asyncgrpo.sandbox.rewards (the sandbox component), "
            f"which this image cannot import: {err}"
        ) from err
    return module.sandbox_tests(completions, **kwargs)


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


#: name -> function; `python` resolves its function from `module` at build time.
REGISTRY: dict[str, RewardFn | None] = {
    "exact_match": exact_match,
    "regex_match": regex_match,
    "numeric_match": numeric_match,
    "sandbox_tests": sandbox_tests,
    "python": None,
}


def accepted_args(name: str) -> frozenset[str] | None:
    """The `args` a built-in reward takes (its keyword-only parameters); None for `python`,
    whose function is the user's. Everything else a function receives is a data set column,
    so an unknown arg would vanish silently: validation refuses it instead."""
    import inspect

    if name == "python":
        return None
    fn = REGISTRY[name]
    if name == "sandbox_tests":  # the delegate owns the parameters (stdlib-only module)
        fn = importlib.import_module("asyncgrpo.sandbox.rewards").sandbox_tests
    return frozenset(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


class RewardTerm:
    """One weighted term: `weight * fn(completions, **args, **row columns)`.

    Picklable (TRL's scoring child unpickles it): holds the module path, not the function,
    for user functions. `__name__` is what TRL logs the term under.
    """

    def __init__(self, name: str, weight: float = 1.0, args: dict[str, Any] | None = None,
                 module: str | None = None):
        if name not in REGISTRY:
            raise ValueError(f"unknown reward {name!r}; expected one of {sorted(REGISTRY)}")
        if name == "python":
            if not module:
                raise ValueError("reward python needs module: 'package.module:function'")
            load_user_function(module)  # fail at startup, not in the scoring child
        else:
            unknown = set(args or {}) - accepted_args(name)
            if unknown:
                raise ValueError(f"reward {name}: unknown args {sorted(unknown)}; it takes "
                                 f"{sorted(accepted_args(name))}")
        self.name = name
        self.weight = float(weight)
        self.args = dict(args or {})
        self.module = module
        self.__name__ = module.rpartition(":")[2] if name == "python" else name

    def _fn(self) -> RewardFn:
        if self.name == "python":
            return load_user_function(self.module)
        return REGISTRY[self.name]

    def __call__(self, completions, **kwargs) -> list[Reward]:
        merged = {**kwargs, **self.args}
        rewards = self._fn()(completions, **merged)
        if len(rewards) != len(completions):
            raise ValueError(f"reward {self.__name__} returned {len(rewards)} values for "
                             f"{len(completions)} completions")
        return [None if r is None else self.weight * float(r) for r in rewards]

    def __repr__(self) -> str:
        return f"RewardTerm({self.__name__}, weight={self.weight}, args={self.args})"


def build_rewards(spec) -> list[RewardTerm]:
    """TRL reward functions for `run.spec.reward`."""
    return [RewardTerm(f.name, f.weight, f.args, f.module) for f in spec.functions]

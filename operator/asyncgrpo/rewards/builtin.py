"""The built-in reward functions that need nothing but the completion and the row.

Each takes `(completions, options, /, **columns)`: the options are the run's `args` as the
function's own dataclass (see `asyncgrpo.rewards.table`), positional so that no data set
column can take their name.
"""

from __future__ import annotations

import math
import re
from typing import Any

from asyncgrpo.rewards.args import ExactMatchArgs, NumericMatchArgs, RegexMatchArgs
from asyncgrpo.rewards.text import column, completion_text

Reward = float | None

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


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


def exact_match(completions, options: ExactMatchArgs | None = None, /, **columns) -> list[Reward]:
    options = options or ExactMatchArgs()
    expected = column(columns, options.field, len(completions), "exact_match")
    out: list[Reward] = []
    for c, want in zip(completions, expected):
        if want is None:
            out.append(None)
            continue
        got = _extract(completion_text(c), options.extract)
        if got is None:
            out.append(0.0)
            continue
        a, b = str(got), str(want)
        if options.strip:
            a, b = a.strip(), b.strip()
        if not options.case_sensitive:
            a, b = a.casefold(), b.casefold()
        out.append(1.0 if a == b else 0.0)
    return out


def regex_match(completions, options: RegexMatchArgs, /, **columns) -> list[Reward]:
    fl = 0
    for ch in options.flags:
        fl |= _FLAGS[ch]
    rx = re.compile(options.pattern, fl)
    match = rx.fullmatch if options.full else rx.search
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


def numeric_match(completions, options: NumericMatchArgs | None = None, /,
                  **columns) -> list[Reward]:
    options = options or NumericMatchArgs()
    expected = column(columns, options.field, len(completions), "numeric_match")
    out: list[Reward] = []
    for c, want in zip(completions, expected):
        target = _number(want)
        if target is None:
            out.append(None)  # unparseable gold: not this function's call
            continue
        got_text = _extract(completion_text(c), options.pattern)
        got = None if got_text is None else _number(got_text)
        ok = got is not None and math.isfinite(got) and abs(got - target) <= options.tolerance
        out.append(1.0 if ok else 0.0)
    return out

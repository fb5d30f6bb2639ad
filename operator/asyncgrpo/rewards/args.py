"""The `args` of each built-in reward, as the dataclass its function receives.

The one declaration of a built-in's arguments: the API validates a run's `args` against it
(types, required, unknown names: `asyncgrpo.api.validation`), the CRD refuses unknown names
(a CEL rule made from these fields) and the function reads its options from it. Plain
dataclasses, so this package needs nothing beyond the standard library; pydantic reads
`__pydantic_config__` when it validates them.
"""

from __future__ import annotations

from dataclasses import dataclass

_STRICT = {"extra": "forbid", "strict": True}  # pydantic's ConfigDict, as a plain dict


@dataclass(frozen=True)
class ExactMatchArgs:
    """1.0 when the completion (or the regex `extract`'s first group in it) equals the row's
    `field`."""

    __pydantic_config__ = _STRICT
    field: str = "answer"
    strip: bool = True
    case_sensitive: bool = True
    extract: str | None = None


@dataclass(frozen=True)
class RegexMatchArgs:
    """1.0 when `pattern` matches the completion (a format reward: "ends with 'The answer is
    N.'"); `flags` from "imsx"; `full` for a match of the whole text."""

    __pydantic_config__ = _STRICT
    pattern: str
    flags: str = ""
    full: bool = False

    def __post_init__(self) -> None:
        bad = sorted(set(self.flags) - set("imsx"))
        if bad:
            raise ValueError(f"flags takes i, m, s and x, not {', '.join(bad)}")


@dataclass(frozen=True)
class NumericMatchArgs:
    """1.0 when the last number in the completion (or `pattern`'s first group) is within
    `tolerance` of the row's `field`."""

    __pydantic_config__ = _STRICT
    field: str = "answer"
    tolerance: float = 1e-6
    pattern: str | None = None


@dataclass(frozen=True)
class SandboxTestsArgs:
    """The share of the row's tests that pass with the completion's code as `solution_path`,
    scored in a sandbox of its own (`asyncgrpo.sandbox.client.rewards`). `test_command` and `files`
    given here hold for every row; otherwise they are the data set's columns of those names."""

    __pydantic_config__ = _STRICT
    test_command: str | list[str] | None = None
    files: dict[str, str] | str | None = None
    solution_path: str = "solution.py"
    extract: bool = True
    timeout_seconds: float = 60.0
    gateway_url: str | None = None
    lease_wait_seconds: float = 300.0
    #: the row column naming the image of the completion's sandbox (the trainer sets it from
    #: spec.sandboxes.imageColumn); None or a null value: the run's own image
    image_column: str | None = None

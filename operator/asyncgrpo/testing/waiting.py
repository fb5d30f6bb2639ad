"""Waiting for a state in tests and benchmarks: poll until it holds, fail with what was last
seen. The timeout only bounds a hang; no assertion depends on how long it took."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Errors that mean "not there yet" while polling (an object without its status, a field
#: not set, an assertion in `fn` that will hold later): retried, and shown if time runs out.
NOT_YET: tuple[type[BaseException], ...] = (AssertionError, KeyError, TypeError)


def wait_for(fn: Callable[[], T], timeout: float = 30.0, interval: float = 0.2,
             what: str = "condition",
             retry_on: tuple[type[BaseException], ...] = NOT_YET,
             on_timeout: Callable[[], str] | None = None) -> T:
    """Poll `fn` until it returns a truthy value and return it; after `timeout` seconds an
    AssertionError names `what` and the last value or error, followed by `on_timeout()`
    (what a person would look at: objects, events, logs)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except retry_on as e:   # not there yet
            last = e
        time.sleep(interval)
    extra = f"\n{on_timeout()}" if on_timeout else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{extra}")

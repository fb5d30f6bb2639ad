"""A user's own TRL environment (`spec.harness.environment`) as TRL's `environment_factory`.

TRL 1.16's AsyncGRPOTrainer takes any callable returning an environment: it lists the
public functions of the environment's *class* as tools (name, type hints and Google
docstring become the schema), calls `reset(**row)` before each rollout (every column of the
data row, as keywords) and, if the class defines it, `get_reward()` once when the rollout
ends (a reward column named after the class). A user's class is used as it is, with two
additions, both made here so the user's code stays plain TRL:

- its constructor gets the run's `args` as keywords, and, when the run has sandboxes,
  `sandbox=` a `SandboxHandle` (a sandbox of the rollout's own, its session seeded from the
  row's `files`, the built-in tools' isolation);
- with a sandbox, a subclass of the user's class (same name, so the same reward column)
  leases it before the user's `reset` and releases it after `get_reward`.

The factory holds only the module path, the args and the sandbox settings, so it pickles
into TRL's rollout child; the class is imported there. `path` (local runs) is put first on
sys.path before the import.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Any


def load_environment_class(module: str, path: str | None = None) -> type:
    """'package.module:Class' -> the class, importable in the trainer image (or from `path`)."""
    mod_name, _, attr = module.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"environment module must be 'package.module:Class', got {module!r}")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        cls = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"environment module {module!r} cannot be loaded: {err}") from err
    if not inspect.isclass(cls):
        raise TypeError(f"environment {module!r} must be a class (TRL lists its tools from the class)")
    if not callable(getattr(cls, "reset", None)):
        raise TypeError(f"environment {module!r} has no reset(**row) method")
    return cls


def check_environment_class(cls: type, args: dict[str, Any], with_sandbox: bool) -> None:
    """The constructor takes the run's args (and sandbox=) and the tools have schemas."""
    from transformers.utils import get_json_schema

    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    wanted = set(args) | ({"sandbox"} if with_sandbox else set())
    missing = sorted(k for k in wanted if k not in params and not takes_any)
    if missing:
        raise TypeError(f"environment {cls.__name__}() takes no argument(s) {missing}")
    for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name in ("reset", "get_reward") or name.startswith("_"):
            continue
        try:
            get_json_schema(fn)
        except Exception as err:  # transformers raises its own error types
            raise TypeError(f"tool {cls.__name__}.{name} has no usable schema (type hints and a "
                            f"Google docstring with Args:): {err}") from err


@functools.cache
def _task_sandbox_class() -> type:
    from asyncgrpo.sandbox.client.environment import SandboxHandle

    class TaskSandbox(SandboxHandle):
        __doc__ = SandboxHandle.__doc__

        def score(self) -> float | None:
            """The share of the row's tests that pass on the rollout's editable files,
            scored where the rollout never ran; None for a row without `test_command`."""
            return self._rollout.get_reward()

    return TaskSandbox


def task_sandbox(config):
    """The `sandbox=` handle a user environment gets: `SandboxHandle` plus `score()`.

    `score()` is the task author's contract of docs/sandboxes.md ("Reward integrity") for a
    user's `get_reward`: the row's `test_command`, run through the sandbox server's clean
    scoring (`/v1/score`: only the row's `editable` files kept, laid over a fresh copy of
    the row's `files`, a clean environment), parsed as the built-in harness parses it.
    It is the built-in `get_reward`, so failures score as there (a lost sandbox 0.0, no
    sandbox at all None, each counted) and it never raises; it ends the rollout's use of
    the sandbox, so it is the last call of a `get_reward`.
    """
    return _task_sandbox_class()(config)


_WRAPPED: dict[type, type] = {}


def _with_sandbox(cls: type) -> type:
    """Subclass joining the sandbox group around the user's reset/get_reward."""
    if cls in _WRAPPED:
        return _WRAPPED[cls]

    def reset(self, **row):
        self._asyncgrpo_sandbox.begin(row)
        return cls.reset(self, **row)

    ns: dict[str, Any] = {"reset": reset, "__module__": cls.__module__, "__doc__": cls.__doc__,
                          "__qualname__": cls.__qualname__}
    if callable(getattr(cls, "get_reward", None)):
        def get_reward(self):
            try:
                return cls.get_reward(self)
            finally:
                self._asyncgrpo_sandbox.end()
        ns["get_reward"] = get_reward
    _WRAPPED[cls] = type(cls.__name__, (cls,), ns)
    return _WRAPPED[cls]


class UserEnvironmentFactory:
    """Picklable `environment_factory`: one user environment per call.

    `sandbox` is a SandboxEnvConfig when the run has sandboxes (None otherwise)."""

    def __init__(self, module: str, args: dict[str, Any] | None = None, *, path: str | None = None,
                 sandbox=None):
        self.module, self.args, self.path, self.sandbox = module, dict(args or {}), path, sandbox
        check_environment_class(self._class(), self.args, sandbox is not None)  # fail at startup

    def _class(self) -> type:
        return load_environment_class(self.module, self.path)

    def __call__(self):
        cls = self._class()
        if self.sandbox is None:
            return cls(**self.args)
        handle = task_sandbox(self.sandbox)
        env = _with_sandbox(cls)(**self.args, sandbox=handle)
        env._asyncgrpo_sandbox = handle
        return env

    def __repr__(self) -> str:
        return f"UserEnvironmentFactory({self.module!r}, sandbox={self.sandbox is not None})"

"""The multi-turn harness environment for TRL's AsyncGRPOTrainer (`environment_factory`).

How TRL uses it (trl 1.16.0, `async_rollout_worker.py`): the factory is pickled into the
rollout child; it makes one environment per rollout in flight and reuses them; before each
rollout it calls `reset(**row)`; every public method but `reset`/`get_reward` is a tool the
model may call (name, type hints and Google docstring become the tool schema); when a
rollout ends it calls `get_reward()` once. The G rollouts of a group are drawn one after
another, and their resets are awaited in that order, so the k-th reset of the process
belongs to group k // G.

What this environment adds:
- one sandbox lease per group, taken at the group's first tool call and released when all
  G rollouts have ended (their `get_reward`); heartbeats keep it while the model thinks,
  and if the process dies the gateway takes it back after the lease TTL;
- each rollout works in its own session (directory) of the shared sandbox, seeded from the
  row's `files`, so rollouts of a group never see each other's edits;
- tool results are plain text without timings, so identical calls give identical results
  and the group's conversations keep identical prefixes for tree packing;
- `get_reward()` runs the row's `test_command` in the rollout's session and scores it with
  `rewards.score_test_run` (None when the row has no tests: not a reward source then).

Failures a model can cause come back as tool results (non-zero exit, timeout, refused
path); a lost sandbox comes back as a tool result too (the next call gets a fresh one,
seeded again from the row); only "no sandbox at all within the wait" raises, which TRL
turns into an error result and counts as a tool failure.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass, field

from asyncgrpo.sandbox.client import rewards
from asyncgrpo.sandbox.client.gateway_client import (
    GatewayClient,
    Heartbeats,
    LeaseLost,
    NoSandbox,
    SandboxError,
    shared_client,
)
from asyncgrpo.sandbox.client.rewards import prints_counts, score_test_run
from asyncgrpo.sandbox.common.messages import ExecResult

log = logging.getLogger("asyncgrpo.sandbox.client.environment")

TOOL_NAMES = ("shell", "python", "read_file", "write_file")
_LOST = "error: the sandbox was lost and its files with it; the next call starts a fresh sandbox"


@dataclass(frozen=True)
class SandboxEnvConfig:
    """Settings of the harness; everything here is picklable (no clients, no secrets)."""

    num_generations: int = field(metadata={"help": "G: rollouts per group (TRL's num_generations)."})
    tools: tuple[str, ...] = field(default=TOOL_NAMES, metadata={"help": "Tools offered to the model."})
    gateway_url: str | None = field(default=None, metadata={"help": "Gateway URL; default ASYNCGRPO_GATEWAY_URL."})
    timeout_seconds: float = field(default=60.0, metadata={"help": "Timeout of one shell/python call."})
    max_output_bytes: int = field(default=8192, metadata={"help": "Output kept per stream for the model."})
    max_read_bytes: int = field(default=16384, metadata={"help": "Most bytes read_file returns."})
    lease_wait_seconds: float = field(default=300.0, metadata={"help": "Longest wait for a free sandbox."})
    heartbeat_seconds: float = field(default=10.0, metadata={"help": "Heartbeat period (under the lease TTL)."})
    test_timeout_seconds: float = field(default=300.0, metadata={"help": "Timeout of the reward's test run."})
    image_column: str | None = field(default=None, metadata={
        "help": "Row column naming the image of the rollout's sandbox (spec.sandboxes.imageColumn)."})
    default_image: str | None = field(default=None, metadata={
        "help": "The run's own sandbox image: a row naming it leases from the default pool."})

    def __post_init__(self):
        unknown = set(self.tools) - set(TOOL_NAMES)
        if unknown:
            raise ValueError(f"unknown sandbox tools {sorted(unknown)}; expected some of {TOOL_NAMES}")
        if self.num_generations < 1:
            raise ValueError("num_generations must be >= 1")


_PREFIX = uuid.uuid4().hex[:10]  # lease ids unique across processes and restarts
_COUNT = itertools.count()
SESSION = "work"  # every rollout has a sandbox of its own: one name, so identical calls read alike
_TEST_NAME = re.compile(r"^(test_.*|.*_test\.py|conftest\.py)$")

reward_failures = rewards.reward_failures  # one counter for get_reward and sandbox_tests


def _count_failure(reason: str, err: BaseException) -> None:
    rewards.count_failure(reason, err, "get_reward")


def is_test_path(path: str) -> bool:
    """The default split of a row's files: test files (restored before scoring) vs editable."""
    parts = [p for p in path.split("/") if p]
    return any(p in ("test", "tests") for p in parts[:-1]) or bool(parts and _TEST_NAME.match(parts[-1]))


def _client(url: str | None) -> GatewayClient:
    return shared_client(url)


def _format_exec(r: ExecResult, timeout: float) -> str:
    parts = [f"exit code: {r['exit_code']}"]
    if r["timed_out"]:
        parts[0] = f"timed out after {timeout:g}s (killed)"
    for stream in ("stdout", "stderr"):
        text = r[stream]
        if text:
            parts.append(f"{stream}:\n{text.rstrip(chr(10))}")
        if r[f"{stream}_truncated"]:
            parts.append(f"[{stream} truncated: {r[f'{stream}_bytes']} bytes in all]")
    return "\n".join(parts)


class SandboxEnvironmentBase:
    """State of one rollout; the tools live in the mixins below."""

    def __init__(self, config: SandboxEnvConfig):
        self._config = config
        self._client = _client(config.gateway_url)
        self._session = SESSION
        self._files: dict[str, str] = {}
        self._editable: list[str] = []
        self._test_command: str | list | None = None
        self._image: str | None = None
        self._key: str | None = None
        self._lease_id: str | None = None
        self._seeded_lease: str | None = None
        self._ended = True
        self._lock = threading.Lock()

    def reset(self, **row) -> None:
        """Start a rollout: remember the row's files, editable paths and tests (the sandbox comes at the first call)."""
        self._end_rollout()  # a rollout that ended without get_reward (an error) ends here
        self._key, self._ended = f"{_PREFIX}-{next(_COUNT)}", False
        files = row.get("files") or {}
        self._files = json.loads(files) if isinstance(files, str) else dict(files)
        editable = row.get("editable")
        if isinstance(editable, str):
            editable = json.loads(editable) if editable.startswith("[") else [editable]
        self._editable = list(editable) if editable is not None else [p for p in self._files if not is_test_path(p)]
        self._test_command = row.get("test_command") or None
        self._image = self._row_image(row)
        self._seeded_lease = None

    def _row_image(self, row: dict) -> str | None:
        """The image the row's sandbox runs: its `image_column`, None for the run's own."""
        column = self._config.image_column
        image = row.get(column) if column else None
        return image if isinstance(image, str) and image and image != self._config.default_image else None

    def get_reward(self) -> float | None:
        """End of the rollout: score the row's tests where the rollout never ran; never raises.

        None for a row without `test_command`, or when no sandbox could be had at all (the
        pool's fault: TRL leaves the rollout unscored); any other failure of the sandbox
        (lost, an error, the quota) scores 0.0, the lowest reward, so that breaking one's
        own sandbox never pays. Failures are counted (`reward_failures`).
        """
        try:
            if not self._test_command or self._key is None:
                return None
            lease_id = self._lease()
            r = self._client.score(lease_id, self._test_command, files=self._files, editable=self._editable,
                                   session=self._session, timeout_seconds=self._config.test_timeout_seconds,
                                   max_output_bytes=65536)
            return score_test_run(r["exit_code"], r["stdout"], r["stderr"], r["timed_out"],
                                  counts_required=prints_counts(self._test_command)).reward
        except NoSandbox as err:
            _count_failure("no_sandbox", err)
            return None
        except LeaseLost as err:
            _count_failure("sandbox_lost", err)
            return 0.0
        except SandboxError as err:
            _count_failure("workspace_full" if err.error == "workspace_full" else "sandbox_error", err)
            return 0.0
        except Exception as err:  # noqa: BLE001 - TRL's rollout worker must never see it
            _count_failure("error", err)
            return 0.0
        finally:
            self._end_rollout()

    # -- lease plumbing: one sandbox per rollout ---------------------------------------------
    def _lease(self) -> str:
        if self._key is None:
            raise RuntimeError("reset() was not called")
        with self._lock:
            if self._lease_id is None:
                lease = self._client.lease(self._key, wait_seconds=self._config.lease_wait_seconds,
                                           image=self._image)
                self._lease_id = lease.lease_id
                Heartbeats.for_client(self._client, self._config.heartbeat_seconds).add(lease.lease_id)
            lease_id = self._lease_id
        if self._seeded_lease != lease_id:  # first call here, or the sandbox was replaced
            try:
                for path, content in self._files.items():
                    self._client.write_file(lease_id, path, content, session=self._session)
            except LeaseLost:
                self._lost(lease_id)
                raise
            self._seeded_lease = lease_id
        return lease_id

    def _lost(self, lease_id: str) -> None:
        with self._lock:
            if self._lease_id == lease_id:
                self._lease_id = None
        Heartbeats.for_client(self._client, self._config.heartbeat_seconds).discard(lease_id)

    def _end_rollout(self) -> None:
        if self._ended:
            return
        self._ended = True
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id:
            Heartbeats.for_client(self._client, self._config.heartbeat_seconds).discard(lease_id)
            try:
                self._client.release(lease_id, all_holders=True)
            except Exception:  # noqa: BLE001, S110 - already gone; the gateway resets it either way
                pass

    def _exec(self, command, timeout: float) -> ExecResult:
        lease_id = self._lease()
        try:
            return self._client.exec(lease_id, command, timeout_seconds=timeout, session=self._session,
                                     max_output_bytes=self._config.max_output_bytes)
        except LeaseLost:
            self._lost(lease_id)
            raise

    def _call(self, fn, *args, **kwargs):
        """Run one gateway call on this rollout's lease; errors become tool results."""
        lease_id = None
        try:
            lease_id = self._lease()
            return fn(lease_id, *args, session=self._session, **kwargs), None
        except LeaseLost:
            if lease_id:
                self._lost(lease_id)
            return None, _LOST
        except NoSandbox:
            raise  # infrastructure, not the model: TRL counts it as a tool failure
        except SandboxError as err:
            return None, f"error: {err.error}: {err.detail}"

    def _run(self, command) -> str:
        t = self._config.timeout_seconds
        r, error = self._call(self._client.exec, command, timeout_seconds=t,
                              max_output_bytes=self._config.max_output_bytes)
        return error or _format_exec(r, t)


class _ShellTool:
    def shell(self, command: str) -> str:
        """Run a shell command (bash) in the sandbox's working directory.

        Args:
            command: The command line to run, e.g. "ls -la" or "pytest -q".

        Returns:
            The exit code, then stdout and stderr (long output is truncated in the middle).
        """
        return self._run(command)


class _PythonTool:
    def python(self, code: str) -> str:
        """Run a Python 3 program in the sandbox's working directory.

        Args:
            code: The Python source to run.

        Returns:
            The exit code, then stdout and stderr (long output is truncated in the middle).
        """
        return self._run(["python3", "-c", code])


class _ReadFileTool:
    def read_file(self, path: str) -> str:
        """Read a text file from the sandbox's working directory.

        Args:
            path: Path relative to the working directory, e.g. "src/main.py".

        Returns:
            The file's content, or an error message.
        """
        r, error = self._call(self._client.read_file, path, max_bytes=self._config.max_read_bytes)
        if error:
            return error
        note = f"\n[truncated: {r['size']} bytes in all]" if r["truncated"] else ""
        return r["content"] + note


class _WriteFileTool:
    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the sandbox's working directory, creating directories as needed.

        Args:
            path: Path relative to the working directory, e.g. "src/main.py".
            content: The full new content of the file.

        Returns:
            A confirmation, or an error message.
        """
        r, error = self._call(self._client.write_file, path, content)
        if error:
            return error
        return f"wrote {r['bytes']} bytes to {path}"


class SandboxHandle:
    """The group's sandbox as a user's own environment sees it (`spec.harness.environment`).

    A user environment gets one as its `sandbox=` constructor argument when the run has
    sandboxes. It is the built-in tools' plumbing, nothing else: a sandbox of this rollout's
    own (siblings never share one; see "Reward integrity" in docs/sandboxes.md), its session
    seeded from the row's `files`, the same exec timeout, output caps and path checks of the
    sandbox server. The handle leases the sandbox when the environment's `reset` runs and
    releases it after its `get_reward` (or at the next reset when the environment has none);
    the wrapper in `asyncgrpo.trainer.environments` does both, so the user's code only calls
    the four methods below.

    `run`/`read_text`/`write_text` return text for a tool result (failures as text, like the
    built-ins); `exec` returns the raw ExecResult and raises LeaseLost/SandboxError, for
    rewards that need the exit code.
    """

    def __init__(self, config: SandboxEnvConfig):
        self._rollout = SandboxEnvironmentBase(config)

    def begin(self, row: dict) -> None:
        """Lease this rollout's sandbox (called by the wrapper before the user's reset)."""
        self._rollout.reset(**row)

    def end(self) -> None:
        """Release this rollout's sandbox."""
        self._rollout._end_rollout()

    def exec(self, command: str | list[str], timeout_seconds: float | None = None) -> ExecResult:
        """Run a command in this rollout's session: exit_code, stdout, stderr, timed_out."""
        t = self._rollout._config.timeout_seconds if timeout_seconds is None else timeout_seconds
        return self._rollout._exec(command, t)

    def run(self, command: str | list[str]) -> str:
        """Run a command; the result as the built-in shell tool formats it (exit code, streams)."""
        return self._rollout._run(command)

    def read_text(self, path: str) -> str:
        """A file's text, or an error message (as the built-in read_file returns it)."""
        return _ReadFileTool.read_file(self._rollout, path)

    def write_text(self, path: str, content: str) -> str:
        """Write a file; a confirmation or an error message (as the built-in write_file)."""
        return _WriteFileTool.write_file(self._rollout, path, content)


_MIXINS = {"shell": _ShellTool, "python": _PythonTool, "read_file": _ReadFileTool, "write_file": _WriteFileTool}
_CLASSES: dict[tuple[str, ...], type] = {}


def environment_class(tools: tuple[str, ...] = TOOL_NAMES) -> type:
    """The environment class offering exactly `tools` (TRL lists tools from the class)."""
    key = tuple(t for t in TOOL_NAMES if t in tools)
    if key not in _CLASSES:
        name = "SandboxEnvironment" if key == TOOL_NAMES else "SandboxEnvironment_" + "_".join(key)
        _CLASSES[key] = type(name, (SandboxEnvironmentBase, *(_MIXINS[t] for t in key)), {
            "__module__": __name__, "__doc__": f"Sandbox tools {', '.join(key)} through the run's gateway."})
    return _CLASSES[key]


SandboxEnvironment = environment_class(TOOL_NAMES)


class SandboxEnvironmentFactory:
    """Pass an instance as `environment_factory=`: picklable, makes one environment per call.

    Example: `AsyncGRPOTrainer(..., environment_factory=SandboxEnvironmentFactory(
    num_generations=args.num_generations, tools=("shell", "write_file")))`; the rollout
    child needs ASYNCGRPO_GATEWAY_URL and ASYNCGRPO_GATEWAY_TOKEN in its environment.
    """

    def __init__(self, num_generations: int, **settings):
        self.config = SandboxEnvConfig(num_generations=num_generations, **{
            k: tuple(v) if k == "tools" else v for k, v in settings.items()})

    def __call__(self):
        return environment_class(self.config.tools)(self.config)

    def __repr__(self) -> str:
        return f"SandboxEnvironmentFactory({self.config})"


__all__ = ["TOOL_NAMES", "SandboxEnvConfig", "SandboxEnvironment", "SandboxEnvironmentFactory", "SandboxHandle",
           "environment_class"]

"""Reward "the tests pass in a sandbox": the score of a test run, and a TRL reward function.

`score_test_run` turns a run's exit code and output into a reward: the share of tests that
passed when the runner printed counts (pytest's summary line, unittest's "Ran N tests"),
else 1.0 for exit code 0 and 0.0 otherwise; a timed-out run scores 0.0 whatever it printed.
Counting passed tests gives a graded signal (3 of 4 beats 0 of 4) where the exit code alone
gives GRPO no gradient inside a group that fails everywhere.

`sandbox_tests` is the built-in reward `sandbox_tests` (`asyncgrpo.rewards`'s table names it):
a plain module-level function (TRL pickles reward functions into its scoring child).
It is called once per group and scores the group's completions in parallel, each in a
sandbox of its own (one lease per completion) through the sandbox's `/v1/score`: a fresh
copy of the row's files, only the completion's `solution_path` carried over, a clean
environment. Siblings share nothing (a session per completion in one sandbox would let
one's code read, corrupt or kill another's run), and the integrity model is that of the
harness environment's `get_reward` (docs/sandboxes.md "Reward integrity"). It never raises
into TRL: a sandbox failure scores as documented there and is counted (`reward_failures`).
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rewards import SandboxTestsArgs, completion_text, per_row

log = logging.getLogger("asyncgrpo.sandbox.client.rewards")

_FAILURES: collections.Counter[str] = collections.Counter()
_FAILURES_LOCK = threading.Lock()
try:  # the scoring process's default registry (served where the trainer serves it)
    from prometheus_client import Counter as _PromCounter

    _PROM_FAILURES = _PromCounter("asyncgrpo_harness_reward_failures",
                                  "scorings (get_reward, sandbox_tests) whose sandbox failed, scored as "
                                  "documented", ["reason"])
except Exception:  # noqa: BLE001 - no prometheus_client, or registered twice: the plain counter still counts
    _PROM_FAILURES = None


def reward_failures(reason: str) -> int:
    """Scorings of this process (the environment's `get_reward`, `sandbox_tests`'s
    completions) that failed for `reason`: sandbox_lost, sandbox_error, workspace_full,
    no_sandbox, error."""
    with _FAILURES_LOCK:
        return _FAILURES[reason]


def count_failure(reason: str, err: BaseException, where: str = "get_reward") -> None:
    with _FAILURES_LOCK:
        _FAILURES[reason] += 1
    if _PROM_FAILURES is not None:
        _PROM_FAILURES.labels(reason=reason).inc()
    log.warning("%s: sandbox failure (%s): %s", where, reason, err)

_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|xfailed|xpassed|skipped)\b")
_PYTEST_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?)\b.*\bin [\d.]+s")
_UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in", re.MULTILINE)
_UNITTEST_FAILED = re.compile(r"^FAILED \(([^)]*)\)", re.MULTILINE)
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class ScoredRun:
    passed: int | None
    failed: int | None
    exit_code: int | None
    timed_out: bool
    reward: float


def _pytest_counts(line: str) -> tuple[int, int]:
    counts = {k: int(n) for n, k in _PYTEST_COUNT.findall(line)}
    return counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)


def _unittest_counts(block: str, total: int) -> tuple[int, int]:
    bad = 0
    m = _UNITTEST_FAILED.search(block)
    if m:
        for part in m.group(1).split(","):
            key, _, value = part.strip().partition("=")
            if key in ("failures", "errors", "unexpected successes") and value.isdigit():
                bad += int(value)
    return max(0, total - bad), bad


def test_reports(output: str) -> list[tuple[int, int]]:
    """Every (passed, not passed) report a pytest or unittest run printed in `output`.

    More than one means something besides the runner printed one (code under test can
    print anything): `score_test_run` believes the worst.
    """
    found = [_pytest_counts(line) for line in output.splitlines() if _PYTEST_SUMMARY.search(line)]
    runs = list(_UNITTEST_RAN.finditer(output))
    for i, m in enumerate(runs):
        block = output[m.end(): runs[i + 1].start() if i + 1 < len(runs) else len(output)]
        found.append(_unittest_counts(block, int(m.group(1))))
    return [c for c in found if sum(c) > 0]


def count_tests(output: str) -> tuple[int, int] | None:
    """(passed, not passed) of the worst report in `output`, or None when there is none."""
    reports = test_reports(output)
    return min(reports, key=lambda c: c[0] / sum(c)) if reports else None


#: a test command naming one of these prints counts; none printed means the run did not finish
_COUNTING_RUNNER = re.compile(r"\b(pytest|py\.test|unittest)\b")


def prints_counts(test_command: str | list | None) -> bool:
    """Whether the command runs pytest or unittest (whose counts `score_test_run` can require)."""
    text = " ".join(test_command) if isinstance(test_command, list) else str(test_command or "")
    return bool(_COUNTING_RUNNER.search(text))


def score_test_run(exit_code: int | None, stdout: str, stderr: str = "", timed_out: bool = False,
                   counts_required: bool = False) -> ScoredRun:
    """The reward of a test run; the exit status wins over printed text.

    - a timeout scores 0.0;
    - with counts: the worst printed report's passed / total; but a non-zero exit status with
      a report claiming no failures scores 0.0 (the text is contradicted, so disbelieved);
    - without counts: 1.0 for exit 0, else 0.0; with `counts_required` (the command runs
      pytest or unittest, which always print them) 0.0: the run ended before its report
      (`os._exit(0)` in the code under test, say).
    """
    if timed_out:
        return ScoredRun(None, None, exit_code, True, 0.0)
    counts = count_tests(stdout + "\n" + stderr)
    if counts is not None:
        passed, failed = counts
        if exit_code != 0 and failed == 0:
            return ScoredRun(passed, failed, exit_code, False, 0.0)
        return ScoredRun(passed, failed, exit_code, False, passed / (passed + failed))
    if counts_required:
        return ScoredRun(None, None, exit_code, False, 0.0)
    return ScoredRun(None, None, exit_code, False, 1.0 if exit_code == 0 else 0.0)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or the whole text when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _files(value: Any) -> dict[str, str]:
    if not value:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


def sandbox_tests(completions: list, options: SandboxTestsArgs | None = None, /,
                  **columns: Any) -> list[float | None]:
    """Reward per completion: its code as `solution_path` next to the row's `files` (a dict
    path -> content, or its JSON), the row's `test_command` run there, scored.

    `test_command` and `files` come from the reward's `args` (same for all) or else from the
    data set's columns of those names (one per completion). A row without `test_command`
    gets None (not applicable). Needs ASYNCGRPO_GATEWAY_URL and ASYNCGRPO_GATEWAY_TOKEN (or
    `gateway_url`).

    Each completion leases a sandbox of its own, writes its code there and is scored by
    `/v1/score` with `editable=[solution_path]`: the row's files (its tests) are written
    fresh, nothing but the solution is carried over, the environment is clean. Never raises:
    no sandbox within the wait (or no gateway) is None (unscored: the pool's fault, TRL
    leaves it out); a sandbox lost before the completion's code ran is retried once on a
    fresh one, then None; a sandbox lost, an error or the quota once the scoring run started
    scores 0.0 (breaking one's own sandbox never pays), and so does a solution the sandbox
    refuses (too large, say). Each failure is counted (`reward_failures`).
    """
    n = len(completions)
    o = options or SandboxTestsArgs()
    commands = per_row(o.test_command if o.test_command is not None else columns.get("test_command"), n)
    row_files = per_row(o.files if o.files is not None else columns.get("files"), n)
    images = per_row(columns.get(o.image_column) if o.image_column else None, n)
    todo = [i for i in range(n) if commands[i]]
    rewards: list[float | None] = [None] * n
    if not todo:
        return rewards

    def run(i: int) -> float | None:
        text = completion_text(completions[i])
        return _score_one(o.gateway_url, commands[i], _files(row_files[i]), o.solution_path,
                          extract_code(text) if o.extract else text, o.timeout_seconds,
                          o.lease_wait_seconds, images[i] if isinstance(images[i], str) else None)

    with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
        for i, reward in zip(todo, pool.map(run, todo)):
            rewards[i] = reward
    return rewards


_GROUP = uuid.uuid4().hex[:10]  # lease group ids unique across processes (each is its own group)


def _score_one(gateway_url: str | None, command: str | list, files: dict[str, str], solution_path: str,
               code: str, timeout_seconds: float, lease_wait_seconds: float,
               image: str | None = None) -> float | None:
    """One completion in one sandbox of its own; see `sandbox_tests` for what each failure scores."""
    from asyncgrpo.sandbox.client.gateway_client import (
        Heartbeats,
        LeaseLost,
        NoSandbox,
        SandboxError,
        shared_client,
    )

    scoring = False  # from the score call on, the completion's code runs: a failure is its own
    try:
        client = shared_client(gateway_url)
        for attempt in range(2):  # one retry on a fresh sandbox lost before the code ran
            lease = client.lease(f"reward-{_GROUP}-{uuid.uuid4().hex[:12]}", wait_seconds=lease_wait_seconds,
                                 image=image or None)
            # the gateway sees no calls on the direct data path: heartbeats keep the lease
            # through test runs longer than its TTL
            beats = Heartbeats.for_client(client, max(0.5, lease.ttl_seconds / 4))
            beats.add(lease)
            try:
                try:
                    client.write_file(lease, solution_path, code, session=_SESSION)
                except LeaseLost:
                    if attempt == 0:
                        continue
                    raise
                scoring = True
                r = client.score(lease, command, files=files, editable=[solution_path], session=_SESSION,
                                 timeout_seconds=timeout_seconds, max_output_bytes=65536)
                return score_test_run(r["exit_code"], r["stdout"], r["stderr"], r["timed_out"],
                                      counts_required=prints_counts(command)).reward
            finally:
                beats.discard(lease)
                try:
                    client.release(lease, all_holders=True)
                except Exception:  # noqa: BLE001, S110 - gone already: the gateway retires or resets it anyway
                    pass
        raise AssertionError("unreachable")  # pragma: no cover
    except NoSandbox as err:
        count_failure("no_sandbox", err, "sandbox_tests")
        return None
    except LeaseLost as err:
        count_failure("sandbox_lost", err, "sandbox_tests")
        return 0.0 if scoring else None
    except SandboxError as err:
        count_failure("workspace_full" if err.error == "workspace_full" else "sandbox_error", err, "sandbox_tests")
        return 0.0
    except Exception as err:  # noqa: BLE001 - TRL's reward call must never see it
        count_failure("error", err, "sandbox_tests")
        return 0.0 if scoring else None


#: the session a completion's code is written to (each completion has a sandbox of its own)
_SESSION = "work"

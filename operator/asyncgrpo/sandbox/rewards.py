"""Reward "the tests pass in a sandbox": the score of a test run, and a TRL reward function.

`score_test_run` turns a run's exit code and output into a reward: the share of tests that
passed when the runner printed counts (pytest's summary line, unittest's "Ran N tests"),
else 1.0 for exit code 0 and 0.0 otherwise; a timed-out run scores 0.0 whatever it printed.
Counting passed tests gives a graded signal (3 of 4 beats 0 of 4) where the exit code alone
gives GRPO no gradient inside a group that fails everywhere.

`sandbox_tests` is the function `asyncgrpo.trainer.rewards` registers as `sandbox_tests`:
a plain module-level function (TRL pickles reward functions into its scoring child).
It is called once per group, so it takes one lease for the whole group and runs each
completion in its own session of that sandbox, in parallel.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asyncgrpo.trainer.rewards import completion_text

log = logging.getLogger("asyncgrpo.sandbox.rewards")

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


def _per_row(value: Any, n: int) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) and len(value) == n else [value] * n


def _files(value: Any) -> dict[str, str]:
    if not value:
        return {}
    return json.loads(value) if isinstance(value, str) else dict(value)


def sandbox_tests(
    completions: list,
    *,
    test_command: str | list | None = None,
    files: Any = None,
    solution_path: str = "solution.py",
    extract: bool = True,
    timeout_seconds: float = 60.0,
    gateway_url: str | None = None,
    lease_wait_seconds: float = 300.0,
    **_columns: Any,
) -> list[float | None]:
    """Reward per completion: write its code to `solution_path` next to the row's `files`
    (a dict path -> content, or its JSON), run the row's `test_command` there, score it.

    `test_command` and `files` come from the data set's columns (one per completion) or
    from the reward's `args` (same for all). A row without `test_command` gets None (not
    applicable). Needs ASYNCGRPO_GATEWAY_URL and ASYNCGRPO_GATEWAY_TOKEN (or `gateway_url`).

    If no sandbox can be had (none free within the wait, or lost twice), the group's rewards
    are None and a warning is logged: TRL then drops the group as unscorable instead of the
    rollout worker dying on a passing infrastructure problem.
    """
    from asyncgrpo.sandbox.client import Heartbeats, LeaseLost, SandboxError, shared_client

    n = len(completions)
    commands = _per_row(test_command, n)
    row_files = _per_row(files, n)
    todo = [i for i in range(n) if commands[i]]
    rewards: list[float | None] = [None] * n
    if not todo:
        return rewards
    client = shared_client(gateway_url)
    for attempt in range(2):  # one retry on a fresh sandbox if the first one is lost
        try:
            lease = client.lease(f"reward-{uuid.uuid4().hex}", wait_seconds=lease_wait_seconds)
        except SandboxError as err:
            log.warning("sandbox_tests: no sandbox (%s); group left unscored", err)
            return [None] * n
        # the gateway sees no calls on the direct data path: heartbeats keep the lease
        # through test runs longer than its TTL
        beats = Heartbeats.for_client(client, max(0.5, lease.ttl_seconds / 4))
        beats.add(lease)
        try:
            def run(i: int, lease_id: str = lease.lease_id) -> float:
                session = f"t{i}"
                for path, content in _files(row_files[i]).items():
                    client.write_file(lease_id, path, content, session=session)
                text = completion_text(completions[i])
                client.write_file(lease_id, solution_path, extract_code(text) if extract else text,
                                  session=session)
                r = client.exec(lease_id, commands[i], timeout_seconds=timeout_seconds,
                                session=session, max_output_bytes=65536)
                return score_test_run(r["exit_code"], r["stdout"], r["stderr"], r["timed_out"],
                                      counts_required=prints_counts(commands[i])).reward

            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                for i, reward in zip(todo, pool.map(run, todo)):
                    rewards[i] = reward
            return rewards
        except LeaseLost:
            if attempt == 1:
                log.warning("sandbox_tests: sandbox lost twice; group left unscored")
                return [None] * n
        finally:
            beats.discard(lease)
            try:
                client.release(lease, all_holders=True)
            except Exception:  # noqa: BLE001, S110 - gone already: the gateway resets it anyway
                pass
    return rewards

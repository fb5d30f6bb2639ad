"""The code-fix environment: tools that work in the rollout's own sandbox, and a reward that
runs the task's tests through the sandbox server's clean scoring.

With `spec.sandboxes`, the trainer hands the constructor `sandbox=`, a handle on a sandbox
of this rollout's own (docs/tasks.md): its session is seeded from the row's `files` before
`reset` runs, and released after `get_reward`. The tools are thin: the sandbox server
already caps output, times commands out and refuses paths outside the session.

`get_reward` does not run the tests where the model worked: `sandbox.score()` asks the
server's `/v1/score` to take only the row's `editable` files out of the session, lay them
over a fresh copy of the row's `files` (tests restored) and run `test_command` there with a
clean environment. So a model that edits the tests, drops a conftest.py or leaves a
background process gains nothing (docs/sandboxes.md, "Reward integrity"). The reward is the
share of tests that pass.

Every tool result is a function of the sandbox's files only (no timings, no temp paths):
identical calls of a group's rollouts read alike and keep their shared prefix. Each result
is cut to `max_read_chars` (a file's start, the test output's end), so a rollout's turns fit
the run's maxModelLen (run.yaml says how the numbers add up).
"""

from __future__ import annotations


class CodeFix:
    """Read, edit and test the files of one task in a sandbox."""

    def __init__(self, sandbox, max_read_chars: int = 800):
        self.sandbox = sandbox
        self.max_read_chars = max_read_chars
        self.test_command = None
        self.tool_calls = 0

    def reset(self, **row) -> None:
        """A new rollout of `row`; its sandbox session already holds the row's files."""
        self.test_command = row.get("test_command")
        self.tool_calls = 0

    def read_file(self, path: str) -> str:
        """Read a file of the task.

        Args:
            path: Path relative to the task's folder, e.g. "stats.py".

        Returns:
            The file's text, or an error message.
        """
        self.tool_calls += 1
        text = self.sandbox.read_text(path)
        if len(text) > self.max_read_chars:
            return text[:self.max_read_chars] + f"\n[cut at {self.max_read_chars} characters]"
        return text

    def write_file(self, path: str, content: str) -> str:
        """Replace a file of the task with new content.

        Args:
            path: Path relative to the task's folder, e.g. "stats.py".
            content: The complete new text of the file.

        Returns:
            A confirmation, or an error message.
        """
        self.tool_calls += 1
        return self.sandbox.write_text(path, content)

    def run_tests(self) -> str:
        """Run the task's tests on the current files.

        Returns:
            The test command's exit code and output.
        """
        self.tool_calls += 1
        if not self.test_command:
            return "error: this task has no tests"
        out = self.sandbox.run(self.test_command)
        if len(out) > self.max_read_chars:  # the end holds the summary and the failures
            return (f"[first {len(out) - self.max_read_chars} characters cut]\n"
                    + out[-self.max_read_chars:])
        return out

    def get_reward(self) -> float | None:
        """The share of the task's tests that pass on the model's edits, scored in a fresh
        session by the sandbox server (None: the row has no tests)."""
        return self.sandbox.score()

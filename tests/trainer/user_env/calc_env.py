"""Two small user environments for the tests: TRL's protocol, nothing of asyncgrpo's."""

from __future__ import annotations


class Calculator:
    """A calculator; scores the last result against the row's answer."""

    def __init__(self, precision: int = 6):
        self.precision = precision
        self.answer = None
        self.last = None

    def reset(self, **row) -> None:
        self.answer, self.last = row.get("answer"), None

    def multiply(self, a: float, b: float) -> str:
        """Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.

        Returns:
            The product.
        """
        self.last = round(a * b, self.precision)
        return str(self.last)

    def get_reward(self) -> float:
        return float(self.answer is not None and self.last == float(self.answer))


class Repo:
    """Edits a file in the group's sandbox; scored by running the row's check in it."""

    def __init__(self, sandbox, check: str = "python3 check.py"):
        self.sandbox, self.check = sandbox, check

    def reset(self, **row) -> None:
        self.row_id = row["id"]

    def replace_file(self, path: str, content: str) -> str:
        """Replace a file's content.

        Args:
            path: The file, relative to the working directory.
            content: Its new content.

        Returns:
            A confirmation or an error.
        """
        return self.sandbox.write_text(path, content)

    def run(self, command: str) -> str:
        """Run a shell command.

        Args:
            command: The command line.

        Returns:
            Exit code and output.
        """
        return self.sandbox.run(command)

    def get_reward(self) -> float:
        return float(self.sandbox.exec(self.check)["exit_code"] == 0)


class NoSchema:
    def reset(self, **row) -> None:
        pass

    def look(self, x):
        return x

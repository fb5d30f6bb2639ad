"""One command run for tests and benchmarks on the node: its output, or an error that carries
the command's own last words (kubectl's, helm's, ctr's), never a bare exit code."""

from __future__ import annotations

import subprocess


class CommandFailed(RuntimeError):
    pass


def sh(*argv: str, input: str | None = None, timeout: float = 600, env=None,
       check: bool = True) -> str:
    """stdout of `argv`; with `check`, a non-zero exit raises `CommandFailed` with the tails of
    stdout and stderr."""
    out = subprocess.run(list(argv), capture_output=True, text=True, input=input, check=False,
                         timeout=timeout, env=env)
    if check and out.returncode != 0:
        raise CommandFailed(f"{' '.join(argv[:4])}... exited {out.returncode}:\n"
                            f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout

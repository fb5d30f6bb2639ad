"""`asyncgrpo local run FILE`: the same run file as local processes (the embedded default).

The local backend (trainer, vLLM, S3 server and sandboxes as supervised processes on one
machine) is not built yet. Until it is, this command validates the run, says what is
missing, and exits non-zero rather than pretending to train.
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("local", help="run an AsyncGRPORun as local processes (no cluster)")
    lsub = p.add_subparsers(dest="local_command", required=True)
    run = lsub.add_parser("run", help="validate FILE and run it locally")
    run.add_argument("file", type=Path)
    run.set_defaults(func=_run)


def _run(args) -> int:
    from asyncgrpo.api import RunValidationError, load_run

    try:
        run = load_run(args.file)
    except (OSError, RunValidationError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.file}: {run.metadata.name} is valid, but the local backend is not built yet: "
        "it needs the process supervisor that starts the S3 server, vLLM (CPU venv), the "
        "sandbox gateway and the trainer from one run file. Use `make test` to exercise the "
        "components, or a cluster (README: Quick start).",
        file=sys.stderr,
    )
    return 2

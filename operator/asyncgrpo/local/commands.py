"""`asyncgrpo local ...`: the same run file as local processes (the embedded default)."""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("local", help="run an AsyncGRPORun as local processes (no cluster)")
    lsub = p.add_subparsers(dest="local_command", required=True)
    run = lsub.add_parser(
        "run", help="start S3 (if local), vLLM, sandboxes and the trainer for FILE; follow "
        "the trainer; stop everything")
    run.add_argument("file", type=Path)
    run.add_argument("--workdir", type=Path, default=None,
                     help="logs, caches and trainer status (default .cache/local/<run name>)")
    run.add_argument("--max-steps", type=int, default=None,
                     help="stop after this step even if spec.trainer.totalSteps is larger")
    run.add_argument("--s3-dir", type=Path, default=None,
                     help="where a local S3 server keeps its objects between runs (default: "
                     "beside the work folder, .cache/local/s3)")
    run.add_argument("--no-preflight", action="store_true",
                     help="skip the deep checks of the model, data and modules")
    run.set_defaults(func=_run)
    demo = lsub.add_parser("demo-assets", help="write the demo's tiny model and prompts to DIR")
    demo.add_argument("directory", type=Path)
    demo.set_defaults(func=_demo_assets)


def _run(args) -> int:
    from asyncgrpo.api import RunValidationError, load_run
    from asyncgrpo.local.backend import LocalBackend, LocalRunError

    try:
        run = load_run(args.file)
    except (OSError, RunValidationError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    workdir = args.workdir or Path(".cache") / "local" / run.metadata.name
    backend = LocalBackend(run, workdir, max_steps=args.max_steps,
                           say=lambda line: print(line, flush=True), s3_dir=args.s3_dir,
                           preflight=not args.no_preflight, run_file=args.file)
    try:
        return backend.run_to_completion()
    except LocalRunError as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130


def _demo_assets(args) -> int:
    from asyncgrpo.local.demo import prepare_demo

    model, prompts = prepare_demo(args.directory)
    print(f"model {model}\nprompts {prompts}")
    return 0

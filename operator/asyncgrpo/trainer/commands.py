"""`asyncgrpo trainer --config FILE`: one trainer process (torchrun starts one per rank)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "trainer",
        help="run one trainer process from a run file (under torchrun for several)",
        description="Train an AsyncGRPORun. Deployment facts come from ASYNCGRPO_* variables "
        "(see docs/trainer.md); rank and world size from torchrun.",
    )
    p.add_argument("--config", required=True, metavar="FILE",
                   help="the AsyncGRPORun YAML (the operator mounts it from a ConfigMap)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from asyncgrpo.trainer.main import main_from_file

    return main_from_file(args.config)

"""The `asyncgrpo` command.

Each subcommand lives beside the code it drives and registers itself through a
`register(subparsers)` function listed in `_COMMAND_MODULES`; modules are imported lazily
so that `asyncgrpo crd` never imports torch and the operator image needs no trainer extras.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from asyncgrpo import __version__

# subcommand name -> module with `register(subparsers)`; the module registers exactly that name.
_COMMAND_MODULES: dict[str, str] = {
    "crd": "asyncgrpo.api.commands",
    "validate": "asyncgrpo.api.commands",
    "tree": "asyncgrpo.trainer.tree.commands",
    "trainer": "asyncgrpo.trainer.commands",
    "sandbox": "asyncgrpo.sandbox.server.commands",
    "gateway": "asyncgrpo.sandbox.gateway.commands",
    "operator": "asyncgrpo.controller.commands",
    "bucket": "asyncgrpo.bucket.command",
    "local": "asyncgrpo.local.commands",
    "weights": "asyncgrpo.weights.commands",
    "report": "asyncgrpo.report",
    "preflight": "asyncgrpo.preflight",
    "pull": "asyncgrpo.adapters.pull",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo",
        description="Asynchronous GRPO with tree-packed training, on Kubernetes or one machine.",
    )
    parser.add_argument("--version", action="version", version=f"asyncgrpo {__version__}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    # Import only the module of the chosen command; for --help import all that import cleanly;
    # for a bare --version none (it answers before any subcommand is looked at).
    if wanted is None and "--version" in argv:
        modules = []
    else:
        modules = [_COMMAND_MODULES[wanted]] if wanted in _COMMAND_MODULES else list(
            dict.fromkeys(_COMMAND_MODULES.values()))
    registered: set[str] = set()
    for name in dict.fromkeys(modules):
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # an extra that this image does not install
            if wanted in _COMMAND_MODULES:
                raise SystemExit(f"asyncgrpo {wanted}: missing dependency: {err}") from err
            continue
        if name in registered:
            continue
        module.register(sub)
        registered.add(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`asyncgrpo crd` and `asyncgrpo validate`."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def register(sub) -> None:
    p = sub.add_parser("crd", help="print the AsyncGRPORun CustomResourceDefinition (YAML)")
    p.set_defaults(func=_crd)
    p = sub.add_parser("validate", help="check run files; print every error with its field path")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    p.add_argument("--deep", action="store_true",
                   help="also check what the file names: the model and its chat template, the "
                   "data's first rows, reward and environment modules (asyncgrpo.preflight)")
    p.set_defaults(func=_validate)


def _crd(args) -> int:
    from asyncgrpo.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _validate(args) -> int:
    from asyncgrpo.api.validation import is_run, validate_run

    failed = False
    for path in args.files:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except (OSError, yaml.YAMLError) as e:
            print(f"{path}: cannot read: {e}", file=sys.stderr)
            failed = True
            continue
        runs = [d for d in docs if is_run(d)]
        if not runs:
            print(f"{path}: no AsyncGRPORun (apiVersion asyncgrpo.dev/v1alpha1) found",
                  file=sys.stderr)
            failed = True
        for doc in runs:
            name = (doc.get("metadata") or {}).get("name", "<unnamed>")
            run, errors = validate_run(doc)
            for e in errors:
                print(f"{path}: {name}: {e}", file=sys.stderr)
            if errors:
                failed = True
                continue
            if getattr(args, "deep", False):
                from asyncgrpo.preflight import format_report, preflight

                report = preflight(run)
                for line in format_report(report, f"{path}: {name}: "):
                    print(line, file=sys.stderr)
                if not report.ok:
                    failed = True
                    continue
            print(f"{path}: {name}: valid")
    return 1 if failed else 0

"""`asyncgrpo bucket setup|cleanup`: the container of a run's bucket Jobs (the operator builds
them in `asyncgrpo.controller.bucketjob`).

Runs in the run's own pod, never in the operator: it reads where the run folder is from the
env the Job builder sets (`common.bucket_env`, the run's uid, createBucket, the admin's
endpoint allowlist), the keys from the run's Secret (secretKeyRef env) or, without them, the
pod's own cloud identity, and calls the one implementation in `asyncgrpo.bucket.folder`
(`setup_run_folder`, `cleanup_run_folder`: the ownership-marker rules).

Its outcome is its exit status and its termination message (`/dev/termination-log`, or
$ASYNCGRPO_TERMINATION_LOG): `<Reason>: <message>` on failure, which the operator copies into
BucketReady or the deletion's event, and a one-line summary on success. The message names the
bucket and the S3 error code, never a credential or the endpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from asyncgrpo import wire


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bucket", help="set up or empty the run's bucket folder (the operator's bucket Jobs)")
    p.add_argument("action", choices=["setup", "cleanup"])
    p.set_defaults(func=_main)


def _store(env: Mapping[str, str]):
    from asyncgrpo.api.v1alpha1 import AdapterStoreSpec

    spec = {"bucket": env[wire.ADAPTER_BUCKET_ENV],
            "prefix": env.get(wire.ADAPTER_PREFIX_ENV) or "asyncgrpo",
            "region": env.get(wire.ADAPTER_REGION_ENV) or "us-east-1",
            "createBucket": env.get(wire.CREATE_BUCKET_ENV, "true").lower() == "true"}
    if env.get(wire.ADAPTER_ENDPOINT_ENV):
        spec["endpoint"] = env[wire.ADAPTER_ENDPOINT_ENV]
    return AdapterStoreSpec.model_validate(spec)


def execute(action: str, env: Mapping[str, str]) -> tuple[int, str]:
    """(exit status, termination message) of one action; never raises on bad input."""
    from pydantic import ValidationError

    from asyncgrpo.bucket import folder as bucket

    try:
        try:
            store = _store(env)
        except (KeyError, ValidationError) as e:
            raise bucket.BucketError("InvalidSpec", f"the Job's bucket settings are "
                                     f"incomplete or invalid ({type(e).__name__})") from None
        owner = bucket.Owner(env.get(wire.ADAPTER_NAMESPACE_ENV) or "default",
                             env.get(wire.ADAPTER_RUN_ENV, ""), env.get(wire.RUN_UID_ENV, ""))
        if not owner.uid:
            raise bucket.BucketError("InvalidSpec", f"{wire.RUN_UID_ENV} is not set")
        allow = [a.strip() for a in env.get(wire.ALLOWED_ENDPOINTS_ENV, "").split(",") if a.strip()]
        bucket.check_endpoint(store, allow)   # resolving names, from this pod
        creds = bucket.credentials_from_env(env)
        if action == "setup":
            created = bucket.setup_run_folder(
                store, creds, owner, reclaim=env.get(wire.RECLAIM_RETAINED_ENV, "").lower() == "true")
            folder = bucket.run_folder(store, owner)
            return 0, (f"{'created bucket ' + repr(store.bucket) + ', ' if created else ''}"
                       f"claimed s3://{store.bucket}/{folder}")
        n = bucket.cleanup_run_folder(store, creds, owner)
        return 0, f"deleted {n} objects of the run's folder"
    except bucket.BucketError as e:
        return 1, f"{e.reason}: {e.message}"
    except Exception as e:  # noqa: BLE001 - the reason must reach the run's condition
        return 1, f"BucketError: the bucket {action} failed ({type(e).__name__})"


def _main(args: argparse.Namespace) -> int:

    code, message = execute(args.action, os.environ)
    path = os.environ.get(wire.TERMINATION_LOG_ENV) or wire.TERMINATION_LOG
    try:
        with open(path, "w") as f:
            f.write(message)
    except OSError:
        pass   # not in a pod: stderr is all there is
    print(message, file=sys.stderr if code else sys.stdout)
    return code

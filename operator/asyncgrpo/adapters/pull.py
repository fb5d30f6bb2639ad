"""`asyncgrpo pull NAME-or-FILE`: the run's result (`<run folder>/final/`) onto this machine.

The run's bucket settings come from the run file, or from the cluster (the AsyncGRPORun
NAME in `--namespace`, through the current kubeconfig). The files are checked against
`final/manifest.json` (sizes, sha256) before the destination appears, and land as the
trainer wrote them: a LoRA result is a peft adapter folder, a full one a transformers model
folder (config, weights, tokenizer), which vLLM also loads.

Where the objects are read from: the bucket through S3 (boto3's credential chain:
AWS_ACCESS_KEY_ID..., or the machine's identity); for a local run whose S3 server is not
running, straight from the local S3's folder on disk (`--s3-dir`, default `.cache/local/s3`,
see asyncgrpo.local.s3), with the same checks.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def register(sub) -> None:
    p = sub.add_parser("pull", help="download a run's final adapter or weights (final/) into "
                       "a folder peft, transformers and vLLM load directly")
    p.add_argument("run", metavar="NAME-or-FILE",
                   help="a run file, or the name of an AsyncGRPORun in the cluster")
    p.add_argument("--dest", type=Path, default=None, help="target folder (default ./<run>-final)")
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace of NAME (default: the kubeconfig's, else default)")
    p.add_argument("--s3-dir", type=Path, default=Path(".cache/local/s3"),
                   help="a local run's S3 folder, read when its server is not running")
    p.set_defaults(func=_pull)


def run_from_cluster(name: str, namespace: str | None):
    """The AsyncGRPORun `name` as the model reads it, from the current kubeconfig."""
    from kubernetes import client, config

    from asyncgrpo import API_GROUP, API_VERSION, PLURAL
    from asyncgrpo.api import parse_run

    config.load_config()
    if namespace is None:
        try:
            namespace = config.list_kube_config_contexts()[1]["context"].get("namespace")
        except Exception:  # noqa: BLE001 - in a pod, or a kubeconfig without contexts
            namespace = None
    namespace = namespace or "default"
    doc = client.CustomObjectsApi().get_namespaced_custom_object(
        API_GROUP, API_VERSION, namespace, PLURAL, name)
    doc.pop("status", None)
    doc.setdefault("metadata", {})["namespace"] = namespace
    return parse_run(doc)


def load_target(ref: str, namespace: str | None):
    from asyncgrpo.api import load_run

    if Path(ref).is_file():
        return load_run(ref)
    return run_from_cluster(ref, namespace)


def _store(run):
    from asyncgrpo import storage
    from asyncgrpo.adapters.store import AdapterStore

    s = run.spec.adapter_store
    keys = None
    if not os.environ.get("AWS_ACCESS_KEY_ID") and _local_endpoint(run):
        from asyncgrpo.local.backend import LOCAL_S3_CREDENTIALS

        keys = (LOCAL_S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                LOCAL_S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    client = storage.client(s.endpoint, s.region, keys=keys)
    return AdapterStore(s.bucket, run=run.metadata.name, prefix=s.prefix,
                        namespace=run.metadata.namespace, region=s.region, client=client,
                        attempts=3, backoff_s=0.5)


def _local_endpoint(run) -> bool:
    u = urlparse(run.spec.adapter_store.endpoint or "")
    return u.hostname in LOOPBACK


def fetch_final_from_dir(store, s3_dir: Path, dest: Path):
    """`final/` out of a local S3's folder on disk (`<s3_dir>/<bucket>/<key>`), every file
    checked against its manifest before `dest` appears."""
    from asyncgrpo.adapters.store import (
        MANIFEST,
        AdapterCorrupt,
        AdapterNotFound,
        parse_any_manifest,
    )
    from asyncgrpo.storage.versions import replace_verified, sha256_file

    src = Path(s3_dir) / store.bucket / store.final_prefix
    if not (src / MANIFEST).is_file():
        raise AdapterNotFound(f"no final result at {src} (the run has not finished, or its "
                              "local S3 keeps its objects elsewhere: --s3-dir)")
    manifest = parse_any_manifest((src / MANIFEST).read_bytes(), str(src / MANIFEST))
    def copy_verified(tmp: Path) -> None:
        for rel, entry in manifest.files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (src / rel).is_file():
                raise AdapterCorrupt(f"{src / rel} is listed in the manifest but missing")
            shutil.copyfile(src / rel, target)
            if target.stat().st_size != entry.size or sha256_file(target) != entry.sha256:
                raise AdapterCorrupt(f"{src / rel} does not match its manifest")

    return replace_verified(dest, manifest, copy_verified)


def pull(run, dest: Path, s3_dir: Path | None = None):
    """(folder, manifest) of the run's result in `dest`: from S3, or from a local run's
    S3 folder when the run's endpoint is loopback and no server answers there."""
    from asyncgrpo.local.net import listening

    store = _store(run)
    if _local_endpoint(run) and s3_dir is not None:
        port = urlparse(run.spec.adapter_store.endpoint).port or 80
        if not listening(port):
            return fetch_final_from_dir(store, s3_dir, dest)
    return store.fetch_final(dest)


def load_lines(kind: str, dest: Path, base_model: str) -> list[str]:
    """How to load what was pulled (printed for the user)."""
    if kind == "lora":
        return [(f"peft:         PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                f"{base_model!r}), {str(dest)!r})"),
                f"vLLM:         vllm serve {base_model} --enable-lora --lora-modules final={dest}"]
    return [f"transformers: AutoModelForCausalLM.from_pretrained({str(dest)!r})",
            f"vLLM:         vllm serve {dest}"]


def _pull(args) -> int:
    from asyncgrpo.adapters.store import AdapterStoreError
    from asyncgrpo.api import RunValidationError

    try:
        run = load_target(args.run, args.namespace)
    except (OSError, RunValidationError) as e:
        print(f"{args.run}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the cluster said no (not found, forbidden...)
        print(f"{args.run}: not a run file, and the cluster did not give a run of that name: "
              f"{getattr(e, 'reason', None) or e}", file=sys.stderr)
        return 1
    dest = args.dest or Path(f"{run.metadata.name}-final")
    try:
        folder, manifest = pull(run, dest, args.s3_dir)
    except AdapterStoreError as e:
        print(f"{args.run}: {e}", file=sys.stderr)
        return 1
    kind = manifest.extra.get("kind") or ("lora" if hasattr(manifest, "rank") else "full")
    print(f"{run.metadata.name}: final {kind} result of step {manifest.step} "
          f"({len(manifest.files)} files, {manifest.total_bytes / 1e6:.1f} MB) in {folder}")
    for line in load_lines(kind, folder, run.spec.model.name):
        print(f"  {line}")
    return 0

"""The trainer's config: the run itself, rendered as the run file `asyncgrpo trainer` reads.

The trainer loads it with `asyncgrpo.api.load_run`, so the cluster and the local backend read
exactly the same document. Status, `suspend` and `ttlSecondsAfterFinished` are left out: they
are the operator's business, and leaving them out means suspending or progress never rewrites
the ConfigMap.
"""

from __future__ import annotations

from typing import Any

import yaml

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller.common import metadata, stamp
from asyncgrpo.wire import CONFIG_KEY

COMPONENT = "config"


def run_document(run: AsyncGRPORun) -> dict[str, Any]:
    meta = {"name": run.metadata.name}
    if run.metadata.namespace:
        meta["namespace"] = run.metadata.namespace
    return {
        "apiVersion": run.api_version,
        "kind": run.kind,
        "metadata": meta,
        "spec": run.spec.model_dump(mode="json", by_alias=True, exclude_none=True,
                                    exclude={"suspend", "ttl_seconds_after_finished"}),
    }


def build_config_map(run: AsyncGRPORun) -> dict[str, Any]:
    text = yaml.safe_dump(run_document(run), sort_keys=False)
    return stamp({"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": metadata(run, COMPONENT), "data": {CONFIG_KEY: text}})

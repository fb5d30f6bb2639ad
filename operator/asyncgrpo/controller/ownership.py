"""Never adopt: a child is the run's only when the run made it.

A tenant who may create objects in the namespace can make `<run>-gateway` (a ServiceAccount
that may list Secrets), `<run>-config` or `<run>-sandbox` before the run exists, with or
without the operator's labels. Creating over it is answered 409, and a 409 taken as success
would run the run's pods as, or with, the tenant's object. So the operator uses an existing
object only when its controller ownerReference names the run's uid (every child the
operator creates carries one: `kopf.adopt`), and reports every other one as `ChildConflict`
(kind and name) while the run starts nothing.

Kinds without an ownerReference to the run: the bucket cleanup Job (it must outlive a
foreground deletion; it is only ever created and read in the delete handler, whose outcome
only releases the tenant's own run) and the workloads' pods (owned by their StatefulSet or
ReplicaSet; the status reads them, nothing runs as them). Sandbox pods are owned by the run.
"""

from __future__ import annotations

import time
from typing import Any

from asyncgrpo.controller import bucketjob, sandboxes
from asyncgrpo.controller.observe import Child

#: kinds the reconcile may start workloads with or as: a conflict stops the run
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "Pod", "Job"})
#: Seconds before trying again to create a child whose name another object holds.
CONFLICT_RETRY_SECONDS = 10.0


def must_own(kind: str, component: str) -> bool:
    """Whether a child of this kind and component must name the run as its controller."""
    if kind == "Pod":
        return component == sandboxes.COMPONENT
    if kind == "Job":
        return component != bucketjob.CLEANUP
    return True


def owned_by(meta: dict[str, Any], uid: str) -> bool:
    """A live object's metadata names `uid` as its controller owner."""
    return bool(uid) and any(o.get("uid") == uid and o.get("controller")
                             for o in meta.get("ownerReferences") or [])


def split(children: list[Child], uid: str) -> tuple[list[Child], list[Child]]:
    """(the run's own children, objects that carry its labels but are not its own)."""
    mine, foreign = [], []
    for c in children:
        if must_own(c.kind, c.component) and (not uid or c.owner_uid != uid):
            foreign.append(c)
        else:
            mine.append(c)
    return mine, foreign


def message(conflicts: list[tuple[str, str]]) -> str:
    names = ", ".join(f"{k} {n}" for k, n in conflicts[:5])
    more = f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""
    return (f"{names}{more} already exist and are not this run's (no controller reference to "
            "it): the operator does not use them and starts nothing until they are removed "
            "or renamed")


def ours_after_all(kube: Any, obj: dict[str, Any], uid: str) -> bool:
    """After a create answered 409: the object is the run's (a cache that lagged), or gone."""
    meta = obj["metadata"]
    found = kube.get(obj["kind"], meta["namespace"], meta["name"])
    return found is None or owned_by(found.get("metadata") or {}, uid)


def create_own(kube: Any, held: dict[tuple[str, str], float], obj: dict[str, Any], uid: str,
               conflicts: list[tuple[str, str]]) -> bool:
    """Create `obj` (`controller.kube.Kube.create`); False when its name is held by an object
    that is not the run's: then (kind, name) is added to `conflicts` and to `held` (the run's
    `RunState.conflicts`: not tried again for CONFLICT_RETRY_SECONDS)."""
    key = (obj["kind"], obj["metadata"]["name"])
    if kube.create(obj) is None and not ours_after_all(kube, obj, uid):
        held[key] = time.monotonic() + CONFLICT_RETRY_SECONDS
        if key not in conflicts:
            conflicts.append(key)
        return False
    return True

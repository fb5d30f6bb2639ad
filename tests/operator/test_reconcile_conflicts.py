"""One reconcile pass that finds a workload's name held by a tenant's object (a create
answered 409, the object not the run's): nothing of the run may start in that same pass, the
sandbox pods included. The conflict is only learnt from the create, after the pass had
decided the pool was not held; the pool must see it (issue 28: never use, never start)."""

from __future__ import annotations

from asyncgrpo.controller import reconcile
from tests.operator.helpers import sandboxes_run
from tests.operator.test_reconcile_stale import Recorder, owned_secret, unreachable_runtime


class HeldName(Recorder):
    """The API client where one (kind, name) is a tenant's object: its create is a 409."""

    def __init__(self, secret, held: tuple[str, str]):
        super().__init__(secret)
        self.held = held

    def get(self, kind, ns, name):
        if (kind, name) == self.held:
            return {"metadata": {"name": name, "namespace": ns}}   # no owner reference
        return super().get(kind, ns, name)

    def create(self, obj):
        if (obj["kind"], obj["metadata"]["name"]) == self.held:
            return None   # `Kube.create` on 409 AlreadyExists
        return super().create(obj)


def test_a_workload_conflict_found_by_its_create_starts_no_sandbox_pod(s3_server):
    run = sandboxes_run(s3_server, "ns", "sq")
    run["metadata"].update({"uid": "u1", "generation": 1})
    rt = unreachable_runtime()
    rt.kube = HeldName(owned_secret(s3_server, "u1"), ("Deployment", "sq-gateway"))

    out = reconcile.reconcile(rt, run, [])

    created = [o["kind"] for verb, o in rt.kube.writes if verb == "create"]
    assert "Pod" not in created, created
    assert out.status["conditions"] and any(
        c["type"] == "Degraded" and c["reason"] == "ChildConflict"
        for c in out.status["conditions"]), out.status

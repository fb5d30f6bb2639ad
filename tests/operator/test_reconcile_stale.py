"""One reconcile function against a stale body: the watch may deliver the run as it was
before the operator's last status patch. A finished run must stay finished (not scale its
trainer back up) even then. Writes go to a recorder (the bucket is a Job's business: the
reconcile never talks to it)."""

from __future__ import annotations

from asyncgrpo.controller import reconcile
from asyncgrpo.controller.observe import Child
from asyncgrpo.controller.runtime import Runtime, Settings
from tests.operator.helpers import make_run


class Recorder:
    """Stands in for the API client: records writes; `get` finds only `secret` (the gateway
    token Secret, when a test gives one)."""

    def __init__(self, secret):
        self.writes: list[tuple[str, dict]] = []
        self.secret = secret

    def get(self, kind, ns, name):
        return self.secret if kind == "Secret" else None

    def secret_kind(self, ns, name):   # the credentials Secret: marked as S3 credentials
        return "Opaque", {"asyncgrpo.dev/s3-credentials": "true"}

    def create(self, obj):
        self.writes.append(("create", obj))
        return obj

    def patch(self, obj):
        self.writes.append(("patch", obj))
        return obj

    def delete(self, kind, ns, name, propagation="Background"):
        self.writes.append(("delete", {"kind": kind, "name": name}))
        return True


def owned_secret(s3_server, uid: str) -> dict:
    """A Secret the run `uid` owns, holding the test S3 server's keys, as `Recorder.get`
    answers it."""
    import base64

    return {"data": {k: base64.b64encode(v.encode()).decode() for k, v in {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}.items()},
        "metadata": {"ownerReferences": [{"uid": uid, "controller": True}]}}


def unreachable_runtime() -> Runtime:
    """A Runtime whose gateway and trainer endpoints answer nothing (nothing runs)."""
    return Runtime(Settings(gateway_url="http://127.0.0.1:1",
                            trainer_metrics_url="http://127.0.0.1:1"))


def test_a_stale_body_never_unfinishes_a_run(s3_server):
    rt = unreachable_runtime()
    rt.kube = Recorder(owned_secret(s3_server, "u1"))
    body = make_run(s3_server, "ns", "done")
    body["metadata"].update({"uid": "u1", "generation": 1})
    body["status"] = {"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}

    def sts(replicas):
        return Child(kind="StatefulSet", name="done-trainer", component="trainer", hash="x",
                     replicas=replicas, ready_replicas=replicas, owner_uid="u1")
    vllm = Child(kind="Deployment", name="done-vllm", component="vllm", hash="x", replicas=2,
                 ready_replicas=2, owner_uid="u1")
    finished_pod = Child(kind="Pod", name="done-trainer-0", component="trainer", hash=None,
                         phase="Running", exit_codes=(0,))

    first = reconcile.reconcile(rt, body, [vllm, sts(1), finished_pod])
    assert first.status["phase"] == "Succeeded"

    # the same (stale) body again, the trainer pod already gone after the scale-down
    rt.kube.writes.clear()
    second = reconcile.reconcile(rt, body, [vllm, sts(0)])
    assert second.status["phase"] == "Succeeded"
    # the children are written again (the recorder finds none), every workload at zero
    scaled = {o["kind"]: o["spec"]["replicas"] for verb, o in rt.kube.writes
              if o.get("kind") in ("StatefulSet", "Deployment")}
    assert scaled == {"StatefulSet": 0, "Deployment": 0}

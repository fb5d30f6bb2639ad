"""The bucket check never holds the reconcile: a silent endpoint is reported from the last
finished check while the S3 call runs (and times out) on a bucket worker."""

from __future__ import annotations

import base64
import socket

from asyncgrpo.controller import reconcile
from asyncgrpo.controller.runtime import Runtime, Settings
from tests.operator.helpers import make_run, wait_for
from tests.operator.test_reconcile_stale import Recorder


def bucket_condition(out) -> dict:
    return next(c for c in out.status["conditions"] if c["type"] == "BucketReady")


def test_silent_endpoint_is_reported_without_holding_the_reconcile(s3_server):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        secret = {"data": {k: base64.b64encode(b"x").decode()
                           for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
        rt = Runtime(Settings(gateway_url="http://127.0.0.1:1",
                              trainer_metrics_url="http://127.0.0.1:1"))
        rt.kube = Recorder(secret)
        body = make_run(s3_server, "ns", "quiet")
        body["spec"]["adapterStore"]["endpoint"] = f"http://127.0.0.1:{silent.getsockname()[1]}"
        body["metadata"].update({"uid": "u1", "generation": 1})
        # the S3 call can only end by its 3 s timeout; the reconcile waits 0.5 s at most
        first = reconcile.reconcile(rt, body, [])
        assert bucket_condition(first)["reason"] == "Checking"
        assert first.status["phase"] == "Pending"
        # later ticks pick up the finished check
        out = wait_for(lambda: (o := reconcile.reconcile(rt, body, [])) and
                       bucket_condition(o)["reason"] == "EndpointUnreachable" and o,
                       what="EndpointUnreachable")
        assert bucket_condition(out)["status"] == "False"
    finally:
        silent.close()

"""Test-side helpers of the operator tests: serve a gateway's demand and a trainer's metrics,
make runs from the examples. The API client, the kubelet's part and the wait are
`asyncgrpo.testing` (shared with the benchmarks), named here for the tests."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from asyncgrpo.testing import waiting
from asyncgrpo.testing.kube import Api, component, kubelet, now, pod_status  # noqa: F401

#: The operator tests' default wait. Where a test's operator runs preflights, a run's start
#: includes that Job, whose pod here is a Python process that imports transformers and loads a
#: tokenizer: 13-70 s on the shared 2-core machine under load, once over 120 s in a
#: clean-clone CI run. The timeout only bounds a hang.
WAIT_SECONDS = 240.0


def wait_for(fn, timeout: float = WAIT_SECONDS, **kw):
    """`asyncgrpo.testing.waiting.wait_for` with the operator tests' default timeout."""
    return waiting.wait_for(fn, timeout=timeout, **kw)

REPO = Path(__file__).resolve().parents[2]
LABEL_RUN = "asyncgrpo.dev/run"


def reconcile_errors(metrics) -> dict[str, float]:
    """error -> count of the operator's reconcile errors, read through its registry."""
    return {s.labels["error"]: s.value for family in metrics.registry.collect()
            for s in family.samples if s.name == "asyncgrpo_operator_reconcile_errors_total"}


# ---------------------------------------------------------------- fake peers over real HTTP


class JsonServer:
    """A loopback HTTP server answering GET <path> from a dict the test changes; paths in
    `drips` answer one byte every half second, for ever (a hostile tenant's server)."""

    def __init__(self):
        self.routes: dict[str, tuple[str, bytes]] = {}
        self.drips: set[str] = set()
        self.hits: dict[str, int] = {}
        self.auth: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def drip(self) -> None:
                import time

                self.send_response(200)
                self.end_headers()
                try:
                    while self.path in server.drips:
                        self.wfile.write(b"#")
                        self.wfile.flush()
                        time.sleep(0.5)
                except OSError:
                    pass

            def do_GET(self):
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                if self.path in server.drips:
                    return self.drip()
                if self.path not in server.routes:
                    self.send_response(404)
                    self.end_headers()
                    return
                ctype, body = server.routes[self.path]
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                server.auth[self.path] = self.headers.get("Authorization", "")
                if self.path in server.drips:
                    return self.drip()
                _, body = server.routes.get(self.path, ("", b'{"safe_to_delete": true}'))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_json(self, path_: str, doc: dict) -> None:
        self.routes[path_] = ("application/json", json.dumps(doc).encode())

    def set_text(self, path_: str, text: str) -> None:
        self.routes[path_] = ("text/plain; version=0.0.4", text.encode())

    def close(self) -> None:
        self.httpd.shutdown()


# ---------------------------------------------------------------- runs


def example(name: str) -> dict:
    docs = list(yaml.safe_load_all((REPO / "examples" / name).read_text()))
    return copy.deepcopy(next(d for d in docs if d.get("kind") == "AsyncGRPORun"))


#: Data of the example runs as files "in the trainer image": the harness's job kubelet runs
#: the preflight Job's pod on this machine, which sees these paths. The examples name data in
#: the bucket (`bucketPath`), which the tests' buckets do not hold (several tests assert what
#: a bucket holds), so a preflight would refuse them naming the field.
EXAMPLE_DATA = {
    "lora-math.yaml": REPO / "examples/tasks/calculator-math/calculator_math/data/train.jsonl",
    "multi-turn-sandboxes.yaml": REPO / "examples/tasks/code-fix/code_fix/data/train.jsonl",
}


def make_run(s3, ns: str, name: str, source: str = "lora-math.yaml", **spec_changes) -> dict:
    """An example run pointed at the test S3 server, with a credentials Secret in `ns`, its
    data a file the preflight finds (EXAMPLE_DATA)."""
    run = example(source)
    run["metadata"] = {"name": name, "namespace": ns}
    if source in EXAMPLE_DATA:
        data = run["spec"]["data"]
        data.pop("bucketPath", None)
        data["path"] = str(EXAMPLE_DATA[source])
    store = run["spec"]["adapterStore"]
    store["endpoint"] = s3.endpoint
    store["credentialsSecret"] = {"name": "s3-credentials"}
    for key, value in spec_changes.items():
        run["spec"][key] = value
    return run


def sandboxes_run(s3, ns: str, name: str, **changes) -> dict:
    """The multi-turn sandbox example on the test cluster: no RuntimeClass, no egress hosts
    to resolve, a pool of one warm pod (at most two); `changes` set pool fields."""
    run = make_run(s3, ns, name, "multi-turn-sandboxes.yaml")
    sb = run["spec"]["sandboxes"]
    sb.pop("runtimeClassName")
    sb["network"].pop("allowedEgressHosts")
    sb.update({"minWarm": 1, "max": 2, "hardCap": 2})
    sb.update(changes)
    return run


def s3_secret(s3, ns: str, name: str = "s3-credentials") -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {
                "name": name, "namespace": ns, "labels": {"asyncgrpo.dev/s3-credentials": "true"}},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key,
                           "AWS_SECRET_ACCESS_KEY": s3.secret_key}}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@contextlib.contextmanager
def one_page_server(path: str, body: bytes):
    """A real HTTP server on loopback answering GET `path` with `doc["body"]` (the test may
    change it between reads) and 404 elsewhere; yields (doc, port)."""
    doc = {"body": body}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            page = doc["body"] if self.path == path else b"not found"
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield doc, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()

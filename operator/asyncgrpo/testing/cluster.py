"""A real Kubernetes control plane on loopback for tests and benchmarks.

Starts etcd, kube-apiserver and kube-controller-manager (garbage collection, service
accounts, Deployments, StatefulSets...) with RBAC on, an admin token in system:masters, and
writes a kubeconfig. There is no kubelet: tests play its part by patching pod status.

Binaries come from KUBEBUILDER_ASSETS (the envtest layout: etcd, kube-apiserver, and
optionally kube-controller-manager) when set, else from the cache that
`hack/build-kube-binaries.sh` fills. Every process started here is ended by PID.

    python -m asyncgrpo.testing.cluster up --dir /tmp/kube   # prints KUBECONFIG=...
    python -m asyncgrpo.testing.cluster down --dir /tmp/kube

`audit=True` (off by default) makes the API server write an audit log of every write request
(`create`, `update`, `patch`, `delete`, `deletecollection`; level Metadata: who, verb,
resource, namespace, name, response code; no bodies) to `<workdir>/audit.log`, one JSON event
a line; `read_audit()` parses it. Benchmarks count API writes with it
(bench/sandbox_pool_node_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from asyncgrpo import wire
from asyncgrpo.testing.net import free_port

ADMIN_TOKEN = "asyncgrpo-test-admin-token"
#: the verbs `audit=True` records (writes only: reads would dwarf them and cost the server)
AUDITED_VERBS = ("create", "update", "patch", "delete", "deletecollection")
SERVICE_CIDR = "10.96.0.0/16"


def cache_dir() -> Path:
    return wire.user_cache_dir()


def find_binaries() -> dict[str, Path]:
    """Locate the cluster's binaries (etcd and kube-apiserver at least), or say how to get them."""
    dirs = []
    if os.environ.get("KUBEBUILDER_ASSETS"):
        dirs.append(Path(os.environ["KUBEBUILDER_ASSETS"]))
    dirs.append(cache_dir() / "kube" / "bin")
    found: dict[str, Path] = {}
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                 "kubelet", "kube-proxy"):
        for d in dirs:
            if (d / name).exists():
                found[name] = d / name
                break
        else:
            if name == "etcd" and shutil.which("etcd"):
                found[name] = Path(shutil.which("etcd"))
    missing = {"etcd", "kube-apiserver"} - set(found)
    if missing:
        raise FileNotFoundError(
            f"missing {', '.join(sorted(missing))}: set KUBEBUILDER_ASSETS to envtest binaries "
            "or run hack/build-kube-binaries.sh (make test does)"
        )
    return found


@dataclass
class TestCluster:
    """One control plane; use as a context manager or call start()/stop().

    Without a node (the default) everything listens on 127.0.0.1 and no pod runs. With a
    node (asyncgrpo.testing.node), the API server listens on the host's end of the node's
    veth (`bind_address`) so pods reach it through the `kubernetes` Service, and
    kube-scheduler binds pods. Either way the ServiceAccount admission plugin is on, as on
    any cluster: a pod whose ServiceAccount does not exist is refused (a foreground deletion
    of a run showed why that matters).
    """

    workdir: Path
    with_controller_manager: bool = True
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0
    bind_address: str = "127.0.0.1"
    service_cidr: str = SERVICE_CIDR
    for_node: bool = False
    #: write an audit log of write requests to `audit_log` (off by default: it costs disk)
    audit: bool = False

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    @property
    def server(self) -> str:
        return f"https://{self.bind_address}:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 90.0) -> None:
        bins = find_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        self._make_keys(pki)
        (self.workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')

        etcd_port, etcd_peer = free_port(), free_port()
        self.api_port = free_port()
        self._spawn("etcd", [
            str(bins["etcd"]),
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",
        ], env={"ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")})
        self._spawn("kube-apiserver", [
            str(bins["kube-apiserver"]),
            "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", self.bind_address,
            "--advertise-address", self.bind_address,
            "--secure-port", str(self.api_port),
            "--cert-dir", str(pki / "serving"),
            "--token-auth-file", str(self.workdir / "tokens.csv"),
            "--authorization-mode", "RBAC",
            "--service-cluster-ip-range", self.service_cidr,
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            # logs/exec: dial the kubelet at its InternalIP (the node has no resolvable name)
            "--kubelet-preferred-address-types", "InternalIP",
            "--kubelet-client-certificate", str(pki / "kubelet-client.crt"),
            "--kubelet-client-key", str(pki / "kubelet-client.key"),
            *self._audit_args(),
        ])
        self._write_kubeconfig()
        self._wait_ready(timeout)
        if self.with_controller_manager and "kube-controller-manager" in bins:
            self._spawn("kube-controller-manager", [
                str(bins["kube-controller-manager"]), *self._client_args(),
                "--authentication-kubeconfig", str(self.kubeconfig),
                "--authorization-kubeconfig", str(self.kubeconfig),
                "--controllers", "*,-csrsigning,-csrapproving,-csrcleaner,-nodeipam,-ttl",
                "--service-account-private-key-file", str(pki / "sa.key"),
                "--root-ca-file", str(pki / "serving" / "apiserver.crt"),
                "--concurrent-gc-syncs", "4",
            ])
        if self.for_node and "kube-scheduler" in bins:
            self._spawn("kube-scheduler", [str(bins["kube-scheduler"]), *self._client_args()])

    def _audit_args(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.workdir / "audit-policy.json"
        policy.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", "verbs": list(AUDITED_VERBS)}, {"level": "None"}],
        }))
        return ["--audit-policy-file", str(policy), "--audit-log-path", str(self.audit_log),
                "--audit-log-format", "json", "--audit-log-maxsize", "0",
                "--audit-log-mode", "blocking"]

    def read_audit(self) -> list[dict]:
        """The audit log's events (`audit=True`), oldest first; [] when there is none."""
        if not self.audit_log.exists():
            return []
        events = []
        for line in self.audit_log.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:  # a line being written as we read
                continue
        return events

    def _client_args(self) -> list[str]:
        """What the controller-manager and the scheduler share: the admin kubeconfig, one
        replica (no leader election), no serving ports (nothing scrapes or probes them)."""
        return ["--kubeconfig", str(self.kubeconfig), "--leader-elect=false",
                "--bind-address", "127.0.0.1", "--secure-port", "0", "--port", "0"]

    def _make_keys(self, pki: Path) -> None:
        if (pki / "sa.key").exists():
            return
        subprocess.run(["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(pki / "sa.key"), "-pubout",
                        "-out", str(pki / "sa.pub")], check=True, capture_output=True)
        # the API server's client identity towards kubelets (logs, exec, port-forward)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=kube-apiserver-kubelet-client/O=system:masters",
                        "-keyout", str(pki / "kubelet-client.key"),
                        "-out", str(pki / "kubelet-client.crt")],
                       check=True, capture_output=True)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.procs[name] = proc
        (self.workdir / f"{name}.pid").write_text(str(proc.pid))

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.server,
                                                      "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin",
                                                      "namespace": "default"}}],
            "current-context": "test",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2))

    def _wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            try:
                req = urllib.request.Request(f"{self.server}/readyz",
                                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, ssl.SSLError) as e:  # not up yet (URLError is an OSError)
                last = str(e)
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"kube-apiserver not ready after {timeout}s: {last}")

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        for name in _STOP_ORDER:
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            _end(proc.pid)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _end(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            (self.workdir / f"{name}.pid").unlink(missing_ok=True)


_STOP_ORDER = ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


def _end(pid: int, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(pid, sig)  # started in its own session: its group is its own
    except ProcessLookupError:
        pass


def stop_by_pidfiles(workdir: Path) -> None:
    """End the processes a `cluster up` in another shell started (by their PID files)."""
    for name in _STOP_ORDER:
        pidfile = workdir / f"{name}.pid"
        if pidfile.exists():
            _end(int(pidfile.read_text()))
            pidfile.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.testing.cluster")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/asyncgrpo-cluster"))
    args = parser.parse_args(argv)
    if args.action == "down":
        stop_by_pidfiles(args.dir)
        return 0
    cluster = TestCluster(args.dir)
    cluster.start()
    cluster.procs.clear()  # leave them running; `down` ends them by PID file
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

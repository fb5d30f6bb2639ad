"""A real node for the test cluster: containerd, kubelet, kube-proxy and cluster DNS.

Pods the operator builds run here for real, from the project's images, so a Dockerfile,
securityContext, probe, volume or address mistake fails a test the way it would fail on a
cluster. What it is made of (all Debian packages or binaries built from Debian's
`kubernetes` source by hack/build-kube-binaries.sh):

- a network namespace of its own (`NodeNetwork`): a veth pair joins it to the host; the node
  (kubelet, kube-proxy, containerd and so every pod) lives inside, with no default route, so
  pod traffic can only reach pods, Services and the host's end of the veth (where the API
  server and the test's S3 server listen). Addresses come from 198.18.0.0/15, the range set
  aside for network tests (RFC 2544), never a private or public one;
- one private mount namespace shared by containerd and the kubelet (container rootfs
  overlays, emptyDirs, Secret tmpfs and CNI netns pins live and die with it); /var/log and
  /var/lib/kubelet are bind-mounted from the work dir there, so logs stay with the test;
- containerd 1.6 (runc, overlayfs, cgroupfs; `restrict_oom_score_adj`, because this machine
  refuses negative OOM scores), CNI bridge + host-local;
- kubelet and kube-proxy (iptables mode, masquerading Service traffic so hairpin replies
  come back through the node);
- dnsmasq answering `<svc>.<ns>.svc.cluster.local` (and StatefulSet pod names) from a hosts
  file that `asyncgrpo.testing.cluster_dns` keeps in sync with Services and Endpoints.

Everything is started and ended by PID. `stop()` kills the pods' processes through their
cgroups, removes the kubepods cgroups, restores the kernel settings the kubelet changes,
and deletes the network namespace: the host is left as it was found (the containerd image
store is a cache under ~/.cache/asyncgrpo/node so imported images survive between runs).

Needs root (namespaces, cgroups, iptables). `NodeUnavailable` says what is missing.

    python -m asyncgrpo.testing.node up --dir /tmp/kube-node     # prints export KUBECONFIG=...
    python -m asyncgrpo.testing.node down --dir /tmp/kube-node
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.testing.cluster import TestCluster, cache_dir, find_binaries

NODE_NAME = "asyncgrpo-node"
HOST_IP = "198.18.255.1"  # the host's end of the veth: API server, test S3 server
NODE_IP = "198.18.255.2"  # the node's end: kubelet, kube-proxy, cluster DNS
LINK_CIDR = "198.18.255.0/24"
POD_CIDR = "198.18.0.0/24"
POD_GATEWAY = "198.18.0.1"
SERVICE_CIDR = "198.19.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "asyncgrpo.local/pause:3.2"
#: busybox-static in an image: small pods for the node's own tests (httpd, nslookup, wget)
BUSYBOX_IMAGE = "asyncgrpo.local/busybox:1.35"

#: kernel settings the kubelet sets at start (protectKernelDefaults false); put back at stop
_KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")
_HOST_TOOLS = ("ip", "nsenter", "unshare", "iptables", "containerd", "containerd-shim-runc-v2",
               "runc", "ctr", "dnsmasq", "conntrack", "busybox")


class NodeUnavailable(RuntimeError):
    """This machine cannot run the test node (not root, or a tool is missing)."""


def node_cache() -> Path:
    return cache_dir() / "node"


def check_host() -> dict[str, Path]:
    """The binaries the node needs, or NodeUnavailable saying what is missing."""
    if os.geteuid() != 0:
        raise NodeUnavailable("the test node needs root (network namespaces, cgroups, iptables)")
    missing = [t for t in _HOST_TOOLS if shutil.which(t) is None]
    if not Path("/usr/lib/cni/bridge").exists():
        missing.append("/usr/lib/cni/bridge (containernetworking-plugins)")
    try:
        bins = find_binaries()
    except FileNotFoundError as e:
        raise NodeUnavailable(str(e)) from e
    missing += [b for b in ("kubelet", "kube-proxy", "kube-scheduler") if b not in bins]
    if missing:
        raise NodeUnavailable(
            "missing for the test node: " + ", ".join(missing)
            + " (hack/install-system-deps.sh and hack/build-kube-binaries.sh install them)")
    return bins


def _run(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


# ---------------------------------------------------------------- network


@dataclass
class NodeNetwork:
    """The node's network namespace and the veth pair that joins it to the host."""

    name: str = "asyncgrpo-node"

    @property
    def host_link(self) -> str:
        return "agr-host"

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def create(self) -> None:
        self.delete()  # a previous run killed before its cleanup
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "agr-node")
        _run("ip", "link", "set", "agr-node", "netns", self.name)
        _run("ip", "addr", "add", f"{HOST_IP}/24", "dev", self.host_link)
        _run("ip", "link", "set", self.host_link, "up")
        inside = ["ip", "netns", "exec", self.name]
        _run(*inside, "ip", "addr", "add", f"{NODE_IP}/24", "dev", "agr-node")
        _run(*inside, "ip", "link", "set", "agr-node", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        # routes between pods and the veth; deliberately no default route in the node
        _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        # the host reaches pods and Services through the node
        _run("ip", "route", "add", POD_CIDR, "via", NODE_IP)
        _run("ip", "route", "add", SERVICE_CIDR, "via", NODE_IP)

    def delete(self) -> None:
        _run("ip", "netns", "del", self.name, check=False)
        _run("ip", "link", "del", self.host_link, check=False)  # routes go with the link


# ---------------------------------------------------------------- images


def _docker_archive(path: Path, ref: str, files: dict[str, tuple[bytes, int]],
                    entrypoint: list[str]) -> None:
    """Write a one-layer image in `docker save` format (what `ctr images import` reads)."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        dirs = sorted({str(Path(p).parent) for p in files} - {"."})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for p, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(p)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64" if os.uname().machine == "x86_64" else "arm64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "User": "65532:65532"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref],
                            "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in (("layer.tar", layer_bytes), (config_name, config),
                           ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def base_images(dest: Path) -> dict[str, Path]:
    """The pause image and a busybox image, built from Debian's busybox-static (no registry)."""
    dest.mkdir(parents=True, exist_ok=True)
    busybox = Path(shutil.which("busybox") or "/bin/busybox").read_bytes()
    out = {}
    pause = dest / "pause.tar"
    if not pause.exists():
        # PID 1 of every pod sandbox: holds the namespaces, does nothing
        _docker_archive(pause, PAUSE_IMAGE, {"bin/busybox": (busybox, 0o755)},
                        ["/bin/busybox", "sleep", "2147483647"])
    out[PAUSE_IMAGE] = pause
    box = dest / "busybox.tar"
    if not box.exists():
        _docker_archive(box, BUSYBOX_IMAGE, {"bin/busybox": (busybox, 0o755),
                                            "bin/sh": (busybox, 0o755),
                                            "www/index.html": (b"asyncgrpo node\n", 0o644)},
                        ["/bin/busybox"])
    out[BUSYBOX_IMAGE] = box
    return out


# ---------------------------------------------------------------- the node


@dataclass
class TestNode:
    """containerd + kubelet + kube-proxy + cluster DNS, joined to `cluster`.

    `cluster` must have been created with `node_cluster(...)` (API server on the veth).
    """

    cluster: TestCluster
    workdir: Path
    network: NodeNetwork = field(default_factory=NodeNetwork)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _sysctls: dict[str, str] = field(default_factory=dict)
    _created_kubelet_dir: bool = False

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    # ------------------------------------------------------------ start
    def start(self, timeout: float = 120.0) -> None:
        bins = check_host()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for key in _KUBELET_SYSCTLS:
            self._sysctls[key] = Path("/proc/sys", key).read_text().strip()
        self._start_holder()
        self._start_containerd()
        self.import_images(base_images(node_cache() / "base-images"))
        self._write_cni_config()
        self._start_dns()
        self._spawn("kubelet", self._kubelet_argv(bins["kubelet"]), mount=True)
        self._spawn("kube-proxy", [str(bins["kube-proxy"]), "--config",
                                   str(self._write_kube_proxy_config())], mount=True)
        self.wait_node_ready(timeout)

    def _spawn(self, name: str, argv: list[str], mount: bool = False,
               net: bool = True) -> subprocess.Popen:
        enter = ["nsenter"]
        if net:
            enter.append(f"--net={self.network.path}")
        if mount:
            enter.append(f"--mount=/proc/{self.procs['holder'].pid}/ns/mnt")
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen([*enter, "--", *argv], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        (self.workdir / f"{name}.pid").write_text(str(proc.pid))
        return proc

    def _start_holder(self) -> None:
        """A process holding the node's private mount namespace, set up for the kubelet."""
        w = self.workdir
        for d in ("log", "kubelet", "containerd/state", "cni/net.d", "cni/ipam"):
            (w / d).mkdir(parents=True, exist_ok=True)
        kubelet_dir = Path("/var/lib/kubelet")
        if not kubelet_dir.exists():  # device-plugin paths are fixed in kubelet 1.20
            kubelet_dir.mkdir(parents=True)
            self._created_kubelet_dir = True
        script = (
            "set -e\n"
            # CNI netns pins, shim sockets: private, gone with the namespace
            "mkdir -p /run/netns /run/containerd\n"
            "mount -t tmpfs -o mode=755 node-run /run/netns\n"
            "mount -t tmpfs -o mode=711 node-run /run/containerd\n"
            f"mount --bind {w / 'log'} /var/log\n"
            f"mount --bind {w / 'kubelet'} /var/lib/kubelet\n"
            "echo ready\n"
            "exec sleep 2147483647\n"
        )
        log = open(w / "holder.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        self.procs["holder"] = proc
        (w / "holder.pid").write_text(str(proc.pid))
        line = proc.stdout.readline().decode().strip() if proc.stdout else ""
        if line != "ready":
            raise RuntimeError(f"node mount namespace failed: {(w / 'holder.log').read_text()}")

    def _start_containerd(self) -> None:
        root = node_cache() / "containerd-root"
        root.mkdir(parents=True, exist_ok=True)
        state = self.workdir / "containerd" / "state"
        config = self.workdir / "containerd" / "config.toml"
        config.write_text(f"""\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_unprivileged_ports = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{self.workdir / 'cni' / 'net.d'}"
""")
        self._spawn("containerd", ["containerd", "--config", str(config)], mount=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.procs["containerd"].poll() is not None:
                raise RuntimeError(self._tail("containerd"))
            if self.ctr("version", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError("containerd did not answer: " + self._tail("containerd"))

    def ctr(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """`ctr` against the node's containerd, in its k8s.io namespace (what the CRI uses)."""
        return _run("ctr", "--address", str(self.containerd_socket), "-n", "k8s.io", *args,
                    check=check, **kw)

    def import_images(self, archives: dict[str, Path]) -> None:
        """Import image archives (docker or OCI format) unless the tag is already present."""
        present = set(self.ctr("images", "ls", "-q").stdout.split())
        for ref, archive in archives.items():
            if ref in present or f"docker.io/library/{ref}" in present:
                continue
            self.ctr("images", "import", "--no-unpack", str(archive))

    def _write_cni_config(self) -> None:
        conf = {
            "cniVersion": "0.4.0",
            "name": "asyncgrpo",
            "plugins": [
                {"type": "bridge", "bridge": "agr0", "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(self.workdir / "cni" / "ipam"),
                          "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                          "routes": [{"dst": LINK_CIDR}, {"dst": SERVICE_CIDR}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (self.workdir / "cni" / "net.d" / "10-asyncgrpo.conflist").write_text(json.dumps(conf))

    def _start_dns(self) -> None:
        dns = self.workdir / "dns"
        dns.mkdir(exist_ok=True)
        hosts = dns / "hosts"
        hosts.write_text("")
        self._spawn("dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--log-facility=-",
            f"--listen-address={NODE_IP}", "--bind-interfaces", "--except-interface=lo",
            "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}", "--user=root",
            f"--pid-file={dns / 'dnsmasq.pid'}", f"--local=/{CLUSTER_DOMAIN}/",
            "--domain-needed", "--cache-size=0", "--port=53",
        ])
        self._spawn("cluster-dns", [
            sys.executable, "-m", "asyncgrpo.testing.cluster_dns",
            "--kubeconfig", str(self.cluster.kubeconfig), "--hosts", str(hosts),
            "--dnsmasq-pid", str(self.procs["dnsmasq"].pid), "--domain", CLUSTER_DOMAIN,
        ], net=False)

    def _kubelet_argv(self, kubelet: Path) -> list[str]:
        w = self.workdir
        (w / "resolv.conf").write_text(f"nameserver {NODE_IP}\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "clusterDNS": [NODE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(w / "resolv.conf"),
            "staticPodPath": "",
            "serializeImagePulls": False,
            # the imported images are all there is: never garbage-collect them
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%"},
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "nodeStatusUpdateFrequency": "5s",
            "maxPods": 110,
        }
        (w / "kubelet.yaml").write_text(json.dumps(config))
        return [
            str(kubelet), "--config", str(w / "kubelet.yaml"),
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.containerd_socket}",
            "--runtime-request-timeout=5m",
            "--root-dir=/var/lib/kubelet",
            f"--cert-dir={w / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            "--v=1",
        ]

    def _write_kube_proxy_config(self) -> Path:
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.cluster.kubeconfig)},
            "hostnameOverride": NODE_NAME,
            "bindAddress": NODE_IP,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "mode": "iptables",
            "clusterCIDR": POD_CIDR,
            # hairpin (a pod reaching itself or a neighbour through a Service) without relying
            # on br_netfilter: replies come back through the node
            "iptables": {"masqueradeAll": True, "syncPeriod": "5s", "minSyncPeriod": "0s"},
            # leave the kernel's global conntrack settings alone
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }))
        return path

    def wait_node_ready(self, timeout: float) -> None:
        kubectl = _kubectl(self.cluster)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n"
                                       + self._tail(name))
            out = _run(*kubectl, "get", "node", NODE_NAME, "-o",
                       "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
            if out.stdout.strip() == "True":
                return
            time.sleep(0.5)
        raise TimeoutError(f"node {NODE_NAME} not Ready after {timeout}s:\n"
                           + self._tail("kubelet"))

    def _tail(self, name: str) -> str:
        log = self.workdir / f"{name}.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    # ------------------------------------------------------------ stop
    def stop(self) -> None:
        """End everything; every step runs even if an earlier one failed (the host must be
        left clean), and the first error is raised at the end."""
        steps = [*(lambda n=n: self._end(n) for n in ("cluster-dns", "dnsmasq", "kube-proxy",
                                                       "kubelet")),
                 lambda: _kill_cgroup_tree("kubepods"), self._kill_namespace_members,
                 lambda: self._end("containerd"), self._kill_namespace_members,
                 lambda: self._end("holder"), lambda: _remove_cgroup_tree("kubepods"),
                 self._restore_sysctls, self.network.delete, self._remove_kubelet_dir]
        errors = []
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 (cleanup goes on; raised below)
                errors.append(e)
        if errors:
            raise errors[0]

    def _restore_sysctls(self) -> None:
        for key, value in self._sysctls.items():
            Path("/proc/sys", key).write_text(value)

    def _remove_kubelet_dir(self) -> None:
        if self._created_kubelet_dir:
            shutil.rmtree("/var/lib/kubelet", ignore_errors=True)

    def _end(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        (self.workdir / f"{name}.pid").unlink(missing_ok=True)

    def _kill_namespace_members(self) -> None:
        """SIGKILL every process left in the node's mount namespace (containerd shims)."""
        holder = self.procs.get("holder")
        if holder is None or holder.poll() is not None:
            return
        ns = os.readlink(f"/proc/{holder.pid}/ns/mnt")
        for pid in _pids():
            if pid == holder.pid:
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/mnt") == ns:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    return [p for p in base.iterdir() if p.is_dir()] if base.exists() else []


def _cgroup_dirs(tree: Path) -> list[Path]:
    """Every cgroup under `tree`, deepest first; cgroups that vanish meanwhile are skipped."""
    found = []
    for dirpath, _dirs, _files in os.walk(tree, onerror=lambda _e: None):
        found.append(Path(dirpath))
    return sorted(found, key=lambda p: -len(p.parts))


def _kill_cgroup_tree(name: str) -> None:
    for root in _cgroup_roots():
        for cgroup in _cgroup_dirs(root / name):
            try:
                pids = (cgroup / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
    time.sleep(0.2)


def _remove_cgroup_tree(name: str) -> None:
    for root in _cgroup_roots():
        for cgroup in _cgroup_dirs(root / name):
            try:
                cgroup.rmdir()
            except OSError:
                pass


def _kubectl(cluster: TestCluster) -> list[str]:
    kubectl = shutil.which("kubectl") or str(cache_dir() / "bin" / "kubectl")
    return [kubectl, "--kubeconfig", str(cluster.kubeconfig)]


def node_cluster(workdir: Path, audit: bool = False) -> TestCluster:
    """The control plane for a cluster with a node: the API server on the veth's host end
    (`audit`: TestCluster's audit log of write requests, off by default)."""
    return TestCluster(workdir, bind_address=HOST_IP, service_cidr=SERVICE_CIDR, for_node=True,
                       audit=audit)


@dataclass
class ClusterWithNode:
    """Network, control plane and node, started and ended together."""

    workdir: Path
    network: NodeNetwork = field(default_factory=NodeNetwork)
    cluster: TestCluster | None = None
    node: TestNode | None = None
    #: the API server's audit log of write requests (TestCluster.audit), off by default
    audit: bool = False

    def start(self) -> None:
        check_host()
        self.network.create()
        try:
            self.cluster = node_cluster(self.workdir / "control-plane", audit=self.audit)
            self.cluster.start()
            self.node = TestNode(self.cluster, self.workdir / "node", self.network)
            self.node.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.stop()
            finally:
                self.network.delete()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.testing.node")
    parser.add_argument("action", choices=["up"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/asyncgrpo-node"))
    args = parser.parse_args(argv)
    whole = ClusterWithNode(args.dir)
    whole.start()
    print(f"export KUBECONFIG={whole.cluster.kubeconfig}", flush=True)
    print("node Ready; Ctrl-C (or SIGTERM) stops everything and cleans up", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        whole.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whole runs through the operator's own pods on the test cluster's real node.

The stack, once per session: the cluster with its node (tests/node/conftest.py), the
project's images imported into the node's containerd (`make images` built them), two small
derived images carrying the tiny model (a model is "a path in the images", as for users who
bake weights into images), a real S3 server where pods reach it, and the operator installed
with the project's Helm chart, as a user would. Tests then only use the API server:
`kubectl apply -f run.yaml`, `kubectl get agr`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
E2E_TRAINER_IMAGE = "asyncgrpo.local/trainer-tiny:e2e"
E2E_VLLM_IMAGE = "asyncgrpo.local/vllm-tiny:e2e"
MODEL_PATH = "/models/tiny-qwen3"
OPERATOR_NAMESPACE = "asyncgrpo-system"


def _cache() -> Path:
    return Path(os.environ.get("ASYNCGRPO_CACHE", Path.home() / ".cache" / "asyncgrpo"))


def _image_env() -> dict[str, str]:
    """podman as hack/images-lib.sh sets it up on these machines (runc, lower rlimits)."""
    env = dict(os.environ)
    conf = _cache() / "images" / "containers.conf"
    if conf.exists():
        env.setdefault("CONTAINERS_CONF", str(conf))
    return env


def sh(*argv: str, input: str | None = None, timeout: float = 600, env=None,
       check: bool = True) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, input=input, check=False,
                         timeout=timeout, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:4])}... exited {out.returncode}:\n"
                             f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def _derived_images(workdir: Path) -> dict[str, str]:
    """trainer and vLLM images with the tiny demo model at MODEL_PATH, built by podman."""
    from asyncgrpo.local.demo import prepare_demo

    ctx = workdir / "tiny-image"
    model, _ = prepare_demo(ctx)
    tag = (REPO / "pyproject.toml").read_text().split('version = "', 1)[1].split('"', 1)[0]
    built = {}
    for base, ref in ((f"ghcr.io/asyncgrpo/trainer:{tag}", E2E_TRAINER_IMAGE),
                      (f"ghcr.io/asyncgrpo/vllm:{tag}", E2E_VLLM_IMAGE)):
        (ctx / "Containerfile").write_text(
            f"FROM {base}\nCOPY {model.name} {MODEL_PATH}\n")
        sh("podman", "build", "--pull=never", "--isolation", "chroot", "-t", ref,
           "-f", str(ctx / "Containerfile"), str(ctx), env=_image_env())
        built[ref] = base
    return built


@dataclass
class Stack:
    whole: object  # asyncgrpo.testing.node.ClusterWithNode
    s3: object  # asyncgrpo.testing.s3.S3Server
    workdir: Path

    @property
    def kubeconfig(self) -> str:
        return str(self.whole.cluster.kubeconfig)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> str:
        kubectl = shutil.which("kubectl") or str(_cache() / "bin" / "kubectl")
        return sh(kubectl, "--kubeconfig", self.kubeconfig, *args, input=input, check=check,
                  timeout=timeout)

    def apply(self, *docs: dict) -> None:
        self.kubectl("apply", "-f", "-",
                     input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)}))

    def get(self, kind: str, name: str, ns: str) -> dict | None:
        out = self.kubectl("-n", ns, "get", kind, name, "-o", "json", check=False)
        return json.loads(out) if out.strip() else None

    def namespace(self, ns: str, s3_secret: bool = True) -> str:
        """A tenant namespace with the S3 credentials Secret a run refers to."""
        self.kubectl("create", "namespace", ns)
        if s3_secret:
            self.kubectl("-n", ns, "create", "secret", "generic", "s3",
                         f"--from-literal=accessKeyId={self.s3.access_key}",
                         f"--from-literal=secretAccessKey={self.s3.secret_key}")
        return ns

    def logs(self, ns: str, selector: str) -> str:
        return self.kubectl("-n", ns, "logs", "-l", selector, "--tail", "60",
                            "--all-containers", "--prefix", check=False)

    def describe(self, ns: str) -> str:
        """What a person would look at when a wait fails."""
        return "\n".join([
            self.kubectl("-n", ns, "get", "agr,pods,events", "-o", "wide", check=False),
            self.kubectl("-n", OPERATOR_NAMESPACE, "logs", "deploy/asyncgrpo", "--tail", "40",
                         check=False),
        ])


def wait_for(what: str, fn, timeout: float, interval: float = 2.0, on_timeout=None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    extra = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}\n"
                         f"{extra}")


@pytest.fixture(scope="session")
def e2e_stack(kube_node, tmp_path_factory):
    from asyncgrpo.testing.node import HOST_IP
    from asyncgrpo.testing.s3 import S3Server

    if shutil.which("podman") is None:
        pytest.fail("podman is missing: `make images` installs it and builds the images")
    workdir = tmp_path_factory.mktemp("e2e")
    node = kube_node.node
    env = {**_image_env(), "CONTAINERD_ADDRESS": str(node.containerd_socket)}
    sh("bash", str(REPO / "hack" / "import-images-containerd.sh"), env=env, timeout=900)
    for ref in _derived_images(workdir):
        archive = workdir / (ref.replace("/", "_").replace(":", "_") + ".tar")
        sh("podman", "save", "--format", "docker-archive", "-o", str(archive), ref,
           env=_image_env())
        node.ctr("images", "import", str(archive), timeout=600)
        archive.unlink()

    s3 = S3Server.start(workdir / "s3.log", host=HOST_IP)
    stack = Stack(kube_node, s3, workdir)
    helm = shutil.which("helm") or str(_cache() / "bin" / "helm")
    sh(helm, "--kubeconfig", stack.kubeconfig, "install", "asyncgrpo",
       str(REPO / "charts" / "asyncgrpo"), "--namespace", OPERATOR_NAMESPACE,
       "--create-namespace", "--set", "operator.resyncSeconds=3", "--wait", "--timeout", "5m")
    try:
        yield stack
    finally:
        s3.stop()

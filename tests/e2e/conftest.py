"""Whole runs through the operator's own pods on the test cluster's real node.

The stack, once per session: the cluster with its node (tests/node/conftest.py), the
project's images imported into the node's containerd (`make images` built them), two small
derived images carrying the tiny model (a model is "a path in the images", as for users who
bake weights into images), a real S3 server where pods reach it, and the operator installed
with the project's Helm chart, as a user would. Tests then only use the API server:
`kubectl apply -f run.yaml`, `kubectl get agr`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncgrpo import wire
from asyncgrpo.testing import waiting
from asyncgrpo.testing.shell import sh

REPO = Path(__file__).resolve().parents[2]
#: the tag `make images` gave the project's images (hack/images-lib.sh: the same variable)
IMAGE_TAG = os.environ.get("IMAGE_TAG") or \
    (REPO / "pyproject.toml").read_text().split('version = "', 1)[1].split('"', 1)[0]
SANDBOX_IMAGE = f"ghcr.io/asyncgrpo/sandbox:{IMAGE_TAG}"
E2E_TRAINER_IMAGE = "asyncgrpo.local/trainer-tiny:e2e"
E2E_VLLM_IMAGE = "asyncgrpo.local/vllm-tiny:e2e"
MODEL_PATH = "/models/tiny-qwen3"
#: a tiny Qwen3-MoE (the flagship shape: full fine-tuning with expert parallel)
MOE_MODEL_PATH = "/models/tiny-qwen3-moe"
OPERATOR_NAMESPACE = "asyncgrpo-system"
OPERATOR_DEPLOYMENT = "asyncgrpo-operator"  # the chart's fullname for release "asyncgrpo"


def _cache() -> Path:
    return wire.user_cache_dir()


def _image_env() -> dict[str, str]:
    """podman as hack/images-lib.sh sets it up on these machines (runc, lower rlimits)."""
    env = dict(os.environ)
    conf = _cache() / "images" / "containers.conf"
    if conf.exists():
        env.setdefault("CONTAINERS_CONF", str(conf))
    return env


def model_folder() -> Path:
    """The tiny dense model's files on this machine, as the e2e images carry them at
    MODEL_PATH (the derived images' build context)."""
    return _cache() / "e2e" / "tiny-image" / "tiny-qwen3"


def _derived_images() -> dict[str, str]:
    """trainer and vLLM images with the tiny demo model at MODEL_PATH and a tiny Qwen3-MoE at
    MOE_MODEL_PATH, built by podman.

    The build context is cached, so the model files (and so podman's COPY layer and the
    image id) stay the same from run to run and the import into containerd is skipped."""
    from asyncgrpo.local.demo import prepare_demo

    ctx = _cache() / "e2e" / "tiny-image"
    model, _ = prepare_demo(ctx)
    assert model == model_folder(), model
    moe = ctx / "tiny-qwen3-moe"
    if not (moe / "config.json").is_file():  # kept: the same files keep the same image id
        from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

        save_tiny_checkpoint(moe, kind="moe", seed=0)
    readable_by_pods(ctx)
    built = {}
    for base, ref in ((f"ghcr.io/asyncgrpo/trainer:{IMAGE_TAG}", E2E_TRAINER_IMAGE),
                      (f"ghcr.io/asyncgrpo/vllm:{IMAGE_TAG}", E2E_VLLM_IMAGE)):
        (ctx / "Containerfile").write_text(
            f"FROM {base}\nCOPY {model.name} {MODEL_PATH}\nCOPY {moe.name} {MOE_MODEL_PATH}\n")
        podman_build(ref, ctx)
        built[ref] = base
    return built


def readable_by_pods(folder: Path) -> None:
    """An image's build context made readable by the pods' uid 65532, not only the files'
    owner (safetensors writes 0600 files)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _containerd_config_digest(node, ref: str) -> str | None:
    """The config digest of the image containerd holds under `ref` (= podman's image id)."""
    listed = node.ctr("images", "ls", f"name=={ref}", check=False).stdout.splitlines()
    if len(listed) < 2:
        return None
    target = listed[1].split()[2]
    manifest = node.ctr("content", "get", target, check=False).stdout
    try:
        return json.loads(manifest).get("config", {}).get("digest")
    except ValueError:
        return None


def import_into_node(node, ref: str, workdir: Path) -> None:
    """Put podman's image `ref` into the node's containerd (imagePullPolicy: Never), unless
    containerd already holds that very image: its store is a cache across runs."""
    image_id = sh("podman", "image", "inspect", "--format", "{{.Id}}", ref,
                  env=_image_env()).strip()
    if _containerd_config_digest(node, ref) == f"sha256:{image_id}":
        return
    archive = workdir / (ref.replace("/", "_").replace(":", "_") + ".tar")
    sh("podman", "save", "--format", "docker-archive", "-o", str(archive), ref,
       env=_image_env())
    node.ctr("images", "import", str(archive), timeout=900)
    archive.unlink()


def podman_build(ref: str, context: Path, containerfile: Path | None = None,
                 build_args: dict[str, str] | None = None) -> None:
    """podman build as the e2e images are built here (no pulls, chroot isolation)."""
    args = [f"--build-arg={k}={v}" for k, v in (build_args or {}).items()]
    sh("podman", "build", "--pull=never", "--isolation", "chroot", "-t", ref, *args,
       "-f", str(containerfile or context / "Containerfile"), str(context), env=_image_env())


@dataclass
class Stack:
    whole: object  # asyncgrpo.testing.node.ClusterWithNode
    s3: object  # asyncgrpo.testing.s3.S3Server
    workdir: Path
    prometheus: object = None  # asyncgrpo.testing.prometheus.PrometheusServer

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
                         f"--from-literal=AWS_ACCESS_KEY_ID={self.s3.access_key}",
                         f"--from-literal=AWS_SECRET_ACCESS_KEY={self.s3.secret_key}")
            self.kubectl("-n", ns, "label", "secret", "s3", "asyncgrpo.dev/s3-credentials=true")
        return ns

    def logs(self, ns: str, selector: str) -> str:
        return self.kubectl("-n", ns, "logs", "-l", selector, "--tail", "60",
                            "--all-containers", "--prefix", check=False)

    def describe(self, ns: str) -> str:
        """What a person would look at when a wait fails."""
        return "\n".join([
            self.kubectl("-n", ns, "get", "agr,pods,events", "-o", "wide", check=False),
            self.kubectl("-n", OPERATOR_NAMESPACE, "logs", f"deploy/{OPERATOR_DEPLOYMENT}",
                         "--tail", "40",
                         check=False),
        ])


def wait_for(what: str, fn, timeout: float, interval: float = 2.0, on_timeout=None):
    """asyncgrpo.testing.waiting.wait_for with the e2e's argument order; errors in `fn`
    are not retried here (kubectl failures are reported, not waited out)."""
    return waiting.wait_for(fn, timeout, interval, what, retry_on=(), on_timeout=on_timeout)


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
    for ref in _derived_images():
        import_into_node(node, ref, workdir)

    s3 = S3Server.start(workdir / "s3.log", host=HOST_IP)
    stack = Stack(kube_node, s3, workdir)
    helm = shutil.which("helm") or str(_cache() / "bin" / "helm")
    sh(helm, "--kubeconfig", stack.kubeconfig, "install", "asyncgrpo",
       str(REPO / "charts" / "asyncgrpo"), "--namespace", OPERATOR_NAMESPACE,
       "--create-namespace", "--set", "operator.resyncSeconds=3", "--set",
       f"image.tag={IMAGE_TAG}", "--wait", "--timeout", "5m")
    with contextlib.ExitStack() as running:
        running.callback(s3.stop)
        stack.prometheus = running.enter_context(_prometheus(kube_node, workdir))
        yield stack


@contextlib.contextmanager
def _prometheus(whole, workdir: Path):
    """A real Prometheus on the host, with the chart's scrape job (pods discovered through
    the API server, annotations and relabelling as shipped) and the chart's rules: it
    scrapes the pods on the node by their pod IPs, as an in-cluster Prometheus would."""
    from asyncgrpo.testing import prometheus as p
    from asyncgrpo.testing.cluster import ADMIN_TOKEN
    from asyncgrpo.testing.pod_discovery import PodDiscovery

    with contextlib.ExitStack() as running:
        if p.supports_kubernetes_sd():
            token = workdir / "prometheus-token"
            token.write_text(ADMIN_TOKEN)
            job = p.kubernetes_job(whole.cluster.server, token)
        else:  # Debian's build: the pod role's targets and labels over HTTP SD
            sd = running.enter_context(PodDiscovery(whole.cluster.server, ADMIN_TOKEN))
            job = p.http_sd_job(sd.url)
        # alerts fire without their `for:` hold, so a forced fault shows within a test
        rules = p.rules_file(workdir / "rules.yaml", hold="0s")
        yield running.enter_context(p.PrometheusServer(
            workdir / "prometheus", [job], rule_files=[rules], scrape_interval="2s",
            evaluation_interval="2s"))

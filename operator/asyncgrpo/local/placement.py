"""The pods of a run as the operator builds them, and the `LocalPlacement` that runs them here.

`run_pods` asks the operator's builders for every pod (the same functions the reconcile
and the pool scaler call), and `bucket_setup_pod` for the pod of the run's bucket setup Job
(`asyncgrpo bucket setup`, ownership marker included), so the local backend never assembles
a command line itself.
`build_placement` decides the local data `asyncgrpo.local.pods.translate` needs: a
loopback address per pod, the ports that must move, a directory per volume (the run
document written where the ConfigMap would be mounted), Secret values, the images'
interpreters and ENV, and the CPUs vLLM and the trainer are pinned to.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.controller import bucketjob, configmap, gateway, sandboxes, trainer, vllm
from asyncgrpo.controller.common import name
from asyncgrpo.controller.runtime import Settings
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, SANDBOX_TOKEN_KEY, secret_name
from asyncgrpo.local.net import free_port
from asyncgrpo.local.pods import ImageRuntime, LocalPlacement, parse_dockerfile_env
from asyncgrpo.local.vllm import PACKAGE_ROOT, vllm_venv
from asyncgrpo.wire import (
    GATEWAY_MEMBERS_FILE_ENV,
    MAX_STEPS_ENV,
    TERMINATION_LOG_ENV,
    TRAINER_RENDEZVOUS_PORT,
)

#: where images/<x>/Dockerfile are (a checkout)
IMAGES_DIR = PACKAGE_ROOT.parent / "images"
#: ports a program binds on every interface whatever host it is given (torch's TCPStore):
#: they share the machine's port space, so each run gets free ones
WILDCARD_PORTS = frozenset({TRAINER_RENDEZVOUS_PORT})
#: host variables a pod inherits from the machine (a container gets PATH from its image)
PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
#: caches of the machine, kept across runs as a node-local cache volume would be: vLLM's
#: (model info, compile cache) costs ~40 s of every start when cold, and a pod's HOME is a
#: fresh emptyDir. The same place vLLM uses outside pods, so the tests' server shares it.
MACHINE_CACHES = {"VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "vllm")}


@dataclass
class Pod:
    """One pod the builders produce: its name, labels, spec, and the workload it belongs to."""

    name: str
    component: str
    labels: dict
    spec: dict
    #: a Job's pod: how long it may run (activeDeadlineSeconds); None for a workload's pod
    deadline_s: float | None = None


def local_uid(run: AsyncGRPORun) -> str:
    """The uid a local run's bucket folder is claimed with: the same for every local run of
    one namespace/name, so running it again reclaims its own folder (as a cluster run keeps
    its uid across restarts), and never a cluster run's, whose folder it must not take."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "asyncgrpo-local:"
                          f"{run.metadata.namespace or 'default'}/{run.metadata.name}"))


def bucket_setup_pod(run: AsyncGRPORun) -> Pod:
    """The pod of the run's bucket setup Job, as the operator builds it (`bucketjob`): the
    one implementation of bucket creation and the ownership marker, run before any pod that
    reads or writes the bucket."""
    job = bucketjob.build_job(run, bucketjob.SETUP, local_uid(run),
                              bucketjob.JobSettings(image=Settings.bucket_job_image))
    t = job["spec"]["template"]
    return Pod(f"{job['metadata']['name']}-0", bucketjob.SETUP, t["metadata"]["labels"],
               t["spec"], deadline_s=float(job["spec"]["activeDeadlineSeconds"]))


def termination_log(workdir: Path, pod: Pod) -> Path:
    """Where a pod's container writes its termination message locally (a kubelet reads
    `terminationMessagePath`; here the program is told the file through its variable)."""
    return workdir / pod.name / "termination-log"


def run_pods(run: AsyncGRPORun, sandbox_count: int) -> list[Pod]:
    """Every pod of the run in start order: vLLM, sandboxes, gateway, trainer nodes. One pod
    per Deployment (a Service then has one endpoint); all of the StatefulSet's replicas."""
    def template(obj: dict, component: str, pod_name: str) -> Pod:
        t = obj["spec"]["template"]
        return Pod(pod_name, component, t["metadata"]["labels"], t["spec"])

    pods = [template(vllm.build_deployment(run), vllm.COMPONENT, f"{name(run, vllm.COMPONENT)}-0")]
    if run.spec.sandboxes is not None:
        for i in range(sandbox_count):
            p = sandboxes.build_pod(run, f"local{i}")
            pods.append(Pod(p["metadata"]["name"], sandboxes.COMPONENT, p["metadata"]["labels"],
                            p["spec"]))
        pods.append(template(gateway.build_deployment(run), gateway.COMPONENT,
                             f"{name(run, gateway.COMPONENT)}-0"))
    sts = trainer.build_statefulset(run)
    pods += [template(sts, trainer.COMPONENT, f"{sts['metadata']['name']}-{i}")
             for i in range(sts["spec"]["replicas"])]
    return pods


def services(run: AsyncGRPORun) -> list[dict]:
    out = [vllm.build_service(run), trainer.build_service(run)]
    if (replicas := vllm.build_replicas_service(run)) is not None:  # the router's DNS name
        out.append(replicas)
    if run.spec.sandboxes is not None:
        out.append(gateway.build_service(run))
    return out


def hosts(run: AsyncGRPORun, pods: list[Pod]) -> dict[str, str]:
    """Cluster DNS: a Service name -> its first selected pod; for a StatefulSet's headless
    Service also `<pod>.<service>` -> that pod."""
    out: dict[str, str] = {}
    for svc in services(run):
        svc_name, selector = svc["metadata"]["name"], svc["spec"]["selector"]
        chosen = [p for p in pods if selector.items() <= p.labels.items()]
        if chosen:
            out[svc_name] = chosen[0].name
        if svc["spec"].get("clusterIP") == "None":
            out.update({f"{p.name}.{svc_name}": p.name for p in chosen})
    return out


def image_runtimes(run: AsyncGRPORun) -> dict[str, ImageRuntime]:
    """Each image of the run -> the interpreter that stands for it and its Dockerfile's ENV.
    The trainer, sandbox and operator (bucket Job) images are this project's venv; the vLLM
    image the vLLM venv."""
    here = str(Path(sys.executable).parent)  # the venv's bin, not the resolved interpreter
    roles = {run.spec.trainer.image: ("trainer", here),
             run.spec.rollout.image: ("vllm", str(vllm_venv() / "bin"))}
    roles.setdefault(Settings.bucket_job_image, ("operator", here))
    if run.spec.sandboxes is not None:
        roles.setdefault(run.spec.sandboxes.image, ("sandbox", here))
    out = {}
    for image, (role, bin_dir) in roles.items():
        dockerfile = IMAGES_DIR / role / "Dockerfile"
        if not dockerfile.exists():
            raise ValueError(f"{dockerfile} not found: the images' ENV comes from the "
                             "checkout's Dockerfiles (run from a clone of asyncgrpo)")
        out[image] = ImageRuntime(bin_dirs=(bin_dir,),
                                  env=parse_dockerfile_env(dockerfile.read_text()))
    return out


def _address_block() -> str:
    """A random 127.A.B.0/24 for one run's pods (not 127.0.0.x: the host's own)."""
    return f"127.{1 + secrets.randbelow(254)}.{secrets.randbelow(256)}"


def members_file(workdir: Path) -> Path:
    """The gateway's members (`--members-file`), kept by the local sandbox pool
    (`asyncgrpo.local.sandbox_pool`) in place of the pod watch a cluster gateway has."""
    return workdir / "sandbox-members.json"


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _volumes(run: AsyncGRPORun, pod: Pod, workdir: Path) -> dict[str, str]:
    """A fresh directory per volume (emptyDirs start empty); the run's ConfigMap written."""
    config = configmap.build_config_map(run)
    out = {}
    for v in pod.spec.get("volumes", []):
        d = workdir / pod.name / v["name"]
        if "emptyDir" in v:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        elif v.get("configMap", {}).get("name") == config["metadata"]["name"]:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            for key, text in config["data"].items():
                (d / key).write_text(text)
        else:
            raise ValueError(f"volume {v['name']} of pod {pod.name} "
                             f"({', '.join(k for k in v if k != 'name')}) needs a cluster")
        out[v["name"]] = str(d.resolve())
    return out


def host_paths(run: AsyncGRPORun) -> tuple[str, ...]:
    """The run's local files named by absolute path (model, prompts, and the folders where
    the trainer finds the task's modules, preflight.module_paths): the machine's, even under
    a mountPath such as /tmp (a checkout under /tmp is not the pod's /tmp emptyDir)."""
    from asyncgrpo.preflight import module_paths

    d = run.spec.data
    named = [run.spec.model.name, d.path, d.eval.path if d.eval else None,
             run.spec.model.chat_template_path, *module_paths(run)]
    return tuple(dict.fromkeys(p for p in named if p and os.path.isabs(p) and os.path.exists(p)))


def machine_endpoints(run: AsyncGRPORun) -> tuple[str, ...]:
    """The run's endpoints on the machine, reached as written from every pod: the S3 endpoint
    (`host[:port]`; at a loopback address it is the machine's, not a pod's own loopback)."""
    endpoint = run.spec.adapter_store.endpoint
    return (urlsplit(endpoint).netloc,) if endpoint else ()


def build_placement(run: AsyncGRPORun, pods: list[Pod], workdir: Path, *,
                    s3_credentials: dict[str, str], max_steps: int | None = None,
                    cpus: dict[str, set[int] | None] | None = None) -> LocalPlacement:
    """`s3_credentials` (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY): the values of the run's
    credentials Secret, and what the machine gives every pod when the run names none (as
    IRSA or an instance profile would). `cpus`: component -> CPUs its pods are pinned to."""
    block = _address_block()
    addresses = {p.name: f"{block}.{i + 1}" for i, p in enumerate(pods)}
    ports = {port: free_port() for port in WILDCARD_PORTS}
    for p in pods:
        for c in p.spec["containers"]:
            for cp in c.get("ports", []):
                port = cp["containerPort"]
                if port not in ports and not _bindable(addresses[p.name], port):
                    ports[port] = free_port()  # taken on every address (0.0.0.0:port)
    values = {(secret_name(run), GATEWAY_TOKEN_KEY): secrets.token_urlsafe(24),
              (secret_name(run), SANDBOX_TOKEN_KEY): secrets.token_urlsafe(24)}
    ref = run.spec.adapter_store.credentials_secret
    if ref is not None:
        values[(ref.name, ref.access_key_id_key)] = s3_credentials["AWS_ACCESS_KEY_ID"]
        values[(ref.name, ref.secret_access_key_key)] = s3_credentials["AWS_SECRET_ACCESS_KEY"]
    overrides: dict[str, dict[str, str]] = {}
    for p in pods:
        mine = overrides.setdefault(p.name, {})
        if p.component == gateway.COMPONENT:  # no pod watch: the local pool's members file
            mine[GATEWAY_MEMBERS_FILE_ENV] = str(members_file(workdir).resolve())
        if p.component == trainer.COMPONENT and max_steps is not None:  # --max-steps
            mine[MAX_STEPS_ENV] = str(max_steps)
        if any(c.get("terminationMessagePath") for c in p.spec["containers"]):
            mine[TERMINATION_LOG_ENV] = str(termination_log(workdir, p))
    return LocalPlacement(
        images=image_runtimes(run),
        addresses=addresses,
        hosts=hosts(run, pods),
        volumes={p.name: _volumes(run, p, workdir) for p in pods},
        cwd=os.getcwd(),
        ports=ports,
        secrets=values,
        env={**{k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ},
             **{k: os.environ.get(k, v) for k, v in MACHINE_CACHES.items()},
             **s3_credentials},
        overrides=overrides,
        # this checkout first (the vLLM venv's editable install may point elsewhere), then
        # where the run is started from: user reward modules are importable from there
        pythonpath=(str(PACKAGE_ROOT), os.getcwd()),
        namespace=run.metadata.namespace or "default",
        host_paths=host_paths(run),
        machine_endpoints=machine_endpoints(run),
        cpus={p.name: frozenset(cpus[p.component]) for p in pods
              if cpus and cpus.get(p.component)},
    )


def named_port(pod: Pod, port_name: str, ports: Mapping[int, int]) -> int:
    """The local port of the pod's (single container's) port called `port_name`."""
    (c,) = pod.spec["containers"]
    port = next(p["containerPort"] for p in c["ports"] if p.get("name") == port_name)
    return ports.get(port, port)


def add_pod(placement: LocalPlacement, run: AsyncGRPORun, pod: Pod, workdir: Path,
            after: str | None = None) -> LocalPlacement:
    """The placement with one more pod, started while the run runs (a sandbox the local pool
    adds): a loopback address of its own in the run's block, where its ports bind (the next
    free one after `after`, so a freed address is taken again last; another block once the
    run's is full), and fresh directories for its volumes."""
    ports = [placement.ports.get(cp["containerPort"], cp["containerPort"])
             for c in pod.spec["containers"] for cp in c.get("ports", [])]
    taken = set(placement.addresses.values())
    some = next(iter(placement.addresses.values()), None)
    block = some.rsplit(".", 1)[0] if some else _address_block()
    start = int(after.rsplit(".", 1)[1]) if after and after.startswith(block + ".") else 0
    address = None
    for _ in range(4):
        for k in range(254):
            candidate = f"{block}.{(start + k) % 254 + 1}"
            if candidate not in taken and all(_bindable(candidate, port) for port in ports):
                address = candidate
                break
        if address is not None:
            break
        block, start = _address_block(), 0
    if address is None:
        raise ValueError(f"no loopback address free for pod {pod.name}")
    return dataclasses.replace(
        placement, addresses={**placement.addresses, pod.name: address},
        volumes={**placement.volumes, pod.name: _volumes(run, pod, workdir)})


def drop_pod(placement: LocalPlacement, pod_name: str) -> LocalPlacement:
    """The placement without a pod that is gone (its address free again)."""
    return dataclasses.replace(
        placement, addresses={k: v for k, v in placement.addresses.items() if k != pod_name},
        volumes={k: v for k, v in placement.volumes.items() if k != pod_name},
        overrides={k: v for k, v in placement.overrides.items() if k != pod_name},
        cpus={k: v for k, v in placement.cpus.items() if k != pod_name})

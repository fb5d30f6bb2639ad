"""The contract between the operator's pods and the programs in them, for every example.

Each container the builders produce is checked against the image it runs and the code that
reads it: its argv parses with the program's own parser, the env the program requires is
set, every path it writes (its own or its image's defaults) lies on a writable mount (the
root filesystem is read-only), and every port a probe, a Service or a URL names is one the
program listens on. These are the mistakes that only show when a pod really runs; the e2e
tests on the test node run them, this test finds them in a second.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest

from asyncgrpo import wire
from asyncgrpo.api import load_run
from asyncgrpo.cli import build_parser
from asyncgrpo.controller import gateway, sandboxes, trainer, vllm

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.yaml"))
IMAGE_OF = {"trainer": "trainer", "vllm": "vllm", "gateway": "sandbox", "sandbox": "sandbox",
            "weights-puller": "vllm"}
#: the variables naming where each program writes (its code, TRL's and Hugging Face's)
WRITES = {
    "trainer": ("HOME", "HF_HOME", wire.WORK_DIR_ENV),
    "vllm": ("HOME", "HF_HOME", wire.ADAPTER_CACHE_DIR_ENV),
    "gateway": (),
    "sandbox": (wire.SANDBOX_WORKSPACE_ENV,),
    "weights-puller": ("HOME", wire.WEIGHTS_DIR_ENV),
}


def workloads(run) -> dict[str, dict]:
    """component -> pod spec, as the operator creates them."""
    out = {"trainer": trainer.build_statefulset(run)["spec"]["template"]["spec"],
           "vllm": vllm.build_deployment(run)["spec"]["template"]["spec"]}
    if run.spec.sandboxes is not None:
        out["gateway"] = gateway.build_deployment(run)["spec"]["template"]["spec"]
        out["sandbox"] = sandboxes.build_pod(run, "x")["spec"]
    return out


def containers_of(run) -> dict[str, tuple[dict, dict]]:
    """component (or sidecar name) -> (pod spec, container): every container that runs."""
    out = {}
    for component, pod in workloads(run).items():
        main, *sidecars = pod["containers"]
        out[component] = (pod, main)
        out.update({c["name"]: (pod, c) for c in sidecars})
    return out


def services(run) -> dict[str, dict]:
    out = {s["metadata"]["name"]: s for s in (trainer.build_service(run), vllm.build_service(run))}
    if run.spec.sandboxes is not None:
        s = gateway.build_service(run)
        out[s["metadata"]["name"]] = s
    return out


def plain_env(container: dict) -> dict[str, str]:
    """The container's variables as the program sees them; valueFrom ones as placeholders."""
    return {e["name"]: e["value"] if "value" in e else f"<from {sorted(e['valueFrom'])}>"
            for e in container.get("env", [])}


def image_env(image: str) -> dict[str, str]:
    """ENV of images/<image>/Dockerfile (the defaults a container inherits)."""
    text = (REPO / "images" / image / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for k, v in re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", line):
                env[k] = v
    return env


def writable_mounts(pod: dict, container: dict) -> list[str]:
    empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    return [m["mountPath"] for m in container["volumeMounts"]
            if m["name"] in empty and not m.get("readOnly")]


def expand(script: str, env: dict[str, str], hostname: str) -> list[str]:
    """The words /bin/sh -c runs, for the simple forms the trainer's command uses."""
    script = script.replace("${HOSTNAME##*-}", hostname.rsplit("-", 1)[1])
    script = re.sub(r"\$([A-Z_][A-Z0-9_]*)", lambda m: env[m.group(1)], script)
    return shlex.split(script)


def cases():
    for example in EXAMPLES:
        run = load_run(REPO / "examples" / example)
        for component in containers_of(run):
            yield pytest.param(example, component, id=f"{example}-{component}")


@pytest.mark.parametrize(("example", "component"), list(cases()))
def test_container_matches_its_program_and_image(example, component, monkeypatch):
    run = load_run(REPO / "examples" / example)
    pod, container = containers_of(run)[component]
    env = plain_env(container)
    argv = [*container.get("command", []), *container.get("args", [])]
    listens: set[int] = set()

    # -- argv parses with the program's own parser; env the program reads is set
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if argv[0] == "asyncgrpo":
        args = build_parser(argv[1:]).parse_args(argv[1:])  # env-backed flags parse too
        if hasattr(args, "port"):
            listens.add(int(args.port))
    elif component == "trainer":
        from torch.distributed.run import get_args_parser

        assert argv[:2] == ["/bin/sh", "-c"]
        words = expand(argv[2], env, f"{run.metadata.name}-trainer-0")
        assert words[0] == "exec"
        torchrun = get_args_parser().parse_args(words[2:])
        assert torchrun.module and torchrun.training_script == "asyncgrpo.cli"
        ours = build_parser(torchrun.training_script_args).parse_args(
            torchrun.training_script_args)
        assert ours.command == "trainer"
        from asyncgrpo.trainer.runtime_env import RuntimeEnv

        runtime = RuntimeEnv.from_env(env)  # raises on a malformed variable
        assert runtime.require_vllm()
        listens.add(int(env[wire.METRICS_PORT_ENV]))
        # the run file the command names is where the config map is mounted
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(ours.config).parent) in mounts
    elif component == "vllm":
        assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        port = argv[argv.index("--port") + 1]
        listens.add(int(port))
        assert argv[argv.index("--host") + 1] == "0.0.0.0"
        from asyncgrpo.adapters.vllm_plugin import S3AdapterResolver

        S3AdapterResolver(env)  # raises when the resolver's variables are missing
    else:
        pytest.fail(f"no contract for {component}: {argv}")

    # -- every path written lies on a writable mount (the root filesystem is read-only)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = writable_mounts(pod, container)
    inherited = {**image_env(IMAGE_OF[component]), **env}
    for k in WRITES[component]:
        assert k in inherited, f"{component}: {k} is set neither by the pod nor by its image"
        value = inherited[k]
        assert any(value == m or value.startswith(m.rstrip("/") + "/") for m in writable), (
            f"{component}: {k}={value} is on the read-only root (writable: {writable})")
    assert "/tmp" in writable

    # -- every port a probe names is a container port the program listens on
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert set(ports.values()) <= listens | {wire.TRAINER_RENDEZVOUS_PORT}, (ports, listens)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            port = container[probe]["httpGet"]["port"]
            assert (ports.get(port) if isinstance(port, str) else port) in listens

    # -- no GPU asked for where the run says CPU
    gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
    if component == "trainer":
        assert gpus == run.spec.trainer.gpus_per_replica
    if component == "vllm" and run.spec.rollout.gpus_per_replica == 0:
        assert gpus == 0


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_url_names_a_service_port_that_is_served(example):
    run = load_run(REPO / "examples" / example)
    svcs = services(run)
    pods = workloads(run)
    for component, pod in pods.items():
        for e in pod["containers"][0].get("env", []):
            value = e.get("value") or ""
            if not value.startswith("http://"):
                continue
            url = urlparse(value)
            host = url.hostname
            if host not in svcs:
                assert e["name"].endswith(("_ENDPOINT", "_URL_S3")), (component, e)  # the bucket
                continue
            svc = svcs[host]
            port = next(p for p in svc["spec"]["ports"] if p["port"] == url.port)
            target_component = svc["spec"]["selector"]["app.kubernetes.io/component"]
            target = pods[target_component]["containers"][0]
            named = {p["name"]: p["containerPort"] for p in target["ports"]}
            tp = port["targetPort"]
            assert (named[tp] if isinstance(tp, str) else tp) in named.values()
    assert services(run)[f"{run.metadata.name}-vllm"]["spec"]["ports"][0]["port"] == wire.VLLM_PORT


def test_sandbox_exec_timeout_of_the_run_is_the_servers_limit():
    """A reward asking for the run's execTimeoutSeconds must not be clamped by the server."""
    run = load_run(REPO / "examples" / "multi-turn-sandboxes.yaml")
    run.spec.sandboxes.exec_timeout_seconds = 1800
    (container,) = sandboxes.build_pod(run, "x")["spec"]["containers"]
    env = plain_env(container)
    assert float(env[wire.SANDBOX_MAX_TIMEOUT_ENV]) >= 1800

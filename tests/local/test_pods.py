"""The one translation of the operator's pods into local processes (asyncgrpo.local.pods):
pure, so checked here on the pods the builders make for the examples, without starting
anything."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from asyncgrpo import wire
from asyncgrpo.api import load_run
from asyncgrpo.controller import gateway, trainer, vllm
from asyncgrpo.controller.configmap import run_document
from asyncgrpo.controller.secret import GATEWAY_TOKEN_KEY, SANDBOX_TOKEN_KEY, secret_name
from asyncgrpo.local.placement import build_placement, members_file, run_pods
from asyncgrpo.local.pods import (
    ImageRuntime,
    LocalPlacement,
    PodTranslationError,
    parse_dockerfile_env,
    translate,
    translate_pod,
)
from asyncgrpo.local.vllm import vllm_venv
from asyncgrpo.wire import (
    ADAPTER_ENDPOINT_ENV,
    BIND_HOST_ENV,
    PULLER_PORT,
    SANDBOX_PORT,
    VLLM_PORT,
    WEIGHTS_DIR_ENV,
    WEIGHTS_PORT_ENV,
    WEIGHTS_VLLM_URL_ENV,
)
from asyncgrpo.wire import TRAINER_RENDEZVOUS_PORT as RENDEZVOUS_PORT
from tests.api.invalid_specs import REPO

CREDS = {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "secret"}


def local(example: str, tmp_path: Path, sandboxes: int = 2, max_steps: int | None = None):
    run = load_run(REPO / "examples" / example)
    pods = run_pods(run, sandboxes)
    placement = build_placement(run, pods, tmp_path, s3_credentials=CREDS,
                                max_steps=max_steps, cpus={"trainer": {0}, "vllm": {1}})
    procs = {p.name: translate(p.name, p.spec["containers"][0], placement) for p in pods}
    return run, pods, placement, procs


def sh_words(lp) -> list[str]:
    """The words the trainer's `/bin/sh -c` runs, expanded with its env (as dash would)."""
    assert lp.argv[:2] == ["/bin/sh", "-c"]
    script = lp.argv[2].replace("${HOSTNAME##*-}", lp.env["HOSTNAME"].rsplit("-", 1)[1])
    for k, v in lp.env.items():
        script = script.replace(f"${k}", v)
    return shlex.split(script)


def test_local_tiny_runs_the_builders_pods(tmp_path):
    run, pods, placement, procs = local("local-tiny.yaml", tmp_path, max_steps=3)
    assert [p.name for p in pods] == ["local-tiny-vllm-0", "local-tiny-trainer-0"]
    v, t = procs["local-tiny-vllm-0"], procs["local-tiny-trainer-0"]
    v_addr, t_addr = placement.addresses[v.pod], placement.addresses[t.pod]
    assert v_addr != t_addr and v_addr.startswith("127.") and not v_addr.startswith("127.0.0.")

    # vLLM: the builder's argv, bound to the pod's address; its image's ENV and the run's env
    container = vllm.build_deployment(run)["spec"]["template"]["spec"]["containers"][0]
    want = [*container["command"], *container["args"]]
    want[want.index("0.0.0.0")] = v_addr
    assert v.argv == want
    assert v.env["VLLM_PLUGINS"] == "asyncgrpo_s3_lora_resolver"  # from images/vllm
    assert v.env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # rollout.env of the run file
    assert v.env["PATH"].split(":")[0] == str(vllm_venv() / "bin")  # python3 is the venv's
    cache = placement.volumes[v.pod]["cache"]
    assert v.env["ASYNCGRPO_ADAPTER_CACHE_DIR"] == f"{cache}/adapters"
    assert v.env["HOSTNAME"] == v.pod and v.env[BIND_HOST_ENV] == v_addr
    assert v.env["AWS_ACCESS_KEY_ID"] == "id"  # the machine's credentials (no Secret named)
    assert not v.env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))  # kept across runs
    assert v.ready_url == f"http://{v_addr}:{VLLM_PORT}/health"
    assert v.cpus == {1} and t.cpus == {0}

    # trainer: torchrun against its own pod, the run document where the ConfigMap would be
    words = sh_words(t)
    assert words[:2] == ["exec", "torchrun"]
    assert f"--master-addr={t_addr}" in words and "--node-rank=0" in words
    port = placement.ports[RENDEZVOUS_PORT]
    assert port != RENDEZVOUS_PORT and f"--master-port={port}" in words
    config = Path(words[words.index("--config") + 1])
    assert config.parent == Path(placement.volumes[t.pod]["config"])
    assert yaml.safe_load(config.read_text()) == run_document(run)
    assert t.env["ASYNCGRPO_VLLM_URL"] == f"http://{v_addr}:{VLLM_PORT}"
    # affine routing's headless Service names the one local vLLM pod (host and port translated)
    assert t.env["ASYNCGRPO_VLLM_REPLICAS"] == f"{v_addr}:{VLLM_PORT}"
    assert t.env["ASYNCGRPO_WORK_DIR"] == placement.volumes[t.pod]["work"]
    assert t.env["HOME"] == placement.volumes[t.pod]["tmp"]
    assert t.env["TRL_EXPERIMENTAL_SILENCE"] == "1"  # from images/trainer
    assert t.env["ASYNCGRPO_MAX_STEPS"] == "3"
    assert t.env["PYTHONPATH"].split(":")[:2] == [str(REPO / "operator"), placement.cwd]
    assert t.ready_url == f"http://{t_addr}:{run.spec.trainer.metrics_port}/healthz"


def test_sandbox_pods_gateway_and_tokens(tmp_path):
    run, pods, placement, procs = local("multi-turn-sandboxes.yaml", tmp_path, sandboxes=2)
    boxes = [p.name for p in pods if p.component == "sandbox"]
    (gw,) = [p.name for p in pods if p.component == "gateway"]
    assert len(boxes) == 2
    g = procs[gw]
    # the gateway follows the local pool's members file instead of watching pods (the pool,
    # tests/local/test_sandbox_pool.py, writes it); it binds its own address
    assert g.env["ASYNCGRPO_GATEWAY_MEMBERS_FILE"] == str(members_file(tmp_path).resolve())
    assert "ASYNCGRPO_GATEWAY_MEMBERS" not in g.env
    for b in boxes:  # each sandbox on its own address: the URL the pool writes for it
        assert procs[b].ready_url == f"http://{placement.addresses[b]}:{SANDBOX_PORT}/healthz"
    assert g.env[BIND_HOST_ENV] == placement.addresses[gw]
    assert g.env["ASYNCGRPO_GATEWAY_NAMESPACE"] == "default"  # fieldRef
    assert g.argv == ["asyncgrpo", "gateway"]
    # one token per role, the same in every pod that holds it, from the run's Secret
    secret = secret_name(run)
    sandbox_token = placement.secrets[(secret, SANDBOX_TOKEN_KEY)]
    gateway_token = placement.secrets[(secret, GATEWAY_TOKEN_KEY)]
    assert sandbox_token != gateway_token
    assert {procs[b].env["ASYNCGRPO_SANDBOX_TOKEN"] for b in boxes} == {sandbox_token}
    assert g.env["ASYNCGRPO_SANDBOX_TOKEN"] == sandbox_token
    assert g.env["ASYNCGRPO_GATEWAY_TOKEN"] == gateway_token
    t = procs[f"{run.metadata.name}-trainer-0"]
    assert t.env["ASYNCGRPO_GATEWAY_TOKEN"] == gateway_token
    assert t.env["ASYNCGRPO_GATEWAY_URL"] == (
        f"http://{placement.addresses[gw]}:{g.ready_url.split(':')[2].split('/')[0]}")
    # each sandbox server: its own workspace emptyDir, its own address
    for b in boxes:
        assert procs[b].env["ASYNCGRPO_SANDBOX_WORKSPACE"] == placement.volumes[b]["workspace"]
        assert procs[b].env[BIND_HOST_ENV] == placement.addresses[b]


def test_two_trainer_nodes_meet_at_node_zero(tmp_path):
    doc = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["trainer"]["replicas"] = 2
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    run = load_run(tmp_path / "run.yaml")
    pods = run_pods(run, 0)
    placement = build_placement(run, pods, tmp_path / "w", s3_credentials=CREDS)
    nodes = [p for p in pods if p.component == "trainer"]
    words = [sh_words(translate(p.name, p.spec["containers"][0], placement))
             for p in nodes]
    master = placement.addresses[nodes[0].name]
    assert [w[w.index("--nnodes=2")] for w in words] == ["--nnodes=2"] * 2
    assert [next(x for x in w if x.startswith("--node-rank")) for w in words] == [
        "--node-rank=0", "--node-rank=1"]
    assert all(f"--master-addr={master}" in w for w in words)
    # each node's own work dir
    assert len({placement.volumes[p.name]["work"] for p in nodes}) == 2


def test_full_finetuning_runs_the_weights_puller_beside_its_vllm(tmp_path):
    """The vLLM pod of a full fine-tuning run is two processes, as two containers of one pod:
    one address (the puller's `127.0.0.1` is its pod's), one `weights` directory (the puller
    writes the copy vLLM reloads), the puller's readiness on its own port; the bucket's
    loopback endpoint stays the machine's."""
    run, pods, placement, _ = local("local-tiny-full.yaml", tmp_path)
    pod = next(p for p in pods if p.component == vllm.COMPONENT)
    server, puller = translate_pod(pod.name, pod.spec, placement)
    addr = placement.addresses[pod.name]
    assert (server.name, puller.name) == (pod.name, f"{pod.name}.{vllm.PULLER_CONTAINER}")
    assert server.container is None and puller.container == vllm.PULLER_CONTAINER
    assert puller.argv == ["asyncgrpo", "weights", "pull"]
    assert puller.env[BIND_HOST_ENV] == server.env[BIND_HOST_ENV] == addr
    assert puller.env[WEIGHTS_VLLM_URL_ENV] == f"http://{addr}:{VLLM_PORT}"
    assert server.argv[server.argv.index("--host") + 1] == addr
    assert server.argv[server.argv.index("--middleware") + 1] == (
        "asyncgrpo.weights.guard.DevRoutesLoopbackOnly")
    assert "--enable-scale-out" in server.argv  # the route that reports weight versions
    weights = placement.volumes[pod.name]["weights"]
    assert puller.env[WEIGHTS_DIR_ENV] == weights and Path(weights).is_dir()
    assert puller.env[WEIGHTS_PORT_ENV] == str(PULLER_PORT)
    assert puller.ready_url == f"http://{addr}:{PULLER_PORT}/ready"
    assert server.ready_url == f"http://{addr}:{VLLM_PORT}/health"
    for lp in (server, puller):
        assert lp.env[ADAPTER_ENDPOINT_ENV] == run.spec.adapter_store.endpoint
        assert lp.env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9000"
        assert lp.cpus == {1}
    assert puller.env["PATH"].split(":")[0] == str(vllm_venv() / "bin")  # the vLLM image's


def test_a_pods_own_loopback_is_its_address_but_machine_endpoints_stay():
    p = placement(machine_endpoints=("127.0.0.1:9000",), ports={8000: 18000})
    lp = translate("p-0", container(
        args=["http://127.0.0.1:8000/x", "localhost:8000", "http://127.0.0.1:9000",
              "127.0.0.10", "127.0.0.1.nip.io"],
        env=[{"name": "S3", "value": "http://127.0.0.1:9000"},
             {"name": "ME", "value": "http://localhost"}]), p)
    assert lp.argv[1:] == ["http://127.9.9.1:18000/x", "127.9.9.1:18000",
                           "http://127.0.0.1:9000", "127.0.0.10", "127.0.0.1.nip.io"]
    assert lp.env["S3"] == "http://127.0.0.1:9000" and lp.env["ME"] == "http://127.9.9.1"


def test_a_run_needing_a_cluster_config_map_is_refused(tmp_path):
    run = load_run(REPO / "examples" / "moe-expert-parallel.yaml")
    with pytest.raises(ValueError, match="needs a cluster"):
        build_placement(run, run_pods(run, 0), tmp_path, s3_credentials=CREDS)


def test_every_service_port_is_its_target_port():
    """The host:port rule maps a Service's port as the container's port: true of every
    Service the builders make."""
    for example in sorted((REPO / "examples").glob("*.yaml")):
        run = load_run(example)
        built = [(vllm.build_service(run), vllm.build_deployment(run)),
                 (trainer.build_service(run), trainer.build_statefulset(run))]
        if run.spec.sandboxes is not None:
            built.append((gateway.build_service(run), gateway.build_deployment(run)))
        for svc, workload in built:
            named = {p["name"]: p["containerPort"]
                     for c in workload["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                target = p["targetPort"]
                assert named.get(target, target) == p["port"], (example.name, svc, p)


# ---------------------------------------------------------------- the rules, one by one

def placement(**kw) -> LocalPlacement:
    base = {"images": {"img": ImageRuntime(bin_dirs=("/venv/bin",), env={"HOME": "/home/x"})},
            "addresses": {"p-0": "127.9.9.1", "q-0": "127.9.9.2"},
            "hosts": {"q": "q-0", "q-0.q": "q-0"},
            "volumes": {"p-0": {"tmp": "/L/tmp", "cfg": "/L/cfg"}}, "cwd": "/here"}
    return LocalPlacement(**{**base, **kw})


def container(**kw) -> dict:
    return {"name": "c", "image": "img", "command": ["prog"],
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                             {"name": "cfg", "mountPath": "/etc/app"}], **kw}


def test_paths_are_rewritten_by_mount_prefix_only():
    lp = translate("p-0", container(args=[
        "/tmp", "/tmp/a", "--f=/etc/app/run.yaml", '--c "/etc/app/x"', "/tmpx", "/var/tmp",
        "/etc/apples"]), placement())
    assert lp.argv[1:] == ["/L/tmp", "/L/tmp/a", "--f=/L/cfg/run.yaml", '--c "/L/cfg/x"',
                           "/tmpx", "/var/tmp", "/etc/apples"]


def test_a_rewritten_path_is_not_rewritten_again():
    """One pass: a local directory named like a Service (a --workdir called `q`) stays."""
    p = placement(volumes={"p-0": {"tmp": "/w/q", "cfg": "/w/0.0.0.0"}})
    lp = translate("p-0", container(args=["/tmp/x", "/etc/app", "http://q"]), p)
    assert lp.argv[1:] == ["/w/q/x", "/w/0.0.0.0", "http://127.9.9.2"]


def test_the_runs_own_files_are_the_machines_even_under_a_mount(tmp_path):
    """A model under /tmp is a file of this machine, not of the pod's /tmp emptyDir."""
    p = placement(host_paths=("/tmp/pytest-x/model",))
    lp = translate("p-0", container(args=["--model", "/tmp/pytest-x/model", "/tmp/pytest-x/m",
                                           "/tmp/pytest-x/model/config.json"]), p)
    assert lp.argv[1:] == ["--model", "/tmp/pytest-x/model", "/L/tmp/pytest-x/m",
                           "/tmp/pytest-x/model/config.json"]
    # from a run file: the model's absolute path, when it exists, is a host path
    doc = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["model"]["name"] = str(tmp_path)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    run = load_run(tmp_path / "run.yaml")
    pods = run_pods(run, 0)
    placed = build_placement(run, pods, tmp_path / "w", s3_credentials=CREDS)
    assert placed.host_paths == (str(tmp_path),)
    v = translate(pods[0].name, pods[0].spec["containers"][0], placed)
    assert v.argv[v.argv.index("--model") + 1] == str(tmp_path)


def test_the_trainers_pythonpath_folders_are_the_machines_even_under_a_mount(tmp_path):
    """A task package found through spec.trainer.env PYTHONPATH (the local way, docs/tasks.md)
    in a checkout under /tmp: the folders are this machine's, not the pod's /tmp emptyDir
    (CI clones under /tmp: the trainer found no `calculator_math` when they were rewritten)."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as checkout:  # under the pod's /tmp mount
        pkg, other = Path(checkout) / "task", Path(checkout) / "more"
        pkg.mkdir()
        other.mkdir()
        doc = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
        doc["spec"]["trainer"]["env"] = [{"name": "PYTHONPATH", "value": f"{pkg}:{other}"}]
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
        run = load_run(tmp_path / "run.yaml")
        pods = run_pods(run, 0)
        placed = build_placement(run, pods, tmp_path / "w", s3_credentials=CREDS)
    assert set(placed.host_paths) >= {str(pkg), str(other)}
    trainer_pod = next(p for p in pods if p.component == "trainer")
    v = translate(trainer_pod.name, trainer_pod.spec["containers"][0], placed)
    assert v.env["PYTHONPATH"].split(":")[-2:] == [str(pkg), str(other)], v.env["PYTHONPATH"]


def test_a_host_path_ends_where_its_word_does():
    p = placement(host_paths=("/tmp/pytest-x/pkg",))
    lp = translate("p-0", container(args=["/tmp/pytest-x/pkg:/tmp/y", "/tmp/pytest-x/pkgs"]), p)
    assert lp.argv[1:] == ["/tmp/pytest-x/pkg:/L/tmp/y", "/L/tmp/pytest-x/pkgs"]


def test_hosts_and_ports_are_rewritten_only_where_they_name_one():
    p = placement(ports={8000: 18000})
    lp = translate("p-0", container(
        args=["--port", "8000", "--max-model-len", "8000", "--host", "0.0.0.0",
              "--master-port=8000", "http://q:8000/v1", "q-0.q:8000", "qq", "q.example.com"],
        env=[{"name": "A_PORT", "value": "8000"}, {"name": "N", "value": "8000"},
             {"name": "URL", "value": "http://q-0.q:8000"},
             {"name": "LISTEN", "value": "0.0.0.0:8000"}]), p)
    assert lp.argv[1:] == ["--port", "18000", "--max-model-len", "8000", "--host", "127.9.9.1",
                           "--master-port=18000", "http://127.9.9.2:18000/v1",
                           "127.9.9.2:18000", "qq", "q.example.com"]
    assert (lp.env["A_PORT"], lp.env["N"]) == ("18000", "8000")
    assert lp.env["URL"] == "http://127.9.9.2:18000"
    assert lp.env["LISTEN"] == "127.9.9.1:18000"


def test_env_layers_image_then_machine_then_pod_then_placement():
    p = placement(env={"HOME": "/machine", "M": "1"}, overrides={"p-0": {"X": "local"}},
                  pythonpath=("/checkout",))
    lp = translate("p-0", container(env=[{"name": "X", "value": "pod"},
                                             {"name": "HOME", "value": "/tmp"}]), p)
    assert lp.env["HOME"] == "/L/tmp" and lp.env["M"] == "1" and lp.env["X"] == "local"
    assert lp.env["PATH"] == "/venv/bin" and lp.env["PYTHONPATH"] == "/checkout"
    assert lp.env["HOSTNAME"] == "p-0" and lp.cwd == "/here"


def test_what_the_placement_cannot_provide_is_an_error():
    p = placement()
    secret = {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    with pytest.raises(PodTranslationError, match="Secret 's'"):
        translate("p-0", container(env=[secret]), p)
    optional = {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k",
                                                            "optional": True}}}
    assert "S" not in translate("p-0", container(env=[optional]), p).env
    with pytest.raises(PodTranslationError, match="fieldRef"):
        translate("p-0", container(env=[{"name": "U", "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.uid"}}}]), p)
    with pytest.raises(PodTranslationError, match="no local runtime for image"):
        translate("p-0", container(image="other"), p)
    with pytest.raises(PodTranslationError, match="ENTRYPOINT"):
        translate("p-0", container(command=[]), p)
    with pytest.raises(PodTranslationError, match="no local directory"):
        translate("p-0", container(volumeMounts=[{"name": "x", "mountPath": "/x"}]), p)


def test_dockerfile_env_is_the_last_stage_s():
    text = ("FROM a AS build\nENV A=1\nFROM b\nENV B=2 \\\n    C=\"x y\" \\\n    D=/p\n"
            "RUN true\n")
    assert parse_dockerfile_env(text) == {"B": "2", "C": "x y", "D": "/p"}
    vllm_env = parse_dockerfile_env((REPO / "images" / "vllm" / "Dockerfile").read_text())
    assert vllm_env["VLLM_PLUGINS"] == "asyncgrpo_s3_lora_resolver"


def test_servers_without_a_host_flag_bind_the_pods_address(monkeypatch):
    """ASYNCGRPO_BIND_HOST is the default host of the sandbox server, the gateway, the
    weights puller and the trainer's metrics endpoint; unset (in a pod) they bind every interface."""
    from asyncgrpo.cli import build_parser
    from asyncgrpo.trainer.metrics import TrainerMetrics

    servers = (["sandbox", "serve"], ["gateway"], ["weights", "pull"])
    monkeypatch.delenv(BIND_HOST_ENV, raising=False)
    for argv in servers:
        assert build_parser(argv).parse_args(argv).host == "0.0.0.0"
    monkeypatch.setenv(BIND_HOST_ENV, "127.77.0.1")
    for argv in servers:
        assert build_parser(argv).parse_args(argv).host == "127.77.0.1"
    node = TrainerMetrics.for_node(1)
    node.serve(0)
    try:
        assert node._server.server_address[0] == "127.77.0.1"
    finally:
        node.close()


def test_the_bucket_setup_jobs_pod_runs_the_clusters_command(tmp_path):
    """Locally the bucket is set up by the pod of the run's bucket setup Job, translated like
    every other pod: the command a cluster runs, the run's own (stable) uid, its termination
    message in a file the backend reads, HOME on its /tmp emptyDir."""
    from asyncgrpo.controller import bucketjob
    from asyncgrpo.local.placement import bucket_setup_pod, local_uid, termination_log
    from asyncgrpo.wire import TERMINATION_LOG_ENV

    run = load_run(REPO / "examples" / "local-tiny.yaml")
    setup = bucket_setup_pod(run)
    pods = [setup, *run_pods(run, 0)]
    placement = build_placement(run, pods, tmp_path, s3_credentials=CREDS)
    lp = translate(setup.name, setup.spec["containers"][0], placement)
    assert setup.component == bucketjob.SETUP and setup.deadline_s > 0
    assert lp.argv == ["asyncgrpo", "bucket", "setup"]
    assert lp.env[wire.RUN_UID_ENV] == local_uid(run) == local_uid(load_run(
        REPO / "examples" / "local-tiny.yaml"))
    assert lp.env[TERMINATION_LOG_ENV] == str(termination_log(tmp_path, setup))
    assert lp.env["HOME"] == placement.volumes[setup.name]["tmp"]
    assert lp.env["AWS_ACCESS_KEY_ID"] == "id"
    assert lp.env["ASYNCGRPO_ADAPTER_ENDPOINT"] == run.spec.adapter_store.endpoint
    assert lp.ready_url is None   # a Job's pod is run to its end, not probed
    # another run's uid differs: a local run never takes another's folder
    other = run.model_copy(update={"metadata": run.metadata.model_copy(update={"name": "b"})})
    assert local_uid(other) != local_uid(run)

"""The child builders, without a cluster: every example builds, specs carry what the run
asks for, and hashes move only with what each child depends on."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncgrpo.api import load_run
from asyncgrpo.api.validation import parse_run
from asyncgrpo.controller import (
    configmap,
    gateway,
    network,
    rbac,
    sandboxes,
    secret,
    trainer,
    vllm,
)
from asyncgrpo.controller.children import build_children
from asyncgrpo.controller.common import HASH_ANNOTATION, RUN_AS_USER
from asyncgrpo.weights.guard import MIDDLEWARE

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def run_of(name: str = "multi-turn-sandboxes.yaml", **changes):
    run = load_run(Path(__file__).resolve().parents[2] / "examples" / name)
    doc = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["metadata"]["namespace"] = "ns"
    for dotted, value in changes.items():
        node = doc
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_run(doc)


def h(obj) -> str:
    return obj["metadata"]["annotations"][HASH_ANNOTATION]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_builds_labelled_hashed_children(path):
    run = load_run(path)
    run.metadata.namespace = "ns"
    objs = build_children(run)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    for o in objs:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "asyncgrpo-operator"
        assert labels["asyncgrpo.dev/run"] == run.metadata.name
        assert len(o["metadata"]["name"]) <= 63
        assert HASH_ANNOTATION in o["metadata"]["annotations"]
    kinds = {k for k, _ in names}
    assert {"ConfigMap", "StatefulSet", "Deployment", "Service", "NetworkPolicy",
            "ServiceAccount"} <= kinds
    assert ("Role" in kinds) == (run.spec.sandboxes is not None)


def test_builders_are_deterministic():
    assert build_children(run_of()) == build_children(run_of())


def test_config_map_is_the_run_file_the_trainer_loads(tmp_path):
    run = run_of(**{"spec.suspend": True})
    cm = configmap.build_config_map(run)
    text = cm["data"]["run.yaml"]
    (tmp_path / "run.yaml").write_text(text)
    loaded = load_run(tmp_path / "run.yaml")
    assert loaded.spec.model_copy(update={
        "suspend": True, "ttl_seconds_after_finished": run.spec.ttl_seconds_after_finished,
    }) == run.spec
    assert "suspend" not in yaml.safe_load(text)["spec"]


def test_trainer_statefulset_for_torchrun():
    run = run_of("moe-expert-parallel.yaml")
    sts = trainer.build_statefulset(run)
    spec = sts["spec"]
    assert spec["replicas"] == run.spec.trainer.replicas
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == trainer.build_service(run)["metadata"]["name"]
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ASYNCGRPO_NNODES"] == str(run.spec.trainer.replicas)
    assert env["ASYNCGRPO_NPROC"] == str(run.spec.trainer.gpus_per_replica)
    assert "ASYNCGRPO_WORLD_SIZE" not in env and "POD_NAME" not in env  # nothing reads them
    assert env["ASYNCGRPO_MASTER_ADDR"] == f"{run.metadata.name}-trainer-0.{run.metadata.name}-trainer"
    assert env["ASYNCGRPO_VLLM_URL"] == f"http://{run.metadata.name}-vllm:8000"
    assert "${HOSTNAME##*-}" in c["command"][2]
    gpus = run.spec.trainer.gpus_per_replica
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert {"containerPort": run.spec.trainer.metrics_port, "name": "metrics"} in c["ports"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsUser"] == RUN_AS_USER
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    svc = trainer.build_service(run)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    # every pod answers its probe (not only global rank 0's), on a path every pod serves
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    # the root filesystem is read-only: what the trainer writes is mounted
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {env["ASYNCGRPO_WORK_DIR"], "/tmp", "/var/cache/asyncgrpo"} <= mounts
    assert env["HF_HOME"].startswith("/var/cache/asyncgrpo/")


def test_trainer_waits_and_suspends_at_zero():
    run = run_of()
    assert trainer.build_statefulset(run, replicas=0)["spec"]["replicas"] == 0
    objs = {(o["kind"], o["metadata"]["name"]): o
            for o in build_children(run, stopped=True)}
    for key in (("StatefulSet", "coder-agent-trainer"), ("Deployment", "coder-agent-vllm"),
                ("Deployment", "coder-agent-gateway")):
        assert objs[key]["spec"]["replicas"] == 0


def test_user_env_wins_and_credentials_come_from_the_secret():
    run = run_of(**{"spec.trainer.env": [{"name": "ASYNCGRPO_PROBE_TOLERANCE", "value": "0.1"},
                                         {"name": "ASYNCGRPO_METRICS_PORT", "value": "9999"}]})
    env = trainer.build_statefulset(run)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "ASYNCGRPO_METRICS_PORT"] == [
        {"name": "ASYNCGRPO_METRICS_PORT", "value": "9999"}]
    assert {"name": "ASYNCGRPO_PROBE_TOLERANCE", "value": "0.1"} in env
    key = next(e for e in env if e["name"] == "AWS_SECRET_ACCESS_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "s3-credentials",
                                                "key": "AWS_SECRET_ACCESS_KEY"}


def test_a_configmap_data_source_is_mounted_where_the_trainer_reads_it():
    from asyncgrpo.trainer.data import read_rows

    run = run_of("moe-expert-parallel.yaml")
    pod = trainer.build_statefulset(run)["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "data")
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    with pytest.raises(ValueError, match=f"mounted at {mount['mountPath']}/prompts.jsonl"):
        read_rows(run.spec.data, env=env)  # the path the trainer reads, with the pod's env
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "data")
    assert volume["projected"]["sources"] == [{"configMap": {"name": "moe-prompts", "items": [
        {"key": "prompts.jsonl", "path": "prompts.jsonl"}]}}]

    # an eval set in another ConfigMap shares the mount, under eval/
    doc = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["data"]["eval"] = {"configMap": {"name": "held-out", "key": "test.parquet"}}
    with_eval = parse_run(doc)
    pod = trainer.build_statefulset(with_eval)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "data")
    assert volume["projected"]["sources"][1] == {"configMap": {"name": "held-out", "items": [
        {"key": "test.parquet", "path": "eval/test.parquet"}]}}
    with pytest.raises(ValueError, match=f"mounted at {mount['mountPath']}/eval/test.parquet"):
        read_rows(with_eval.spec.data.eval, env=env, eval_set=True)
    plain = trainer.build_statefulset(run_of("lora-math.yaml"))["spec"]["template"]["spec"]
    assert all(v["name"] != "data" for v in plain["volumes"])


def test_vllm_serves_lora_from_the_bucket():
    run = run_of("lora-math.yaml")
    dep = vllm.build_deployment(run)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    assert args[args.index("--max-lora-rank") + 1] == str(run.spec.rollout.max_lora_rank)
    assert args[args.index("--max-loras") + 1] == str(run.spec.rollout.max_loras)
    assert args[args.index("--max-model-len") + 1] == str(run.spec.rollout.max_model_len)
    assert "--enable-lora" in args
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert env["ASYNCGRPO_ADAPTER_BUCKET"] == run.spec.adapter_store.bucket
    assert env["ASYNCGRPO_ADAPTER_PREFIX"] == run.spec.adapter_store.prefix
    assert env["ASYNCGRPO_ADAPTER_ENDPOINT"] == run.spec.adapter_store.endpoint
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert dep["spec"]["replicas"] == run.spec.rollout.replicas


def test_full_finetuning_pulls_weights_from_the_bucket_in_a_sidecar():
    run = run_of("full-finetune.yaml")
    pod = vllm.build_deployment(run)["spec"]["template"]["spec"]
    c, puller = pod["containers"]
    assert "--enable-lora" not in c["args"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in c["env"]
    # dev routes guarded; the generate route reports which weights sampled each token
    assert c["args"][c["args"].index("--middleware") + 1] == MIDDLEWARE
    assert "--enable-scale-out" in c["args"]
    # the puller's swap (asyncgrpo_reload_weights) lives in this worker extension
    assert c["args"][c["args"].index("--worker-extension-cls") + 1] == \
        "asyncgrpo.weights.vllm_worker.WeightSwapExtension"
    assert puller["command"] == ["asyncgrpo", "weights", "pull"]
    assert puller["readinessProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e.get("value") for e in puller["env"]}
    assert env["ASYNCGRPO_WEIGHTS_VLLM_URL"] == "http://127.0.0.1:8000"  # loopback, same pod
    assert env["ASYNCGRPO_ADAPTER_RUN"] == run.metadata.name
    # one emptyDir sized for the copies, written by the puller, read by vLLM
    vol = next(v for v in pod["volumes"] if v["name"] == "weights")
    assert vol["emptyDir"]["sizeLimit"] == "4Gi"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["weights"]["readOnly"] is True
    assert {m["mountPath"] for m in puller["volumeMounts"] if m["name"] == "weights"} == {
        mounts["weights"]["mountPath"]}


def test_lora_vllm_pod_has_no_puller():
    pod = vllm.build_deployment(run_of())["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    assert not {"--middleware", "--enable-scale-out"} & set(pod["containers"][0]["args"])
    assert all(v["name"] != "weights" for v in pod["volumes"])


def test_sandbox_pod_is_locked_down():
    run = run_of()
    pod = sandboxes.build_pod(run, "ab12")
    spec = pod["spec"]
    assert pod["metadata"]["name"] == "coder-agent-sandbox-ab12"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["securityContext"]["runAsNonRoot"] is True
    c = spec["containers"][0]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    token = next(e for e in c["env"] if e["name"] == "ASYNCGRPO_SANDBOX_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == secret.secret_name(run)
    assert c["resources"]["limits"] == {"cpu": 1, "memory": "1Gi", "ephemeral-storage": "4Gi"}
    # a spec without limits still gets bounded pods; a limit the spec sets wins
    bare = sandboxes.build_pod(run_of(**{"spec.sandboxes.resources": {"requests": {"cpu": "1"}}}), "x")
    assert bare["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "1"}, "limits": sandboxes.DEFAULT_LIMITS}
    big = sandboxes.build_pod(run_of(**{"spec.sandboxes.resources": {"limits": {"memory": "8Gi"}}}), "x")
    assert big["spec"]["containers"][0]["resources"]["limits"]["memory"] == "8Gi"
    # one hash per template: two pods of one spec share it; a new image changes it
    assert h(pod) == h(sandboxes.build_pod(run, "zz99")) == sandboxes.current_hash(run)
    assert sandboxes.current_hash(run_of(**{"spec.sandboxes.image": "x:2"})) != h(pod)


def test_gateway_watches_only_its_run_and_reads_tokens_from_env():
    run = run_of()
    c = gateway.build_deployment(run)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["ASYNCGRPO_GATEWAY_SELECTOR"]["value"] == (
        "app.kubernetes.io/name=asyncgrpo,app.kubernetes.io/instance=coder-agent,"
        "app.kubernetes.io/component=sandbox")
    assert "valueFrom" in env["ASYNCGRPO_GATEWAY_TOKEN"]
    assert not any("token" in a.lower() for a in c["command"])


def test_rbac_least_privilege():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in rbac.build_rbac(run_of())}
    role = objs[("Role", "coder-agent-gateway")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert objs[("ServiceAccount", "coder-agent-sandbox")]["automountServiceAccountToken"] is False
    assert objs[("ServiceAccount", "coder-agent-workload")]["automountServiceAccountToken"] is False
    single = rbac.build_rbac(run_of("lora-math.yaml"))
    assert [o["kind"] for o in single] == ["ServiceAccount"]


def test_the_workload_account_is_held_for_the_bucket_cleanup_only_with_delete():
    """The cleanup Job runs as `<run>-workload`: with deletionPolicy Delete a finalizer keeps
    it through a foreground deletion; with Retain an empty list, so that the merge patch of a
    policy change drops it."""
    def account(example):
        return next(o for o in rbac.build_rbac(run_of(example))
                    if o["metadata"]["name"].endswith("-workload"))

    held = account("full-finetune.yaml")
    assert held["metadata"]["finalizers"] == [rbac.CLEANUP_FINALIZER]
    assert held["metadata"]["name"] == "qwen3-full-workload"
    assert account("lora-math.yaml")["metadata"]["finalizers"] == []
    # no other account is held
    assert all("finalizers" not in o["metadata"] for o in rbac.build_rbac(run_of())
               if not o["metadata"]["name"].endswith("-workload"))


def test_network_policies():
    run = run_of()
    pols = {p["metadata"]["name"]: p["spec"] for p in network.build_policies(
        run, resolved_hosts=["93.184.216.34", "2606:2800:220:1::1", "93.184.216.34"])}
    sb = pols["coder-agent-sandbox"]
    assert sb["policyTypes"] == ["Ingress", "Egress"]
    assert sb["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "gateway"
    cidrs = [t["ipBlock"]["cidr"] for t in sb["egress"][0]["to"]]
    assert cidrs == sorted({"10.20.0.0/16", "93.184.216.34/32", "2606:2800:220:1::1/128"})
    assert sb["egress"][1]["to"] == [network.KUBE_DNS_PEER]   # hosts listed: DNS opened
    # the direct data path: the run's gateway and trainer reach sandboxes, on the server port only
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in sb["ingress"][0]["from"]
            ] == ["gateway", "trainer"]
    assert sb["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 8000}] and len(sb["ingress"]) == 1
    vllm_rules = pols["coder-agent-vllm"]["ingress"]
    assert vllm_rules[0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "trainer"
    # the preflight pod runs the tenant's modules and serves nothing: no ingress at all (its
    # egress stays open, as the trainer's: the model may come from a hub, the data from anywhere)
    assert pols["coder-agent-preflight"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "asyncgrpo",
                                        "app.kubernetes.io/instance": "coder-agent",
                                        "app.kubernetes.io/component": "preflight"}},
        "policyTypes": ["Ingress"], "ingress": []}
    assert vllm_rules[1]["from"] == network.DEFAULT_SCRAPERS

    closed = run_of(**{"spec.sandboxes.network": {}})
    sb = next(p for p in network.build_policies(closed) if p["metadata"]["name"].endswith(
        "sandbox"))["spec"]
    assert sb["egress"] == []   # no allow-list: all egress denied, not even DNS


def test_hashes_move_only_with_what_a_child_reads():
    base = run_of()
    sts = trainer.build_statefulset(base)
    template = sts["spec"]["template"]["metadata"]["annotations"]
    # a pool-size change does not roll the trainer nor vLLM
    bigger = run_of(**{"spec.sandboxes.max": 100})
    assert trainer.build_statefulset(bigger)["spec"]["template"]["metadata"][
        "annotations"] == template
    assert h(vllm.build_deployment(bigger)) == h(vllm.build_deployment(base))
    # a learning-rate change rolls the trainer but not vLLM
    lr = run_of(**{"spec.trainer.learningRate": 3e-5})
    assert trainer.build_statefulset(lr)["spec"]["template"]["metadata"][
        "annotations"] != template
    assert h(vllm.build_deployment(lr)) == h(vllm.build_deployment(base))
    # suspending changes replicas only
    assert configmap.build_config_map(run_of(**{"spec.suspend": True})) == \
        configmap.build_config_map(base)


@pytest.mark.parametrize("change", [
    {"spec.rollout.maxLoraRank": 256}, {"spec.rollout.maxLoras": 7},
    {"spec.rollout.maxModelLen": 12345}, {"spec.rollout.replicas": 5},
    {"spec.rollout.extraArgs": ["--enforce-eager"]}, {"spec.sandboxes.minWarm": 9},
    {"spec.adapterStore.createBucket": False}, {"spec.adapterStore.deletionPolicy": "Delete"},
])
def test_what_the_trainer_does_not_read_does_not_restart_it(change):
    """vLLM's LoRA slots and context length, its replicas, the pool and the bucket's
    lifecycle are outside the trainer's view of the run: its pods keep running."""
    base = trainer.build_statefulset(run_of())
    changed = trainer.build_statefulset(run_of(**change))
    assert changed["spec"]["template"] == base["spec"]["template"]


@pytest.mark.parametrize("change", [
    {"spec.rollout.sampling": {"temperature": 0.5}}, {"spec.sandboxes.execTimeoutSeconds": 77},
    {"spec.adapterStore.retention": 30}, {"spec.model.lora": {"rank": 8}},
    {"spec.harness.maxTurns": 3},
])
def test_what_the_trainer_reads_restarts_it(change):
    base = trainer.build_statefulset(run_of())["spec"]["template"]["metadata"]["annotations"]
    changed = trainer.build_statefulset(run_of(**change))["spec"]["template"]["metadata"]
    assert changed["annotations"] != base


def test_token_secret_is_random_per_build():
    a, b = secret.build_secret(run_of()), secret.build_secret(run_of())
    assert a["stringData"]["gateway-token"] != b["stringData"]["gateway-token"]
    assert len(a["stringData"]["sandbox-token"]) >= 40


def test_affine_routing_finds_the_ready_replicas_through_a_headless_service():
    run = run_of("full-finetune.yaml", **{"spec.rollout.replicas": 3})
    assert run.spec.rollout.routing == "affine"  # the default
    svc = vllm.build_replicas_service(run)
    assert svc["metadata"]["name"] == f"{run.metadata.name}-vllm-replicas"
    # one DNS record per Ready pod: a replica loading or catching up gets no rollouts
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"] == vllm.build_service(run)["spec"]["selector"]
    assert svc in build_children(run)
    env = {e["name"]: e.get("value") for e in trainer.trainer_env(run)}
    assert env["ASYNCGRPO_VLLM_REPLICAS"] == f"{run.metadata.name}-vllm-replicas:8000"
    assert env["ASYNCGRPO_VLLM_PULLER_PORT"] == "8100"   # full fine-tuning: version-aware
    # the trainer reads the pullers' /status: admitted on that port beside the operator
    vllm_rules = next(p for p in network.build_policies(run)
                      if p["metadata"]["name"].endswith("-vllm"))["spec"]["ingress"]
    puller = next(r for r in vllm_rules if r["ports"] == [{"protocol": "TCP", "port": 8100}])
    assert network.OPERATOR_SCRAPER in puller["from"]
    assert {"podSelector": {"matchLabels": trainer.build_statefulset(run)["spec"]["selector"][
        "matchLabels"]}} in puller["from"]
    # still no token and no Role for the trainer: DNS needs none
    workload = next(o for o in rbac.build_rbac(run) if o["kind"] == "ServiceAccount")
    assert workload["automountServiceAccountToken"] is False
    # LoRA: no puller to read
    lora = {e["name"]: e.get("value") for e in trainer.trainer_env(run_of("lora-math.yaml"))}
    assert "ASYNCGRPO_VLLM_REPLICAS" in lora and "ASYNCGRPO_VLLM_PULLER_PORT" not in lora


def test_routing_service_sends_everything_through_the_vllm_service():
    run = run_of("full-finetune.yaml", **{"spec.rollout.routing": "service"})
    assert vllm.build_replicas_service(run) is None
    assert not any(o["metadata"]["name"].endswith("-vllm-replicas") for o in build_children(run))
    env = {e["name"] for e in trainer.trainer_env(run)}
    assert not env & {"ASYNCGRPO_VLLM_REPLICAS", "ASYNCGRPO_VLLM_PULLER_PORT"}
    vllm_rules = next(p for p in network.build_policies(run)
                      if p["metadata"]["name"].endswith("-vllm"))["spec"]["ingress"]
    puller = next(r for r in vllm_rules if r["ports"] == [{"protocol": "TCP", "port": 8100}])
    assert puller["from"] == [network.OPERATOR_SCRAPER]

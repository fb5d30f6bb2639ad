"""Prompt data (local file, mounted ConfigMap, real S3 bucket), runtime env, metrics endpoint."""

from __future__ import annotations

import json
import urllib.request

import pytest

from asyncgrpo.api import parse_run
from asyncgrpo.storage import Bucket
from asyncgrpo.storage import client as s3_client
from asyncgrpo.trainer.data import DataError, epoch_order, load_dataset, parse_jsonl
from asyncgrpo.trainer.metrics import METRICS, PREFIX, TrainerMetrics
from asyncgrpo.trainer.runtime_env import RuntimeEnv, RuntimeEnvError

LINES = [
    {"prompt": "What is 2 + 3?", "answer": "5"},
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 4 + 4?"}], "answer": "8"},
    {"prompt": "What is 9 - 1?", "answer": "8"},
]


def run_with(data: dict, **trainer) -> object:
    return parse_run({
        "metadata": {"name": "data-run"},
        "spec": {"model": {"name": "m"}, "adapterStore": {"bucket": "bkt"}, "data": data,
                 "trainer": {"totalSteps": 2, "promptsPerStep": 2, "maxStaleness": 0, **trainer},
                 "reward": {"functions": [{"name": "exact_match"}]}},
    })


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_parse_makes_chat_prompts_and_keeps_columns():
    rows = parse_jsonl(jsonl(LINES) + "\n")
    assert rows[0] == {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
    assert rows[1]["prompt"][0]["role"] == "system"


@pytest.mark.parametrize("text,match", [
    ('{"prompt": "a"}\nnot json\n', r"data:2: not JSON"),
    ('{"question": "a"}\n', r"data:1: no field 'prompt'"),
    ('{"prompt": [{"content": "x"}]}\n', r"data:1: .* must be a string"),
    ("[1, 2]\n", r"data:1: expected a JSON object"),
    ("\n\n", r"no prompts"),
])
def test_bad_lines_name_their_line(text, match):
    with pytest.raises(DataError, match=match):
        parse_jsonl(text)


def test_custom_prompt_field():
    rows = parse_jsonl('{"q": "hi", "answer": 1}\n', prompt_field="q")
    assert rows == [{"prompt": [{"role": "user", "content": "hi"}], "answer": 1}]


def test_order_is_seeded_per_epoch_and_covers_every_prompt():
    a = epoch_order(10, 3, seed=1, shuffle=True)
    assert a == epoch_order(10, 3, seed=1, shuffle=True)
    assert a != epoch_order(10, 3, seed=2, shuffle=True)
    for e in range(3):
        assert sorted(a[e * 10:(e + 1) * 10]) == list(range(10))
    assert a[:10] != a[10:20]
    assert epoch_order(3, 2, seed=0, shuffle=False) == [0, 1, 2, 0, 1, 2]


def test_local_path(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text(jsonl(LINES))
    ds = load_dataset(run_with({"path": str(p), "shuffle": False}))
    assert ds[0]["answer"] == "5" and ds[3]["answer"] == "5"  # second pass, file order
    assert len(ds) % 3 == 0 and len(ds) >= 2 * 3


def test_configmap_mount(tmp_path):
    (tmp_path / "p.jsonl").write_text(jsonl(LINES))
    ds = load_dataset(run_with({"configMap": {"name": "cm", "key": "p.jsonl"}}),
                      env={"ASYNCGRPO_DATA_DIR": str(tmp_path)})
    assert {r["answer"] for r in ds} == {"5", "8"}
    with pytest.raises(DataError, match="not mounted"):
        load_dataset(run_with({"configMap": {"name": "cm", "key": "other.jsonl"}}),
                     env={"ASYNCGRPO_DATA_DIR": str(tmp_path)})


def test_bucket_path_from_real_s3(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.client().create_bucket(Bucket="data-bkt")
    s3_server.client().put_object(Bucket="data-bkt", Key="sets/p.jsonl", Body=jsonl(LINES).encode())
    bucket = Bucket("data-bkt", "x/data-run", s3_client(s3_server.endpoint, "us-east-1"))
    ds = load_dataset(run_with({"bucketPath": "sets/p.jsonl"}), bucket=bucket)
    answers = [r["answer"] for r in ds]
    assert answers.count("8") == 2 * answers.count("5") > 0


def test_runtime_env_parses_and_refuses_bad_values():
    env = RuntimeEnv.from_env({"ASYNCGRPO_VLLM_URL": "http://v:8000/", "RANK": "1",
                               "WORLD_SIZE": "4", "ASYNCGRPO_METRICS_PORT": "9999"})
    assert env.vllm_url == "http://v:8000" and env.topology.rank == 1
    assert env.topology.world_size == 4 and env.metrics_port == 9999
    assert env.adapter_name_prefix == "policy-v"
    with pytest.raises(RuntimeEnvError, match="ASYNCGRPO_VLLM_URL"):
        RuntimeEnv.from_env({}).require_vllm()
    with pytest.raises(RuntimeEnvError, match="must end in '-v'"):
        RuntimeEnv.from_env({"ASYNCGRPO_ADAPTER_NAME_PREFIX": "policy"})
    with pytest.raises(RuntimeEnvError, match="not an integer"):
        RuntimeEnv.from_env({"ASYNCGRPO_METRICS_PORT": "x"})


def test_metrics_endpoint_serves_every_documented_name_and_status():
    m = TrainerMetrics()
    port = m.serve(0, host="127.0.0.1")
    try:
        m.set("step", 3)
        m.set("policy_version", 4)
        m.update_from_logs({"reward": 0.5, "reward_std": 0.1, "batch/packing_ratio": 2.0,
                            "perf/forwarded_tok_s_wall_clock": 100.0, "perf/step_s": 1.5,
                            "sample/dropped_stale_total": 3.0, "sample/staleness_mean": 0.5,
                            "sample/rollout_queue_size": 7.0, "sample/staleness_max": 2.0,
                            "perf/rollout_wait_s": 0.5, "perf/fwd_bwd_s": 0.75,
                            "perf/optimizer_s": 0.25, "perf/weight_sync_s": 0.1})
        m.inc("retries_total", target="s3")
        m.hint("ServedPolicyMatches", False, "LogProbMismatch", "max diff 0.3")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        for name in METRICS:
            assert PREFIX + name.removesuffix("_total") in text, name
        assert f"{PREFIX}raw_tokens_per_second 200.0" in text
        assert f"{PREFIX}dropped_stale_samples_total 3.0" in text
        assert f"{PREFIX}sample_staleness_max_steps 2.0" in text
        # the step split: waiting for rollouts vs training (forward + backward + optimizer)
        assert f"{PREFIX}rollout_wait_seconds_sum 0.5" in text
        assert f"{PREFIX}train_seconds_sum 1.0" in text
        status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status").read())
        assert status["step"] == 3 and status["policy_version"] == 4
        assert status["conditions"][0]["status"] == "False"
        assert status["conditions"][0]["reason"] == "LogProbMismatch"
    finally:
        m.close()


def test_docs_list_every_metric_and_variable():
    import re
    from pathlib import Path

    from asyncgrpo.trainer import runtime_env

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    for name in METRICS:
        assert PREFIX + name in doc, name
    variables = set(re.findall(r"\b(ASYNCGRPO_[A-Z_]+|AWS_[A-Z_]+)\b", runtime_env.__doc__))
    documented = set(re.findall(r"\b(ASYNCGRPO_[A-Z_]+|AWS_[A-Z_]+)\b", doc))
    assert variables - {"AWS_ENDPOINT_URL_S3"} <= documented
    assert documented - {"AWS_ENDPOINT_URL_S3"} <= variables | {"ASYNCGRPO_ADAPTER_ENDPOINT"}


def test_rollouts_move_on_unless_vllm_refused_the_adapter():
    """Found on the test node: vLLM's engine died during the first probe, rollouts stayed on
    `policy-v0` (never published), every request got 404 and the run stalled for good."""
    from asyncgrpo.trainer.grpo import rollouts_move_on

    assert rollouts_move_on(True, 3, False)          # served: move on
    assert rollouts_move_on(False, 0, False)         # nothing served yet: nothing to stay on
    assert rollouts_move_on(False, 3, True)          # vLLM failed (5xx, unreachable)
    assert not rollouts_move_on(False, 3, False)     # refused (corrupt adapter): stay on v3

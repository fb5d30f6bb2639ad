"""The vLLM and trainer images end to end, on a tiny model, against the tests' moto S3 server:

* the vLLM image (its S3 LoRA resolver plugin, as installed by images/vllm/Dockerfile)
  serves `<run>/policy-vN` straight from the bucket, with the adapter really applied (greedy
  tokens equal a local peft forward), and refuses a version whose weights are corrupt;
* the trainer image trains 2 steps against that vLLM container: every adapter it publishes
  reaches vLLM through the resolver (its served-log-prob probe says `served`).

Both containers run as the operator runs them: uid 65532, read-only root, tmpfs where the
pods have emptyDirs.
"""

from __future__ import annotations

import json
import uuid

import pytest
import yaml

from tests.images import containers
from tests.images.containers import Container

pytestmark = [pytest.mark.images, pytest.mark.slow]

TRAINER_TIMEOUT_S = 1500  # a guard against hangs on a busy machine, not a performance bound


def _store(vllm_container, s3_server, run: str):
    from asyncgrpo.adapters.store import AdapterStore

    return AdapterStore(vllm_container.bucket, run=run, endpoint_url=s3_server.endpoint,
                        client=s3_server.client(), attempts=2, backoff_s=0.1)


def _greedy_local(model_dir, adapter_dir, ids: list[int], n: int) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def test_vllm_image_resolves_adapters_from_s3_and_refuses_a_corrupt_one(
        vllm_container, s3_server, tiny_model, tmp_path):
    from asyncgrpo.adapters.tiny import save_random_adapter

    run = f"img-{uuid.uuid4().hex[:8]}"
    store = _store(vllm_container, s3_server, run)
    for v in (1, 2):
        save_random_adapter(tiny_model, tmp_path / f"v{v}", seed=v)
        store.publish(tmp_path / f"v{v}", v, step=v)
    # v2: complete manifest, weights with one flipped byte (same size)
    key = store.version_prefix(2) + "adapter_model.safetensors"
    data = bytearray((tmp_path / "v2" / "adapter_model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    s3_server.client().put_object(Bucket=store.bucket, Key=key, Body=bytes(data))

    ids = [5, 6, 7, 8]
    status, body = vllm_container.completion(f"{run}/policy-v1", ids, max_tokens=8,
                                             temperature=0.0, ignore_eos=True,
                                             return_token_ids=True)
    assert status == 200, body
    assert list(body["choices"][0]["token_ids"]) == _greedy_local(tiny_model, tmp_path / "v1",
                                                                 ids, 8)

    status, body = vllm_container.completion(f"{run}/policy-v2", ids, max_tokens=2)
    assert status == 404, body
    message = body["error"]["message"]
    assert f"{run}/policy-v2" in message
    assert s3_server.endpoint not in message and s3_server.secret_key not in message
    assert "refused: corrupt version" in vllm_container.container.logs()
    # the server is unharmed and still serves v1
    status, _ = vllm_container.completion(f"{run}/policy-v1", ids, max_tokens=2)
    assert status == 200


def _run_file(tmp, vllm_container, s3_server, run: str) -> dict:
    return {
        "apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
        "metadata": {"name": run},
        "spec": {
            "model": {"name": vllm_container.model, "dtype": "float32",
                      "lora": {"rank": 8, "alpha": 16,
                               "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj"]}},
            "trainer": {"numGenerations": 4, "promptsPerStep": 2, "tokenBudgetPerRank": 1024,
                        "maxStaleness": 1, "totalSteps": 2, "checkpointInterval": 2,
                        "learningRate": 1e-3},
            "rollout": {"maxLoraRank": 16, "maxModelLen": 1024,
                        "sampling": {"maxCompletionTokens": 12}},
            "adapterStore": {"bucket": vllm_container.bucket,
                             "endpoint": s3_server.endpoint, "retention": 50},
            "data": {"path": "/etc/asyncgrpo/prompts.jsonl"},
            "reward": {"functions": [{"name": "numeric_match"}]},
        },
    }


def test_trainer_image_trains_two_steps_against_the_vllm_image(
        trainer_image, vllm_container, s3_server, tiny_model, tmp_path):
    run = f"trn-{uuid.uuid4().hex[:8]}"
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {a} + {b}? Answer with a number.", "answer": str(a + b)})
        + "\n" for a in range(1, 6) for b in range(1, 6)))
    (conf / "run.yaml").write_text(yaml.safe_dump(_run_file(tmp_path, vllm_container,
                                                            s3_server, run)))
    containers.readable(conf)
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)  # the trainer (uid 65532) writes status.json here
    env = {
        **s3_server.env(),
        "ASYNCGRPO_VLLM_URL": vllm_container.base_url,
        "ASYNCGRPO_ADAPTER_NAME_PREFIX": f"{run}/policy-v",  # the shared server's naming
        "ASYNCGRPO_WORK_DIR": "/work",
        "ASYNCGRPO_RETRY_BACKOFF_S": "0.2",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }
    opts = ["--read-only", "--user", "65532:65532", "--tmpfs", "/tmp:rw,mode=1777",
            "--shm-size", "256m", "-v", f"{conf}:/etc/asyncgrpo:ro",
            "-v", f"{tiny_model}:/models/tiny:ro", "-v", f"{work}:/work"]
    for k, v in env.items():
        opts += ["-e", f"{k}={v}"]
    # the image's default command: `asyncgrpo trainer --config /etc/asyncgrpo/run.yaml`
    c = Container(trainer_image, [], run_opts=opts, name_hint="trainer")
    try:
        rc = c.wait(TRAINER_TIMEOUT_S)
        assert rc == 0, c.logs()
        status = json.loads((work / "status.json").read_text())
    finally:
        c.stop()
    assert status["step"] == 2, status
    published = status["published"]
    assert [p["version"] for p in published] == list(range(1, len(published) + 1))
    assert len(published) >= 2
    # every version reached the vLLM image through its resolver and was served as trained
    assert all(p["served"] for p in published), published
    last = published[-1]["version"]
    status_code, body = vllm_container.completion(f"{run}/policy-v{last}", [1, 2, 3],
                                                  max_tokens=1)
    assert status_code == 200, body

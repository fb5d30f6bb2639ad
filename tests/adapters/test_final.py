"""The run's result, `<run folder>/final/`: written from the last published version with the
store's own manifest, pulled (from S3, or from a local S3's folder on disk) in a layout peft
(LoRA) and transformers (full) load directly, with the same log-probs as the last version.
Real S3 (moto), the real tiny model, peft and transformers."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.api.invalid_specs import REPO


def _logprobs(model, ids):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()
    return torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(ids[1:])[:, None])


def _peft(base_dir, adapter_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


IDS = [1, 5, 9, 17, 33, 2, 8, 40, 3]


def test_a_lora_final_loads_with_peft_and_matches_the_last_version(store, adapters, tiny_base,
                                                                   tmp_path):
    import torch
    from transformers import AutoTokenizer

    from asyncgrpo.adapters.store import Manifest
    from asyncgrpo.trainer.final import output_record, write_final_lora

    assert write_final_lora(store) is None  # nothing published yet: no result
    store.publish(adapters[1], 1, step=1)
    store.publish(adapters[2], 2, step=2)
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    manifest = write_final_lora(store, tok)
    assert isinstance(manifest, Manifest)  # the adapter manifest format, not a new one
    assert (manifest.version, manifest.step, manifest.extra["kind"]) == (2, 2, "lora")
    assert output_record(store, manifest, "lora") == {
        "bucket": store.bucket, "key": "team/x/default/run-a/final/", "kind": "lora",
        "step": 2, "version": 2}

    dest, pulled = store.fetch_final(tmp_path / "final")
    assert pulled.files == manifest.files and (dest / "adapter_config.json").is_file()
    final = _logprobs(_peft(tiny_base, dest), IDS)
    last = _logprobs(_peft(tiny_base, adapters[2]), IDS)
    assert torch.equal(final, last)
    first = _logprobs(_peft(tiny_base, adapters[1]), IDS)
    assert not torch.equal(final, first)


def test_final_is_rewritten_when_a_resumed_run_finishes_again(store, adapters, s3_server):
    from asyncgrpo.trainer.final import write_final_lora

    store.publish(adapters[1], 1, step=1)
    write_final_lora(store)
    store.client.put_object(Bucket=store.bucket, Key=store.final_prefix + "stale.bin", Body=b"x")
    store.publish(adapters[2], 2, step=7)
    m = write_final_lora(store)
    assert (m.version, m.step) == (2, 7)
    keys = set(store.objects.list(store.final_prefix))
    assert store.final_prefix + "stale.bin" not in keys
    assert store.final_manifest().step == 7


def test_a_full_final_loads_with_transformers_and_matches_the_weights(s3_server, s3_env, bucket,
                                                                       tiny_base, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.trainer.final import write_final_full
    from asyncgrpo.weights.store import WeightsManifest, WeightStore

    ws = WeightStore(bucket, run="full-run", endpoint_url=s3_server.endpoint, attempts=2,
                     backoff_s=0.05)
    trained = AutoModelForCausalLM.from_pretrained(str(tiny_base), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    tensors = {k: v.detach().clone().contiguous() for k, v in trained.state_dict().items()}
    m = write_final_full(ws, tensors, version=6, step=5, base_model=str(tiny_base),
                         tokenizer=AutoTokenizer.from_pretrained(str(tiny_base)))
    assert isinstance(m, WeightsManifest) and m.kind == "anchor" and m.extra["kind"] == "full"
    dest, _ = ws.fetch_final(tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32).eval()
    assert torch.allclose(_logprobs(loaded, IDS), _logprobs(trained, IDS), atol=1e-6)
    AutoTokenizer.from_pretrained(str(dest))  # the tokenizer travels with it


def test_pull_from_a_run_file_over_s3_and_from_a_local_s3_folder(adapters, tiny_base, tmp_path,
                                                                  monkeypatch, capsys):
    """`asyncgrpo pull FILE`: the bucket settings from the run file; a local run's result
    from its S3 folder on disk once its server stopped."""
    from asyncgrpo.adapters.store import AdapterStore
    from asyncgrpo.cli import main
    from asyncgrpo.local.s3 import S3Server
    from asyncgrpo.trainer.final import write_final_lora

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    server = S3Server.start(tmp_path / "s3.log", data_dir=tmp_path / "s3")
    doc = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
    doc["spec"]["adapterStore"]["endpoint"] = server.endpoint
    doc["spec"]["model"]["name"] = str(tiny_base)
    run_file = tmp_path / "run.yaml"
    run_file.write_text(yaml.safe_dump(doc))
    try:
        server.client().create_bucket(Bucket="asyncgrpo-local")
        store = AdapterStore("asyncgrpo-local", run="local-tiny", client=server.client())
        store.publish(adapters[2], 1, step=3)
        write_final_lora(store)
        # the server answers: through S3, with the local server's credentials
        assert main(["pull", str(run_file), "--dest", str(tmp_path / "a")]) == 0
        assert "final lora result of step 3" in capsys.readouterr().out
        assert (tmp_path / "a" / "adapter_model.safetensors").is_file()
    finally:
        server.stop()
    # the server is gone: from its folder on disk, checked against the manifest
    assert main(["pull", str(run_file), "--s3-dir", str(tmp_path / "s3"),
                 "--dest", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "PeftModel.from_pretrained" in out
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["step"] == 3
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "b" / "adapter_model.safetensors").read_bytes()
    # a tampered file is refused
    f = next((tmp_path / "s3").rglob("final/adapter_model.safetensors"))
    f.write_bytes(b"tampered")
    assert main(["pull", str(run_file), "--s3-dir", str(tmp_path / "s3"),
                 "--dest", str(tmp_path / "c")]) == 1
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("message", [('{"step": 4, "policyVersion": 5, "outputs": [{"bucket": '
                                     '"b", "key": "p/ns/r/final/", "kind": "lora", "step": 4}]}')])
def test_status_outputs_come_from_the_trainers_termination_message(message):
    from asyncgrpo.api.v1alpha1 import AsyncGRPORunStatus
    from asyncgrpo.controller import progress
    from asyncgrpo.controller.status import Observation, _observed_fields

    p = progress.from_termination_message(message)
    out = _observed_fields(None, Observation(generation=1, progress=p))
    assert out["outputs"] == [{"bucket": "b", "key": "p/ns/r/final/", "kind": "lora", "step": 4}]
    AsyncGRPORunStatus.model_validate({"outputs": out["outputs"]})  # the CRD's status field

"""Per-rank (sharded) weight publication: two real gloo ranks (torchrun, FSDP2, expert
parallel for the MoE), a real S3 server (moto), the real puller's catch-up.

What must hold: each rank uploads only its own objects, and none the whole model; the
manifest is written by rank 0 only after every rank's object is in the bucket; the puller's
assembled copy equals the full state dict bit for bit at every version (anchors and deltas)
and equals what today's gather-to-rank-0 publisher gives; a missing or corrupt shard gets
the version refused; a manifest naming a shard that is not in the bucket is never written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.testing.net import free_port
from asyncgrpo.weights.puller import Puller, VLLMControl
from asyncgrpo.weights.store import (
    ANCHOR,
    DELTA,
    WEIGHTS_FORMAT_SHARDED,
    WeightsCorrupt,
    WeightsIncomplete,
    WeightsManifest,
    WeightStore,
)

WORKER = Path(__file__).with_name("shard_worker.py")
VERSIONS = 5  # anchor every 3: A D D A D
KINDS = ("dense", "moe")


@pytest.fixture(scope="module")
def published(tmp_path_factory, s3_server):
    """Both models published by both paths, two ranks; the worker's records."""
    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    out = tmp_path_factory.mktemp("sharded")
    bucket = "sharded-weights"
    s3_server.client().create_bucket(Bucket=bucket)
    for kind in KINDS:
        save_tiny_checkpoint(out / f"tiny-{kind}", kind=kind, seed=0)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), str(WORKER),
         str(out), s3_server.endpoint, bucket, *KINDS],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, **s3_server.env(), "SHARD_VERSIONS": str(VERSIONS)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    return out, bucket, ranks


def _store(s3_server, bucket, run):
    return WeightStore(bucket, run=run, endpoint_url=s3_server.endpoint, attempts=2,
                       backoff_s=0.05)


def _puller(store, tmp_path, name):
    return Puller(store, VLLMControl("http://127.0.0.1:9"), tmp_path / name)  # no swap here


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_uploads_only_its_own_shard(published, s3_server, s3_env, kind):
    _out, bucket, ranks = published
    store = _store(s3_server, bucket, f"sharded-{kind}")
    assert store.versions() == list(range(1, VERSIONS + 1))
    listing = store.objects.list(store.root)
    for v in store.versions():
        m = store.manifest(v)
        assert m.format == WEIGHTS_FORMAT_SHARDED and m.shards["world"] == 2
        assert m.kind == (ANCHOR if v in (1, 4) else DELTA), v
        prefix = store.version_prefix(v)
        for r in (0, 1):
            mine = {p["key"]: p["bytes"] for p in ranks[r]["puts"] if p["key"].startswith(prefix)}
            files = {prefix + f for f in m.shards["ranks"].get(str(r), [])}
            # rank r put exactly its own files (rank 0 also the manifest), with their sizes
            assert set(mine) - {prefix + "manifest.json"} == files, (v, r)
            assert ("manifest.json" in {k[len(prefix):] for k in mine}) == (r == 0)
            for key in files:
                assert mine[key] == listing[key] == m.files[key[len(prefix):]].size
        if m.kind == ANCHOR:  # both ranks own part of the model, neither all of it
            per = m.rank_bytes()
            assert set(per) == {0, 1} and sum(per.values()) == m.total_bytes
            assert max(per.values()) < 0.75 * m.total_bytes, per
            gathered = _store(s3_server, bucket, f"gathered-{kind}").manifest(v)
            # same tensors, same bytes of payload: nothing uploaded twice
            assert abs(m.total_bytes - gathered.total_bytes) < 0.05 * gathered.total_bytes
        # the manifest went up after the last byte of every rank's objects of the version
        shard_end = max(p["end"] for rk in ranks for p in rk["puts"]
                        if p["key"].startswith(prefix) and not p["key"].endswith("manifest.json"))
        manifest_put = next(p for p in ranks[0]["puts"] if p["key"] == prefix + "manifest.json")
        assert manifest_put["start"] >= shard_end
    # records: every rank published every version, each its own bytes
    for r in (0, 1):
        recs = ranks[r]["records"][kind]["sharded"]
        assert [x["version"] for x in recs] == list(range(1, VERSIONS + 1))
        assert all(x["rank"] == r for x in recs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_assembled_weights_equal_the_full_state_at_every_version(published, s3_server, s3_env, tmp_path,
                                                                 kind):
    out, bucket, _ranks = published
    store = _store(s3_server, bucket, f"sharded-{kind}")
    follower = _puller(store, tmp_path, "follow")
    gathered = _puller(_store(s3_server, bucket, f"gathered-{kind}"), tmp_path, "gathered")
    for v in range(1, VERSIONS + 1):
        follower._catch_up(v)  # anchor, then the deltas one by one
        gathered._catch_up(v)
        assert follower.local_version == v and not follower.refused
        got = load_file(follower.current / "model.safetensors")
        want = load_file(out / f"expected-{kind}-v{v}.safetensors")
        assert _equal(got, want), v
        assert _equal(got, load_file(gathered.current / "model.safetensors")), v
    if kind == "moe":
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in got  # per-expert, global index
    # a fresh replica: newest anchor (v4) and its delta
    fresh = _puller(store, tmp_path, "fresh")
    fresh._catch_up(VERSIONS)
    assert fresh.local_version == VERSIONS
    assert _equal(load_file(fresh.current / "model.safetensors"),
                  load_file(out / f"expected-{kind}-v{VERSIONS}.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_final_of_a_sharded_run_is_the_last_version_rebuilt_from_the_bucket(published, s3_server,
                                                                           s3_env, tmp_path, kind):
    """No rank holds the whole model, so final/ is rebuilt on disk from the bucket (the
    puller's assembly): it must be the last version bit for bit and load with transformers."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.trainer.final import write_final_full_from_bucket

    out, bucket, _ranks = published
    store = _store(s3_server, bucket, f"sharded-{kind}")
    manifest = write_final_full_from_bucket(store, version=VERSIONS, step=VERSIONS,
                                            base_model=str(out / f"tiny-{kind}"))
    assert manifest.extra["final"] and manifest.version == VERSIONS
    final_dir, _m = store.fetch_final(tmp_path / "final")
    want = load_file(out / f"expected-{kind}-v{VERSIONS}.safetensors")
    assert _equal(load_file(final_dir / "model.safetensors"), want)
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    state = model.state_dict()
    some = next(k for k in want if k in state)
    assert torch.equal(state[some].to(want[some].dtype), want[some])


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_serves_the_assembled_sharded_version(published, s3_server, s3_env, tmp_path):
    """The real puller swaps a sharded version (anchor v4 + delta v5 of two ranks) into a real
    vLLM CPU server, which then serves transformers' log-probs of the full state. Runs before
    the corruption test below, which breaks this run's v4 and v5."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.adapters.probe import (
        probe_token_ids,
        served_prompt_logprobs,
        trained_prompt_logprobs,
    )
    from asyncgrpo.local.vllm import vllm_python, vllm_venv
    from tests.weights.test_puller_vllm import start_full_ft_vllm

    if vllm_python() is None:
        pytest.skip(f"vLLM venv missing at {vllm_venv()}")
    out, bucket, _ranks = published
    store = _store(s3_server, bucket, "sharded-dense")
    ckpt = out / "tiny-dense"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.load_state_dict(load_file(out / f"expected-dense-v{VERSIONS}.safetensors"), strict=True)
    ids = probe_token_ids(AutoTokenizer.from_pretrained(ckpt))
    trained = trained_prompt_logprobs(model.eval(), ids)
    server = start_full_ft_vllm(ckpt, tmp_path / "vllm.log")
    try:
        puller = Puller(store, VLLMControl(server.base_url), tmp_path / "pod", poll_s=0.1)
        assert puller.round()
        st = puller.status()
        assert st["ready"] and st["served_version"] == VERSIONS and not st["refused"], st
        served = served_prompt_logprobs(server.base_url, VLLMControl(server.base_url).served_model(),
                                        ids)
        assert max(abs(a - b) for a, b in zip(served, trained)) <= 1e-5
    finally:
        server.stop()


@pytest.mark.slow
def test_a_corrupt_or_missing_shard_gets_the_version_refused(published, s3_server, s3_env, tmp_path):
    out, bucket, _ranks = published
    store = _store(s3_server, bucket, "sharded-dense")
    p = _puller(store, tmp_path, "pod")
    p._catch_up(4)
    # rank 1's delta of v5 corrupted in the bucket: v5 refused, v4 kept
    m5 = store.manifest(5)
    r1 = m5.shards["ranks"]["1"][0]
    store.client.put_object(Bucket=bucket, Key=store.version_prefix(5) + r1, Body=b"corrupted")
    p._catch_up(5)
    assert 5 in p.refused and p.local_version == 4
    assert _equal(load_file(p.current / "model.safetensors"),
                  load_file(out / "expected-dense-v4.safetensors"))
    # rank 1's part of the anchor v4 gone: a fresh replica refuses v4 (and v5 builds on it)
    # and takes the newest version it can still build: v3, from anchor v1
    a4 = store.manifest(4).shards["ranks"]["1"][0]
    store.client.delete_object(Bucket=bucket, Key=store.version_prefix(4) + a4)
    fresh = _puller(store, tmp_path, "fresh")
    fresh._catch_up(5)
    assert 4 in fresh.refused and fresh.local_version == 3
    assert _equal(load_file(fresh.current / "model.safetensors"),
                  load_file(out / "expected-dense-v3.safetensors"))


@pytest.mark.slow
def test_a_manifest_whose_pieces_do_not_tile_a_tensor_is_corrupt(published, s3_server, s3_env):
    _out, bucket, _ranks = published
    doc = json.loads(_store(s3_server, bucket, "sharded-moe").manifest(1).to_json())
    name = next(n for n, t in doc["shards"]["tensors"].items() if len(t["pieces"]) == 2)
    doc["shards"]["tensors"][name]["pieces"].pop()  # one rank's half of a tensor missing
    with pytest.raises(WeightsCorrupt, match="cover"):
        WeightsManifest.from_json(json.dumps(doc))
    doc = json.loads(_store(s3_server, bucket, "sharded-moe").manifest(1).to_json())
    doc["format"] = "asyncgrpo.weights/v3"  # a newer format: refused by name, not misread
    with pytest.raises(WeightsCorrupt, match="asyncgrpo.weights/v3"):
        WeightsManifest.from_json(json.dumps(doc))


def test_no_manifest_until_every_listed_shard_is_in_the_bucket(store, tmp_path):
    """Rank 0 checks the listing: a rank whose object did not land leaves no manifest."""
    from safetensors.torch import save_file

    from asyncgrpo.adapters.store import FileEntry, sha256_file
    from asyncgrpo.weights.shards import anchor_name, table_entry

    t = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    files, tensors = {}, {"w": {"dtype": "F32", "shape": [4, 2], "pieces": []}}
    for r in (0, 1):
        d = tmp_path / f"r{r}"
        d.mkdir()
        save_file({"w": t[2 * r:2 * r + 2].contiguous()}, str(d / anchor_name(r, 2)))
        e = table_entry("float32", (4, 2), anchor_name(r, 2), (2 * r, 0), (2, 2))
        tensors["w"]["pieces"] += e["pieces"]
        if r == 0:  # only rank 0's object is uploaded
            files.update(store.upload_rank_files(d, 1))
        else:
            p = d / anchor_name(r, 2)
            files[anchor_name(r, 2)] = FileEntry(sha256_file(p), p.stat().st_size)
    shards = {"world": 2, "ranks": {"0": [anchor_name(0, 2)], "1": [anchor_name(1, 2)]},
              "tensors": tensors}
    with pytest.raises(WeightsIncomplete, match="no manifest"):
        store.publish_sharded_manifest(1, kind=ANCHOR, step=1, dtype="float32", files=files,
                                       shards=shards)
    assert store.versions() == []
    store.upload_rank_files(tmp_path / "r1", 1)  # once it lands, the version can be completed
    store.publish_sharded_manifest(1, kind=ANCHOR, step=1, dtype="float32", files=files,
                                   shards=shards)
    p = _puller(store, tmp_path, "pod")
    p._catch_up(1)
    assert torch.equal(load_file(p.current / "model.safetensors")["w"], t)


def _publish_world(store, tmp_path, world: int, t):
    """``t`` published as a sharded anchor (v1) by ``world`` ranks, rows split evenly."""
    from safetensors.torch import save_file

    from asyncgrpo.weights.shards import anchor_name, table_entry

    rows = t.shape[0] // world
    files, tensors = {}, {"w": {"dtype": "F32", "shape": list(t.shape), "pieces": []}}
    for r in range(world):
        d = tmp_path / f"w{world}-r{r}"
        d.mkdir()
        save_file({"w": t[rows * r:rows * (r + 1)].contiguous()}, str(d / anchor_name(r, world)))
        e = table_entry("float32", tuple(t.shape), anchor_name(r, world), (rows * r, 0),
                        (rows, t.shape[1]))
        tensors["w"]["pieces"] += e["pieces"]
        files.update(store.upload_rank_files(d, 1))
    shards = {"world": world, "ranks": {str(r): [anchor_name(r, world)] for r in range(world)},
              "tensors": tensors}
    store.publish_sharded_manifest(1, kind=ANCHOR, step=1, dtype="float32", files=files,
                                   shards=shards)


def test_the_puller_downloads_the_rank_files_of_a_version_concurrently(store, tmp_path):
    """Every rank file of a version in flight at once (up to download_concurrency): each GET
    waits at a barrier for all the others, so files fetched one after another never pass it
    (the barrier's timeout only bounds how long a broken puller holds the test)."""
    import threading

    world = 4
    t = torch.arange(world * 6, dtype=torch.float32).reshape(world * 3, 2)
    _publish_world(store, tmp_path, world, t)
    barrier = threading.Barrier(world, timeout=60)
    get = store.objects.get_or_none
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def get_at_barrier(key):
        if not key.endswith(".safetensors"):
            return get(key)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        barrier.wait()  # BrokenBarrierError when the files come one at a time
        try:
            return get(key)
        finally:
            with lock:
                in_flight[0] -= 1

    store.objects.get_or_none = get_at_barrier
    p = _puller(store, tmp_path, "pod")
    p._catch_up(1)
    assert p.local_version == 1 and most[0] == world
    assert torch.equal(load_file(p.current / "model.safetensors")["w"], t)


def test_a_corrupt_rank_file_among_concurrent_downloads_refuses_the_version(store, tmp_path):
    """One bad file of several fetched at once: the version is refused as a whole and leaves
    nothing behind, as when the files came one by one."""
    from asyncgrpo.weights.shards import anchor_name

    world = 4
    t = torch.arange(world * 6, dtype=torch.float32).reshape(world * 3, 2)
    _publish_world(store, tmp_path, world, t)
    store.client.put_object(Bucket=store.bucket, Key=store.version_prefix(1)
                            + anchor_name(2, world), Body=b"corrupted")
    with pytest.raises(WeightsCorrupt, match="shard-00002"):
        store.fetch(1, tmp_path / "got")
    assert not (tmp_path / "got").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".got")] == []

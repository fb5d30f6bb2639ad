"""WeightStore and the trainer's BucketWeightTransfer against a real S3 server (moto)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.weights.format import apply_delta, write_anchor
from asyncgrpo.weights.store import (
    ANCHOR,
    DELTA,
    WeightsCorrupt,
    WeightsIncomplete,
    WeightsManifest,
    WeightsNotFound,
    WeightsVersionExists,
)


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.ones(8)}


def _step(state, k):
    """A sparse update, as an optimizer step in bf16 would make."""
    out = {n: t.clone() for n, t in state.items()}
    out["model.layers.0.mlp.up_proj.weight"][k % 16, :3] += 0.5
    return out


def _publish(store, version, state, tmp_path, kind=ANCHOR):
    write_anchor(state, tmp_path / f"v{version}")
    return store.publish_version(tmp_path / f"v{version}", version, kind=kind, step=version,
                                 dtype="float32")


class Recording:
    def __init__(self, client):
        self._c, self.calls = client, []

    def __getattr__(self, name):
        fn = getattr(self._c, name)

        def call(*a, **kw):
            self.calls.append((name, kw.get("Key") or (a[2] if name == "upload_file" else "")))
            return fn(*a, **kw)

        return call


def test_weights_live_beside_the_adapters_of_the_same_run(store):
    from asyncgrpo.adapters.store import AdapterStore

    adapters = AdapterStore(store.bucket, run=store.run, prefix=store.prefix, client=store.client)
    assert store.root == adapters.root.removesuffix("adapters/") + "weights/"
    assert store.root == "team/x/default/run-w/weights/"  # <prefix>/<namespace>/<run>/


def test_manifest_is_written_last_and_versions_are_immutable(store, tmp_path):
    store.client = Recording(store.client)
    m = _publish(store, 1, _model(), tmp_path)
    puts = [k for op, k in store.client.calls if op in ("put_object", "upload_file")]
    assert puts[-1].endswith("v1/manifest.json") and len(puts) == 2
    assert m.kind == ANCHOR and m.anchor == 1 and m.base is None
    with pytest.raises(WeightsVersionExists):
        _publish(store, 1, _model(), tmp_path)


def test_partial_and_missing_versions_are_not_served(store, tmp_path):
    store.client.put_object(Bucket=store.bucket, Key=store.version_prefix(3) + "model.safetensors",
                            Body=b"half")
    assert store.versions() == []
    with pytest.raises(WeightsIncomplete):
        store.manifest(3)
    with pytest.raises(WeightsNotFound):
        store.manifest(4)


def test_corrupt_file_is_refused_and_leaves_no_directory(store, tmp_path):
    _publish(store, 1, _model(), tmp_path)
    store.client.put_object(Bucket=store.bucket, Key=store.version_prefix(1) + "model.safetensors",
                            Body=b"corrupted")
    with pytest.raises(WeightsCorrupt):
        store.fetch(1, tmp_path / "got")
    assert not (tmp_path / "got").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".got")] == []


def test_fault_injection_overwrites_through_the_store_and_is_refused(store, tmp_path):
    """The trainer's fault injection (`VersionedStore.overwrite`) goes through the storage
    layer; the copy it leaves is refused with the weights' own error, which is storage's
    VersionCorrupt and not the adapters' (siblings, neither built on the other)."""
    from asyncgrpo.adapters.store import AdapterCorrupt
    from asyncgrpo.storage.versions import VersionCorrupt

    _publish(store, 1, _model(), tmp_path)
    key = store.overwrite(1, "model.safetensors", b"corrupted")
    assert key == store.version_prefix(1) + "model.safetensors"
    with pytest.raises(WeightsCorrupt) as e:
        store.fetch(1, tmp_path / "got")
    assert isinstance(e.value, VersionCorrupt) and not isinstance(e.value, AdapterCorrupt)
    assert not (tmp_path / "got").exists()


@pytest.mark.parametrize("doc", [
    {"kind": "delta", "base": None, "anchor": 1},
    {"kind": "delta", "base": 5, "anchor": 1},   # base not before the version
    {"kind": "anchor", "base": 1, "anchor": 2},
    {"kind": "other", "base": None, "anchor": 2},
    {"kind": "anchor", "base": None, "anchor": 2, "files": {"../x": {"sha256": "0" * 64, "size": 1}}},
])
def test_bad_manifests_are_corrupt(doc):
    base = {"format": "asyncgrpo.weights/v1", "run": "r", "version": 2, "step": 2,
            "dtype": "float32", "files": {"delta.safetensors": {"sha256": "0" * 64, "size": 1}}}
    with pytest.raises(WeightsCorrupt):
        WeightsManifest.from_json(json.dumps({**base, **doc}))


def test_publisher_anchors_every_k_and_deltas_rebuild_each_version(store, tmp_path):
    """What a replica does, by hand: newest anchor, then each delta; every version equal."""
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=3, retention=50)
    pub.init_weight_transfer()
    states = [_model()]
    for k in range(7):
        pub.send_weights(iter(states[-1].items()))
        states.append(_step(states[-1], k))
    kinds = {v: store.manifest(v).kind for v in store.versions()}
    assert kinds == {1: ANCHOR, 2: DELTA, 3: DELTA, 4: ANCHOR, 5: DELTA, 6: DELTA, 7: ANCHOR}
    assert store.manifest(3).base == 2 and store.manifest(3).anchor == 1
    # a delta carries only the changed elements: 3 of 32*8+16*8+8
    assert store.manifest(2).extra["changed_elements"] == 3
    assert store.manifest(2).total_bytes < store.manifest(1).total_bytes / 3
    local = tmp_path / "replica"
    store.fetch(1, local)
    for v in range(2, 4):
        store.fetch(v, tmp_path / f"d{v}")
        apply_delta(local, tmp_path / f"d{v}" / "delta.safetensors")
        got = load_file(local / "model.safetensors")
        assert all(torch.equal(got[n], states[v - 1][n]) for n in got), v
    # a process that restarts continues the numbering and starts with an anchor
    again = BucketWeightTransfer(store, tmp_path / "stage2", anchor_interval=3)
    again.init_weight_transfer()
    again.send_weights(iter(states[-1].items()))
    assert store.manifest(8).kind == ANCHOR


def test_plan_follows_the_chain_or_restarts_from_the_newest_anchor(store, tmp_path):
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=3, retention=50)
    pub.init_weight_transfer()
    state = _model()
    for k in range(6):
        pub.send_weights(iter(state.items()))
        state = _step(state, k)
    assert [m.version for m in store.plan(2, 3)] == [3]
    assert [m.version for m in store.plan(2, 6)] == [4, 5, 6]  # v4 is an anchor
    assert [m.version for m in store.plan(None, 6)] == [4, 5, 6]
    assert [m.version for m in store.plan(4, 6)] == [5, 6]
    assert [m.version for m in store.plan(None, 3)] == [1, 2, 3]
    assert store.plan(6, 6) == []


def test_retention_never_drops_the_anchor_kept_versions_build_on(store, tmp_path):
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=4, retention=2)
    pub.init_weight_transfer()
    state = _model()
    seen = []
    for k in range(10):
        pub.send_weights(iter(state.items()))
        state = _step(state, k)
        vs = store.versions()
        seen.append(vs)
        # whatever is kept, the newest version can be rebuilt from what is kept
        assert store.plan(None, vs[-1])[0].version in vs
    # anchors at 1, 5, 9: retention 2 at v10 keeps 9,10; at v8 it had to keep 5..8
    assert seen[7] == [5, 6, 7, 8]
    assert seen[9] == [9, 10]
    # a partial version older than the floor (a dead publisher's) goes too
    store.client.put_object(Bucket=store.bucket, Key=store.version_prefix(3) + "x", Body=b"x")
    store.prune(2)
    assert store.versions_in.scan()[1] == {9, 10}


def test_moe_anchor_uses_the_checkpoint_names_and_layout(store, tmp_path):
    """transformers 5 fuses a MoE's experts in memory; the anchor must be what save_pretrained
    writes (per-expert names), which is what vLLM loads."""
    from transformers.core_model_loading import revert_weight_conversion

    from asyncgrpo.trainer.tiny import tiny_model

    model = tiny_model("moe", seed=1)
    model.save_pretrained(tmp_path / "hf")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    pub = BucketWeightTransfer(store, tmp_path / "stage",
                               to_checkpoint=lambda sd: revert_weight_conversion(model, sd))
    pub.init_weight_transfer()
    pub.send_weights(model.named_parameters())
    store.fetch(1, tmp_path / "got")
    got = load_file(tmp_path / "got" / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in got
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # and deltas are keyed the same way
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[2, 70, 5] += 1  # expert 2, up half
    pub.send_weights(model.named_parameters())
    assert store.manifest(2).extra["changed_elements"] == 1
    store.fetch(2, tmp_path / "d2")
    apply_delta(tmp_path / "got", tmp_path / "d2" / "delta.safetensors")
    assert load_file(tmp_path / "got" / "model.safetensors")[
        "model.layers.0.mlp.experts.2.up_proj.weight"][70 - 64, 5] == want[
        "model.layers.0.mlp.experts.2.up_proj.weight"][70 - 64, 5] + 1


def test_a_delta_larger_than_the_weights_is_published_as_an_anchor(store, tmp_path):
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=100)
    pub.init_weight_transfer()
    state = _model()
    pub.send_weights(iter(state.items()))
    pub.send_weights(iter(_step(state, 0).items()))  # a few elements: a delta
    dense = {n: t + 1 for n, t in state.items()}  # every element: 3x the bytes as a delta
    pub.send_weights(iter(dense.items()))
    assert [store.manifest(v).kind for v in (1, 2, 3)] == [ANCHOR, DELTA, ANCHOR]

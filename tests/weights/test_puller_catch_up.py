"""The puller's catch-up against a real S3 server: chains, refusals, a copy killed mid-apply.

Only the bucket and the local copy are involved here (no swap); the swap into a real vLLM is
tests/weights/test_puller_vllm.py.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from asyncgrpo.trainer.weights import BucketWeightTransfer
from asyncgrpo.weights.puller import STATE, Puller, VLLMControl
from tests.weights.test_store import _model, _step


def _publish_run(store, tmp_path, n, anchor_every, corrupt=()):
    pub = BucketWeightTransfer(store, tmp_path / "stage", anchor_interval=anchor_every,
                               retention=100, fault_corrupt_versions=corrupt)
    pub.init_weight_transfer()
    states = {}
    state = _model()
    for v in range(1, n + 1):
        pub.send_weights(iter(state.items()))
        states[v] = {k: t.clone() for k, t in state.items()}
        state = _step(state, v)
    return states


def _local(puller):
    return load_file(puller.current / "model.safetensors")


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _puller(store, tmp_path, name="pod"):
    # nothing listens there: catch-up never talks to vLLM
    return Puller(store, VLLMControl("http://127.0.0.1:9"), tmp_path / name)


def test_catch_up_follows_deltas_then_takes_the_newest_good_version(store, tmp_path):
    states = _publish_run(store, tmp_path, 4, anchor_every=3, corrupt={4})
    p = _puller(store, tmp_path)
    p._catch_up(2)
    assert p.local_version == 2 and _equal(_local(p), states[2])
    # v4 (anchor) is corrupt: refused; v3 is reached by a delta from the local v2
    p._catch_up(4)
    assert "corrupt" not in p.refused.get(3, "") and 4 in p.refused
    assert p.local_version == 3 and _equal(_local(p), states[3])


def test_a_refused_delta_is_skipped_for_an_older_good_version(store, tmp_path):
    states = _publish_run(store, tmp_path, 5, anchor_every=10, corrupt={4})
    p = _puller(store, tmp_path)
    p._catch_up(5)  # 5 builds on the corrupt 4: the newest reachable version is 3
    assert set(p.refused) == {4} and p.local_version == 3
    assert _equal(_local(p), states[3])
    assert p._catch_up(5) is None and p.local_version == 3  # no retry of an immutable refusal


def test_a_copy_killed_mid_apply_starts_again_from_an_anchor(store, tmp_path):
    states = _publish_run(store, tmp_path, 3, anchor_every=10)
    p = _puller(store, tmp_path)
    p._catch_up(2)
    (p.current / STATE).write_text(json.dumps({"version": None, "applying": 3}))
    again = _puller(store, tmp_path)  # the restarted container, same emptyDir
    assert again.local_version is None
    again._catch_up(3)
    assert again.local_version == 3 and _equal(_local(again), states[3])


def test_status_says_swapping_between_pause_and_resume(store, tmp_path):
    """The trainer's router reads `swapping` to give a replica mid-swap no new group."""
    seen = []

    class Recording(VLLMControl):
        def swap(self, weights_dir, version):  # where /pause .. /resume happen
            seen.append(puller.status()["swapping"])

        def served_model(self):
            return "m"

    puller = Puller(store, Recording("http://127.0.0.1:9"), tmp_path / "pod", probe=False)
    assert puller.status()["swapping"] is None
    assert puller._swap(3, None)
    assert seen == [3] and puller.status()["swapping"] is None
    assert puller.status()["served_version"] == 3

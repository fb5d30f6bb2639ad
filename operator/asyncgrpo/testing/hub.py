"""A Hugging Face hub cache for pods of the test cluster, which has no network: the named
models laid out as `huggingface_hub` caches them (`models--org--name/refs/main`,
`snapshots/<rev>/...`), each the tiny Qwen3 tokenizer (TRL's Qwen3 chat template) and a
tiny config. The job kubelet (asyncgrpo.testing.jobs) gives it to the preflight Job's pod
as HF_HUB_CACHE with HF_HUB_OFFLINE=1, as a pod of a cluster whose model cache (or the hub)
holds the run's model: the example runs name hub models (Qwen/Qwen3-1.7B, ...), and the
preflight loads their tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

#: The hub models the example runs the operator tests start from name.
EXAMPLE_MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B",
                  "Qwen/Qwen3-30B-A3B")
REVISION = "0" * 40


def seed_hub_cache(folder: str | Path, models=EXAMPLE_MODELS) -> Path:
    """Write (or keep) `models` into the hub cache `folder`; returns it."""
    from asyncgrpo.trainer.tiny import DENSE
    from asyncgrpo.trainer.tiny_tokenizer import tiny_tokenizer

    folder = Path(folder)
    tokenizer = None
    for name in models:
        repo = folder / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / REVISION
        if (snapshot / "config.json").is_file():
            continue
        tokenizer = tokenizer or tiny_tokenizer()
        snapshot.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(snapshot)
        (snapshot / "config.json").write_text(json.dumps(
            {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **DENSE}))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
    return folder

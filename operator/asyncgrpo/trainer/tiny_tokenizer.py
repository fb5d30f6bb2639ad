"""A tiny byte-level BPE tokenizer trained here, and a whole tiny checkpoint for vLLM.

No tokenizer can be downloaded where this project is tested, yet vLLM, TRL's rollout worker
and the trainer all need a real one: vLLM loads it from the model directory, TRL's worker
recognises chat templates by exact text (it patches only templates it knows), and message-level
tokenization must round-trip. So a byte-level BPE (every string encodes, nothing maps to
<unk>) is trained on a small built-in corpus, deterministic, with the Qwen3 special tokens and
TRL's own `qwen3.jinja` template, and its vocabulary fits the tiny models' 512 embeddings.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from asyncgrpo.trainer.tiny import DENSE, save_tiny_model

#: The tiny models' embedding rows; every token id must stay below this.
VOCAB_SIZE = DENSE["vocab_size"]

#: Qwen3's control tokens (special: skipped when decoding with skip_special_tokens).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Qwen3's structural tokens, which Qwen keeps visible in decoded text (tool calls are parsed
#: from it), so they are added tokens but not special ones.
STRUCTURE_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

#: vLLM's CPU attention supports head sizes 32, 64, 80, ... but not tiny.py's 16, so the
#: checkpoints vLLM serves use 32 (4 query heads x 32 = 128 > hidden 64 is fine for Qwen3,
#: whose head_dim is explicit). Train on the same checkpoint directory vLLM serves.
VLLM_HEAD_DIM = 32

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

#: Enough varied text for merges of common English, digits, arithmetic, JSON and code; the
#: exact content only shapes which merges exist, never correctness (byte fallback is total).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "What is 7 * 8? The answer is 56.",
    "Compute 100 - 58 and give the answer as a number.",
    "Please think step by step, then give the final answer.",
    "The answer is",
    "Hello! How can I help you today?",
    "You are a helpful assistant.",
    "Write a function that returns the sum of a list of numbers.",
    "def add(a, b):\n    return a + b\n",
    "def solve(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
    "import math\nprint(math.sqrt(16))\n",
    '{"name": "python", "arguments": {"code": "print(1 + 1)"}}',
    '{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}',
    "The tests pass. All 3 tests passed in 0.01 seconds.",
    "Error: the test failed with an assertion error on line 7.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "one two three four five six seven eight nine ten",
    "Reverse the string hello: olleh. Count the letters: 5.",
    "Is 17 a prime number? Yes, 17 is prime.",
    "Sort the numbers 5, 3, 9, 1 in ascending order: 1, 3, 5, 9.",
    "user assistant system tool function call response result",
    "A policy is trained with reinforcement learning from rewards.",
    "Each group of completions is scored and normalized.",
]

_BPE_VOCAB = VOCAB_SIZE - len(SPECIAL_TOKENS) - len(STRUCTURE_TOKENS)


def qwen3_chat_template() -> str:
    """TRL's own Qwen3 template text, read from the installed trl without importing it.

    TRL's rollout worker compares templates by exact text, so this must be its file, not a
    copy that could drift from the pinned trl.
    """
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("trl is not installed; the tiny tokenizer uses trl's qwen3.jinja template")
    for root in spec.submodule_search_locations:
        path = Path(root) / "chat_templates" / "qwen3.jinja"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise RuntimeError("the installed trl has no chat_templates/qwen3.jinja")


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer():
    """A PreTrainedTokenizerFast with Qwen3's special tokens and TRL's Qwen3 chat template."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in STRUCTURE_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=DENSE["max_position_embeddings"],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = qwen3_chat_template()
    if len(tokenizer) > VOCAB_SIZE:  # would index past the embedding table
        raise AssertionError(f"tiny tokenizer has {len(tokenizer)} tokens > {VOCAB_SIZE}")
    return tokenizer


def save_tiny_checkpoint(path: str | Path, kind: str = "dense", seed: int = 0, **overrides) -> Path:
    """Write a tiny random model and its tokenizer as one directory vLLM can serve.

    The model's config and generation config name the tokenizer's EOS and pad ids, so vLLM and
    `generate` stop at `<|im_end|>` like a real Qwen3 chat model. ``head_dim`` defaults to
    :data:`VLLM_HEAD_DIM` (vLLM's CPU attention rejects 16); the trainer must load this same
    directory (``from_pretrained(path)``), not ``tiny_model()``, to train the served model.
    """
    from transformers import GenerationConfig

    path = Path(path)
    tokenizer = tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    overrides = {"eos_token_id": eos_id, "pad_token_id": pad_id, "bos_token_id": None,
                 "head_dim": VLLM_HEAD_DIM, **overrides}
    save_tiny_model(path, kind=kind, seed=seed, **overrides)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

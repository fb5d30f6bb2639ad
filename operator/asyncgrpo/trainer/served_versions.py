"""Which weights generated each rollout, as vLLM reports it (full fine-tuning).

Why: with full fine-tuning every replica swaps to version N on its own, some seconds after
the trainer publishes it (its puller downloads, verifies and swaps), refuses a corrupt version
outright, and may swap in the middle of a rollout. TRL tags a rollout with the trainer's
version when its group started, which is the version the trainer *published*, not the one
that sampled the tokens: staleness was assumed, and a corrupt version no replica ever served
was still the tag. (With LoRA the tag is exact: each request names its adapter version.)

vLLM 0.32 reports which weight version sampled which output tokens (`weight_versions`: spans
labelled by `/update_weight_version`, which the puller sets at each swap), but only on its
token-in/token-out route `/inference/v1/generate` (served with `--enable-scale-out`), not on
`/v1/completions`, which TRL's rollout loop uses. `ServedVersionRolloutLoop` sends each turn to
that route, with the same token ids and sampling parameters as TRL's `/v1/completions`
payload, and tags every training row of a rollout with the **oldest** version that sampled any
of its tokens. TRL's staleness (`trainer version - sample version`, which drops samples over
`maxStaleness`) is then measured, and an upper bound for every token of the sample.
"""

from __future__ import annotations

import random
from contextvars import ContextVar

from asyncgrpo.trainer.rollout_gate import GatedRolloutLoop

#: vLLM's token-in/token-out route; the only one that reports weight versions per completion.
GENERATE_PATH = "/inference/v1/generate"
#: vLLM's label for weights no `/update_weight_version` has named: the base model, version 0.
BASE_LABEL = "default"

# The versions one rollout's turns were sampled with. A context variable because TRL runs each
# rollout as its own asyncio task (`_generate_one`), and the turns are awaited inside it.
_rollout_versions: ContextVar[list[int] | None] = ContextVar("asyncgrpo_rollout_versions",
                                                             default=None)


class UnknownWeightVersion(ValueError):
    pass


def version_of(label: str) -> int:
    """A vLLM weight-version label as a policy version (the puller labels with the number)."""
    if label == BASE_LABEL:
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        raise UnknownWeightVersion(
            f"vLLM reports weight version {label!r}: asyncgrpo's puller labels each version with "
            f"its number, so something else has swapped weights on this server") from None


def span_versions(spans: list[dict] | None, tokens: int) -> list[int]:
    """The versions of a choice's `weight_versions` spans that sampled at least one token."""
    if spans is None:
        if tokens:
            raise UnknownWeightVersion(
                f"vLLM returned {tokens} tokens without weight versions: it is not the vLLM "
                f"(>= 0.32, --enable-scale-out) full fine-tuning needs")
        return []
    return [version_of(s["version"]) for s in spans if s["end"] > s["start"]]


def sampling_params(loop) -> dict:
    """TRL 1.16's `/v1/completions` sampling fields (`_generate_one_turn`), as vLLM's
    `SamplingParams`. Unset (None) fields are left to vLLM's defaults."""
    params = {
        "max_tokens": loop.max_tokens,
        "temperature": loop.temperature,
        "top_p": loop.top_p,
        "top_k": loop.top_k,
        "repetition_penalty": loop.repetition_penalty,
        "min_p": loop.min_p,
        "n": 1,
        "logprobs": 0,
        # as TRL: unseeded requests on data-parallel engines can decode the same sample
        "seed": random.getrandbits(63),
    }
    return {k: v for k, v in params.items() if v is not None}


class ServedVersionRolloutLoop(GatedRolloutLoop):
    """TRL's rollout loop (with the trainer's gate), each sample tagged with the oldest weight
    version vLLM says sampled it. Runs in the rollout child process."""

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        payload = {"model": self._request_model, "token_ids": list(prompt_ids),
                   "sampling_params": sampling_params(self)}
        output = await self._retry(
            lambda: self._post(GENERATE_PATH, payload, self.request_timeout),
            max_attempts=30, label=f"vllm {GENERATE_PATH}")
        choice = output["choices"][0]
        token_ids = choice["token_ids"]
        logprobs = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
        if len(logprobs) != len(token_ids):
            raise ValueError(f"vLLM returned {len(token_ids)} tokens and {len(logprobs)} log-probs")
        versions = _rollout_versions.get()
        if versions is not None:
            versions.extend(span_versions(choice.get("weight_versions"), len(token_ids)))
        return token_ids, logprobs

    async def _generate_one(self, *args, **kwargs):
        versions: list[int] = []
        token = _rollout_versions.set(versions)
        try:
            result = await super()._generate_one(*args, **kwargs)
        finally:
            _rollout_versions.reset(token)
        # No token generated at all: nothing to measure, TRL's tag stands.
        oldest = min(versions) if versions else self.model_version
        for row in result[2]:  # TRL's TrainingSequence rows of this rollout
            row.weight_version = oldest
        mixed = self._rates["rollout/mixed_versions_ratio"]
        mixed[0] += len(set(versions)) > 1
        mixed[1] += 1
        return result

    async def _score_group(self, group):
        samples = await super()._score_group(group)
        # TRL builds one sample per row, rows in order, and stamps the group's version on all.
        rows = [row for rollout_rows in group.completions_sequences for row in rollout_rows]
        for sample, row in zip(samples, rows, strict=True):
            sample.model_version = row.weight_version
        return samples

"""Packing numbers the trainer exports (Prometheus, TRL's logs) for each step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .budget import MicroBatch
from .forest import Trie


@dataclass
class PackingMetrics:
    """Raw vs forwarded work of a set of micro-batches; per-rank lists are indexed by rank."""

    rollouts: int = 0
    micro_batches: int = 0
    raw_tokens: int = 0  # sum of rollout lengths: what sequence packing forwards
    forwarded_tokens: int = 0  # tokens the rows forward (a prefix repeats in each row it is in)
    distinct_tokens: int = 0  # distinct prefixes of all rollouts: what one unbounded tree would forward
    trained_tokens: int = 0  # loss terms
    attention_pairs: int = 0  # (query, key) pairs tree attention computes
    raw_attention_pairs: int = 0  # pairs causal attention over each rollout alone computes
    filler_rows: int = 0
    rank_tokens: list[int] = field(default_factory=list)
    rank_load: list[int] = field(default_factory=list)  # attention pairs per rank

    @property
    def compression_ratio(self) -> float:
        return self.raw_tokens / self.forwarded_tokens if self.forwarded_tokens else 1.0

    @property
    def rank_imbalance(self) -> float:
        """Slowest rank's attention load over the mean: 1.0 is perfectly balanced."""
        if not self.rank_load or not sum(self.rank_load):
            return 1.0
        return max(self.rank_load) * len(self.rank_load) / sum(self.rank_load)

    @property
    def repeated_tokens(self) -> int:
        """Forwarded tokens beyond the distinct prefixes: prefixes repeated across rows (and filler copies)."""
        return self.forwarded_tokens - self.distinct_tokens

    @classmethod
    def of(cls, batches: Sequence[MicroBatch]) -> PackingMetrics:
        ranks = len(batches[0].rows) if batches else 0
        m = cls(micro_batches=len(batches), rank_tokens=[0] * ranks, rank_load=[0] * ranks)
        everything = Trie()
        for batch in batches:
            for rank, row in enumerate(batch.rows):
                m.rank_tokens[rank] += row.tokens
                m.rank_load[rank] += row.attention_pairs
                m.forwarded_tokens += row.tokens
                m.attention_pairs += row.attention_pairs
                m.trained_tokens += row.trained
                if row.filler:
                    m.filler_rows += 1
                    continue
                m.rollouts += len(row.rollouts)
                for r in row.rollouts:
                    everything.insert(r.input_ids)
                m.raw_tokens += row.raw_tokens
                m.raw_attention_pairs += sum(len(r) * (len(r) + 1) // 2 for r in row.rollouts)
        m.distinct_tokens = len(everything)
        return m

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compression_ratio"] = self.compression_ratio
        d["rank_imbalance"] = self.rank_imbalance
        d["repeated_tokens"] = self.repeated_tokens
        return d

    def as_scalars(self, prefix: str = "tree/") -> dict[str, float]:
        """Flat float metrics for a logger; per-rank lists become max/min."""
        d = self.as_dict()
        out = {f"{prefix}{k}": float(v) for k, v in d.items() if not isinstance(v, list)}
        for key in ("rank_tokens", "rank_load"):
            if d[key]:
                out[f"{prefix}{key}_max"] = float(max(d[key]))
                out[f"{prefix}{key}_min"] = float(min(d[key]))
        return out

"""Rollouts -> micro-batches of one packed row per data-parallel rank, under a token budget.

Rules, and why:
- A row holds at most `budget` forwarded (unique) tokens and `budget` loss terms. Unique
  tokens bound activation memory; loss terms bound the LM-head work, which sharing does
  not shrink (every branch of a fork keeps its own term).
- A group is a unit: its rollouts share their prompt, so together they cost the prompt
  once. A group whose forest exceeds the budget is cut at its deepest shared node into
  whole subtrees (`split_group`), so a chunk repeats only the path down to the cut (the
  prompt, or a multi-turn history up to the fork), never a prefix deeper than that;
  nothing is ever dropped. A rollout longer than the budget is a configuration
  error (`RolloutError`) raised before any packing.
- Units go longest-first (by attention pairs, which grow faster than tokens) to the least
  loaded row that still fits them (LPT), opening a new micro-batch only when none fits.
- No rank gets an empty row, since a rank that forwards nothing would desynchronise
  FSDP/EP collectives: an empty row takes half of the fullest row's rollouts; if no row
  has two, it forwards a copy of a rollout with no loss terms (`filler=True`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .forest import PackedRow, Trie, pack
from .rollout import Rollout, RolloutError


def validate_budget(rollouts: Sequence[Rollout], budget: int) -> None:
    """Every rollout must fit one row on its own; otherwise the configuration is wrong."""
    if budget < 1:
        raise RolloutError(
            f"token budget must be positive, got {budget}; a budget <= 0 means TRL's fixed count of "
            "samples per micro-batch, which only the trainer's TreeBatcher (plan_fixed_count) takes"
        )
    too_long = [i for i, r in enumerate(rollouts) if len(r) > budget]
    if too_long:
        longest = max(len(rollouts[i]) for i in too_long)
        raise RolloutError(
            f"{len(too_long)} rollout(s) exceed the per-rank token budget of {budget} "
            f"(longest has {longest} tokens; first index {too_long[0]}): raise the budget to at "
            "least the generator's max_model_len"
        )


@dataclass
class _Bin:
    """A row being filled: indices into the input rollouts, with its trie for pricing."""

    trie: Trie = field(default_factory=Trie)
    members: list[int] = field(default_factory=list)
    trained: int = 0
    filler_of: int | None = None  # an empty rank's stand-in: forwards this rollout, trains nothing

    def fits(self, unit: list[int], rollouts: Sequence[Rollout], budget: int) -> bool:
        new_tokens, _ = self.trie.price([rollouts[i].input_ids for i in unit])
        trained = sum(rollouts[i].trained for i in unit)
        return len(self.trie) + new_tokens <= budget and self.trained + trained <= budget

    def add(self, unit: list[int], rollouts: Sequence[Rollout]) -> None:
        for i in unit:
            self.trie.insert(rollouts[i].input_ids)
            self.members.append(i)
            self.trained += rollouts[i].trained

    @classmethod
    def of(cls, members: list[int], rollouts: Sequence[Rollout]) -> _Bin:
        b = cls()
        b.add(members, rollouts)
        return b


def group_units(rollouts: Sequence[Rollout], budget: int) -> list[list[int]]:
    """Each group as one unit, or, if its forest overflows the budget, as whole subtrees (`split_group`)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rollouts):
        groups[r.group_id].append(i)
    return [unit for members in groups.values() for unit in split_group(members, rollouts, budget)]


def _common_prefix(seqs: list[Sequence[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for d in range(n):
        token = first[d]
        if any(s[d] != token for s in seqs):
            return d
    return n


def split_group(members: list[int], rollouts: Sequence[Rollout], budget: int) -> list[list[int]]:
    """Cut a group that overflows the budget at its deepest shared node, into whole subtrees.

    The members' forest branches at the end of their common prefix; each branch (a subtree)
    is cut recursively only if it overflows on its own, and the pieces are then packed
    first-fit, largest first, into as few chunks as fit. A chunk repeats only the path down
    to the node it was cut at: the prompt when a group forks at its first completion token,
    nothing deeper. Cutting in arrival order instead repeats whole histories of multi-turn
    episodes whenever a cut falls inside one. Identical rollouts (nothing to branch on) are
    chunked in order.
    """
    if _Bin().fits(members, rollouts, budget):
        return [members]
    ids = [rollouts[i].input_ids for i in members]
    depth = _common_prefix(ids)
    branches: dict[int | None, list[int]] = defaultdict(list)
    for i, seq in zip(members, ids):
        branches[seq[depth] if len(seq) > depth else None].append(i)
    pieces: list[list[int]] = []
    for token, branch in branches.items():
        if token is None:  # rollouts ending exactly at the fork: one piece each (duplicates, in order)
            pieces.extend([i] for i in branch)
        else:
            pieces.extend(split_group(branch, rollouts, budget))
    chunks: list[_Bin] = []
    sizes = {id(p): Trie().price([rollouts[i].input_ids for i in p])[0] for p in pieces}
    for piece in sorted(pieces, key=lambda p: -sizes[id(p)]):
        chunk = next((c for c in chunks if c.fits(piece, rollouts, budget)), None)
        if chunk is None:
            chunk = _Bin()
            chunks.append(chunk)
        chunk.add(piece, rollouts)
    return [sorted(c.members) for c in chunks]


@dataclass
class MicroBatch:
    """One forward/backward of every rank: `rows[r]` is rank r's packed row."""

    rows: list[PackedRow]
    sources: list[list[int]]  # rows[r].rollouts[j] is input rollout sources[r][j]

    @property
    def trained(self) -> int:
        return sum(row.trained for row in self.rows)


def plan(rollouts: Sequence[Rollout], ranks: int, budget: int) -> list[MicroBatch]:
    """Pack all rollouts into micro-batches of `ranks` rows, each within `budget`."""
    if ranks < 1:
        raise RolloutError(f"need at least one rank, got {ranks}")
    if not rollouts:
        raise RolloutError("nothing to pack: no rollouts")
    validate_budget(rollouts, budget)

    units = group_units(rollouts, budget)
    cost = {id(u): Trie().price([rollouts[i].input_ids for i in u])[1] for u in units}
    units.sort(key=lambda u: (-cost[id(u)], u[0]))

    batches: list[list[_Bin]] = []
    for unit in units:
        fitting = [b for batch in batches for b in batch if b.fits(unit, rollouts, budget)]
        if not fitting:
            batches.append([_Bin() for _ in range(ranks)])
            fitting = batches[-1]
        min(fitting, key=lambda b: b.trie.load).add(unit, rollouts)

    _fill_empty_rows(batches, rollouts)
    return [_materialise(batch, rollouts) for batch in batches]


def plan_fixed_count(rollouts: Sequence[Rollout], ranks: int, per_micro_batch: int) -> list[MicroBatch]:
    """TRL's `token_budget <= 0`: consecutive `per_micro_batch` samples per micro-batch, no token bound.

    Each chunk is planned as by `plan` with a budget that holds the whole chunk, so it becomes
    one micro-batch: groups together, LPT across ranks, no empty rank (as TRL's
    `FixedCountBatcher`, which also leaves peak memory unbounded).
    """
    if per_micro_batch < 1:
        raise RolloutError(f"need at least one sample per micro-batch, got {per_micro_batch}")
    batches = []
    for start in range(0, len(rollouts), per_micro_batch):
        chunk = list(rollouts[start: start + per_micro_batch])
        unbounded = max(sum(len(r) for r in chunk), sum(r.trained for r in chunk), 1)
        for mb in plan(chunk, ranks, unbounded):
            mb.sources = [[start + s for s in srcs] for srcs in mb.sources]
            batches.append(mb)
    return batches


def _fill_empty_rows(batches: list[list[_Bin]], rollouts: Sequence[Rollout]) -> None:
    """Give every empty row rollouts of the fullest row (any subset of a fitting row fits), else a filler."""
    for batch in batches:
        for slot, row in enumerate(batch):
            if row.members:
                continue
            slots = [(other, i) for other in batches for i in range(len(other))]
            donor_batch, donor_slot = max(slots, key=lambda s: len(s[0][s[1]].members))
            donor = donor_batch[donor_slot]
            if len(donor.members) < 2:
                first = next(b.members[0] for b in batch if b.members)
                batch[slot] = _Bin(filler_of=first)
                continue
            keep, give = _halve(donor.members, rollouts)
            donor_batch[donor_slot] = _Bin.of(keep, rollouts)
            batch[slot] = _Bin.of(give, rollouts)


def _halve(members: list[int], rollouts: Sequence[Rollout]) -> tuple[list[int], list[int]]:
    """Split whole groups apart when the row holds several; otherwise split its one group."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i in members:
        groups[rollouts[i].group_id].append(i)
    if len(groups) >= 2:
        parts = list(groups.values())
        half = len(parts) // 2
        return [i for p in parts[:half] for i in p], [i for p in parts[half:] for i in p]
    half = len(members) // 2
    return members[:half], members[half:]


def _materialise(batch: list[_Bin], rollouts: Sequence[Rollout]) -> MicroBatch:
    rows, sources = [], []
    for b in batch:
        if b.filler_of is not None:
            source = rollouts[b.filler_of]
            row = pack([replace(source, completion_mask=(0,) * len(source))])
            row.filler = True
            rows.append(row)
            sources.append([])
            continue
        rows.append(pack([rollouts[i] for i in b.members]))
        sources.append(list(b.members))
    return MicroBatch(rows=rows, sources=sources)

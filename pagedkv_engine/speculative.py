"""Speculative decoding by prompt lookup: drafts from the sequence's own text, no second model.

A decoding sequence whose last tokens already occurred earlier in its prompt or its
output probably continues the way it did then (a quoted passage, a repeated phrase, a
list that is copied). :func:`propose_ngram` proposes those following tokens as
*drafts*, as vLLM's ``ngram`` method (``prompt_lookup_min``/``prompt_lookup_max``)
does. The engine writes the last sampled token and its drafts in one step, runs one
forward over them (a causal chunk, like a prefill chunk), and :func:`num_accepted`
counts the drafts the model itself would have generated, greedily: those are kept,
with the model's own token after them, so one forward yields ``1 + accepted`` tokens.
The rejected drafts' K/V were written too and must be rolled back
(:meth:`pagedkv_lib.KVCacheManager.rollback`) before anything reads or shares them.

Greedy decoding only: with sampling, accepting a draft needs the draft's probability
(rejection sampling), which prompt lookup does not have.

The engine's step records the tables after the rollback only; :class:`RecordingManager`
(a manager part, ``EngineParts(manager=RecordingManager)``) also keeps what the pool
looked like between the verifying forward and the rollback (notebook 13).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedkv_lib import KVCacheManager

__all__ = [
    "PROMPT_LOOKUP_MAX",
    "PROMPT_LOOKUP_MIN",
    "propose_ngram",
    "num_accepted",
    "stats_line",
    "Rollback",
    "RecordingManager",
]

#: The longest and shortest suffix matched (tokens); vLLM's ``prompt_lookup_max/min``.
PROMPT_LOOKUP_MAX = 4
PROMPT_LOOKUP_MIN = 2


def propose_ngram(
    token_ids: Sequence[int], num_drafts: int, max_n: int = PROMPT_LOOKUP_MAX, min_n: int = PROMPT_LOOKUP_MIN
) -> list[int]:
    """Up to ``num_drafts`` draft tokens for the sequence ``token_ids`` (prompt and
    generated text, ending with the last sampled token); ``[]`` when nothing matches.

    For ``n`` from ``max_n`` down to ``min_n``: find the earliest earlier occurrence of
    the last ``n`` tokens (ending before the last token, so at least one token follows
    it) and propose the tokens that followed it, at most ``num_drafts`` of them. The
    first ``n`` that matches wins: a longer match is better evidence.

    Raises ValueError unless ``num_drafts >= 0`` and ``1 <= min_n <= max_n``.
    """
    if num_drafts < 0 or not 1 <= min_n <= max_n:
        raise ValueError(f"num_drafts={num_drafts} must be >= 0 and 1 <= min_n={min_n} <= max_n={max_n}")
    tokens = list(token_ids)
    if num_drafts == 0:
        return []
    last = len(tokens)
    for n in range(min(max_n, last - 1), min_n - 1, -1):
        suffix = tokens[last - n :]
        for i in range(last - n):  # the occurrence tokens[i : i + n] is followed by tokens[i + n]
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + num_drafts]
    return []


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading ``drafts`` the model confirms: ``drafts[i] == targets[i]`` for
    each, where ``targets[i]`` is the model's greedy token after the last sampled token
    and ``drafts[:i]`` (so ``targets`` has one more entry than ``drafts``: the model's
    own token after the accepted ones)."""
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        accepted += 1
    return accepted


def stats_line(stats, max_drafts: int) -> str:
    """One line of an engine's speculative counters (:class:`pagedkv_engine.EngineStats`)."""
    return (
        f"speculative decoding (prompt lookup, up to {max_drafts} drafts per step): "
        f"{stats.drafts_accepted} of {stats.drafts_proposed} drafts accepted ({stats.acceptance_rate:.0%}); "
        f"{stats.forwards_per_token:.2f} forwards per generated token ({stats.sampled_chunks} sequence-forwards "
        f"for {stats.generated_tokens} tokens)"
    )


class Rollback(NamedTuple):
    """One rollback of a speculative step as :class:`RecordingManager` saw it: the
    sequence, the tokens it had committed before the step (``start``, the position of its
    last sampled token), the rejected tokens dropped (``num_tokens``), and before and
    after: its block table, its length (tokens), the refcount of each page of the table
    before, and the pool's free pages. ``released``: the pages the rollback gave back."""

    seq_id: str
    start: int
    num_tokens: int
    table_before: list[int]
    table_after: list[int]
    len_before: int
    len_after: int
    refcounts_before: list[int]
    refcounts_after: list[int]
    free_before: int
    free_after: int
    released: list[int]

    @property
    def num_drafts(self) -> int:
        """Drafts the step verified (its tokens after the last sampled one)."""
        return self.len_before - self.start - 1

    @property
    def accepted(self) -> int:
        return self.num_drafts - self.num_tokens


class RecordingManager(KVCacheManager):
    """A :class:`~pagedkv_lib.KVCacheManager` that keeps a :class:`Rollback` of every
    rollback dropping at least one token in :attr:`rollbacks`, in order, and checks its
    invariants (:meth:`~pagedkv_lib.KVCacheManager.check_integrity`) just before and
    just after each: mid-step, with the drafts written but not verified, the books must
    hold too. The engine's manager part: ``Engine(..., parts=EngineParts(manager=RecordingManager))``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rollbacks: list[Rollback] = []

    def rollback(self, seq_id, num_tokens: int) -> list[int]:
        if not num_tokens:
            return super().rollback(seq_id, num_tokens)
        self.check_integrity()
        table, length, start, free = (
            self.block_table(seq_id),
            self.seq_len(seq_id),
            self.committed_len(seq_id),
            self.num_free,
        )
        refs = [self.refcount(b) for b in table]
        released = super().rollback(seq_id, num_tokens)
        self.check_integrity()
        after = [self.refcount(b) for b in table]
        self.rollbacks.append(
            Rollback(
                seq_id,
                start,
                num_tokens,
                table_before=table,
                table_after=self.block_table(seq_id),
                len_before=length,
                len_after=self.seq_len(seq_id),
                refcounts_before=refs,
                refcounts_after=after,
                free_before=free,
                free_after=self.num_free,
                released=list(released),
            )
        )
        return released

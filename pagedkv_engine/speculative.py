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
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PROMPT_LOOKUP_MAX", "PROMPT_LOOKUP_MIN", "propose_ngram", "num_accepted", "stats_line"]

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

"""The engine's faults (:mod:`pagedkv_engine`): replacement parts for
:class:`pagedkv_engine.parts.EngineParts`, each the correct part with one wrong line.

Duck-typed on the engine's objects (a chunk's ``start``, ``token_ids``, ``is_prefill``;
an attention backend's ``write``/``prefill``/``decode``), so this library module never
imports the engine above it.
"""

from __future__ import annotations

import torch

from pagedkv_lib.manager import KVCacheManager

__all__ = ["decode_positions_off_by_one", "LastWriterWins", "RollbackKeepsDrafts"]


def decode_positions_off_by_one(chunk) -> range:
    """:func:`pagedkv_engine.parts.token_positions` with the bug: a decode chunk's token
    gets position ``seq_len`` (one past the last computed token) instead of ``seq_len -
    1``, so RoPE rotates its K and Q one step too far; prefill chunks are right."""
    n = len(chunk.token_ids)
    if chunk.is_prefill:
        return range(chunk.start, chunk.start + n)
    return range(chunk.start + 1, chunk.start + n + 1)  # the wrong line: range(chunk.start, chunk.start + n)


class LastWriterWins:
    """A backend whose writes let the later of two tokens with the same slot win, as a
    GPU race between them usually ends, instead of refusing the duplicate slot as the
    suite's write functions do. Only the planted ``no_copy_on_write`` fault needs it
    (two forked samples then write one shared row in the same step): the write is split
    into two ordered writes, each with distinct slots."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name

    def write(self, q, k, v, cache, slot_mapping, positions) -> None:
        slots = slot_mapping.tolist()
        last = {slot: i for i, slot in enumerate(slots)}
        early = [i for i, slot in enumerate(slots) if last[slot] != i]
        if not early:
            return self.inner.write(q, k, v, cache, slot_mapping, positions)
        for rows in (early, [i for i in range(len(slots)) if i not in early]):
            idx = torch.tensor(rows, dtype=torch.long, device=q.device)
            part = q[idx].contiguous()
            self.inner.write(part, k[idx].contiguous(), v[idx].contiguous(), cache, slot_mapping[idx], positions[idx])
            q[idx] = part

    def prefill(self, *args, **kwargs):
        return self.inner.prefill(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.inner.decode(*args, **kwargs)


class RollbackKeepsDrafts(KVCacheManager):
    """A manager whose :meth:`~pagedkv_lib.KVCacheManager.rollback` drops nothing: a
    speculative step's rejected drafts stay in the sequence. Its books still agree with
    themselves (``check_integrity`` passes), but the engine's next token, at the first
    rejected draft's position, is written to a slot past the drafts, and attention reads
    that position's row: the stale K/V of the rejected draft."""

    def rollback(self, seq_id, num_tokens: int) -> list[int]:
        self._get(seq_id)
        return []  # the wrong line: return super().rollback(seq_id, num_tokens)

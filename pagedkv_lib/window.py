"""Sliding windows, in the two forms engines use: a ring that decides where tokens are
stored, and a mask over a linear cache.

:class:`RingWindow` follows TensorRT-LLM's ``KVBlockArray``: the first ``sink_tokens``
tokens stay where they were written, the rest of the sequence cycles through a
ring of ``cyclic_cache_len`` slots. When the sinks do not fill a whole block the
rest of that block is left empty (the *bubble*), so the ring starts on a block
boundary and every ring block is a whole block. The write path
(``formats.slot_mapping``, the Triton write kernel) and the read path (``reference``
attention, the Triton read kernels) both go through :meth:`RingWindow.kv_token_idx`;
there is no second copy of the modulo.

:class:`LinearWindow` is FlashInfer's ``window_left`` and vLLM's ``sliding_window``: the
cache holds every position at its own row (no ring) and the window only masks, so a
query at position ``p`` sees keys ``p - window_left .. p``. The two are told apart by
type; both expose ``sink_tokens``, ``recent_tokens``, ``kv_token_idx`` and
``cache_len``, so :func:`window_mask` and the read kernels treat them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from pagedkv_lib.checks.scalars import check_int, check_positive_int, is_int

__all__ = ["RingWindow", "LinearWindow", "Window", "window_mask"]

Index = TypeVar("Index", int, torch.Tensor)


@dataclass(frozen=True)
class RingWindow:
    """A sliding window of ``max_attention_window`` tokens, ``sink_tokens`` of which
    are the sequence's first tokens, stored in pages of ``tokens_per_block`` rows.

    ``one_more_block`` adds a block to the ring so that a chunk of up to
    ``tokens_per_block`` new tokens can be written without overwriting keys the
    chunk's own queries still need (a plain ring only supports one token a step).
    """

    max_attention_window: int
    sink_tokens: int
    tokens_per_block: int
    one_more_block: bool = False

    def __post_init__(self) -> None:
        for field in ("max_attention_window", "tokens_per_block"):
            check_positive_int(field, getattr(self, field), "RingWindow")
        sinks = self.sink_tokens
        check_int("sink_tokens", sinks, owner="RingWindow")
        if self.max_attention_window <= sinks:
            raise ValueError(
                f"RingWindow: max_attention_window={self.max_attention_window} must exceed "
                f"sink_tokens={sinks}, or no slot is left for the moving part of the window"
            )

    @property
    def recent_tokens(self) -> int:
        """Positions of the moving part of the window, the query's own included: a query
        at ``p`` sees the sinks and keys ``p - recent_tokens + 1 .. p``."""
        return self.max_attention_window - self.sink_tokens

    @property
    def bubble_len(self) -> int:
        """Empty rows after the sinks, padding the sink block to a whole block."""
        rem = self.sink_tokens % self.tokens_per_block
        return 0 if rem == 0 else self.tokens_per_block - rem

    @property
    def cyclic_cache_len(self) -> int:
        """Rows in the ring that the non-sink tokens cycle through."""
        extra = self.tokens_per_block if self.one_more_block else 0
        return self.max_attention_window + extra - self.sink_tokens

    @property
    def max_cache_len(self) -> int:
        """Rows a sequence occupies once its ring has wrapped: sinks + bubble + ring."""
        return self.sink_tokens + self.bubble_len + self.cyclic_cache_len

    def is_sink(self, t: Index) -> Index | bool:
        """True where token position ``t`` is an attention sink (``t < sink_tokens``)."""
        return t < self.sink_tokens

    def kv_token_idx(self, t: Index) -> Index:
        """Cache row (logical, before the block table) that token position ``t`` is stored in.

        ``t`` if it is a sink, else ``sinks + bubble + (t - sinks) % cyclic_cache_len``.
        Works elementwise on integer tensors.
        """
        s = self.sink_tokens
        ring = s + self.bubble_len + (t - s) % self.cyclic_cache_len
        if isinstance(t, torch.Tensor):
            return torch.where(t < s, t, ring)
        return t if t < s else ring

    def cache_len(self, seq_len: Index) -> Index:
        """Cache rows a sequence of ``seq_len`` tokens spans (bubble included).

        ``seq_len`` while every token is a sink, then sinks + bubble + the ring part,
        capped at :attr:`max_cache_len`. Works elementwise on integer tensors.
        """
        s = self.sink_tokens
        if isinstance(seq_len, torch.Tensor):
            ring = torch.clamp(seq_len - s, max=self.cyclic_cache_len)
            return torch.where(seq_len <= s, seq_len, s + self.bubble_len + ring)
        if seq_len <= s:
            return seq_len
        return s + self.bubble_len + min(seq_len - s, self.cyclic_cache_len)

    def num_blocks(self, seq_len: Index) -> Index:
        """Blocks (pages) a sequence of ``seq_len`` tokens needs."""
        rows = self.cache_len(seq_len)
        if isinstance(rows, torch.Tensor):
            return torch.div(rows + self.tokens_per_block - 1, self.tokens_per_block, rounding_mode="floor")
        return -(-rows // self.tokens_per_block)

    def max_chunk_len(self) -> int:
        """Longest run of new tokens one write may add, whatever the sequence's length,
        while its own queries still find every key they attend to: ``cyclic_cache_len -
        (window - sinks) + 1`` (1 for a plain ring, ``tokens_per_block + 1`` with
        ``one_more_block``). :meth:`lost_key` is the exact rule for one chunk."""
        return self.cyclic_cache_len - self.recent_tokens + 1

    def lost_key(self, seq_len: Index, q_len: Index) -> Index:
        """The oldest position a query of a chunk still sees but the ring no longer holds,
        or -1 when every key the chunk's queries see is still in place (elementwise on
        integer tensors).

        The chunk's ``q_len`` queries sit at ``seq_len - q_len .. seq_len - 1`` and every
        position up to ``seq_len - 1`` has been written, so the ring holds the non-sink
        positions ``>= seq_len - cyclic_cache_len`` (older ones were overwritten). The
        oldest non-sink key any query sees is ``max(sinks, seq_len - q_len -
        recent_tokens + 1)``, seen by the first query at or past the sinks (if any).
        A chunk longer than :meth:`max_chunk_len` is fine while that key is held: a ring
        that has not wrapped, or a chunk whose early queries reach back into the sinks
        only while the ring still holds the first non-sink tokens.
        """
        s = self.sink_tokens
        if isinstance(seq_len, torch.Tensor) or isinstance(q_len, torch.Tensor):
            seq_len, q_len = torch.as_tensor(seq_len), torch.as_tensor(q_len)
            oldest = torch.clamp(seq_len - q_len - self.recent_tokens + 1, min=s)
            lost = (q_len > 0) & (seq_len > s) & (oldest < seq_len - self.cyclic_cache_len)
            return torch.where(lost, oldest, -1)
        oldest = max(s, seq_len - q_len - self.recent_tokens + 1)
        return oldest if q_len > 0 and seq_len > s and oldest < seq_len - self.cyclic_cache_len else -1


@dataclass(frozen=True)
class LinearWindow:
    """A sliding window applied as a mask over a linear cache (every position at its own
    row), as FlashInfer and vLLM apply theirs: a query at position ``p`` sees the keys
    ``p - window_left .. p``, that is ``window_left + 1`` of them.

    ``window_left`` has FlashInfer's meaning (``plan(..., window_left=w)``: ``w`` keys to
    the left of the query, the query's own key too; its ``-1``, no window, is
    ``window=None`` here). vLLM's ``sliding_window = w`` counts the query's own key
    among its ``w``: :meth:`from_sliding_window` converts (``window_left = w - 1``).
    Without ``causal`` (prefill only) the window bounds the left side alone, as
    FlashInfer's does: keys ``p - window_left .. seq_len - 1``.

    No sinks, no ring: tokens are written as without a window (a write kernel refuses a
    ``LinearWindow``), and the pages before the window are still in the page table.
    """

    window_left: int

    def __post_init__(self) -> None:
        w = self.window_left
        if not is_int(w) or w < 0:
            raise ValueError(
                f"LinearWindow: window_left={w!r} must be an int >= 0 (FlashInfer's window_left; "
                "its -1, no window, is window=None)"
            )

    @classmethod
    def from_sliding_window(cls, sliding_window: int) -> LinearWindow:
        """vLLM's ``sliding_window = w`` (a query sees ``w`` keys, its own included) as
        ``LinearWindow(window_left=w - 1)``."""
        w = sliding_window
        if not is_int(w) or w < 1:
            raise ValueError(f"sliding_window={w!r} must be an int >= 1 (vLLM's count of keys, the query's own too)")
        return cls(w - 1)

    @property
    def sliding_window(self) -> int:
        """vLLM's ``sliding_window``: the keys a query sees, its own included."""
        return self.window_left + 1

    @property
    def sink_tokens(self) -> int:
        """No attention sinks: 0."""
        return 0

    @property
    def recent_tokens(self) -> int:
        """A query at ``p`` sees keys ``p - recent_tokens + 1 .. p``: ``window_left + 1``."""
        return self.window_left + 1

    def kv_token_idx(self, t: Index) -> Index:
        """Cache row of position ``t``: ``t`` itself (a linear cache)."""
        return t

    def cache_len(self, seq_len: Index) -> Index:
        """Cache rows a sequence of ``seq_len`` tokens spans: all of them."""
        return seq_len


Window = RingWindow | LinearWindow


def window_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: Window | None = None, causal: bool = True
) -> torch.Tensor:
    """Boolean mask ``[..., q, k]``: may a query at ``query_pos`` attend a key at ``key_pos``?

    Causal (``key <= query``) unless ``causal=False``. With a window, only the sinks and
    the last ``window.recent_tokens`` positions up to the query itself are kept (a
    :class:`RingWindow`: StreamingLLM-style, at most ``max_attention_window`` keys; a
    :class:`LinearWindow`: keys ``query - window_left .. query``); without ``causal`` the
    window bounds the left side only (FlashInfer's non-causal window).
    """
    q = query_pos.unsqueeze(-1)
    k = key_pos.unsqueeze(-2)
    mask = k <= q if causal else torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool)
    if window is not None:
        recent = k > q - window.recent_tokens
        mask = mask & (recent | (k < window.sink_tokens))
    return mask

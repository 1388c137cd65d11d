"""Ring-window mapping for sliding-window attention with attention sinks.

Follows the rules of TensorRT-LLM's ``KVBlockArray``: the first ``sink_tokens``
tokens stay where they were written, the rest of the sequence cycles through a
ring of ``cyclic_cache_len`` slots. When the sinks do not fill a whole block the
rest of that block is left empty (the *bubble*), so the ring starts on a block
boundary and every ring block is a whole block.

The write path (``formats.slot_mapping``, the Triton write kernel) and the read
path (``reference`` attention, the Triton read kernel) both go through
:meth:`RingWindow.kv_token_idx`; there is no second copy of the modulo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["RingWindow", "window_mask"]

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
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"RingWindow: {field}={value!r} must be a positive int")
        sinks = self.sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"RingWindow: sink_tokens={sinks!r} must be an int >= 0")
        if self.max_attention_window <= sinks:
            raise ValueError(
                f"RingWindow: max_attention_window={self.max_attention_window} must exceed "
                f"sink_tokens={sinks}, or no slot is left for the moving part of the window"
            )

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
        """Longest run of new tokens one write may add while its own queries still
        find every key they attend to: ``cyclic_cache_len - (window - sinks) + 1``."""
        return self.cyclic_cache_len - (self.max_attention_window - self.sink_tokens) + 1


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: RingWindow | None = None) -> torch.Tensor:
    """Boolean mask ``[..., q, k]``: may a query at ``query_pos`` attend a key at ``key_pos``?

    Always causal (``key <= query``). With a window, only the sinks and the last
    ``max_attention_window - sink_tokens`` positions up to the query itself are kept
    (StreamingLLM-style), so a query sees at most ``max_attention_window`` keys.
    """
    q = query_pos.unsqueeze(-1)
    k = key_pos.unsqueeze(-2)
    mask = k <= q
    if window is not None:
        recent = k > q - (window.max_attention_window - window.sink_tokens)
        mask = mask & (recent | (k < window.sink_tokens))
    return mask

"""The engine's replaceable parts: how a step's token positions are built, which
manager keeps the block tables, and what (if anything) wraps the attention backend.

:class:`pagedkv_engine.engine.Engine` takes an :class:`EngineParts`; the defaults are
the correct parts. A planted bug is a replacement part from the fault registry
(:func:`pagedkv_lab.faults.engine_parts` builds the :class:`EngineParts` of a fault), so
the engine's step holds no fault name and no branch on one, and the engine imports
nothing of the lab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv_engine.scheduler import Chunk
from pagedkv_lib import KVCacheManager

__all__ = ["EngineParts", "token_positions", "same_backend"]


def token_positions(chunk: Chunk) -> range:
    """Positions of ``chunk``'s tokens: ``start .. start + len(token_ids) - 1`` (a decode
    chunk's one token sits at ``seq_len - 1``, its sequence's last position)."""
    return range(chunk.start, chunk.start + len(chunk.token_ids))


def same_backend(backend):
    """The attention backend as it is (the correct ``attention`` part: no wrapper)."""
    return backend


@dataclass(frozen=True)
class EngineParts:
    """The parts an :class:`~pagedkv_engine.engine.Engine` is built from.

    * ``positions(chunk) -> range``: the positions RoPE and the causal mask use for a
      chunk's tokens;
    * ``manager(num_pages, page_size, prefix_cache=...)``: a
      :class:`pagedkv_lib.KVCacheManager` (or subclass) for the block tables;
    * ``attention(backend) -> backend``: wraps the attention backend (``write``,
      ``prefill``, ``decode``).
    """

    positions: Callable[[Chunk], range] = token_positions
    manager: Callable[..., KVCacheManager] = KVCacheManager
    attention: Callable = same_backend

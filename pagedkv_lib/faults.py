"""Named, switchable faults: the silent bugs of paged KV caches, made reproducible.

Each fault is an explicit object or parameter handed to the code path that should
misbehave; nothing here patches a module globally, so a fault never leaks into the
next cell or test.
"""

from __future__ import annotations

from dataclasses import dataclass

from .window import RingWindow

__all__ = ["AbsolutePositionWindow"]


@dataclass(frozen=True)
class AbsolutePositionWindow(RingWindow):
    """A read side that forgets the ring: it looks a token up at its absolute position
    (wrapped into the sequence's pages only so the read stays in bounds) instead of
    :meth:`RingWindow.kv_token_idx`. Pass it as the ``window`` of a *read*; the write
    side keeps the real :class:`RingWindow`."""

    def kv_token_idx(self, t):
        return t % self.max_cache_len

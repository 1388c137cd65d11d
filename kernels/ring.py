"""The ring-window row mapping inside Triton kernels.

Device-side twin of :meth:`pagedkv_lib.window.RingWindow.kv_token_idx` (the same
formula, which the write and read kernels both call from here, so they can never
disagree). Tests hold it equal to the Python method.
"""

import triton
import triton.language as tl

from pagedkv_lib.window import RingWindow


def ring_params(window: RingWindow | None) -> tuple[int, int, int]:
    """``(sink_tokens, bubble_len, cyclic_cache_len)`` for a launch; ``(0, 0, 0)`` means
    no window (the kernels take ``HAS_WINDOW`` as a constexpr and skip the mapping)."""
    if window is None:
        return 0, 0, 0
    return window.sink_tokens, window.bubble_len, window.cyclic_cache_len


@triton.jit
def kv_token_idx(pos, sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW: tl.constexpr):
    """Cache row of token position(s) ``pos``: ``pos`` for sinks (or without a window),
    else ``sinks + bubble + (pos - sinks) % cyclic_cache_len``."""
    if HAS_WINDOW:
        ring = sink_tokens + bubble_len + (pos - sink_tokens) % cyclic_cache_len
        return tl.where(pos < sink_tokens, pos, ring)
    else:
        return pos

"""Argument rules every family shares: float dtypes, the ring window, the softmax scale,
query and K/V tensors, slots inside the pool, and the RoPE options.

The MHA (:mod:`.mha`), quantized (:mod:`.quant`) and MLA (:mod:`.mla`) rules are built
from these, so one message names one broken rule whichever family's call broke it.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lib.checks.scalars import is_number
from pagedkv_lib.formats import PAD, index_tensor
from pagedkv_lib.pool import CacheDims, cache_dims
from pagedkv_lib.window import LinearWindow, RingWindow, Window

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ROPE_STYLES = (None, "neox", "gptj")
MAX_SCALE = 1e4


# --------------------------------------------------------------------------- scalars


def check_window(window, page_size: int | None = None) -> RingWindow | None:
    """``window`` must be a :class:`~pagedkv_lib.window.RingWindow` or None (a call that
    stores tokens through the ring, or a read kernel that only implements the ring);
    with ``page_size``, one whose ring counts in pages of that many tokens."""
    if isinstance(window, LinearWindow):
        raise ValueError(
            f"window={window!r} is a mask over a linear cache (FlashInfer's window_left, vLLM's sliding_window): "
            "this call stores or reads tokens through a ring and takes a RingWindow or None; write a linear "
            "cache with window=None and pass the LinearWindow to the decode or prefill that reads it"
        )
    if window is not None and not isinstance(window, RingWindow):
        raise ValueError(f"window must be a RingWindow, a LinearWindow or None, got {type(window).__name__}")
    if window is not None and page_size is not None and window.tokens_per_block != page_size:
        raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={page_size}")
    return window


def check_read_window(window, page_size: int | None = None, csr: bool = False) -> Window | None:
    """The window of an MHA decode or prefill: a :class:`~pagedkv_lib.window.LinearWindow`
    (a mask over absolute positions), a :class:`~pagedkv_lib.window.RingWindow` as
    :func:`check_window` wants it, or None. A ring is refused over a CSR page table
    (``csr``): its pages hold the ring's rows, so ``kv_last_page_len`` cannot give the
    sequence's length."""
    if isinstance(window, LinearWindow):
        return window
    if csr and isinstance(window, RingWindow):
        raise ValueError(
            "window is a RingWindow but the page table is CSR: a ring's pages hold its rows, not the sequence, "
            "so kv_last_page_len cannot give the length; use the padded entry point (block_tables, seq_lens), "
            "or a LinearWindow for a linear cache"
        )
    return check_window(window, page_size)


def check_scale(scale) -> float | None:
    """``scale`` (the softmax scale) must be None or a finite real number with
    ``|scale| <= MAX_SCALE`` (1e4).

    Why a bound: the kernels form ``scale * log2(e) * (q . k)`` in fp32, so a finite scale
    of 1e38 overflows every score to inf and the softmax to NaN, where the float64
    reference stays finite. With ``|scale| <= 1e4`` the scores stay finite for every
    ``|q . k| < 2e34``, far past anything an fp32 dot of real activations forms. Models
    use ``1 / sqrt(head_dim)`` (0.04 to 0.2; MLA's YaRN factor keeps it below 1)."""
    if scale is None:
        return None
    if not is_number(scale) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite number or None")
    if abs(scale) > MAX_SCALE:
        raise ValueError(
            f"scale={scale!r} is beyond +-{MAX_SCALE:g}: the kernels' fp32 scores scale * q.k would overflow "
            "(models use 1/sqrt(head_dim))"
        )
    return float(scale)


# --------------------------------------------------------------------------- tensors


def check_float_tensor(name: str, x, shape_doc: str) -> None:
    """``x`` must be a 3-D float tensor; the message names ``name`` and its wanted
    ``shape_doc`` (e.g. ``"[tokens, num_q_heads, head_dim]"``)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be {shape_doc}, got {got}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype} is not a float dtype")


def check_kv_rows(
    k, v, dims: CacheDims, holder: str = "cache", dtype: torch.dtype | None = None, names: tuple = ("k", "v")
) -> None:
    """``k, v [num_tokens, num_kv_heads, head_dim]`` float tensors of equal shape with the
    heads and head_dim of ``dims`` (the ``holder``'s, named in the message), and with
    ``dtype`` given, in that dtype (checked per tensor, K before V). ``names``: the two
    arguments' names in the messages."""
    for name, x in zip(names, (k, v)):
        check_float_tensor(name, x, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(x.shape[1:]) != (dims.num_kv_heads, dims.head_dim):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but the {holder} holds {dims.num_kv_heads} KV heads of "
                f"head_dim {dims.head_dim}"
            )
        if dtype is not None and x.dtype != dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from {holder}.dtype={dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{names[0]} has shape {tuple(k.shape)} but {names[1]} has {tuple(v.shape)}")


def check_q(q, cache, layout: str = "NHD", rows: int | None = None, rows_name: str = "tokens") -> CacheDims:
    """``q [rows, num_q_heads, head_dim]``: a float tensor whose head count is a positive
    multiple of the cache's KV heads (GQA) and whose head_dim is the cache's; with
    ``rows`` given, exactly that many rows. Returns the cache's dims."""
    dims = cache_dims(cache, layout)
    check_float_tensor("q", q, "[tokens, num_q_heads, head_dim]")
    if q.shape[2] != dims.head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {dims.head_dim}")
    if q.shape[1] == 0 or q.shape[1] % dims.num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {dims.num_kv_heads} KV heads")
    if rows is not None and q.shape[0] != rows:
        raise ValueError(f"q has {q.shape[0]} rows but there are {rows} {rows_name}")
    return dims


def check_kv(k, v, cache, layout: str = "NHD") -> CacheDims:
    """``k, v [num_tokens, num_kv_heads, head_dim]``, equal shapes, in the cache's dtype
    and head layout. Returns the cache's dims."""
    dims = cache_dims(cache, layout)
    check_kv_rows(k, v, dims, "cache", cache.dtype)
    return dims


def check_slots(slots: torch.Tensor, dims: CacheDims, name: str = "slot_mapping") -> None:
    """Every slot (host int64 ``[num_tokens]``) is ``-1`` or inside the pool of ``dims``,
    and no slot is written twice (two writers of one row would race)."""
    num_slots = dims.num_pages * dims.page_size
    bad = (slots < PAD) | (slots >= num_slots)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"{name}[{i}] = {int(slots[i])} is outside the pool "
            f"({dims.num_pages} pages x {dims.page_size} slots; -1 marks padding)"
        )
    real = slots[slots >= 0]
    if real.numel() != torch.unique(real).numel():
        vals, counts = torch.unique(real, return_counts=True)
        raise ValueError(f"{name} writes slot {int(vals[counts > 1][0])} more than once (two writers of one row)")


# --------------------------------------------------------------------------- RoPE


def check_rope_style(rope) -> None:
    """``rope`` must be None, ``"neox"`` or ``"gptj"`` (:data:`ROPE_STYLES`)."""
    if rope not in ROPE_STYLES:
        raise ValueError(f"rope={rope!r} must be None, 'neox' or 'gptj'")


def check_rope_positions(
    rope_theta, positions, num_tokens: int, slots: torch.Tensor, name: str = "positions"
) -> torch.Tensor:
    """The options of a fused RoPE that every family shares; return ``positions`` as
    host int64.

    ``rope_theta`` a finite number > 1; ``positions [num_tokens]`` integers, >= 0 for
    every token that is written (``slots >= 0``, host int64 ``[num_tokens]``). ``name``
    is the argument the positions came in as (``"rope_positions"`` when given apart
    from the cache positions, :func:`rope_position_source`)."""
    if not is_number(rope_theta) or not math.isfinite(rope_theta):
        raise ValueError(f"rope_theta={rope_theta!r} must be a finite number")
    if rope_theta <= 1:
        raise ValueError(f"rope_theta={rope_theta!r} must be > 1")
    if positions is None:
        raise ValueError(f"rope needs {name} [num_tokens], the tokens' absolute positions")
    pos = index_tensor(name, positions, 1)
    if pos.numel() != num_tokens:
        raise ValueError(f"{name} has {pos.numel()} entries for {num_tokens} tokens")
    bad = (slots >= 0) & (pos < 0)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name}[{i}]={int(pos[i])} must be >= 0 for a token that is written")
    return pos


def rope_position_source(rope, positions, rope_positions) -> tuple:
    """``(tensor, name)``: the rotary positions of a CSR append and the argument they came
    in as. ``rope_positions [num_tokens]`` (the rotary position of each token, given
    apart from its cache position, :mod:`pagedkv_lib.rotary_positions`) when given, else
    ``positions`` (the cache position, which then is the rotary one too).
    ``rope_positions`` without ``rope`` is a ValueError: nothing would use it."""
    if rope_positions is None:
        return positions, "positions"
    if rope is None:
        raise ValueError("rope_positions is given but rope is None: it only sets the RoPE angle")
    return rope_positions, "rope_positions"


def rotated_rows(slots: torch.Tensor, rope_positions) -> torch.Tensor:
    """``[num_tokens]`` bool: the tokens whose ``q`` a fused-RoPE append rotates. The
    written ones (``slots >= 0``); with separate ``rope_positions`` (host int64) every
    token whose rotary position is >= 0, written or not (a Helix inactive rank rotates
    Q but writes no K/V)."""
    return slots >= 0 if rope_positions is None else rope_positions >= 0

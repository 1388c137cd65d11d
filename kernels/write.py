"""The Triton write kernel: append new tokens' K and V into the paged pool, in place.

Two entry points address the same kernel:

* :func:`append_paged_kv` takes vLLM's ``slot_mapping`` (flat slot ``page * page_size +
  row`` per token, ``-1`` = padding);
* :func:`append_paged_kv_csr` takes FlashInfer's form, ``batch_indices`` and
  ``positions`` per token plus the CSR page table ``kv_indptr`` / ``kv_indices``; the
  kernel itself computes ``row = kv_token_idx(pos)`` (ring window), ``page =
  kv_indices[kv_indptr[b] + row // page_size]`` and ``row % page_size``.

Options, fused into the same launch: RoPE on K (GPT-NeoX half-split or GPT-J
interleaved pairs) with Q rotated in place by extra programs of the same grid; and,
as a second small launch, zeroing the unused V rows of each sequence's last page.

Grid: ``(cdiv(num_tokens, BLOCK_T), kv_head_blocks [+ q_head_blocks])``. Each program
writes one independent tile of ``BLOCK_T`` tokens x ``BLOCK_H`` heads x the whole head
(``BLOCK_D = next_pow2(head_dim)``, masked). The number of programs grows with the
token count, so a prefill of tens of thousands of tokens fills every SM while a
single-token decode still gets one program per head block; grid axis 0 holds up to
2**31 - 1 programs, so no grid-stride loop is needed (it would only amortise a setup of
a few index loads). In Triton's interpreter the cost is per executed ``tl`` operation,
not per element, so the launcher picks much larger tiles there (all heads, hundreds of
tokens per program).

Numerics: the plain copy loads and stores in the cache dtype, so it is bit-exact (NaN
payloads included). RoPE math is fp32 after loading; the angle ``position *
inv_freq`` is formed and reduced to ``[-pi, pi]`` in fp64 first, because in fp32 its
rounding error grows with the position (about 2e-3 rad at position 32768).

Addresses: every element offset is int64 (page ids, token indices and heads are
widened *before* multiplying by a stride), so pools past 2**31 elements are addressed
correctly. Nothing is launched before every argument is validated: an address the
kernel can form is then always inside the tensors it was given.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import torch
import triton
import triton.language as tl

from pagedkv_lib import reference
from pagedkv_lib.pool import cache_dims, cache_strides
from pagedkv_lib.reference import check_append_args
from pagedkv_lib.window import RingWindow

from .ring import kv_token_idx, ring_params
from .validate import (
    check_append_launch,
    check_csr_append_args,
    check_rope_launch,
    check_v_tail_args,
    check_window,
)

__all__ = ["ROPE_STYLES", "append_paged_kv", "append_paged_kv_csr", "zero_paged_v_tail", "write_tiles"]

ROPE_STYLES = {None: 0, "neox": 1, "gptj": 2}


# --------------------------------------------------------------------------- device code


@triton.jit
def _cache_offset(page, kv, row, head, feat, stride_page, stride_kv, stride_n, stride_h, stride_d):
    """Element offset (int64) of ``cache[page, kv, row, head, feat]`` in the layout-free
    order of :func:`pagedkv_lib.indexing.element_offset`; every index is widened to
    int64 before its multiply, so no product can wrap at 2**31."""
    return (
        page.to(tl.int64) * stride_page
        + kv * stride_kv
        + row.to(tl.int64) * stride_n
        + head.to(tl.int64) * stride_h
        + feat.to(tl.int64) * stride_d
    )


@triton.jit
def _token_rows(
    tokens,
    num_tokens,
    idx_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    pos_ptr,
    page_size,
    sink_tokens,
    bubble_len,
    cyclic_cache_len,
    CSR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """``(page, row, valid)`` per token ``[BLOCK_T]``: from the slot (``idx_ptr`` is the
    slot mapping) or, with ``CSR``, from request ``idx_ptr[t]`` and position
    ``pos_ptr[t]`` through the ring window and the CSR page table. Padding (slot,
    request or position ``-1``) and lanes past ``num_tokens`` are invalid."""
    in_range = tokens < num_tokens
    if CSR:
        batch = tl.load(idx_ptr + tokens, mask=in_range, other=-1)
        pos = tl.load(pos_ptr + tokens, mask=in_range, other=-1)
        valid = in_range & (batch >= 0) & (pos >= 0)
        cache_row = kv_token_idx(tl.where(valid, pos, 0), sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW)
        first = tl.load(kv_indptr_ptr + batch, mask=valid, other=0)
        page = tl.load(kv_indices_ptr + first + cache_row // page_size, mask=valid, other=0)
        row = cache_row % page_size
    else:
        slot = tl.load(idx_ptr + tokens, mask=in_range, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        page = slot // page_size
        row = slot % page_size
    return page, row, valid


@triton.jit
def _rope_cos_sin(pos, inv_freq_ptr, pair, pair_mask):
    """``cos, sin [BLOCK_T, BLOCK_P]`` (fp32) of angle ``pos * inv_freq[pair]``, formed and
    reduced to ``[-pi, pi]`` in fp64 so the fp32 cosine sees a small, exact argument."""
    inv_freq = tl.load(inv_freq_ptr + pair, mask=pair_mask, other=0.0)  # fp64
    angle = pos.to(tl.float64)[:, None] * inv_freq[None, :]
    # Float literals would be fp32 constants (2*pi off by 1.7e-7, times the turns):
    # build both as fp64 scalars.
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([], 0.15915494309189535, tl.float64)
    turns = tl.floor(angle * inv_two_pi + 0.5)
    angle = (angle - turns * two_pi).to(tl.float32)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rope_tile(
    src_ptr,
    src_base,
    src_sh,
    src_sd,
    dst_ptr,
    dst_base,
    dst_sh,
    dst_sd,
    heads,
    mask_th,
    cos,
    sin,
    half,
    NEOX: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rotate one ``[BLOCK_T, BLOCK_H, head_dim]`` tile from ``src`` into ``dst`` (which may
    be ``src``: Q rotates in place). Pair ``i`` is features ``(i, i + half)`` (NeoX) or
    ``(2i, 2i + 1)`` (GPT-J). Both features of a pair are loaded as two tiles of the
    same shape, so each thread stores only elements it loaded itself: an in-place
    rotation cannot race with another thread's load of the partner feature."""
    pair = tl.arange(0, BLOCK_P)
    if NEOX:
        f1 = pair
        f2 = pair + half
    else:
        f1 = 2 * pair
        f2 = 2 * pair + 1
    f1 = f1.to(tl.int64)[None, None, :]
    f2 = f2.to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (pair < half)[None, None, :]
    s = src_base[:, None, None] + h * src_sh
    x1 = tl.load(src_ptr + s + f1 * src_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + s + f2 * src_sd, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    sn = sin[:, None, :]
    d = dst_base[:, None, None] + h * dst_sh
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + d + f1 * dst_sd, (x1 * c - x2 * sn).to(out_ty), mask=mask)
    tl.store(dst_ptr + d + f2 * dst_sd, (x2 * c + x1 * sn).to(out_ty), mask=mask)


@triton.jit
def _copy_tile(
    src_ptr,
    src_base,
    src_sh,
    src_sd,
    dst_ptr,
    dst_base,
    dst_sh,
    dst_sd,
    heads,
    mask_th,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    """Copy one ``[BLOCK_T, BLOCK_H, head_dim]`` tile without leaving the source dtype
    (bit-exact)."""
    feat = tl.arange(0, BLOCK_D).to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (feat < head_dim)
    x = tl.load(src_ptr + src_base[:, None, None] + h * src_sh + feat * src_sd, mask=mask)
    tl.store(dst_ptr + dst_base[:, None, None] + h * dst_sh + feat * dst_sd, x, mask=mask)


@triton.jit
def _append_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    q_ptr,
    idx_ptr,
    pos_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    inv_freq_ptr,
    num_tokens,
    num_kv_heads,
    num_q_heads,
    head_dim,
    page_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    stride_d,
    sink_tokens,
    bubble_len,
    cyclic_cache_len,
    CSR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``(t, h)``: tokens ``t*BLOCK_T ...`` x head block ``h``. Head blocks past the
    KV heads rotate Q (only with ``HAS_Q``); their programs write nothing to the cache."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    page, row, valid = _token_rows(
        tokens,
        num_tokens,
        idx_ptr,
        kv_indptr_ptr,
        kv_indices_ptr,
        pos_ptr,
        page_size,
        sink_tokens,
        bubble_len,
        cyclic_cache_len,
        CSR,
        HAS_WINDOW,
    )
    tok = tokens.to(tl.int64)
    kv_blocks = tl.cdiv(num_kv_heads, BLOCK_H)
    hb = tl.program_id(1)
    if ROPE != 0:
        pair = tl.arange(0, BLOCK_D // 2)
        pos = tl.load(pos_ptr + tokens, mask=valid, other=0)
        cos, sin = _rope_cos_sin(pos, inv_freq_ptr, pair, pair < head_dim // 2)
    if hb < kv_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_th = valid[:, None] & (heads < num_kv_heads)[None, :]
        zero = tl.zeros_like(page)
        dst_k = _cache_offset(page, 0, row, zero, zero, stride_page, stride_kv, stride_n, stride_h, stride_d)
        if ROPE != 0:
            _rope_tile(
                k_ptr,
                tok * stride_kt,
                stride_kh,
                stride_kd,
                cache_ptr,
                dst_k,
                stride_h,
                stride_d,
                heads,
                mask_th,
                cos,
                sin,
                head_dim // 2,
                ROPE == 1,
                BLOCK_D // 2,
            )
        else:
            _copy_tile(
                k_ptr, tok * stride_kt, stride_kh, stride_kd, cache_ptr, dst_k, stride_h, stride_d, heads, mask_th,
                head_dim, BLOCK_D,
            )  # fmt: skip
        _copy_tile(
            v_ptr, tok * stride_vt, stride_vh, stride_vd, cache_ptr, dst_k + stride_kv, stride_h, stride_d, heads,
            mask_th, head_dim, BLOCK_D,
        )  # fmt: skip
    elif HAS_Q:
        heads = (hb - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_th = valid[:, None] & (heads < num_q_heads)[None, :]
        base = tok * stride_qt
        _rope_tile(
            q_ptr, base, stride_qh, stride_qd, q_ptr, base, stride_qh, stride_qd, heads, mask_th, cos, sin,
            head_dim // 2, ROPE == 1, BLOCK_D // 2,
        )  # fmt: skip


@triton.jit
def _zero_v_tail_kernel(
    cache_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    last_ptr,
    num_kv_heads,
    head_dim,
    page_size,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    stride_d,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``(b, h)``: zero V rows ``last_page_len[b] .. page_size - 1`` of request
    ``b``'s last page for head block ``h`` (nothing for a request without pages)."""
    b = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + b)
    end = tl.load(kv_indptr_ptr + b + 1)
    has_pages = end > start
    page = tl.load(kv_indices_ptr + end - 1, mask=has_pages, other=0)
    # A request without pages zeroes nothing: its tail starts at page_size. (Folded into
    # the row bound rather than and-ed as a scalar mask, which the interpreter widens
    # to int32.)
    first_zero = tl.where(has_pages, tl.load(last_ptr + b), page_size)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    feat = tl.arange(0, BLOCK_D)
    zeros = tl.zeros((BLOCK_R, BLOCK_H, BLOCK_D), dtype=cache_ptr.dtype.element_ty)
    for r0 in range(0, page_size, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask_r = (rows >= first_zero) & (rows < page_size)
        mask = mask_r[:, None, None] & (heads < num_kv_heads)[None, :, None] & (feat < head_dim)[None, None, :]
        offs = _cache_offset(
            page,
            1,
            rows[:, None, None],
            heads[None, :, None],
            feat[None, None, :],
            stride_page,
            stride_kv,
            stride_n,
            stride_h,
            stride_d,
        )
        tl.store(cache_ptr + offs, zeros, mask=mask)


# --------------------------------------------------------------------------- host code


def write_tiles(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` for a launch. Compiled: tiles of about 2048
    elements (a few per thread at 4 warps), so even a short prefill spreads over the
    SMs. Interpreted: about 2**17 elements (the interpreter pays per operation, not per
    element), all heads at once."""
    block_d = triton.next_power_of_2(head_dim)
    heads = triton.next_power_of_2(max(num_heads, 1))
    if runtime.BACKEND.interpreted:
        block_h, budget = heads, 2**17
    else:
        block_h, budget = min(heads, max(1, 512 // block_d)), 2048
    block_t = max(1, min(triton.next_power_of_2(max(num_tokens, 1)), budget // (block_h * block_d)))
    return block_t, block_h, block_d


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """:func:`pagedkv_lib.reference.rope_inv_freq` (float64) on ``device``."""
    return reference.rope_inv_freq(head_dim, theta).to(device)


def _launch_append(k, v, cache, layout, idx, positions, kv_indptr, kv_indices, window, rope, rope_theta, q) -> None:
    dims = cache_dims(cache, layout)
    # The kernel indexes the 1-D index arrays densely; views of them (slots[::2]) are
    # copied (a no-op for the usual contiguous ones).
    idx, positions, kv_indptr, kv_indices = (
        None if t is None else t.contiguous() for t in (idx, positions, kv_indptr, kv_indices)
    )
    num_tokens = k.shape[0]
    num_q_heads = 0 if q is None else q.shape[1]
    block_t, block_h, block_d = write_tiles(num_tokens, max(dims.num_kv_heads, num_q_heads), dims.head_dim)
    kv_blocks = triton.cdiv(dims.num_kv_heads, block_h)
    q_blocks = triton.cdiv(num_q_heads, block_h)
    inv_freq = rope_inv_freq(dims.head_dim, rope_theta, cache.device) if rope else k  # k: unused placeholder
    q_arg = k if q is None else q  # never dereferenced without HAS_Q
    q_strides = (0, 0, 0) if q is None else q.stride()
    csr = kv_indptr is not None
    grid = (triton.cdiv(num_tokens, block_t), kv_blocks + q_blocks)
    _append_kernel[grid](
        k,
        v,
        cache,
        q_arg,
        idx,
        idx if positions is None else positions,
        kv_indptr if csr else idx,
        kv_indices if csr else idx,
        inv_freq,
        num_tokens,
        dims.num_kv_heads,
        num_q_heads,
        dims.head_dim,
        dims.page_size,
        *k.stride(),
        *v.stride(),
        *q_strides,
        *cache_strides(cache, layout),
        *ring_params(window),
        CSR=csr,
        HAS_WINDOW=window is not None,
        ROPE=ROPE_STYLES[rope],
        HAS_Q=q is not None,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def _launch_v_tail(cache, layout, kv_indptr, kv_indices, kv_last_page_len) -> None:
    dims = cache_dims(cache, layout)
    kv_indptr, kv_indices, kv_last_page_len = (t.contiguous() for t in (kv_indptr, kv_indices, kv_last_page_len))
    batch = kv_last_page_len.numel()
    if batch == 0:
        return
    # Rows of a page play the part of tokens: the same tile budget applies.
    block_r, block_h, block_d = write_tiles(dims.page_size, dims.num_kv_heads, dims.head_dim)
    grid = (batch, triton.cdiv(dims.num_kv_heads, block_h))
    _zero_v_tail_kernel[grid](
        cache,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        dims.num_kv_heads,
        dims.head_dim,
        dims.page_size,
        *cache_strides(cache, layout),
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = "NHD",
    *,
    rope: str | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    q: torch.Tensor | None = None,
    zero_v_tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``cache`` in place (returns None).

    ``cache`` is the raw 5-D pool (``layout`` ``"NHD"`` or ``"HND"``), fp32, fp16 or bf16,
    the dtype of ``k`` and ``v``; any strides of ``k``, ``v`` and ``cache`` work (views
    are fine). Token ``i`` goes to flat slot ``slot_mapping[i]`` (``[num_tokens]`` int32
    or int64, ``-1``: skipped; no slot twice); zero tokens write nothing.

    ``rope="neox"|"gptj"`` stores K rotated by RoPE at ``positions [num_tokens]`` (the
    tokens' absolute positions, required then) with base ``rope_theta``; ``k`` itself
    is not modified. ``q [num_tokens, num_q_heads, head_dim]`` (fp32/fp16/bf16, needs
    ``rope``) is rotated in place in the same launch; rows of padding tokens are left
    as they are.

    ``zero_v_tail=(kv_indptr, kv_indices, kv_last_page_len)`` (a CSR page table, see
    :mod:`pagedkv_lib.formats`) afterwards zeroes V rows ``kv_last_page_len[b] ..
    page_size - 1`` of every request's last page. V only: a read kernel replaces the
    scores of rows past the end, so stale K there is harmless, but ``0 * NaN`` in the
    ``P @ V`` product is not.

    All tensors must be on :func:`pagedkv_lib.runtime.device`. Raises ValueError naming
    the argument (shape, dtype, device, slot range or duplicate, overlapping output
    memory) before anything is written.
    """
    slots = check_append_args(k, v, cache, slot_mapping, layout)
    check_append_launch(k, v, cache, layout, slot_mapping=slot_mapping)
    positions = check_rope_launch(k, cache, layout, rope, positions, rope_theta, q, valid=slots >= 0)
    tail = None if zero_v_tail is None else check_v_tail_args(cache, layout, *zero_v_tail, written=slots)
    if k.shape[0]:
        # The device tensor itself: check_append_args returns its host copy.
        _launch_append(k, v, cache, layout, slot_mapping, positions, None, None, None, rope, rope_theta, q)
    if tail is not None:
        _launch_v_tail(cache, layout, *tail)


def append_paged_kv_csr(
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    layout: str = "NHD",
    *,
    window: RingWindow | None = None,
    rope: str | None = None,
    rope_theta: float = 10000.0,
    q: torch.Tensor | None = None,
    kv_last_page_len: torch.Tensor | None = None,
) -> None:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``cache`` in place, addressed
    by request and position (FlashInfer's ``append_paged_kv_cache``); returns None.

    Token ``i`` of request ``b = batch_indices[i]`` at position ``p = positions[i]``
    (both ``[num_tokens]``; ``-1`` in either marks padding) is stored in cache row ``r =
    p`` (or ``window.kv_token_idx(p)`` with a :class:`RingWindow`) of the request's
    pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``: page ``kv_indices[kv_indptr[b]
    + r // page_size]``, row ``r % page_size``. The kernel computes this itself; the
    launcher checks beforehand that every token lands on one of its request's pages.

    ``rope``, ``rope_theta`` and ``q`` as in :func:`append_paged_kv`; RoPE uses the
    absolute position ``p``, never the ring row. With ``kv_last_page_len [batch]`` the
    V tail of every request's last page is zeroed afterwards (see
    :func:`append_paged_kv`). Raises ValueError naming the argument before any write.
    """
    check_window(window)
    slots, batch_indices, positions = check_csr_append_args(
        k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout, window
    )
    check_append_launch(k, v, cache, layout, kv_indices=kv_indices, kv_indptr=kv_indptr)
    check_rope_launch(k, cache, layout, rope, positions, rope_theta, q, valid=slots >= 0)
    tail = None
    if kv_last_page_len is not None:
        tail = check_v_tail_args(cache, layout, kv_indptr, kv_indices, kv_last_page_len, written=slots)
    if k.shape[0]:
        _launch_append(
            k, v, cache, layout, batch_indices, positions, kv_indptr, kv_indices, window, rope, rope_theta, q
        )
    if tail is not None:
        _launch_v_tail(cache, layout, *tail)


def zero_paged_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> None:
    """Zero V rows ``kv_last_page_len[b] .. page_size - 1`` of each request's last page
    ``kv_indices[kv_indptr[b + 1] - 1]``, in place (returns None). Requests without pages
    are skipped. Raises ValueError naming the argument (see :func:`append_paged_kv`)."""
    tail = check_v_tail_args(cache, layout, kv_indptr, kv_indices, kv_last_page_len)
    _launch_v_tail(cache, layout, *tail)

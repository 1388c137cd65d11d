"""The Triton write kernel: append new tokens' K and V into the paged pool, in place.

Two entry points address the same kernel, :func:`append_kernel`; each is
``run_append(plan_append...(...), ...)``: the plan validates once and can be run again
(:func:`plan_append` / :func:`plan_append_csr` then :func:`run_append`):

* :func:`append_paged_kv` takes vLLM's ``slot_mapping`` (flat slot ``page * page_size +
  row`` per token, ``-1`` = padding);
* :func:`append_paged_kv_csr` takes FlashInfer's form, ``batch_indices`` and
  ``positions`` per token plus the CSR page table ``kv_indptr`` / ``kv_indices``; the
  kernel itself computes ``row = kv_token_idx(pos)`` (ring window), ``page =
  kv_indices[kv_indptr[b] + row // page_size]`` and ``row % page_size``.

Options, fused into the same launch: RoPE on K (GPT-NeoX half-split or GPT-J
interleaved pairs, :mod:`pagedkv_kernels.device.rope`) with Q rotated in place by extra programs of
the same grid, at the cache positions or, in the CSR form, at ``rope_positions`` given
apart from them (:mod:`pagedkv_lib.rotary_positions`); and, as a second small launch,
zeroing the unused V rows of each sequence's last page (:mod:`pagedkv_kernels.v_tail`, whose
:func:`~pagedkv_kernels.v_tail.zero_paged_v_tail` does it alone).

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

Addresses: every element offset is int64, through :mod:`pagedkv_kernels.device.addressing` (page ids,
token indices and heads are widened *before* multiplying by a stride), so pools past
2**31 elements are addressed correctly. Tile sizes come from :mod:`pagedkv_kernels.host.tiles`.
Nothing is launched before every argument is validated (the value rules of
:mod:`pagedkv_lib.checks`, which the reference shares, then the launch checks of
:mod:`pagedkv_kernels.host.validate`): an address the kernel can form is then always inside the
tensors it was given.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_dims, cache_strides
from pagedkv_lib.window import RingWindow

from .device.addressing import kv_write_start, ring_params, row_offset
from .device.rope import (
    copy_tile,
    rope_cos_sin,
    rope_q_in_place,
    rope_tile,
)
from .host.launch import csr_index, fingerprint, memory_key, slot_index
from .host.tiles import write_tiles
from .host.validate import (
    check_device,
    check_disjoint,
    check_in_storage,
    check_kernel_dtype,
    check_no_overlap,
    check_no_self_overlap,
    check_same_layout,
    check_write_index,
)
from .host.write_plan import WritePlan, write_constexprs, write_launch_args, write_plan_fields
from .v_tail import VTailPlan, run_v_tail, v_tail_plan, v_tail_tensors

__all__ = [
    "append_kernel",
    "AppendPlan",
    "plan_append",
    "plan_append_csr",
    "run_append",
    "append_paged_kv",
    "append_paged_kv_csr",
]

# --------------------------------------------------------------------------- device code


# fmt: off
@triton.jit
def append_kernel(
    # pointers: inputs, the pool, q (rotated in place), token addressing, RoPE positions and frequencies
    k_ptr, v_ptr, cache_ptr, q_ptr,
    slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
    rope_pos_ptr, inv_freq_ptr,
    # sizes
    num_tokens, num_kv_heads, num_q_heads, head_dim, page_size,
    # strides of k, v and q [token, head, feature]
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_qt, stride_qh, stride_qd,
    # strides of the pool in the order of pagedkv_kernels.device.addressing.cache_offset
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    # ring window (pagedkv_kernels.device.addressing.ring_params)
    sink_tokens, bubble_len, cyclic_cache_len,
    # constexprs: addressing form, window, RoPE code, rotary positions of their own, q given; tiles
    CSR: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr, ROPE_POS: tl.constexpr, HAS_Q: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(t, h)``: tokens ``t*BLOCK_T ...`` x head block ``h`` (their rows, rotary
    positions and head block from :func:`pagedkv_kernels.device.addressing.kv_write_start`). Head
    blocks past the KV heads rotate Q (only with ``HAS_Q``); their programs write nothing
    to the cache. RoPE angles come from ``rope_pos_ptr``, the cache store is masked by
    ``valid`` alone."""
    tok, page, row, valid, pos, rotated, hb, kv_blocks = kv_write_start(
        num_tokens, num_kv_heads, page_size, sink_tokens, bubble_len, cyclic_cache_len,
        slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, rope_pos_ptr,
        CSR, HAS_WINDOW, ROPE, ROPE_POS, BLOCK_T, BLOCK_H,
    )
    if ROPE != 0:
        pair = tl.arange(0, BLOCK_D // 2)
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, pair, pair < head_dim // 2)
    if hb < kv_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_th = valid[:, None] & (heads < num_kv_heads)[None, :]
        dst_k = row_offset(page, row, stride_page, stride_n)  # K of head 0, feature 0 of each token's row
        if ROPE != 0:
            rope_tile(
                k_ptr, tok * stride_kt, stride_kh, stride_kd,
                cache_ptr, dst_k, stride_h, stride_d,
                heads, mask_th,
                cos, sin, head_dim // 2,
                ROPE == 1, BLOCK_D // 2,
            )
        else:
            copy_tile(
                k_ptr, tok * stride_kt, stride_kh, stride_kd,
                cache_ptr, dst_k, stride_h, stride_d,
                heads, mask_th, head_dim,
                BLOCK_D,
            )
        copy_tile(
            v_ptr, tok * stride_vt, stride_vh, stride_vd,
            cache_ptr, dst_k + stride_kv, stride_h, stride_d,
            heads, mask_th, head_dim,
            BLOCK_D,
        )
    elif HAS_Q:
        rope_q_in_place(
            q_ptr, stride_qt, stride_qh, stride_qd, tok, rotated,
            hb - kv_blocks, num_q_heads, cos, sin, head_dim // 2,
            ROPE == 1, BLOCK_H, BLOCK_D // 2,
        )
# fmt: on


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class AppendPlan(WritePlan):
    """A validated append: everything :func:`run_append` launches, checked once (the
    fields of :class:`~pagedkv_kernels.host.write_plan.WritePlan`, ``checked`` being
    ``memory_key(k, v, cache, q)``, and these).

    Index tensors are the caller's device tensors made contiguous (the kernel reads
    them densely); ``cache`` and ``k``/``v``/``q`` given to :func:`run_append` must have
    the shapes, dtypes and device the plan was made for (``cache`` also its strides:
    page ids and slots were checked against it).
    """

    layout: str
    cache: tuple  # (shape, strides, dtype, device) of the pool
    kv_rows: int  # rows of k and v (and q): num_tokens or more
    kv_dtype: torch.dtype
    q_rows: int  # rows of q (0 without q)
    v_tail: VTailPlan | None  # the V-tail zeroing run after the append


def _check_write_launch(k, v, cache, q, index: dict) -> None:
    """Launch checks of a write: devices, kernel dtypes, index tensors (``index``: by
    name, None when absent), and a pool that can be written (no element reached twice,
    inside its storage, not overlapping the inputs)."""
    for name, t in (("k", k), ("v", v), ("cache", cache)):
        check_device(name, t)
    check_kernel_dtype("cache", cache)
    given = check_write_index(index)
    check_no_self_overlap("cache", cache)
    check_in_storage("cache", cache)
    for name, t in (("k", k), ("v", v)):
        check_no_overlap(name, t, "cache", cache)
    if q is not None:
        check_device("q", q)
        check_kernel_dtype("q", q)
        check_no_self_overlap("q", q)
        check_no_overlap("q", q, "cache", cache)
    check_disjoint([("cache", cache), ("q", q)], given)


def _check_plan_index_apart(plan: AppendPlan, cache, q) -> None:
    """The plan's index and V-tail tensors apart from the tensors the launch writes."""
    read = plan.index.named()
    if plan.v_tail is not None:
        read += list(zip(("kv_indptr", "kv_indices", "kv_last_page_len"), plan.v_tail.tables))
    check_disjoint([("cache", cache), ("q", q)], read)


def _plan(k, v, cache, layout, q, rope, rope_theta, window, v_tail, num_tokens, index: dict) -> AppendPlan:
    """The :class:`AppendPlan` of arguments already checked; ``v_tail`` is the checked
    ``(kv_indptr, kv_indices, kv_last_page_len)`` or None (checked here apart from the
    tensors the launch writes: the V-tail launch reads them)."""
    if v_tail is not None:
        check_disjoint([("cache", cache), ("q", q)], list(zip(("kv_indptr", "kv_indices", "kv_last_page_len"), v_tail)))
    dims = cache_dims(cache, layout)
    fields = write_plan_fields(
        num_tokens, dims.num_kv_heads, dims.head_dim, dims.page_size, q, window, rope, rope_theta, cache.device, index
    )
    return AppendPlan(
        layout=layout,
        cache=fingerprint(cache),
        kv_rows=k.shape[0],
        kv_dtype=k.dtype,
        q_rows=0 if q is None else q.shape[0],
        v_tail=None if v_tail is None else v_tail_plan((cache,), layout, v_tail),
        tiles=write_tiles(num_tokens, max(dims.num_kv_heads, fields["num_q_heads"]), dims.head_dim),
        checked=memory_key(k, v, cache, q),
        **fields,
    )


def plan_append(
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
) -> AppendPlan:
    """Validate an :func:`append_paged_kv` call once and return its :class:`AppendPlan`
    (nothing is written). Arguments and errors as :func:`append_paged_kv`."""
    slots = checks.check_append_args(k, v, cache, slot_mapping, layout)
    checks.check_rope_args(rope, positions, rope_theta, q, k, cache, layout, slots)
    index = slot_index(slot_mapping, positions if rope is not None else None)
    _check_write_launch(k, v, cache, q, index)
    tail = None if zero_v_tail is None else v_tail_tensors(cache, layout, zero_v_tail, slots)
    return _plan(k, v, cache, layout, q, rope, rope_theta, None, tail, slots.numel(), index)


def plan_append_csr(
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
    zero_v_tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rope_positions: torch.Tensor | None = None,
) -> AppendPlan:
    """Validate an :func:`append_paged_kv_csr` call once and return its :class:`AppendPlan`
    (nothing is written). Arguments and errors as :func:`append_paged_kv_csr`."""
    slots = checks.check_csr_append_args(k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout, window)
    source, name = checks.rope_position_source(rope, positions, rope_positions)
    checks.check_rope_args(rope, source, rope_theta, q, k, cache, layout, slots, name)
    index = csr_index(batch_indices, positions, kv_indices, kv_indptr, rope_positions)
    _check_write_launch(k, v, cache, q, index)
    tail = None if zero_v_tail is None else v_tail_tensors(cache, layout, zero_v_tail, slots)
    return _plan(k, v, cache, layout, q, rope, rope_theta, window, tail, slots.numel(), index)


def _check_run_inputs(plan: AppendPlan, k, v, cache, q) -> None:
    """The tensors given to :func:`run_append` must be what the plan was made for."""
    check_same_layout("cache", cache, plan.cache)
    want = (plan.kv_rows, plan.num_kv_heads, plan.head_dim)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != plan.kv_dtype:
            raise ValueError(f"{name} must be {plan.kv_dtype} of shape {want} as planned, got {getattr(t, 'shape', t)}")
        check_device(name, t)
        check_no_overlap(name, t, "cache", cache)
    if (q is None) != (plan.q_dtype is None):
        raise ValueError("q must be given exactly when the plan was made with q")
    if q is not None:
        if tuple(q.shape) != (plan.q_rows, plan.num_q_heads, plan.head_dim) or q.dtype != plan.q_dtype:
            raise ValueError(f"q has shape {tuple(q.shape)} and {q.dtype}; the plan was made for another q")
        check_device("q", q)
        check_no_self_overlap("q", q)
        check_no_overlap("q", q, "cache", cache)
    _check_plan_index_apart(plan, cache, q)


def run_append(plan: AppendPlan, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, q=None) -> None:
    """Launch a planned append (and its V-tail zeroing), in place. ``k``, ``v``, ``cache``
    and ``q`` may be other tensors than those planned with, of the same shapes, dtypes
    and device (``cache`` also of the same strides); anything else is a ValueError. The
    very tensors planned with (same addresses and layouts) are not checked again."""
    if memory_key(k, v, cache, q) != plan.checked:
        _check_run_inputs(plan, k, v, cache, q)
    if plan.num_tokens:
        _launch(plan, k, v, cache, q)
    if plan.v_tail is not None:
        run_v_tail(plan.v_tail, cache)


def _launch(plan: AppendPlan, k, v, cache, q) -> None:
    # fmt: off
    append_kernel[plan.grid](
        k, v, cache, k if q is None else q,  # q_ptr is never dereferenced without HAS_Q
        *write_launch_args(plan, k, v, q),
        *cache_strides(cache, plan.layout),
        *ring_params(plan.window),
        **write_constexprs(plan, q),
    )
    # fmt: on


# --------------------------------------------------------------------------- entry points


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
    or int64, ``-1``: skipped; no slot twice); zero tokens write nothing. ``k`` and ``v``
    may have more rows than ``slot_mapping`` (vLLM pads them for CUDA graphs): only the
    first ``num_tokens`` are written.

    ``rope="neox"|"gptj"`` stores K rotated by RoPE at ``positions [num_tokens]`` (the
    tokens' absolute positions, required then) with base ``rope_theta``; ``k`` itself
    is not modified. ``positions`` is only the rotary position here (the cache row is
    the slot's), so positions other than the cache position, such as TensorRT-LLM's
    speculative-decoding, M-RoPE and Helix sources, go straight in
    (:func:`pagedkv_lib.rotary_positions.rotary_positions` builds them).
    ``q [num_tokens, num_q_heads, head_dim]`` (fp32/fp16/bf16, needs ``rope``) is
    rotated in place in the same launch; rows of padding tokens are left as they are
    (an inactive Helix rank's tokens made padding here keep their Q unrotated: the CSR
    form's ``rope_positions`` rotates them).

    ``zero_v_tail=(kv_indptr, kv_indices, kv_last_page_len)`` (a CSR page table, see
    :mod:`pagedkv_lib.formats`) afterwards zeroes V rows ``kv_last_page_len[b] ..
    page_size - 1`` of every request's last page. V only: a read kernel replaces the
    scores of rows past the end, so stale K there is harmless, but ``0 * NaN`` in the
    ``P @ V`` product is not.

    All tensors must be on :func:`pagedkv_lib.runtime.device`. Raises ValueError naming
    the argument (shape, dtype, device, slot range or duplicate, overlapping memory)
    before anything is written. The Python twin is
    :func:`pagedkv_lib.reference.append_paged_kv` (same arguments, same rules).
    """
    # fmt: off
    return run_append(
        plan_append(
            k, v, cache, slot_mapping, layout,
            rope=rope, positions=positions, rope_theta=rope_theta, q=q, zero_v_tail=zero_v_tail,
        ),
        k, v, cache, q,
    )
    # fmt: on


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
    zero_v_tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rope_positions: torch.Tensor | None = None,
) -> None:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``cache`` in place, addressed
    by request and position (FlashInfer's ``append_paged_kv_cache``); returns None.

    Token ``i`` of request ``b = batch_indices[i]`` at position ``p = positions[i]``
    (both ``[num_tokens]``; ``-1`` in either marks padding, other negative values are
    refused) is stored in cache row ``r = p`` (or ``window.kv_token_idx(p)`` with a
    :class:`RingWindow`) of the request's pages ``kv_indices[kv_indptr[b]:kv_indptr[b +
    1]]``: page ``kv_indices[kv_indptr[b] + r // page_size]``, row ``r % page_size``.
    The kernel computes this itself; the launcher checks beforehand that every token
    lands on one of its request's pages, inside the pool.

    ``rope``, ``rope_theta``, ``q`` and ``zero_v_tail=(kv_indptr, kv_indices,
    kv_last_page_len)`` as in :func:`append_paged_kv`; RoPE uses the absolute position
    ``p``, never the ring row. (FlashInfer's ``append_paged_kv_cache`` also takes a
    ``kv_last_page_len`` but does not write with it; here a V tail is zeroed only when
    asked for by name.)

    ``rope_positions [num_tokens]`` (int32/int64, needs ``rope``) gives each token's
    rotary position apart from its cache position ``p``, as TensorRT-LLM's
    speculative-decoding offsets, M-RoPE deltas and Helix position tables do
    (:func:`pagedkv_lib.rotary_positions.rotary_positions` builds it). K is then
    rotated by ``rope_positions[i]`` (>= 0 for a written token), and ``q`` rows are
    rotated for every token whose ``rope_positions[i] >= 0``, *written or not*: a token
    with ``p = -1`` (a Helix inactive rank, :func:`pagedkv_lib.rotary_positions.as_padding`)
    stores nothing but still has its Q rotated. Raises ValueError naming the argument
    before any write.
    """
    # fmt: off
    return run_append(
        plan_append_csr(
            k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout,
            window=window, rope=rope, rope_theta=rope_theta, q=q, zero_v_tail=zero_v_tail,
            rope_positions=rope_positions,
        ),
        k, v, cache, q,
    )
    # fmt: on

"""The V-tail kernel: zero the unused V rows of each sequence's last page, in place.

A read kernel that loads whole pages multiplies the rows past a sequence's end by
probability 0, and ``0 * NaN = NaN``: V rows ``kv_last_page_len[b] .. page_size - 1`` of
request ``b``'s last page ``kv_indices[kv_indptr[b + 1] - 1]`` must hold finite values.
K there is harmless (the reader replaces those scores by ``-inf``), so only V is
zeroed. The kernel works on any 5-D pool tensor ``[num_pages, 2, ...]`` in ``layout``
whatever its last dimension: the MHA pool, and a quantized pool's codes and scales
(which then read back as 0, never NaN).

* :func:`zero_paged_v_tail`: the entry point for an MHA pool;
* :func:`v_tail_tensors`: the checks of the three CSR tensors, shared by the appends
  of :mod:`pagedkv_kernels.write` and :mod:`pagedkv_kernels.quant_write`, which fuse the zeroing into
  their own call (a second, small launch);
* :class:`VTailPlan`, :func:`plan_v_tail`, :func:`run_v_tail`: validate once, launch
  again on the planned tensors.

Grid: ``(batch, cdiv(page_size, BLOCK_R), cdiv(num_kv_heads, BLOCK_H))``, tiles from
:func:`pagedkv_kernels.host.tiles.write_tiles` (the rows of a page play the part of tokens).
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

from .device.addressing import cache_offset
from .host.launch import fingerprint, owned_copy
from .host.tiles import write_tiles
from .host.validate import (
    check_device,
    check_in_storage,
    check_index_tensor,
    check_kernel_dtype,
    check_no_self_overlap,
)

__all__ = ["VTailPlan", "v_tail_tensors", "v_tail_plan", "plan_v_tail", "run_v_tail", "zero_paged_v_tail"]

_TABLES = ("kv_indptr", "kv_indices", "kv_last_page_len")


# fmt: off
@triton.jit
def zero_v_tail_kernel(
    # pointers: the pool tensor zeroed; the CSR page table and each request's last-page length
    cache_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    # sizes
    num_kv_heads, head_dim, page_size,
    # strides of the pool tensor in the order of pagedkv_kernels.device.addressing.cache_offset
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    # tiles: rows of the page, heads, features
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(b, r, h)``: zero the V rows ``r*BLOCK_R ...`` that lie at or past
    ``kv_last_page_len[b]`` in request ``b``'s last page, for head block ``h`` (nothing
    for a request without pages). One program per row block rather than a loop over
    rows: Triton 3.6's interpreter cannot ``range()`` over a runtime bound."""
    b = tl.program_id(0)
    start = tl.load(kv_indptr_ptr + b)
    end = tl.load(kv_indptr_ptr + b + 1)
    has_pages = end > start
    page = tl.load(kv_indices_ptr + end - 1, mask=has_pages, other=0)
    # A request without pages zeroes nothing: its tail starts at page_size. (Folded into
    # the row bound rather than and-ed as a scalar mask, which the interpreter widens
    # to int32.)
    first_zero = tl.where(has_pages, tl.load(kv_last_page_len_ptr + b), page_size)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    feat = tl.arange(0, BLOCK_D)
    mask_r = (rows >= first_zero) & (rows < page_size)
    mask = mask_r[:, None, None] & (heads < num_kv_heads)[None, :, None] & (feat < head_dim)[None, None, :]
    offs = cache_offset(
        page, 1, rows[:, None, None], heads[None, :, None], feat[None, None, :],
        stride_page, stride_kv, stride_n, stride_h, stride_d,
    )
    zeros = tl.zeros((BLOCK_R, BLOCK_H, BLOCK_D), dtype=cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + offs, zeros, mask=mask)
# fmt: on


@dataclass(frozen=True)
class VTailPlan:
    """A validated V-tail zeroing: the pool tensors it zeroes and the checked tables.

    ``targets`` are the :func:`pagedkv_kernels.host.launch.fingerprint` of each pool tensor zeroed
    (the MHA pool; or a quantized pool's codes and, if it has them, scales), all in
    ``layout``; ``tables`` are ``(kv_indptr, kv_indices, kv_last_page_len)``, contiguous
    copies of the caller's device tensors (the plan's own).
    """

    layout: str
    targets: tuple
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def v_tail_tensors(cache, layout, zero_v_tail, written):
    """The three V-tail tensors ``(kv_indptr, kv_indices, kv_last_page_len)`` made
    contiguous (still the caller's, for the overlap checks; :func:`v_tail_plan` copies
    them), after the value checks (:func:`pagedkv_lib.checks.check_v_tail_args` against
    ``cache`` in ``layout``, with ``written`` the slots this launch writes, or None) and
    the launch checks; raises ``ValueError`` naming the argument."""
    if not isinstance(zero_v_tail, tuple) or len(zero_v_tail) != 3:
        raise ValueError("zero_v_tail must be a tuple (kv_indptr, kv_indices, kv_last_page_len)")
    for name, t in zip(_TABLES, zero_v_tail):
        check_index_tensor(name, t)
    checks.check_v_tail_args(cache, *zero_v_tail, layout=layout, written=written)
    return tuple(t.contiguous() for t in zero_v_tail)


def v_tail_plan(targets, layout: str, tables) -> VTailPlan:
    """The :class:`VTailPlan` zeroing ``targets`` (pool tensors already checked by the
    caller; None entries are skipped) with ``tables`` already checked by
    :func:`v_tail_tensors`, which the plan copies (its own: a caller's later change is not
    seen)."""
    return VTailPlan(layout, tuple(fingerprint(t) for t in targets if t is not None), tuple(map(owned_copy, tables)))


def plan_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> VTailPlan:
    """Validate a :func:`zero_paged_v_tail` call once and return its plan (nothing is
    written). Arguments and errors as :func:`zero_paged_v_tail`."""
    check_device("cache", cache)
    check_kernel_dtype("cache", cache)
    check_no_self_overlap("cache", cache)
    check_in_storage("cache", cache)
    tables = v_tail_tensors(cache, layout, (kv_indptr, kv_indices, kv_last_page_len), None)
    return v_tail_plan((cache,), layout, tables)


def run_v_tail(plan: VTailPlan, *targets) -> None:
    """Zero the planned V tails of ``targets`` in place (the pool tensors planned with, or
    others of the same shapes, strides, dtype and device; None entries are skipped): one
    launch per target, none for an empty batch. Raises ValueError for another tensor."""
    given = [t for t in targets if t is not None]
    if len(given) != len(plan.targets) or any(fingerprint(t) != want for t, want in zip(given, plan.targets)):
        raise ValueError(f"the V tail was planned for {plan.targets}, got {[fingerprint(t) for t in given]}")
    for cache in given:
        _launch(cache, plan.layout, *plan.tables)


def _launch(cache, layout, kv_indptr, kv_indices, kv_last_page_len) -> None:
    dims = cache_dims(cache, layout)
    batch = kv_last_page_len.numel()
    if batch == 0:
        return
    # Rows of a page play the part of tokens: the same tile budget applies.
    block_r, block_h, block_d = write_tiles(dims.page_size, dims.num_kv_heads, dims.head_dim)
    grid = (batch, triton.cdiv(dims.page_size, block_r), triton.cdiv(dims.num_kv_heads, block_h))
    # fmt: off
    zero_v_tail_kernel[grid](
        cache, kv_indptr, kv_indices, kv_last_page_len,
        dims.num_kv_heads, dims.head_dim, dims.page_size,
        *cache_strides(cache, layout),
        BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_D=block_d,
    )
    # fmt: on


def zero_paged_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> None:
    """Zero V rows ``kv_last_page_len[b] .. page_size - 1`` of each request's last page
    ``kv_indices[kv_indptr[b + 1] - 1]`` of ``cache`` (the 5-D pool in ``layout``), in
    place (returns None). Requests without pages are skipped. Raises ValueError naming
    the argument before anything is written (see :func:`pagedkv_kernels.write.append_paged_kv`)."""
    return run_v_tail(plan_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout), cache)

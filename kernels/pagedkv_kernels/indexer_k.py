"""The indexer-K scatter: write FP8 key codes and their per-token scales into the DSA
indexer's pool by flat index, whatever the pool's strides.

The host has already turned pages into flat element indices
(:func:`pagedkv_lib.indexer_cache.indexer_slots`); the kernel only unravels each index
over the pool's 4-D shape ``[num_blocks, block_size, 1, per_token_size]`` and takes the
dot product with its strides (:func:`flat_to_offset`), so a pool spread over separate
segments (one layer's view of a layer-interleaved arena) is written correctly. One
program per token, as TensorRT-LLM's ``indexerKCacheScatterUnifiedKernel``: its
``head_dim`` code bytes and the 4 bytes of its fp32 scale. A byte copy: bit-exact
against :func:`pagedkv_lib.indexer_cache.scatter_indexer_k`.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib.indexer_cache import SCALE_BYTES, check_indexer_scatter_args

from .host.launch import fingerprint, owned_copy
from .host.tiles import pow2
from .host.validate import (
    check_device,
    check_disjoint,
    check_head_dim,
    check_in_storage,
    check_index_tensor,
    check_no_self_overlap,
    check_same_layout,
)

__all__ = [
    "flat_to_offset",
    "indexer_k_scatter_kernel",
    "IndexerScatterPlan",
    "plan_indexer_k_scatter",
    "run_indexer_k_scatter",
    "indexer_k_cache_scatter",
]


@triton.jit
def flat_to_offset(flat, dim1, dim2, dim3, stride0, stride1, stride2, stride3):
    """Element offset of flat index ``flat`` (int64) of a 4-D tensor of shape ``[*, dim1,
    dim2, dim3]`` and the given strides: unravel from the last dimension, then dot with
    the strides (TensorRT-LLM's ``flatIndexToMemoryOffset``)."""
    i3 = flat % dim3
    flat = flat // dim3
    i2 = flat % dim2
    flat = flat // dim2
    i1 = flat % dim1
    i0 = flat // dim1
    return i0 * stride0 + i1 * stride1 + i2 * stride2 + i3 * stride3


# fmt: off
@triton.jit
def indexer_k_scatter_kernel(
    # pointers: token codes and scale bytes, the pool, the two slot mappings
    codes_ptr, scale_bytes_ptr, cache_ptr,
    slot_fp8_ptr, slot_scale_ptr,
    # sizes
    head_dim,
    # the pool's shape (dimension 0 is not needed to unravel) and strides, in elements
    dim1, dim2, dim3,
    stride0, stride1, stride2, stride3,
    # source strides: codes [num_tokens, head_dim], scale bytes [num_tokens, 4]
    stride_code_t, stride_code_d, stride_scale_t,
    # constexprs
    BLOCK_D: tl.constexpr, SCALE_BYTES: tl.constexpr,
):
    """Program ``t``: copy token ``t``'s code bytes and scale bytes to the pool, unless its
    slots are ``-1`` (a padding token: nothing is written)."""
    t = tl.program_id(0).to(tl.int64)
    base = tl.load(slot_fp8_ptr + t).to(tl.int64)
    base_scale = tl.load(slot_scale_ptr + t).to(tl.int64)
    # A padding token copies 0 bytes (a count, not a scalar-and-vector mask: the
    # interpreter refuses that combination).
    real = (base >= 0) & (base_scale >= 0)
    num_codes = tl.where(real, head_dim, 0)
    num_scale = tl.where(real, SCALE_BYTES, 0)
    d = tl.arange(0, BLOCK_D)
    code_mask = d < num_codes
    dst = flat_to_offset(base + d, dim1, dim2, dim3, stride0, stride1, stride2, stride3)
    code = tl.load(codes_ptr + t * stride_code_t + d * stride_code_d, mask=code_mask)
    tl.store(cache_ptr + dst, code, mask=code_mask)
    b = tl.arange(0, SCALE_BYTES)
    scale_mask = b < num_scale
    dst_scale = flat_to_offset(base_scale + b, dim1, dim2, dim3, stride0, stride1, stride2, stride3)
    scale = tl.load(scale_bytes_ptr + t * stride_scale_t + b, mask=scale_mask)
    tl.store(cache_ptr + dst_scale, scale, mask=scale_mask)
# fmt: on


@dataclass(frozen=True)
class IndexerScatterPlan:
    """A validated scatter (:func:`plan_indexer_k_scatter`): the pool's fingerprint, the
    two slot mappings as int64 device tensors, the token count and head size;
    :func:`run_indexer_k_scatter` launches it."""

    cache: tuple  # (shape, strides, dtype, device) of k_cache
    slot_fp8: torch.Tensor
    slot_scale: torch.Tensor
    num_tokens: int
    head_dim: int


def plan_indexer_k_scatter(k_cache, codes, scales, slot_fp8, slot_scale) -> IndexerScatterPlan:
    """Validate an :func:`indexer_k_cache_scatter` call once; nothing is written.
    Arguments and errors as :func:`indexer_k_cache_scatter`."""
    check_indexer_scatter_args(k_cache, codes, scales, slot_fp8, slot_scale)
    for name, t in (("k_cache", k_cache), ("codes", codes), ("scales", scales)):
        check_device(name, t)
    check_index_tensor("slot_fp8", slot_fp8, fits_int32=False)
    check_index_tensor("slot_scale", slot_scale, fits_int32=False)
    check_head_dim(codes.shape[1])
    check_no_self_overlap("k_cache", k_cache)
    check_in_storage("k_cache", k_cache)
    reads = [("codes", codes), ("scales", scales), ("slot_fp8", slot_fp8), ("slot_scale", slot_scale)]
    check_disjoint([("k_cache", k_cache)], reads)
    device = k_cache.device
    return IndexerScatterPlan(
        cache=fingerprint(k_cache),
        slot_fp8=owned_copy(slot_fp8, device, torch.int64),
        slot_scale=owned_copy(slot_scale, device, torch.int64),
        num_tokens=codes.shape[0],
        head_dim=codes.shape[1],
    )


def run_indexer_k_scatter(plan: IndexerScatterPlan, k_cache, codes, scales) -> None:
    """Launch a planned scatter into ``k_cache`` (the planned pool, or one of the same
    shape, strides, dtype and device), in place. ``codes`` and ``scales`` must have the
    planned shapes, their dtypes (uint8 or float8_e4m3fn, float32) and the kernels'
    device; ValueError otherwise."""
    check_same_layout("k_cache", k_cache, plan.cache)
    if tuple(codes.shape) != (plan.num_tokens, plan.head_dim) or tuple(scales.shape) != (plan.num_tokens,):
        raise ValueError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)}; the plan was made for "
            f"[{plan.num_tokens}, {plan.head_dim}] and [{plan.num_tokens}]"
        )
    if codes.dtype not in (torch.uint8, torch.float8_e4m3fn) or scales.dtype != torch.float32:
        raise ValueError(f"codes.dtype={codes.dtype}, scales.dtype={scales.dtype}; E4M3 codes and float32 scales")
    check_device("codes", codes)
    check_device("scales", scales)
    if plan.num_tokens == 0:
        return
    code_bytes = codes.view(torch.uint8)
    scale_bytes = scales.contiguous().view(torch.uint8).view(plan.num_tokens, SCALE_BYTES)
    _, dim1, dim2, dim3 = k_cache.shape
    # fmt: off
    indexer_k_scatter_kernel[(plan.num_tokens,)](
        code_bytes, scale_bytes, k_cache,
        plan.slot_fp8, plan.slot_scale,
        plan.head_dim,
        dim1, dim2, dim3,
        *k_cache.stride(),
        *code_bytes.stride(), scale_bytes.stride(0),
        BLOCK_D=pow2(plan.head_dim), SCALE_BYTES=SCALE_BYTES,
    )
    # fmt: on


def indexer_k_cache_scatter(k_cache, codes, scales, slot_fp8, slot_scale) -> None:
    """Write each token's FP8 codes and fp32 scale into the indexer-K pool, in place.

    ``k_cache`` uint8 ``[num_blocks, block_size, 1, per_token_size]``, any strides (e.g.
    :meth:`pagedkv_lib.indexer_cache.IndexerKPool.cache`); ``codes`` uint8 or
    float8_e4m3fn ``[num_tokens, head_dim]``; ``scales`` fp32 ``[num_tokens]``;
    ``slot_fp8`` / ``slot_scale`` int32 or int64 ``[num_tokens]``: flat element indices
    (of the 4-D shape, as if contiguous) where the token's codes and its scale's 4 bytes
    start, ``-1`` in both for a padding token (skipped), as
    :func:`pagedkv_lib.indexer_cache.indexer_slots` computes them. All on the kernels'
    device. Raises ValueError naming the argument, before anything is launched: wrong
    dtypes, shapes or devices, a slot range outside the pool, two slots writing one
    byte, a pool that reaches an element twice or shares memory with an input.
    """
    run_indexer_k_scatter(plan_indexer_k_scatter(k_cache, codes, scales, slot_fp8, slot_scale), k_cache, codes, scales)

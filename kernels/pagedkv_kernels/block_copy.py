"""The block copy: whole or partial blocks of a multi-layer pool, every layer in one launch.

The Triton twin of TensorRT-LLM's ``cuKVCacheBlockPartialCopy``: pairs of (source block,
destination block, tokens to copy, ``<= 0`` for the whole block), over a pool
``[num_layers, num_pages, 2, page_size, num_heads, head_dim]`` (NHD) or ``[..., 2,
num_heads, page_size, head_dim]`` (HND). One program covers a tile of one pair's token
rows and heads and loops over the layers and K/V, as the CUDA kernel loops over layers
(``strideLayer * iLayer``): the block id is the same in every layer. The partial copy is
a bound on the token index, so the two layouts differ only in their strides (see
:mod:`pagedkv_lib.block_copy`, whose :func:`~pagedkv_lib.block_copy.copy_blocks` is the
reference). Values are loaded and stored in the pool's dtype, never computed with:
bit-exact, NaN payloads included.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib.block_copy import check_block_copy_args, pool_dims

from .host.launch import fingerprint, int32_on_device
from .host.tiles import write_tiles
from .host.validate import (
    check_device,
    check_disjoint,
    check_in_storage,
    check_index_tensor,
    check_no_overlap,
    check_no_self_overlap,
    check_same_layout,
)

__all__ = ["block_copy_kernel", "BlockCopyPlan", "plan_block_copy", "run_block_copy", "copy_paged_blocks"]


# fmt: off
@triton.jit
def block_copy_kernel(
    # pointers: the pools, then one entry per pair
    src_ptr, dst_ptr,
    src_blocks_ptr, dst_blocks_ptr, num_tokens_ptr,
    # sizes
    num_layers, page_size, num_heads, head_dim,
    # source strides: layer, page, K/V, token, head, feature
    s_layer, s_page, s_kv, s_tok, s_head, s_dim,
    # destination strides, in the same order
    d_layer, d_page, d_kv, d_tok, d_head, d_dim,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(pair, t, h)``: rows ``t*BLOCK_T ...`` and heads ``h*BLOCK_H ...`` of pair
    ``pair``, K and V, every layer."""
    pair = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    src_page = tl.load(src_blocks_ptr + pair).to(tl.int64)
    dst_page = tl.load(dst_blocks_ptr + pair).to(tl.int64)
    n = tl.load(num_tokens_ptr + pair)
    n = tl.where(n <= 0, page_size, n)  # the sentinel: the whole block
    mask = (t < n)[:, None, None] & (h < num_heads)[None, :, None] & (d < head_dim)[None, None, :]
    t64, h64, d64 = t.to(tl.int64)[:, None, None], h.to(tl.int64)[None, :, None], d.to(tl.int64)[None, None, :]
    src = src_ptr + src_page * s_page + t64 * s_tok + h64 * s_head + d64 * s_dim
    dst = dst_ptr + dst_page * d_page + t64 * d_tok + h64 * d_head + d64 * d_dim
    # A while loop: Triton 3.6's interpreter cannot range() over a runtime bound. The
    # layer index is int64: layer * s_layer passes 2**31 elements in a large pool.
    layer = tl.zeros([], tl.int64)
    while layer < num_layers:
        for kv in tl.static_range(2):
            values = tl.load(src + layer * s_layer + kv * s_kv, mask=mask)
            tl.store(dst + layer * d_layer + kv * d_kv, values, mask=mask)
        layer += 1
# fmt: on


@dataclass(frozen=True)
class BlockCopyPlan:
    """A validated block copy (:func:`plan_block_copy`): the pools' fingerprints (``dst``
    None for a copy inside one pool), the pairs as int32 device tensors, the sizes and
    the tile; :func:`run_block_copy` launches it."""

    layout: str
    src: tuple  # (shape, strides, dtype, device) of cache
    dst: tuple | None
    src_blocks: torch.Tensor
    dst_blocks: torch.Tensor
    num_tokens: torch.Tensor
    num_pairs: int
    tiles: tuple[int, int, int]  # (BLOCK_T, BLOCK_H, BLOCK_D)


def plan_block_copy(cache, src_blocks, dst_blocks, num_tokens, layout: str = "NHD", dst_cache=None) -> BlockCopyPlan:
    """Validate a :func:`copy_paged_blocks` call once; nothing is copied. Arguments and
    errors as :func:`copy_paged_blocks`."""
    check_block_copy_args(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache)
    written = cache if dst_cache is None else dst_cache
    for name, t in (("cache", cache), ("dst_cache", dst_cache), ("src_blocks", src_blocks),
                    ("dst_blocks", dst_blocks), ("num_tokens", num_tokens)):  # fmt: skip
        if t is not None:
            check_device(name, t)
    for name, t in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks), ("num_tokens", num_tokens)):
        check_index_tensor(name, t)
    written_name = "dst_cache" if dst_cache is not None else "cache"
    check_no_self_overlap(written_name, written)
    check_in_storage("cache", cache)
    if dst_cache is not None:
        check_in_storage("dst_cache", dst_cache)
        check_no_overlap("dst_cache", dst_cache, "cache", cache)
    pairs = [("src_blocks", src_blocks), ("dst_blocks", dst_blocks), ("num_tokens", num_tokens)]
    check_disjoint([(written_name, written)], pairs)  # ids stored in the pool being written
    _, _, page_size, heads, head_dim = pool_dims(cache, layout)
    device = cache.device
    return BlockCopyPlan(
        layout=layout,
        src=fingerprint(cache),
        dst=None if dst_cache is None else fingerprint(dst_cache),
        src_blocks=int32_on_device(src_blocks, device, 1),
        dst_blocks=int32_on_device(dst_blocks, device, 1),
        num_tokens=int32_on_device(num_tokens, device, 1),
        num_pairs=src_blocks.numel(),
        tiles=write_tiles(page_size, heads, head_dim),
    )


def _strides(cache: torch.Tensor, layout: str) -> tuple[int, ...]:
    """``(layer, page, kv, token, head, feature)`` strides of a pool in ``layout``."""
    sl, sp, skv, sa, sb, sd = cache.stride()
    return (sl, sp, skv, sa, sb, sd) if layout == "NHD" else (sl, sp, skv, sb, sa, sd)


def run_block_copy(plan: BlockCopyPlan, cache, dst_cache=None) -> None:
    """Launch a planned copy, in place: from ``cache`` into ``dst_cache`` (``cache`` when
    the plan was made without one). Each pool must have the planned shape, strides,
    dtype and device; ValueError otherwise."""
    check_same_layout("cache", cache, plan.src)
    if (dst_cache is None) != (plan.dst is None):
        raise ValueError("dst_cache must be given exactly when the plan was made with one")
    if dst_cache is not None:
        check_same_layout("dst_cache", dst_cache, plan.dst)
    if plan.num_pairs == 0:
        return
    out = cache if dst_cache is None else dst_cache
    layers, _, page_size, heads, head_dim = pool_dims(cache, plan.layout)
    block_t, block_h, block_d = plan.tiles
    grid = (plan.num_pairs, triton.cdiv(page_size, block_t), triton.cdiv(heads, block_h))
    # fmt: off
    block_copy_kernel[grid](
        cache, out,
        plan.src_blocks, plan.dst_blocks, plan.num_tokens,
        layers, page_size, heads, head_dim,
        *_strides(cache, plan.layout),
        *_strides(out, plan.layout),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )
    # fmt: on


def copy_paged_blocks(cache, src_blocks, dst_blocks, num_tokens, layout: str = "NHD", dst_cache=None) -> None:
    """Copy whole or partial blocks for every layer in one launch, in place.

    ``cache``: ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]`` (NHD) or
    ``[num_layers, num_pages, 2, num_heads, page_size, head_dim]`` (HND), fp32, fp16,
    bf16 or uint8, any strides. ``src_blocks``, ``dst_blocks``, ``num_tokens``: int32 or
    int64 ``[num_pairs]`` on the kernels' device; pair ``i`` copies the first
    ``num_tokens[i]`` rows (``<= 0``: all ``page_size``) of block ``src_blocks[i]`` to
    block ``dst_blocks[i]``, K and V, every head and layer; the destination's other
    rows keep their values. ``dst_cache``: another pool of the same layers, page size,
    heads, head size, dtype and layout to copy into (offload, restore); None copies
    inside ``cache`` (copy-on-write). Equal to
    :func:`pagedkv_lib.block_copy.copy_blocks` bit for bit. Raises ValueError naming
    the argument before anything is launched: a block id outside its pool, a count
    above ``page_size``, two pairs writing one block, inside one pool a destination
    that is also a source, pools that overlap, an index tensor inside the pool written,
    wrong dtypes, shapes or devices.
    """
    run_block_copy(plan_block_copy(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache), cache, dst_cache)

"""Copying whole or partial blocks of a multi-layer pool: the rules and the torch reference.

A block id names the same page in every layer (the cache manager allocates a block for
all layers at once), so one list of ``(source block, destination block, tokens)``
pairs moves a block's K and V for every layer, as TensorRT-LLM's
``cuKVCacheBlockPartialCopy`` does in one launch. ``tokens <= 0`` means the whole block
(the kernel's sentinel); otherwise the first ``tokens`` rows of the block are copied and
the destination's other rows are left as they were (copy-on-write of a partly filled
last block; offload and restore copy whole blocks).

The pool is ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]`` (``"NHD"``)
or ``[num_layers, num_pages, 2, num_heads, page_size, head_dim]`` (``"HND"``, the
TensorRT-LLM block layout ``[head, token, hidden]``). In NHD the first ``n`` rows of a
block's K (or V) are one contiguous prefix of ``n * num_heads * head_dim`` elements; in
HND they are a prefix of each head's run of rows, ``num_heads`` strided pieces. Either
way the token is a dimension of its own, so a partial copy is a bound on the token
index and never a remapping of addresses.
"""

from __future__ import annotations

import torch

from pagedkv_lib.formats import check_has_values
from pagedkv_lib.pool import check_layout

__all__ = ["COPY_DTYPES", "pool_dims", "check_block_copy_args", "copy_blocks"]

# A copy moves bits, so any of these works; uint8 carries FP8 codes.
COPY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


def pool_dims(cache: torch.Tensor, layout: str = "NHD") -> tuple[int, int, int, int, int]:
    """``(num_layers, num_pages, page_size, num_heads, head_dim)`` of a multi-layer pool;
    ValueError unless it is a 6-D tensor of a :data:`COPY_DTYPES` dtype with K/V dim 2."""
    check_layout(layout)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 6 or cache.shape[2] != 2:
        shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        order = "page_size, num_heads" if layout == "NHD" else "num_heads, page_size"
        raise ValueError(f"cache must be [num_layers, num_pages, 2, {order}, head_dim] ({layout}), got {shape}")
    if cache.dtype not in COPY_DTYPES:
        raise ValueError(f"cache.dtype={cache.dtype}; block copies take {', '.join(map(str, COPY_DTYPES))}")
    layers, pages, _, a, b, head_dim = cache.shape
    page_size, heads = (a, b) if layout == "NHD" else (b, a)
    if 0 in (layers, pages, page_size, heads, head_dim):
        raise ValueError(f"cache has shape {tuple(cache.shape)}: an empty dimension holds no block ({layout} layout)")
    return layers, pages, page_size, heads, head_dim


def _host_ids(name: str, t, num_pairs: int | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {got}")
    if num_pairs is not None and t.numel() != num_pairs:
        raise ValueError(f"{name} has {t.numel()} entries but src_blocks has {num_pairs}")
    check_has_values(name, t)
    return t.detach().cpu().long()


def check_block_copy_args(cache, src_blocks, dst_blocks, num_tokens, layout="NHD", dst_cache=None):
    """Value checks of a block copy; returns host int64 ``(src, dst, tokens)``, with
    ``tokens`` resolved (``<= 0`` becomes ``page_size``). ``dst_cache`` None copies
    inside ``cache``; otherwise into ``dst_cache`` (same layers, page size, heads, head
    size, dtype; any number of pages). ValueError naming the argument for a block id
    outside its pool, a token count above ``page_size``, two pairs writing one
    destination block, or (inside one pool) a destination block that is also a source."""
    layers, pages, page_size, heads, head_dim = pool_dims(cache, layout)
    dst_pages = pages
    if dst_cache is not None:
        d_layers, dst_pages, d_ps, d_heads, d_dim = pool_dims(dst_cache, layout)
        if (d_layers, d_ps, d_heads, d_dim) != (layers, page_size, heads, head_dim) or dst_cache.dtype != cache.dtype:
            raise ValueError(
                f"dst_cache {tuple(dst_cache.shape)} {dst_cache.dtype} does not match cache "
                f"{tuple(cache.shape)} {cache.dtype} outside the pages dimension"
            )
    src = _host_ids("src_blocks", src_blocks, None)
    dst = _host_ids("dst_blocks", dst_blocks, src.numel())
    tokens = _host_ids("num_tokens", num_tokens, src.numel())
    for name, ids, n in (("src_blocks", src, pages), ("dst_blocks", dst, dst_pages)):
        bad = (ids < 0) | (ids >= n)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name}[{i}]={int(ids[i])} is outside the pool ({n} pages)")
    if (tokens > page_size).any():
        i = int(torch.nonzero(tokens > page_size)[0])
        raise ValueError(f"num_tokens[{i}]={int(tokens[i])} exceeds page_size={page_size} (<= 0: the whole block)")
    seen: dict[int, int] = {}
    for i, d in enumerate(dst.tolist()):
        if d in seen:
            raise ValueError(f"dst_blocks[{seen[d]}] and dst_blocks[{i}] both write block {d}; the result would race")
        seen[d] = i
    if dst_cache is None:
        both = set(src.tolist()) & seen.keys()
        if both:
            d = min(both)
            j = int(torch.nonzero(src == d)[0])
            raise ValueError(
                f"block {d} is dst_blocks[{seen[d]}] and src_blocks[{j}]: a copy could read it after it was "
                "overwritten; copy through a free block instead"
            )
    return src, dst, torch.where(tokens <= 0, page_size, tokens)


def copy_blocks(cache, src_blocks, dst_blocks, num_tokens, layout: str = "NHD", dst_cache=None) -> None:
    """The reference block copy, in place: for each pair ``i`` and every layer, the first
    ``num_tokens[i]`` rows (all of them when ``<= 0``) of block ``src_blocks[i]`` of
    ``cache`` go to block ``dst_blocks[i]`` of ``dst_cache`` (``cache`` when None), K
    and V, all heads. A torch copy per pair: bits move unchanged (NaN payloads
    included). Arguments and errors as :func:`check_block_copy_args`."""
    src, dst, tokens = check_block_copy_args(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache)
    out = cache if dst_cache is None else dst_cache
    for s, d, n in zip(src.tolist(), dst.tolist(), tokens.tolist()):
        if layout == "NHD":
            out[:, d, :, :n].copy_(cache[:, s, :, :n])
        else:
            out[:, d, :, :, :n].copy_(cache[:, s, :, :, :n])

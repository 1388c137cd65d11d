"""Other engines' KV-cache layouts, and exact conversions to and from the suite's pool.

The suite's pool is one 5-D tensor with K and V interleaved per page
(:mod:`pagedkv_lib.pool`). Kernels written for other engines take other objects; the
conformance harness builds each case's pool directly in the layout a kernel declares
(converting outside the checked call, never inside it) and converts back to compare:

* ``"paged"`` (the suite's): ``cache [num_pages, 2, page_size, num_kv_heads, head_dim]``
  (NHD) or ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), K at index 0 of
  dim 1, V at 1.
* ``"kv_tuple"`` (FlashInfer's ``(k_cache, v_cache)`` tuple; also vLLM's flash-attention
  layout, ``key_cache``/``value_cache``): two tensors ``[num_pages, page_size,
  num_kv_heads, head_dim]`` (NHD) or ``[num_pages, num_kv_heads, page_size, head_dim]``
  (HND).
* ``"vllm_x"`` (vLLM's original paged-attention layout): ``key_cache [num_blocks,
  num_kv_heads, head_dim // x, block_size, x]`` with ``x = 16 // element_size`` (16
  bytes of a key row stay together) and ``value_cache [num_blocks, num_kv_heads,
  head_dim, block_size]``. ``layout`` does not apply (a single layout).
* ``"flat"`` (a flat slot cache, as nano-vllm's store kernel addresses it): ``k_cache,
  v_cache [num_slots, num_kv_heads * head_dim]``, row ``slot = page * page_size + row``.
  ``layout`` does not apply.

:func:`to_native` and :func:`to_paged` are exact copies (bit for bit, NaN payloads
included), so a comparison in the suite's layout is a comparison of what the kernel
wrote.
"""

from __future__ import annotations

import torch

from .pool import cache_dims

__all__ = ["CACHE_LAYOUTS", "check_cache_layout", "native_shapes", "to_native", "to_paged", "native_tensors"]

CACHE_LAYOUTS = ("paged", "kv_tuple", "vllm_x", "flat")


def check_cache_layout(cache_layout: str) -> str:
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout={cache_layout!r} must be one of {CACHE_LAYOUTS}")
    return cache_layout


def _x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group of vLLM's key layout."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def native_shapes(cache_layout: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, layout, dtype):
    """The shape(s) of the native cache object: one shape for ``"paged"``, a pair of
    shapes (K, V) otherwise."""
    check_cache_layout(cache_layout)
    p, n, h, d = num_pages, page_size, num_kv_heads, head_dim
    if cache_layout == "paged":
        return (p, 2, n, h, d) if layout == "NHD" else (p, 2, h, n, d)
    if cache_layout == "kv_tuple":
        shape = (p, n, h, d) if layout == "NHD" else (p, h, n, d)
        return shape, shape
    if cache_layout == "vllm_x":
        x = _x(dtype)
        if d % x:
            raise ValueError(f"vllm_x needs head_dim divisible by x={x} ({dtype}), got {d}")
        return (p, h, d // x, n, x), (p, h, d, n)
    return (p * n, h * d), (p * n, h * d)


def _kv_nhd(cache: torch.Tensor, layout: str, kv: int) -> torch.Tensor:
    """One of K/V of a suite pool as a ``[num_pages, page_size, heads, dim]`` view."""
    half = cache[:, kv]
    return half if layout == "NHD" else half.transpose(1, 2)


def to_native(cache: torch.Tensor, cache_layout: str, layout: str = "NHD"):
    """A copy of the suite pool ``cache`` in ``cache_layout``: a 5-D tensor for
    ``"paged"``, a tuple ``(k_cache, v_cache)`` otherwise (see the module docstring)."""
    dims = cache_dims(cache, layout)
    check_cache_layout(cache_layout)
    if cache_layout == "paged":
        return cache.clone()
    k, v = _kv_nhd(cache, layout, 0), _kv_nhd(cache, layout, 1)  # [p, n, h, d] views
    if cache_layout == "kv_tuple":
        if layout == "NHD":
            return k.contiguous(), v.contiguous()
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    if cache_layout == "vllm_x":
        x = _x(cache.dtype)
        native_shapes("vllm_x", *dims, layout, cache.dtype)  # checks head_dim % x
        key = k.permute(0, 2, 3, 1).reshape(dims.num_pages, dims.num_kv_heads, dims.head_dim // x, x, dims.page_size)
        return key.transpose(3, 4).contiguous(), v.permute(0, 2, 3, 1).contiguous()
    rows = dims.num_pages * dims.page_size
    return k.reshape(rows, -1).contiguous(), v.reshape(rows, -1).contiguous()


def to_paged(native, cache_layout: str, layout: str, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    """The suite pool (a new 5-D tensor in ``layout``) holding what ``native`` holds;
    the inverse of :func:`to_native`."""
    check_cache_layout(cache_layout)
    if cache_layout == "paged":
        return native.clone()
    k, v = native
    p, n, h, d = num_pages, page_size, num_kv_heads, head_dim
    if cache_layout == "kv_tuple":
        k_nhd, v_nhd = (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))
    elif cache_layout == "vllm_x":
        k_nhd = k.transpose(3, 4).reshape(p, h, d, n).permute(0, 3, 1, 2)
        v_nhd = v.permute(0, 3, 1, 2)
    else:
        k_nhd, v_nhd = k.reshape(p, n, h, d), v.reshape(p, n, h, d)
    both = torch.stack([k_nhd, v_nhd], dim=1)  # [p, 2, n, h, d]
    return both.contiguous() if layout == "NHD" else both.transpose(2, 3).contiguous()


def native_tensors(native) -> dict[str, torch.Tensor]:
    """The tensors of a native cache object by name (``cache``, or ``k_cache`` and
    ``v_cache``), for guard checks and reports."""
    if isinstance(native, torch.Tensor):
        return {"cache": native}
    return {"k_cache": native[0], "v_cache": native[1]}

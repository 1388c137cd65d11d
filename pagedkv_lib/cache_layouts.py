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
* ``"flat"`` (a flat slot cache, as nano-vllm's store kernel addresses it, and LightLLM's
  and SGLang's token pools): ``k_cache, v_cache [num_slots, num_kv_heads * head_dim]``,
  row ``slot = page * page_size + row``. ``layout`` does not apply. The pair is a
  :class:`FlatCache`, which carries ``page_size``: a reader given block tables needs it
  to turn ``(page, row)`` into a slot (105 slots are 21 pages of 5 or 35 of 3), as a
  slot-table kernel (LightLLM's ``req_to_token_indexs``) does.

:func:`to_native` and :func:`to_paged` are exact copies (bit for bit, NaN payloads
included), so a comparison in the suite's layout is a comparison of what the kernel
wrote. :func:`kv_cache_view` goes the other way without a copy: it tells the suite's pool,
a ``"kv_tuple"`` pair and a ``"vllm_x"`` pair apart by type and shape and gives the
strides a read kernel addresses K and V with in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv_lib.checks.scalars import check_int
from pagedkv_lib.pool import CacheDims, cache_dims, cache_strides, check_layout

__all__ = [
    "CACHE_LAYOUTS",
    "FlatCache",
    "check_cache_layout",
    "native_shapes",
    "to_native",
    "to_paged",
    "native_tensors",
    "native_from",
    "KVCacheView",
    "kv_cache_view",
]

CACHE_LAYOUTS = ("paged", "kv_tuple", "vllm_x", "flat")


class FlatCache(tuple):
    """A ``"flat"`` cache: the pair ``(k_cache, v_cache)``, each ``[num_slots, num_kv_heads *
    head_dim]``, that also says its ``page_size`` (slot ``page * page_size + row``). It
    unpacks as the pair (``k_cache, v_cache = cache``) and indexes as one."""

    page_size: int

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int):
        check_int("page_size", page_size, 1)
        if k_cache.shape[0] % page_size:
            raise ValueError(f"k_cache has {k_cache.shape[0]} slots, not a whole number of pages of {page_size}")
        pair = super().__new__(cls, (k_cache, v_cache))
        pair.page_size = page_size
        return pair

    def __reduce__(self):  # pickled (a child process's result) as what it is
        return FlatCache, (self[0], self[1], self.page_size)


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
    return FlatCache(k.reshape(rows, -1).contiguous(), v.reshape(rows, -1).contiguous(), dims.page_size)


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


def native_from(native, tensors: dict[str, torch.Tensor]):
    """A native cache object of ``native``'s kind (a tensor, a pair, a :class:`FlatCache`
    with its page size) holding ``tensors`` (by the names of :func:`native_tensors`)."""
    if isinstance(native, torch.Tensor):
        return tensors["cache"]
    if isinstance(native, FlatCache):
        return FlatCache(tensors["k_cache"], tensors["v_cache"], native.page_size)
    return tensors["k_cache"], tensors["v_cache"]


class KVCacheView(NamedTuple):
    """A K/V cache as a read kernel addresses it in place (:func:`kv_cache_view`).

    ``key`` and ``value`` are the tensors K and V are read from (for the suite's pool, its
    halves ``cache[:, 0]`` and ``cache[:, 1]``: views, no copy). Strides are in elements:
    ``key_strides = (page, row, head, feature, feature_in_group)``, feature ``d`` of a key
    row lying at ``(d // key_x) * feature + (d % key_x) * feature_in_group`` (vLLM's x
    packing; ``key_x`` 1 and ``feature_in_group`` 0 elsewhere); ``value_strides = (page,
    row, head, feature)``; ``kv_step``: for the pool, V's offset from K (its
    ``stride_kv``: every V element lies that far after its K element), 0 for a pair."""

    cache_layout: str  # "paged", "kv_tuple" or "vllm_x"
    dims: CacheDims
    key: torch.Tensor
    value: torch.Tensor
    key_strides: tuple[int, int, int, int, int]
    key_x: int
    value_strides: tuple[int, int, int, int]
    kv_step: int = 0

    def geometry(self, layout: str = "NHD") -> torch.Tensor:
        """A ``meta`` tensor (no memory) of the suite pool's shape in ``layout`` and the
        cache's dtype: what the argument rules of :mod:`pagedkv_lib.checks`, written for
        the pool, read (its dims) when the cache is a pair."""
        return torch.empty(native_shapes("paged", *self.dims, layout, self.key.dtype), dtype=self.key.dtype,
                           device="meta")  # fmt: skip


def kv_cache_view(cache, layout: str = "NHD") -> KVCacheView:
    """The :class:`KVCacheView` of ``cache``: the suite's 5-D pool in ``layout``, or a pair
    ``(key_cache, value_cache)``: ``"kv_tuple"`` when the key is 4-D (two tensors of one
    shape in ``layout``), ``"vllm_x"`` when it is 5-D (``[num_blocks, num_kv_heads,
    head_dim // x, block_size, x]`` with ``x = 16 // element_size``, and the value
    ``[num_blocks, num_kv_heads, head_dim, block_size]``; ``layout`` does not apply).

    Raises ValueError naming ``cache`` (``cache[0]`` the key, ``cache[1]`` the value) for
    anything else: another object, tensors of different dtypes or devices, shapes that
    do not match each other, a wrong ``x``, an empty dimension."""
    check_layout(layout)
    if isinstance(cache, torch.Tensor):
        dims = cache_dims(cache, layout)
        sp, skv, sn, sh, sd = cache_strides(cache, layout)
        return KVCacheView("paged", dims, cache[:, 0], cache[:, 1], (sp, sn, sh, sd, 0), 1, (sp, sn, sh, sd), skv)
    if not (isinstance(cache, (tuple, list)) and len(cache) == 2 and all(isinstance(t, torch.Tensor) for t in cache)):
        raise ValueError(
            f"cache must be the suite's 5-D pool or a (key_cache, value_cache) pair of tensors, got {_describe(cache)}"
        )
    key, value = cache
    if key.dtype != value.dtype or key.device != value.device:
        raise ValueError(
            f"cache[1] (value_cache) is {value.dtype} on {value.device} but cache[0] (key_cache) is {key.dtype} on "
            f"{key.device}; K and V must share dtype and device"
        )
    if key.dim() == 4:
        view = _kv_tuple_view(key, value, layout)
    elif key.dim() == 5:
        view = _vllm_x_view(key, value)
    else:
        raise ValueError(
            f"cache[0] (key_cache) has shape {tuple(key.shape)}: a kv_tuple key is 4-D, a vllm_x key 5-D "
            "[num_blocks, num_kv_heads, head_dim // x, block_size, x]"
        )
    empty = [name for name, size in view.dims._asdict().items() if size == 0]
    if empty:
        raise ValueError(f"cache ({view.cache_layout}) has {', '.join(empty)} 0: it holds no row")
    return view


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: " + ", ".join(_describe(t) for t in x)
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _kv_tuple_view(key: torch.Tensor, value: torch.Tensor, layout: str) -> KVCacheView:
    """FlashInfer's ``(k_cache, v_cache)``: ``[pages, page_size, heads, dim]`` (NHD) or
    ``[pages, heads, page_size, dim]`` (HND), one shape for both."""
    if key.shape != value.shape:
        raise ValueError(
            f"cache[1] (value_cache) has shape {tuple(value.shape)} but cache[0] (key_cache) {tuple(key.shape)}; "
            "a kv_tuple pair has one shape"
        )
    p, a, b, d = key.shape
    dims = CacheDims(p, a, b, d) if layout == "NHD" else CacheDims(p, b, a, d)

    def strides(t):
        sp, s1, s2, sd = t.stride()
        return (sp, s1, s2, sd) if layout == "NHD" else (sp, s2, s1, sd)

    return KVCacheView("kv_tuple", dims, key, value, (*strides(key), 0), 1, strides(value))


def _vllm_x_view(key: torch.Tensor, value: torch.Tensor) -> KVCacheView:
    """vLLM's ``key_cache [blocks, heads, dim // x, block_size, x]`` and ``value_cache
    [blocks, heads, dim, block_size]``."""
    p, h, groups, n, x = key.shape
    want_x = _x(key.dtype)
    if x != want_x:
        raise ValueError(
            f"cache[0] (key_cache) has shape {tuple(key.shape)}: its last dim x={x}, but vLLM packs "
            f"x = 16 // element_size = {want_x} {key.dtype} elements"
        )
    if tuple(value.shape) != (p, h, groups * x, n):
        raise ValueError(
            f"cache[1] (value_cache) has shape {tuple(value.shape)}; the key_cache {tuple(key.shape)} needs "
            f"[num_blocks, num_kv_heads, head_dim, block_size] = {(p, h, groups * x, n)}"
        )
    sp, sh, sg, sn, sx = key.stride()
    vp, vh, vd, vn = value.stride()
    return KVCacheView("vllm_x", CacheDims(p, n, h, groups * x), key, value, (sp, sn, sh, sg, sx), x, (vp, vn, vh, vd))

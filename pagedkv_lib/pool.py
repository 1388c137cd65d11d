"""The paged KV pool: one 5-D tensor holding K and V for every page, and its layouts.

Layouts (FlashInfer's names), index 0 of dim 1 is K and 1 is V:

* ``NHD``: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (token rows outermost
  within a page; one token's heads are adjacent, which suits writes);
* ``HND``: ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (one head's rows are
  adjacent, which suits reads that walk a head's keys).

The references and the kernels take the raw tensor (``pool.cache`` or any tensor of
that shape); :func:`cache_dims` and :func:`cache_strides` read a layout from it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import NamedTuple

import torch

from pagedkv_lib.checks.scalars import check_positive_int
from pagedkv_lib.indexing import check_page_size, element_offset

__all__ = ["LAYOUTS", "CacheDims", "check_layout", "cache_dims", "cache_strides", "PagedKVPool"]

LAYOUTS = ("NHD", "HND")


class CacheDims(NamedTuple):
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def check_layout(layout: str) -> str:
    """Return ``layout`` if it is ``"NHD"`` or ``"HND"``, else raise ValueError."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    return layout


def cache_dims(cache: torch.Tensor, layout: str = "NHD") -> CacheDims:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of a raw 5-D pool tensor; every
    one must be > 0 (ValueError naming the empty dimension otherwise)."""
    check_layout(layout)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.shape[1] != 2:
        shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        want = "[num_pages, 2, page_size, num_kv_heads, head_dim]"
        if layout == "HND":
            want = "[num_pages, 2, num_kv_heads, page_size, head_dim]"
        raise ValueError(f"cache has shape {shape}; a {layout} pool is {want}")
    pages, _, a, b, dim = cache.shape
    dims = CacheDims(pages, a, b, dim) if layout == "NHD" else CacheDims(pages, b, a, dim)
    empty = [name for name, size in dims._asdict().items() if size == 0]
    if empty:
        # A pool with an empty dimension holds no row: every index into it is out of
        # bounds (and page_size 0 would divide by zero in the slot arithmetic).
        raise ValueError(f"cache has shape {tuple(cache.shape)}: {', '.join(empty)} is 0 ({layout} layout)")
    return dims


def cache_strides(cache: torch.Tensor, layout: str = "NHD") -> tuple[int, int, int, int, int]:
    """Element strides ``(stride_page, stride_kv, stride_n, stride_h, stride_d)`` of a
    raw pool tensor, in the layout-independent order that :func:`element_offset` takes."""
    cache_dims(cache, layout)
    sp, skv, s2, s3, sd = cache.stride()
    return (sp, skv, s2, s3, sd) if layout == "NHD" else (sp, skv, s3, s2, sd)


def _int_or_none(value) -> int | None:
    """``value`` as an int if it is one (or integer-like, as ``operator.index`` takes it:
    numpy ints, 0-d int tensors), else None. Floats are refused, ``3.0`` too; so is bool,
    an int subclass that is never meant as a page id or row count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class PagedKVPool:
    """A pool of ``num_pages`` pages of ``page_size`` token rows for K and V.

    ``cache`` is the 5-D tensor (see the module docstring for the layouts); pages are
    zero-filled at creation. Page ids are the first index.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        layout: str = "NHD",
        device: torch.device | str = "cpu",
    ) -> None:
        check_page_size(page_size, owner="PagedKVPool")
        for name, value in (
            ("num_pages", num_pages),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_positive_int(name, value, "PagedKVPool")
        self.layout = check_layout(layout)
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
        self.cache = torch.zeros((num_pages, 2, *inner, head_dim), dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.cache.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def num_slots(self) -> int:
        """Token rows in the pool: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def strides(self) -> tuple[int, int, int, int, int]:
        """Element strides ``(page, kv, token row, head, feature)``."""
        return cache_strides(self.cache, self.layout)

    def element_offset(self, page, kv, head, entry, feat):
        """Element offset of (page, K=0/V=1, head, row in page, feature) into the
        flat storage: ``page*stride_page + kv*stride_kv + entry*stride_n + head*stride_h + feat*stride_d``."""
        return element_offset(self.strides, page, kv, head, entry, feat)

    def rows(self, page: int, kv: int) -> torch.Tensor:
        """View of one page's K (``kv=0``) or V (``kv=1``) as ``[page_size, num_kv_heads, head_dim]``."""
        block = self.cache[page, kv]
        return block if self.layout == "NHD" else block.transpose(0, 1)

    def copy_blocks(self, pairs: Iterable[tuple[int, ...]]) -> None:
        """Copy pages (K and V) for every ``(src, dst)`` or ``(src, dst, num_rows)``.

        With ``num_rows`` only the first ``num_rows`` token rows are copied (a partial
        block copy: copy-on-write of a partly filled last page needs no more). Page ids
        and ``num_rows`` are ints (or integer-like, as ``operator.index`` takes them; not
        bools or floats). Every pair is checked before anything is copied: ValueError
        naming ``pairs[i]`` and the field for a pair of the wrong length, a value that is
        not an int, a page outside the pool, ``src == dst``, or ``num_rows`` outside
        ``[0, page_size]``; the pool is then unchanged.
        """
        checked = []
        for i, pair in enumerate(pairs):
            try:
                pair = tuple(pair)
            except TypeError:
                raise ValueError(f"pairs[{i}]={pair!r} must be (src, dst) or (src, dst, num_rows)") from None
            if len(pair) not in (2, 3):
                raise ValueError(f"pairs[{i}]={pair!r} must be (src, dst) or (src, dst, num_rows)")
            values = [_int_or_none(value) for value in pair]
            for name, given, value in zip(("src", "dst", "num_rows"), pair, values):
                if value is None:
                    raise ValueError(f"pairs[{i}].{name}={given!r} is not an int")
            for name, page in zip(("src", "dst"), values[:2]):
                if not 0 <= page < self.num_pages:
                    raise ValueError(f"pairs[{i}].{name}={page} is outside the pool ({self.num_pages} pages)")
            if values[0] == values[1]:
                raise ValueError(f"pairs[{i}] copies page {values[0]} onto itself")
            if len(values) == 3 and not 0 <= values[2] <= self.page_size:
                raise ValueError(f"pairs[{i}].num_rows={values[2]} must be in [0, {self.page_size}]")
            checked.append(values)
        for src, dst, *rows in checked:
            n = rows[0] if rows else self.page_size
            if self.layout == "NHD":
                self.cache[dst, :, :n] = self.cache[src, :, :n]
            else:
                self.cache[dst, :, :, :n] = self.cache[src, :, :, :n]

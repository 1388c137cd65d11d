"""Address arithmetic: token position -> (logical block, offset) -> physical slot -> element.

These functions are the one home of the divmod and of the element-offset formula;
everything else (references, pool, notebooks) calls them. They accept Python ints
or integer torch tensors (elementwise).
"""

from __future__ import annotations

from typing import TypeVar

import torch

from pagedkv_lib.checks.scalars import check_positive_int

__all__ = [
    "check_page_size",
    "is_power_of_two",
    "locate",
    "locate_pow2",
    "slot_of",
    "split_slot",
    "element_offset",
]

Index = TypeVar("Index", int, torch.Tensor)


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def check_page_size(page_size: int, owner: str = "") -> None:
    """Raise ValueError unless ``page_size`` is a positive int (tokens per page); the
    message starts with ``owner`` (``"PagedKVPool: page_size=0 ..."``) when given."""
    check_positive_int("page_size", page_size, owner)


def locate(position: Index, page_size: int) -> tuple[Index, Index]:
    """Return ``(logical_block, offset)`` of a token position: ``divmod(position, page_size)``.

    Works for any positive ``page_size`` (5 as well as 16). ``position`` must be >= 0.
    """
    check_page_size(page_size)
    if isinstance(position, torch.Tensor):
        return torch.div(position, page_size, rounding_mode="floor"), position % page_size
    return divmod(position, page_size)


def locate_pow2(position: Index, page_size: int) -> tuple[Index, Index]:
    """The fast path for power-of-two pages: ``(position >> log2(page), position & (page - 1))``.

    Equal to :func:`locate` for ``position >= 0``; raises ValueError for other page sizes.
    """
    check_page_size(page_size)
    if not is_power_of_two(page_size):
        raise ValueError(f"page_size={page_size} is not a power of two; use locate()")
    shift = page_size.bit_length() - 1
    return position >> shift, position & (page_size - 1)


def slot_of(page: Index, offset: Index, page_size: int) -> Index:
    """Flat slot of row ``offset`` in physical ``page``: ``page * page_size + offset``."""
    return page * page_size + offset


def split_slot(slot: Index, page_size: int) -> tuple[Index, Index]:
    """Inverse of :func:`slot_of`: ``(page, offset)`` of a flat slot."""
    return locate(slot, page_size)


def element_offset(
    strides: tuple[int, int, int, int, int],
    page: Index,
    kv: Index,
    head: Index,
    entry: Index,
    feat: Index,
) -> Index:
    """Element offset of ``cache[page, kv, ...]`` from the pool's 5 strides (in elements).

    ``strides`` are ``(stride_page, stride_kv, stride_n, stride_h, stride_d)`` in the
    layout-independent order page, K/V, token row, head, feature, so NHD
    ``[pages, 2, page_size, heads, dim]`` and HND ``[pages, 2, heads, page_size, dim]``
    share one formula: ``page*sp + kv*skv + entry*sn + head*sh + feat*sd``.
    Multiply by the element size for bytes.
    """
    sp, skv, sn, sh, sd = strides
    return page * sp + kv * skv + entry * sn + head * sh + feat * sd

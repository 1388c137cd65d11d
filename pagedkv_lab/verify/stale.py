"""Which unused pool rows hold NaN: the harness's stale-slot poisoning, and the variants
that attribute a non-finite output to the rows a kernel read.

A decode or prefill case fills every pool slot no sequence wrote with NaN (``poison``
True, the default), so a kernel that lets an unused row into its sum (``0 * NaN``)
returns NaN. When a case fails on non-finite outputs, the runner re-runs it with the
same K, V and queries but finite stale values (:data:`POISON_MODES`): ``"none"`` (no
NaN anywhere), ``"tail"`` (NaN only in the unwritten rows of pages some sequence owns:
the tail of a partly filled last page) and ``"free"`` (NaN only in pages no block-table
entry names: what a read through a padding entry, or past the table, lands on). If the
case passes with ``"none"``, the kernel reads unused rows, and the two others say which.
"""

from __future__ import annotations

import torch

__all__ = ["POISON_MODES", "UNUSED_ROWS", "restrict_poison"]

POISON_MODES = ("none", "tail", "free")
# What a case that fails only with NaN in these rows says about the kernel.
UNUSED_ROWS = {
    "tail": "the tail of a partly filled last page (rows past seq_len on a page the sequence owns)",
    "free": "pages no sequence's table names (a -1 padding entry of the block table, or an entry past the table)",
}


def restrict_poison(caches, block_tables: torch.Tensor, mode, seed: int) -> None:
    """Keep the NaN of the unused rows of ``caches`` (tensors whose dim 0 is the page,
        as written by the case builders) only where ``mode`` says, in place; the others get
        finite values from their own generator (seeded with ``seed``), so the case's K, V and
        queries stay those of the poisoned run. ``mode`` True keeps every NaN (and False,
    a pool drawn finite from the start, has none)."""
    if mode is True or mode is False:
        return
    if mode not in POISON_MODES:
        raise ValueError(f"poison={mode!r} must be True, False or one of {POISON_MODES}")
    gen = torch.Generator().manual_seed(10_007 + seed)
    for cache in caches:
        owned = torch.zeros(cache.shape[0], dtype=torch.bool)
        named = block_tables[block_tables >= 0].long()
        owned[named[named < cache.shape[0]]] = True
        page_mask = owned if mode == "free" else ~owned  # pages whose NaN become finite
        if mode == "none":
            page_mask = torch.ones_like(owned)
        fill = page_mask.view(-1, *([1] * (cache.dim() - 1))) & torch.isnan(cache)
        finite = torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(cache.dtype)
        cache.copy_(torch.where(fill, finite, cache))

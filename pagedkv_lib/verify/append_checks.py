"""Append cases: a random pool, random slots (some ``-1``), K/V written by the callable
under test and compared bit for bit with the reference's write into a copy."""

from __future__ import annotations

import math

import torch

from .. import reference, runtime
from ..pool import PagedKVPool
from .compare import DTYPES, bit_compare, first_difference, rand
from .grid import cover
from .report import CaseResult

__all__ = ["append_grid", "append_case"]


def append_grid(full: bool = False) -> list[dict]:
    """Append cases: layouts x dtypes, cycling head dims, page sizes, token counts,
    padding slots and non-contiguous K/V."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 80, 128],
        "page_size": [1, 5, 16],
        "num_tokens": [0, 1, 45] + ([300] if full else []),
        "num_kv_heads": [2, 1],
        "padding": [0, 3],
        "noncontiguous": [False, True],
    }
    cases = cover(values, outer=3 if full else 2)
    for c in cases:
        c["padding"] = min(c["padding"], c["num_tokens"])
    return cases


def append_case(append_fn, case: dict) -> CaseResult:
    """Run one append case; the pool must equal the reference's bit for bit, and ``k``
    and ``v`` must be left as they were."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d, n = (
        DTYPES[case["dtype"]],
        case["page_size"],
        case["num_kv_heads"],
        case["head_dim"],
        case["num_tokens"],
    )
    layout = case["layout"]
    pool = PagedKVPool(-(-n // ps) + 2, ps, hk, d, dtype, layout)
    pool.cache.copy_(rand(pool.cache.shape, dtype, gen))  # random, so untouched bytes are checkable
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    slots[: case.get("padding", 0)] = -1  # padding tokens
    slots = slots[torch.randperm(n, generator=gen)]
    if case.get("noncontiguous", False):
        k = rand((hk, n, d), dtype, gen).transpose(0, 1)
        v = rand((d, n, hk), dtype, gen).permute(1, 2, 0)
    else:
        k, v = rand((n, hk, d), dtype, gen), rand((n, hk, d), dtype, gen)
    expected = pool.cache.clone()
    reference.append_paged_kv(k, v, expected, slots, layout)
    dev = runtime.device()
    # Copies (``.to`` alone returns the same tensor on the CPU), so k and v can be
    # compared with what they were after the call.
    cache, k_dev, v_dev = (t.to(dev, copy=True) for t in (pool.cache, k, v))
    try:
        append_fn(k_dev, v_dev, cache, slots.to(dev), layout=layout)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("append", case, False, math.inf, 0.0, 0.0, f"raised {type(err).__name__}: {err}")
    ok, max_abs, detail = bit_compare(cache, expected, layout)
    for name, before, after in (("k", k, k_dev), ("v", v, v_dev)):
        count, where = first_difference(after.cpu(), before)
        if count:
            ok = False
            detail = (f"{detail}; " if detail else "") + f"append modified its input {name} ({where})"
    return CaseResult("append", case, ok, max_abs, 0.0, 0.0, detail, 0.0 if ok else math.inf)

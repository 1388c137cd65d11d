"""Append cases: the new tokens of a few requests (each continuing mid-page after earlier
tokens, on scattered pages, with ``-1`` padding tokens among them) written by the
callable under test into a random pool, compared bit for bit with the reference's
write into a copy.

The pool is built in the cache layout the kernel declares (:mod:`.contract`), each
tensor it receives sits between guard regions (:mod:`.guards`), and a difference is
reported where it is: the token (request, position), page, row, head and feature of
the first wrong element, and whether it is a missing write, a wrong value, or a
write to a slot no token addresses.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.contract import Contract, contract_of
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import accepts, cover, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import reference, runtime
from pagedkv_lib.cache_layouts import to_paged
from pagedkv_lib.compare import DTYPES, bit_compare, first_difference
from pagedkv_lib.formats import scatter_pages, slot_mapping
from pagedkv_lib.pool import PagedKVPool

__all__ = ["append_grid", "append_inputs", "append_case", "locate_write_error"]


def append_grid(full: bool = False) -> list[dict]:
    """Append cases: layouts x dtypes x token counts, cycling head dims, page sizes,
    padding slots and non-contiguous K/V (18 cases; a plain write costs little)."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "num_tokens": [0, 1, 45] + ([300] if full else []),
        "head_dim": [64, 80, 128],
        "page_size": [1, 5, 16],
        "num_kv_heads": [2, 1],
        "padding": [0, 3],
        "noncontiguous": [False, True],
    }
    cases = cover(values, outer=4 if full else 3)
    for c in cases:
        c["padding"] = min(c["padding"], c["num_tokens"])
    return cases


def append_inputs(case: dict):
    """``(pool, k, v, slots, batch, positions)`` of an append case, on the CPU: a random
    pool (so untouched bytes are checkable) and ``num_tokens`` tokens, ``padding`` of
    them padding (slot, request and position ``-1``), the rest spread over up to 3
    requests that continue after 0..2 pages' worth of earlier tokens."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d, n = (
        DTYPES[case["dtype"]],
        case["page_size"],
        case["num_kv_heads"],
        case["head_dim"],
        case["num_tokens"],
    )
    real = n - case.get("padding", 0)
    num_req = max(1, min(3, real))
    new = [real // num_req + (b < real % num_req) for b in range(num_req)]
    past = torch.randint(0, 2 * ps + 1, (num_req,), generator=gen).tolist()
    pages_each = [-(-(p + m) // ps) for p, m in zip(past, new)]
    num_pages = sum(pages_each) + 2
    table = torch.full((num_req, max(pages_each, default=0) or 1), -1, dtype=torch.int32)
    for b, row in enumerate(scatter_pages(pages_each, num_pages, gen)):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    batch = torch.cat([torch.full((m,), b) for b, m in enumerate(new)] + [torch.full((n - real,), -1)])
    positions = torch.cat([torch.arange(p, p + m) for p, m in zip(past, new)] + [torch.full((n - real,), -1)])
    order = torch.randperm(n, generator=gen)  # padding tokens land anywhere among the real ones
    batch, positions = batch[order].long(), positions[order].long()
    slots = slot_mapping(table, batch, positions, ps)
    pool = PagedKVPool(num_pages, ps, hk, d, dtype, case["layout"])
    pool.cache.copy_(rand(pool.cache.shape, dtype, gen))
    if case.get("noncontiguous", False):
        k = rand((hk, n, d), dtype, gen).transpose(0, 1)
        v = rand((d, n, hk), dtype, gen).permute(1, 2, 0)
    else:
        k, v = rand((n, hk, d), dtype, gen), rand((n, hk, d), dtype, gen)
    return pool.cache, k, v, slots, batch, positions


def locate_write_error(got, expected, before, slots, batch, positions, layout: str) -> str:
    """Where a written pool first differs from the expected one: the element (page, K/V,
    row, head, feature), the token whose slot it is (its request and position), and
    what kind of error it is (a missing write, a wrong value, a write outside every
    addressed slot). "" when equal."""
    count, _ = first_difference(got, expected, layout)
    if not count:
        return ""
    page_size = got.shape[2] if layout == "NHD" else got.shape[3]
    differ = got.contiguous().view(torch.uint8).view(-1, got.element_size()) != (
        expected.contiguous().view(torch.uint8).view(-1, got.element_size())
    )
    flat = int(torch.nonzero(differ.any(-1))[0])
    page, kv, a, b, feat = (int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape))
    row, head = (a, b) if layout == "NHD" else (b, a)
    where = f"page {page}, {'KV'[kv]}, row {row}, head {head}, feature {feat}"
    slot = page * page_size + row
    hit = torch.nonzero(slots == slot)
    g, e, o = (float(t[page, kv, a, b, feat]) for t in (got, expected, before))
    if not hit.numel():
        return f"{count} elements differ; first: a write outside the addressed slots at {where} ({g!r}, was {o!r})"
    i = int(hit[0])
    token = f"token {i} (request {int(batch[i])}, position {int(positions[i])}, slot {slot})"
    kind = "missing write" if got[page, kv, a, b, feat].equal(before[page, kv, a, b, feat]) else "wrong value"
    return f"{count} elements differ; first: {kind} of {token} at {where}: {g!r} instead of {e!r}"


def _call(fn, args, layout: str, **kwargs):
    """Call a kernel under test, giving ``layout`` only if it takes the argument."""
    if accepts(fn, "layout"):
        kwargs["layout"] = layout
    return fn(*args, **kwargs)


def append_case(append_fn, case: dict, contract: Contract | None = None) -> CaseResult:
    """Run one append case; the pool must equal the reference's bit for bit, nothing
    outside the given tensors may change, and ``k``, ``v`` and ``slot_mapping`` must
    be left as they were. The pool's K and V have distinct strides unless the kernel
    declares them shared (:meth:`Contract.pool_kv_strides`)."""
    contract = contract or contract_of(append_fn)
    reason = contract.outside(case)
    if reason:
        return CaseResult("append", case, None, outside=reason)
    layout = case["layout"]
    cache, k, v, slots, batch, positions = append_inputs(case)
    expected = cache.clone()
    reference.append_paged_kv(k, v, expected, slots, layout)
    dev, guards = runtime.device(), Guards()
    native = guards.place_pool(cache, contract.cache_layout, layout, dev, contract.pool_kv_strides())
    originals = {"k": k, "v": v, "slot_mapping": slots}
    inputs = {name: guards.place(name, t.to(dev)) for name, t in originals.items()}
    try:
        _call(append_fn, (inputs["k"], inputs["v"], native, inputs["slot_mapping"]), layout)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("append", case, False, math.inf, 0.0, 0.0, raised(err))
    dims = (expected.shape[0], case["page_size"], case["num_kv_heads"], case["head_dim"])
    got = to_paged(native if isinstance(native, torch.Tensor) else tuple(native), contract.cache_layout, layout, *dims)
    ok, max_abs, _ = bit_compare(got.cpu(), expected, layout)
    notes = [] if ok else [locate_write_error(got.cpu(), expected, cache, slots, batch, positions, layout)]
    notes += guards.corrupted()
    for name, before in originals.items():
        count, where = first_difference(inputs[name].cpu(), before)
        if count:
            notes.append(f"append modified its input {name} ({where})")
    ok = ok and len(notes) == 0
    return CaseResult("append", case, ok, max_abs, 0.0, 0.0, "; ".join(notes), 0.0 if ok else math.inf)

"""Decode cases: sequences written into a (NaN-poisoned) pool on scattered pages, one
query each, the callable's output compared with the float64 reference by the pass
rule, and the pool and the inputs required to be left exactly as they were.

The grid holds short cases (every layout, dtype, head dim, page size, GQA group,
empty and length-1 sequences, a page shared by two sequences) and long ones: several
hundred to a few thousand tokens, lengths that straddle power-of-two tile boundaries,
``num_splits`` forced above 1 (when the callable takes it) and left to its heuristic,
ring windows that have wrapped, and linear-cache windows (FlashInfer's ``window_left``)
far shorter than the sequence, as wide as one key, and wider than it. A kernel that is right on one tile but wrong
across tiles or splits (a missing online-softmax rescale, unweighted split merges, a
read that stops early) fails the long cases.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.contract import Contract, contract_of
from pagedkv_lab.verify.grid import accepts, cover, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.read_call import call_read, check_lse, score_mod_cases, score_mod_kwargs
from pagedkv_lab.verify.report import CaseResult, located
from pagedkv_lab.verify.stale import restrict_poison
from pagedkv_lib import reference, runtime
from pagedkv_lib.cache_layouts import to_paged
from pagedkv_lib.compare import DTYPES, compare, first_difference
from pagedkv_lib.formats import pad_block_tables, scatter_pages, slot_mapping
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.window import LinearWindow, RingWindow, Window

__all__ = [
    "decode_grid",
    "long_decode_cases",
    "decode_inputs",
    "decode_case",
    "case_window",
    "write_sequence",
    "read_changes",
    "score_mod_decode_cases",
]


def long_decode_cases() -> list[dict]:
    """Cases of several hundred to 3000 tokens: several tiles per split, several splits,
    the heuristic's choice, a wrapped ring window, and linear windows (``window_left``:
    34 keys of 300, with two splits; one key; 97 keys of 129, of exactly 97 and of 20)."""
    base = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 4, "num_kv_heads": 2}
    return [
        {**base, "seq_lens": [300, 1000, 0, 129], "num_splits": 3},
        {**base, "layout": "HND", "dtype": "fp16", "head_dim": 128, "page_size": 5, "group": 1,
         "seq_lens": [2049, 257, 1], "num_splits": None},
        {**base, "dtype": "bf16", "head_dim": 80, "page_size": 1, "group": 5, "num_kv_heads": 1,
         "seq_lens": [640, 383, 384, 385], "num_splits": 7},
        {**base, "layout": "HND", "group": 2, "seq_lens": [1000, 77, 255], "window": (200, 4), "num_splits": 2},
        {**base, "dtype": "fp16", "page_size": 8, "group": 8, "num_kv_heads": 1, "seq_lens": [3000], "num_splits": 16},
        {**base, "dtype": "fp16", "seq_lens": [300, 54, 1, 0], "window_left": 33, "num_splits": 2},
        {**base, "layout": "HND", "dtype": "bf16", "page_size": 5, "group": 2, "seq_lens": [129, 97, 20],
         "window_left": 96, "num_splits": None},
        {**base, "page_size": 1, "group": 1, "num_kv_heads": 1, "seq_lens": [90, 2], "window_left": 0},
    ]  # fmt: skip


def score_mod_decode_cases() -> list[dict]:
    """Cases with score modifiers (:func:`.read_call.score_mod_cases`), for a kernel that
    declares them: the soft cap over empty, length-1 and page-aligned sequences, ALiBi
    over 70 keys, sinks next to an empty and a length-1 sequence, and all three over
    300 keys in three splits (the sink must be counted once, not once per split)."""
    base = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 2, "num_kv_heads": 2}
    return score_mod_cases([
        {**base, "seq_lens": [0, 1, 37, 16]},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "seq_lens": [70, 5]},
        {**base, "dtype": "bf16", "group": 4, "num_kv_heads": 1, "seq_lens": [1, 33, 0]},
        {**base, "seq_lens": [300, 129], "num_splits": 3},
    ])  # fmt: skip


def decode_grid(full: bool = False) -> list[dict]:
    """Decode cases: layouts x dtypes, cycling head dims, page sizes, GQA groups and
    batches that hold an empty, a length-1 and a page-aligned sequence; a page shared
    by two sequences; a pool of finite stale values; a NaN in queries (one of an empty
    sequence, which must still return zeros); then :func:`long_decode_cases`."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 80, 128] + ([256] if full else []),
        "page_size": [1, 5, 16] + ([64] if full else []),
        "group": [1, 4, 5, 8],
        "num_kv_heads": [2, 1],
        "seq_lens": [[0, 1, 37], [16, 5, 70], [1, 80, 0], [33, 32]],
    }
    extra = [
        {"layout": "NHD", "dtype": "fp16", "head_dim": 64, "page_size": 4, "group": 2, "num_kv_heads": 2,
         "seq_lens": [24, 13], "shared_pages": True},
        {"layout": "HND", "dtype": "fp32", "head_dim": 64, "page_size": 8, "group": 1, "num_kv_heads": 2,
         "seq_lens": [40, 3], "poison": False},
        {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 8, "group": 2, "num_kv_heads": 1,
         "seq_lens": [20, 0, 5], "nan_query": True},
        *long_decode_cases(),
    ]  # fmt: skip
    return cover(values, extra, outer=3 if full else 2)


def case_window(case: dict, one_more_block: bool = False) -> Window | None:
    """A case's window: ``"window_left": w`` a :class:`LinearWindow` (FlashInfer's),
    ``"window": (size, sinks)`` a :class:`RingWindow` in pages of the case's size, else None."""
    if case.get("window_left") is not None:
        return LinearWindow(case["window_left"])
    if not case.get("window"):
        return None
    size, sinks = case["window"]
    return RingWindow(size, sinks, case["page_size"], one_more_block=one_more_block)


def write_sequence(pool: PagedKVPool, table, b: int, n: int, window, gen) -> None:
    """Write tokens ``0..n-1`` of sequence ``b`` (random K/V). Through a ring a later token
    overwrites an earlier one's row, so only the last token of every row is written; a
    linear window stores tokens as no window does."""
    window = window if isinstance(window, RingWindow) else None
    slots = slot_mapping(table, torch.full((n,), b), torch.arange(n), pool.page_size, window)
    k, v = (rand((n, pool.num_kv_heads, pool.head_dim), pool.dtype, gen) for _ in range(2))
    if window is not None:
        last = {}
        for i, s in enumerate(slots.tolist()):
            last[s] = i
        keep = torch.zeros(n, dtype=torch.bool)
        keep[list(last.values())] = True
        slots = torch.where(keep, slots, -1)
    reference.append_paged_kv(k, v, pool.cache, slots, pool.layout)


def decode_inputs(case: dict):
    """``(q, cache, block_tables, seq_lens, window)`` of a decode case, on the CPU."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d = DTYPES[case["dtype"]], case["page_size"], case["num_kv_heads"], case["head_dim"]
    window = case_window(case)
    ring = window if isinstance(window, RingWindow) else None
    lens = list(case["seq_lens"])
    shared = case.get("shared_pages", False) and len(lens) > 1
    if shared:  # sequence 1 reads a prefix of sequence 0's pages (a shared prefix)
        lens[1] = min(lens[1], lens[0])
    pages_each = [int(ring.num_blocks(n)) if ring else -(-n // ps) for n in lens]
    num_pages = sum(pages_each) - (pages_each[1] if shared else 0) + 2
    rows = scatter_pages([0 if shared and b == 1 else n for b, n in enumerate(pages_each)], num_pages, gen)
    if shared:
        rows[1] = rows[0][: pages_each[1]]
    pool = PagedKVPool(num_pages, ps, hk, d, dtype, case["layout"])
    if case.get("poison", True):
        pool.cache.fill_(float("nan"))
    else:
        pool.cache.copy_(rand(pool.cache.shape, dtype, gen))
    tables = pad_block_tables(rows, max(pages_each, default=0) + 1)
    for b, n in enumerate(lens):
        if not (shared and b == 1):
            write_sequence(pool, tables, b, n, window, gen)
    q = rand((len(lens), hk * case["group"], d), dtype, gen)
    if case.get("nan_query"):  # an honest kernel returns NaN for sequence 0's head 0 (and 0 for an empty one)
        q[: len(lens) - 1 or 1, 0, 0] = float("nan")
    restrict_poison([pool.cache], tables, case.get("poison", True), case.get("seed", 0))
    return q, pool.cache, tables, torch.tensor(lens, dtype=torch.int32), window


def read_changes(kind: str, case: dict, cache, native, cache_layout: str, originals: dict, inputs: dict) -> list[str]:
    """What a read (``kind``: "decode", "prefill") changed: the pool ``native`` (in the
    kernel's ``cache_layout``) against the paged ``cache`` it was built from, bit for bit,
    and each input ``inputs[name]`` against ``originals[name]``; one note per change."""
    layout = case["layout"]
    dims = (cache.shape[0], case["page_size"], case["num_kv_heads"], case["head_dim"])
    after = {"cache": to_paged(native, cache_layout, layout, *dims).cpu()}
    after.update({name: t.cpu() for name, t in inputs.items()})
    notes = []
    for name, before in {"cache": cache, **originals}.items():
        count, where = first_difference(after[name], before, layout if name == "cache" else None)
        if count:
            what = "wrote into the pool" if name == "cache" else f"modified its input {name}"
            notes.append(f"{kind} {what}: {count} elements changed, first at {where}")
    return notes


def decode_case(decode_fn, case: dict, contract: Contract | None = None) -> CaseResult:
    """Run one decode case: the output within tolerance of the float64 reference (and
    the LSE, for a kernel declaring one), and the pool, ``q`` and the page table
    bit-for-bit unchanged, nothing written next to them or past ``out=``. The pool is
    built in the kernel's declared cache layout (with distinct K and V strides unless it
    declares them shared); score modifiers as :mod:`.read_call`."""
    contract = contract or contract_of(decode_fn)
    reason = contract.outside(case)
    if reason:
        return CaseResult("decode", case, None, outside=reason)
    q, cache, tables, lens, window = decode_inputs(case)
    layout, mods = case["layout"], score_mod_kwargs(case, q.shape[1])
    expected, expected_lse = reference.paged_decode_attention(
        q, cache, tables, lens, layout=layout, window=window, precision="fp64", return_lse=True, **mods
    )
    atol, rtol = contract.tolerance(case["dtype"])
    dev, guards = runtime.device(), Guards()
    native = guards.place_pool(cache, contract.cache_layout, layout, dev, contract.pool_kv_strides())
    originals = {"q": q, "block_tables": tables, "seq_lens": lens}
    inputs = {name: guards.place(name, t.to(dev)) for name, t in originals.items()}
    kwargs, notes = dict(mods), []
    if accepts(decode_fn, "layout"):
        kwargs["layout"] = layout
    if window is not None:
        kwargs["window"] = window
    if "num_splits" in case:
        if accepts(decode_fn, "num_splits"):
            kwargs["num_splits"] = case["num_splits"]
        else:
            notes.append("decode_fn takes no num_splits: ran with its own")
    args = (inputs["q"], native, inputs["block_tables"], inputs["seq_lens"])
    out, lse, error = call_read(decode_fn, args, kwargs, contract, inputs["q"], guards)
    if error:
        return CaseResult("decode", case, False, math.inf, math.inf, atol, error)
    result = compare(out, expected, atol, rtol)

    def where(idx):
        return f"sequence {idx[0]} (length {int(lens[idx[0]])}), query head {idx[1]}" + (
            f", feature {idx[2]}" if len(idx) > 2 else ""
        )

    detail = located(result, where, out, expected)
    if contract.lse is not None:
        _, lse_detail = check_lse(lse, expected_lse, contract, case["dtype"], where)
        notes.append(lse_detail)
    notes += read_changes("decode", case, cache, native, contract.cache_layout, originals, inputs)
    notes += guards.corrupted()
    notes = [n for n in notes if n]
    ok = result.passed and not [n for n in notes if not n.startswith("decode_fn takes no")]
    detail = "; ".join([detail, *notes]) if detail else "; ".join(notes)
    return CaseResult("decode", case, ok, result.max_abs, result.max_rel, atol, detail, result.tol_ratio)

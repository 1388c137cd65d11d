"""Quantized-pool checks: codes and scales bit for bit, decode within tolerance, and the
scales of K and V each fitted to its own range.

* ``quant_append``: a quantized append (``fn(k, v, pool, slot_mapping)`` with the
  signature of ``kernels.append_paged_kv_quant_pool``) must write the codes and scales of
  :mod:`pagedkv_lib.quant_reference` bit for bit, over FP8 per tensor, FP8 per token
  and NVFP4, both layouts, page sizes 1/5/16, head dims 64/128, padding slots and
  inputs holding zeros, NaN, +-inf, values past the format's range and subnormals; the
  rest of the pool and ``k``/``v`` must be left as they were. The fault
  ``nvfp4_unrounded_scale`` fails it.
* ``quant_decode``: a quantized decode (``fn(q, pool, block_tables, seq_lens)`` as
  ``kernels.paged_decode_attention_quant_pool``, optionally ``num_splits=`` and
  ``window=``) must match the float64 reference decode over the dequantized pool by
  the fp32 pass rule of :data:`.compare.TOLERANCES` (the dequantized values are
  exact), in a NaN-poisoned pool, and leave the pool and ``q`` unchanged.
* ``quant_scales``: K with outlier channels (as K after RoPE has) and V written with
  per-tensor scales calibrated on each; every dequantized value must lie within the
  format's error bound of its input (:func:`pagedkv_lib.quant.fp8_error_bound`,
  :func:`pagedkv_lib.quant.nvfp4_error_bound`) and the decode must match the
  reference. The fault ``shared_kv_scale`` fails it.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab import faults as F
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import accepts, cover, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import CaseResult, located
from pagedkv_lib import quant, quant_reference, runtime
from pagedkv_lib.compare import DTYPES, TOLERANCES, bits, compare, first_difference, max_abs_difference
from pagedkv_lib.formats import pad_block_tables, scatter_pages, slot_mapping
from pagedkv_lib.quant_pool import QuantizedKVPool
from pagedkv_lib.window import RingWindow

__all__ = [
    "QUANT_CHECKS",
    "QUANT_FORMATS",
    "quant_append_grid",
    "quant_append_case",
    "quant_decode_grid",
    "quant_decode_case",
    "check_quant_scales",
]

QUANT_CHECKS = ("quant_append", "quant_decode", "quant_scales")
# case "format" -> (kv_dtype, scale_mode)
QUANT_FORMATS = {"fp8": ("fp8", "tensor"), "fp8_token": ("fp8", "token"), "nvfp4": ("nvfp4", "block")}


def _pool(case: dict, num_pages: int, k_scale: float = 1.0, v_scale: float = 1.0) -> QuantizedKVPool:
    kv_dtype, mode = QUANT_FORMATS[case["format"]]
    return QuantizedKVPool(
        num_pages, case["page_size"], case["num_kv_heads"], case["head_dim"], kv_dtype, case["layout"],
        scale_mode=mode, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _specials(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` with a few tokens holding the values that break quantizers: zeros, NaN, +-inf,
    a value past every format's range, subnormals and a row of zeros."""
    n, heads, dim = x.shape
    if n == 0:
        return x
    x = x.clone()  # keeps the strides of a non-contiguous x
    picks = torch.unravel_index(torch.randperm(x.numel(), generator=gen)[:6], x.shape)
    tiny = torch.finfo(x.dtype).tiny
    values = torch.tensor([0.0, math.nan, math.inf, -math.inf, 0.25 * tiny, -3e4], dtype=torch.float64)
    x[picks] = values[: picks[0].numel()].to(x.dtype)
    if n > 1:
        x[int(torch.randint(n, (1,), generator=gen))] = 0.0  # a token of zeros: scale 0
    return x


def quant_append_grid(full: bool = False) -> list[dict]:
    """Quantized append cases: formats x layouts, cycling dtypes, head dims, page sizes,
    token counts, padding, special values and non-contiguous K/V."""
    values = {
        "format": list(QUANT_FORMATS),
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 128] + ([256] if full else []),
        "page_size": [1, 5, 16],
        "num_tokens": [45, 33] + ([300] if full else []),
        "num_kv_heads": [2, 1],
        "padding": [3, 0],
        "specials": [True, False],
        "noncontiguous": [False, True],
    }
    base = {"layout": "NHD", "dtype": "fp16", "head_dim": 64, "page_size": 5, "num_kv_heads": 2, "padding": 0}
    extra = [  # one token, and none
        {**base, "format": "nvfp4", "num_tokens": 1, "specials": True, "noncontiguous": False},
        {**base, "format": "fp8_token", "layout": "HND", "num_tokens": 1, "specials": False, "noncontiguous": True},
        {**base, "format": "fp8", "num_tokens": 0, "specials": False, "noncontiguous": False},
    ]
    cases = cover(values, extra, outer=3 if full else 2)
    for c in cases:
        c["padding"] = min(c["padding"], c["num_tokens"])
    return cases


def _pool_differences(got: QuantizedKVPool, expected: QuantizedKVPool) -> list[str]:
    """One line per pool tensor whose bits differ: how many elements, and the first one
    named by page, K/V, row, head and byte (codes) or scale group, with both values."""
    notes = []
    for name in ("data", "scales"):
        a, b = getattr(got, name), getattr(expected, name)
        if a is None:
            continue
        a = a.cpu()
        count, _ = first_difference(a, b)
        if not count:
            continue
        page, kv, i, j, last = (int(x) for x in torch.nonzero(bits(a) != bits(b))[0])
        row, head = (i, j) if got.layout == "NHD" else (j, i)
        what = {"data": "codes", "scales": "scales"}[name]
        unit = "byte" if name == "data" else "scale"
        if name == "data" and got.kv_dtype == "nvfp4":
            unit = f"byte {last} (features {2 * last}, {2 * last + 1}), code"
        else:
            unit = f"{unit} {last}"
        value = (lambda t: f"0x{int(t):02x}") if a.dtype == torch.uint8 else (lambda t: f"{float(t)!r}")
        at = (page, kv, i, j, last)
        notes.append(
            f"{count} {what} differ, first at page {page}, {'KV'[kv]}, row {row}, head {head}, {unit} "
            f"{value(a[at])} instead of {value(b[at])}"
        )
    return notes


def _guarded_pool(pool: QuantizedKVPool, guards: Guards) -> QuantizedKVPool:
    """``pool`` (on the kernels' device) with its codes, scales and global scales each
    between guard bytes of at least one page: a kernel writing past them is seen."""
    page_bytes = pool.data[0].numel()
    pool.data = guards.place("data", pool.data, page_bytes)
    if pool.scales is not None:
        pool.scales = guards.place("scales", pool.scales, pool.scales[0].numel() * pool.scales.element_size())
    pool.global_scale = guards.place("global_scale", pool.global_scale)
    return pool


def quant_append_case(quant_append_fn, case: dict) -> CaseResult:
    """Run one quantized append case: codes and scales equal the reference's bit for bit;
    ``k`` and ``v`` unchanged."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, n, hk, d = DTYPES[case["dtype"]], case["num_tokens"], case["num_kv_heads"], case["head_dim"]
    if case.get("noncontiguous", False):
        k = rand((hk, n, d), dtype, gen).transpose(0, 1)
        v = rand((d, n, hk), dtype, gen).permute(1, 2, 0)
    else:
        k, v = rand((n, hk, d), dtype, gen), rand((n, hk, d), dtype, gen)
    kv_dtype = QUANT_FORMATS[case["format"]][0]
    # Calibrated before the special values go in, so that -3e4 lies past the range.
    scales = (quant.global_scale_for(k, kv_dtype), quant.global_scale_for(v, kv_dtype))
    if case.get("specials", False):
        k, v = _specials(k, gen), _specials(v, gen)
    pool = _pool(case, -(-n // case["page_size"]) + 2, *scales)
    # Random codes and scales, so that bytes the append must not touch are checkable.
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=gen, dtype=torch.int32).to(torch.uint8))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=gen).to(pool.scales.dtype))
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    slots[: case.get("padding", 0)] = -1
    slots = slots[torch.randperm(n, generator=gen)]
    expected = pool.clone()
    quant_reference.append_paged_kv_quant(k, v, expected, slots)
    dev, guards = runtime.device(), Guards()
    got = _guarded_pool(pool.to(dev), guards)
    k_dev, v_dev, slots_dev = (guards.place(n, t.to(dev)) for n, t in (("k", k), ("v", v), ("slot_mapping", slots)))
    try:
        quant_append_fn(k_dev, v_dev, got, slots_dev)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("quant_append", case, False, math.inf, 0.0, 0.0, raised(err))
    notes = _pool_differences(got, expected) + guards.corrupted()
    for name, before, after in (("k", k, k_dev), ("v", v, v_dev)):
        count, where = first_difference(after.cpu(), before)
        if count:
            notes.append(f"append modified its input {name} ({where})")
    ok = not notes
    max_abs = 0.0
    if not ok:
        max_abs = max_abs_difference(got.to("cpu").dequantize(), expected.dequantize())
    return CaseResult("quant_append", case, ok, max_abs, 0.0, 0.0, "; ".join(notes), 0.0 if ok else math.inf)


def quant_decode_grid(full: bool = False) -> list[dict]:
    """Quantized decode cases: formats x layouts, cycling q dtypes, head dims, page sizes,
    GQA groups and batches with an empty, a length-1 and a page-aligned sequence; then a
    long case over several tiles and splits and a wrapped ring window."""
    values = {
        "format": list(QUANT_FORMATS),
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 128] + ([256] if full else []),
        "page_size": [1, 5, 16],
        "group": [1, 4, 5],
        "num_kv_heads": [2, 1],
        "seq_lens": [[0, 1, 37], [16, 5, 70], [33, 32]],
    }
    extra = [
        {"format": "nvfp4", "layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 4,
         "num_kv_heads": 1, "seq_lens": [300, 129], "num_splits": 3},
        {"format": "fp8_token", "layout": "HND", "dtype": "fp32", "head_dim": 64, "page_size": 4, "group": 2,
         "num_kv_heads": 2, "seq_lens": [90, 7], "window": (40, 4)},
    ]  # fmt: skip
    return cover(values, extra, outer=3 if full else 2)


def quant_decode_inputs(case: dict):
    """``(q, pool, block_tables, seq_lens, window)`` of a quantized decode case, on the CPU:
    a NaN-poisoned pool whose sequences were written by the reference append."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    ps, hk, d = case["page_size"], case["num_kv_heads"], case["head_dim"]
    window = RingWindow(*case["window"], ps) if case.get("window") else None
    lens = list(case["seq_lens"])
    pages_each = [int(window.num_blocks(n)) if window else -(-n // ps) for n in lens]
    num_pages = sum(pages_each) + 2
    rows = scatter_pages(pages_each, num_pages, gen)
    pool = _pool(case, num_pages, 0.01, 0.005).poison_()
    tables = pad_block_tables(rows, max(pages_each, default=0) + 1)
    for b, n in enumerate(lens):
        slots = slot_mapping(tables, torch.full((n,), b), torch.arange(n), ps, window)
        if window is not None:  # through the ring only the last token of each row survives
            last = {s: i for i, s in enumerate(slots.tolist())}
            keep = torch.zeros(n, dtype=torch.bool)
            keep[list(last.values())] = True
            slots = torch.where(keep, slots, -1)
        k, v = (rand((n, hk, d), torch.float32, gen) for _ in range(2))
        quant_reference.append_paged_kv_quant(k, v, pool, slots)
    q = rand((len(lens), hk * case["group"], d), DTYPES[case["dtype"]], gen)
    return q, pool, tables, torch.tensor(lens, dtype=torch.int32), window


def quant_decode_case(quant_decode_fn, case: dict) -> CaseResult:
    """Run one quantized decode case against the float64 reference over the dequantized
    pool; the pool and ``q`` must be left bit-for-bit unchanged."""
    q, pool, tables, lens, window = quant_decode_inputs(case)
    expected = quant_reference.paged_decode_attention_quant(q, pool, tables, lens, window=window, precision="fp64")
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    dev, guards = runtime.device(), Guards()
    got_pool = _guarded_pool(pool.to(dev), guards)
    q_dev, tables_dev, lens_dev = (guards.place(n, t.to(dev)) for n, t in (("q", q), ("block_tables", tables),
                                                                            ("seq_lens", lens)))  # fmt: skip
    kwargs, notes = {}, []
    if window is not None:
        kwargs["window"] = window
    if "num_splits" in case:
        if accepts(quant_decode_fn, "num_splits"):
            kwargs["num_splits"] = case["num_splits"]
        else:
            notes.append("quant_decode_fn takes no num_splits: ran with its own")
    try:
        out = quant_decode_fn(q_dev, got_pool, tables_dev, lens_dev, **kwargs)
    except Exception as err:
        return CaseResult("quant_decode", case, False, math.inf, math.inf, atol, raised(err))
    result = compare(out, expected, atol, rtol)
    ok = result.passed
    detail = located(result, lambda i: f"sequence {i[0]} (length {int(lens[i[0]])}), query head {i[1]}, feature {i[2]}",
                     out, expected)  # fmt: skip
    changed = _pool_differences(got_pool, pool) + guards.corrupted()
    count, where = first_difference(q_dev.cpu(), q)
    if count:
        changed.append(f"modified its input q ({where})")
    if changed:
        ok = False
        notes += [f"decode wrote: {c}" for c in changed]
    detail = "; ".join([x for x in [detail, *notes] if x])
    return CaseResult("quant_decode", case, ok, result.max_abs, result.max_rel, atol, detail, result.tol_ratio)


def _outlier_kv(gen: torch.Generator, n: int, heads: int, dim: int, outlier: float):
    """K with a few outlier channels ``outlier`` times larger (as K after RoPE has), V plain."""
    k, v = rand((n, heads, dim), torch.float32, gen), rand((n, heads, dim), torch.float32, gen)
    channels = torch.randperm(dim, generator=gen)[:4]
    k[..., channels] *= outlier
    return k, v


def check_quant_scales(quant_append_fn, quant_decode_fn, faults, outlier: float = 8.0) -> CaseResult:
    """K (with outlier channels) and V written into FP8 and NVFP4 pools whose K and V
    scales are calibrated on each: every dequantized value within the format's error
    bound of its input, and the decode within tolerance of the reference over the pool.
    With ``shared_kv_scale`` both use V's scale and K saturates."""
    gen, dev = torch.Generator().manual_seed(7), runtime.device()
    n, ps, heads, dim = 24, 4, 2, 64
    k, v = _outlier_kv(gen, n, heads, dim, outlier)
    q = rand((2, 4, dim), torch.float32, gen)
    tables = pad_block_tables([list(range(0, 3)), list(range(3, 6))])
    lens = torch.tensor([12, 12], dtype=torch.int32)
    slots = slot_mapping(tables, torch.arange(n) // 12, torch.arange(n) % 12, ps)
    worst, notes, max_abs = 0.0, [], 0.0
    for fmt in ("fp8", "nvfp4"):
        scales = quant.global_scale_for(k, fmt), quant.global_scale_for(v, fmt)
        if "shared_kv_scale" in faults:
            scales = F.shared_kv_scale(*scales)
        pool = QuantizedKVPool(6, ps, heads, dim, fmt, k_scale=scales[0], v_scale=scales[1], device=dev)
        quant_append_fn(k.to(dev), v.to(dev), pool, slots.to(dev))
        pool = pool.to("cpu")
        values = pool.dequantize()
        for kv, x in ((0, k), (1, v)):
            page, row = slots // ps, slots % ps
            got = values[page, kv, row]
            if fmt == "fp8":
                bound = quant.fp8_error_bound(x, float(pool.global_scale[kv]))
            else:
                bound = quant.nvfp4_error_bound(pool.scales[page, kv, row], float(pool.global_scale[kv]))
            ratio = float(((got - x).abs() / bound).max())
            max_abs = max(max_abs, float((got - x).abs().max()))
            worst = max(worst, ratio)
            if ratio > 1:
                notes.append(f"{fmt} {'KV'[kv]}: error {ratio:.3g}x the format's bound (scale {scales[kv]:.3g})")
        out = quant_decode_fn(q.to(dev), pool.to(dev), tables.to(dev), lens.to(dev))
        expected = quant_reference.paged_decode_attention_quant(q, pool, tables, lens, precision="fp64")
        c = compare(out, expected, *TOLERANCES[torch.float32])
        if not c.passed:
            notes.append(f"{fmt} decode: {c.detail or f'{c.tol_ratio:.3g}x the tolerance'}")
    detail = "; ".join(notes) or f"K outlier channels x{outlier}, scales calibrated per tensor"
    return CaseResult("quant_scales", {"outlier": outlier}, not notes, max_abs, 0.0, 0.0, detail, worst)

"""Indexer-K scatter and block-copy cases: the two stride-driven copies of the write path.

* **indexer scatter**: a few requests' new tokens (with ``-1`` padding tokens among
  them), their keys quantized per token (a zero row, +-inf and NaN included), written by
  the callable under test into one layer's view of a layer-interleaved arena
  (:class:`pagedkv_lib.indexer_cache.IndexerKPool`: every block a separate segment,
  with the other layers' bytes and padding between them). The callable has the
  signature of :func:`pagedkv_kernels.indexer_k.indexer_k_cache_scatter`
  (``fn(k_cache, codes, scales, slot_fp8, slot_scale)``). The whole arena must equal
  the reference's bit for bit, so a write into another layer or a gap fails as surely
  as a missing one; a kernel that takes the flat index for a memory offset (it assumes
  a contiguous pool) passes the one-layer case and fails every other.
* **block copy**: pairs of (source, destination, tokens) over a multi-layer pool of
  random bits (NaN payloads included), whole (``0``, ``-1``) and partial counts, NHD
  and HND, inside one pool or into a second one; the callable has the signature of
  :func:`pagedkv_kernels.block_copy.copy_paged_blocks` (``fn(cache, src_blocks, dst_blocks,
  num_tokens, layout=..., dst_cache=...)``); both pools must equal the reference's bit
  for bit.

Each case is a plain dict; the inputs are built on the CPU and moved to
:func:`pagedkv_lib.runtime.device`.
"""

from __future__ import annotations

import copy
import math

import torch

from pagedkv_lab.verify.append_checks import append_inputs
from pagedkv_lab.verify.compare import DTYPES, bits
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import cover
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import runtime
from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.indexer_cache import IndexerKPool, flat_slots, quantize_indexer_k, scatter_indexer_k

__all__ = [
    "indexer_scatter_grid",
    "indexer_scatter_inputs",
    "indexer_scatter_case",
    "block_copy_grid",
    "block_copy_inputs",
    "block_copy_case",
]


def indexer_scatter_grid(full: bool = False) -> list[dict]:
    """Indexer scatter cases: layers x token counts, cycling block sizes, head sizes,
    the layer written, padding bytes between blocks and padding tokens (6 cases; 8
    with ``full``, which adds 70 tokens)."""
    values = {
        "num_layers": [1, 3],
        "num_tokens": [0, 1, 13] + ([70] if full else []),
        "block_size": [4, 16],
        "head_dim": [32, 128, 16],
        "layer": [0, 2],
        "pad": [0, 12],
        "padding": [2, 0],
    }
    cases = cover(values, outer=2)
    for c in cases:
        c["layer"] = min(c["layer"], c["num_layers"] - 1)
        c["padding"] = min(c["padding"], c["num_tokens"])
    return cases


def _keys(n: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, head_dim]`` fp32 keys; the first rows carry the specials (all zeros, +-inf,
    NaN) the per-token scale rule must handle."""
    k = torch.randn((n, head_dim), generator=gen) * 3
    specials = [torch.zeros(head_dim), torch.full((head_dim,), math.inf), torch.full((head_dim,), math.nan)]
    for i, row in enumerate(specials[:n]):
        k[i, :: 3 + i] = row[:: 3 + i]
    return k


def indexer_scatter_inputs(case: dict):
    """``(pool, codes, scales, slot_fp8, slot_scale, owners)`` of a scatter case, on the
    CPU: the tokens of the append case of the same shape (:func:`.append_inputs`:
    ``num_tokens`` tokens, ``padding`` of them padding, up to 3 requests continuing
    mid-block on scattered blocks), a random-bytes :class:`IndexerKPool` as large as
    that case's pool, the tokens' quantized keys and flat slots; ``owners[t]`` is
    ``(request, position)``."""
    bs, d, n = case["block_size"], case["head_dim"], case["num_tokens"]
    seed = case.get("seed", 0)
    like = {"dtype": "fp32", "layout": "NHD", "num_kv_heads": 1, "page_size": bs, "head_dim": d, "seed": seed}
    pages, _, _, slots, batch, positions = append_inputs({**like, "num_tokens": n, "padding": case["padding"]})
    gen = torch.Generator().manual_seed(seed)
    pool = IndexerKPool(pages.shape[0], bs, d, case["num_layers"], case["pad"], generator=gen)
    codes, scales = quantize_indexer_k(_keys(n, d, gen)[torch.randperm(n, generator=gen)])
    slot_fp8, slot_scale = flat_slots(slots, bs, d)
    return pool, codes, scales, slot_fp8, slot_scale, list(zip(batch.tolist(), positions.tolist()))


def _locate_arena_error(got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, pool: IndexerKPool,
                        layer: int, slots: tuple, owners: list) -> str:  # fmt: skip
    """Where the arena first differs: block, layer, byte in the block (codes, scales or
    the padding after them), the token that owns it, and the kind of error."""
    differ = got != expected
    count = int(differ.sum())
    if not count:
        return ""
    block, lay, byte = (int(i) for i in torch.nonzero(differ)[0])
    kind = "missing or wrong write" if lay == layer else "a write into another layer's block"
    if byte >= pool.block_bytes:
        kind, part = "a write into the padding after a block", f"padding byte {byte - pool.block_bytes}"
    elif byte < pool.block_size * pool.head_dim:
        part = f"codes of row {byte // pool.head_dim}, byte {byte % pool.head_dim}"
    else:
        part = f"scale of row {(byte - pool.block_size * pool.head_dim) // 4}"
    flat = block * pool.block_bytes + byte
    owner = ""
    for name, starts, size in (("codes", slots[0], pool.head_dim), ("scale", slots[1], 4)):
        hit = torch.nonzero((starts >= 0) & (starts <= flat) & (flat < starts + size))
        if hit.numel() and lay == layer:
            t = int(hit[0])
            owner = f" ({name} of token {t}, request {owners[t][0]}, position {owners[t][1]})"
    g, e, o = (int(t[block, lay, byte]) for t in (got, expected, before))
    where = f"block {block}, layer {lay}, {part}{owner}"
    return f"{count} bytes differ; first: {kind} at {where}: {g} instead of {e} (was {o})"


def indexer_scatter_case(scatter_fn, case: dict) -> CaseResult:
    """Run one scatter case: the arena must equal the reference's bit for bit (the other
    layers and the padding untouched), and the inputs must be left as they were."""
    pool, codes, scales, slot_fp8, slot_scale, owners = indexer_scatter_inputs(case)
    layer = case["layer"]
    before = pool.arena.clone()
    expected = copy.copy(pool)
    expected.arena = before.clone()
    scatter_indexer_k(expected.cache(layer), codes, scales, slot_fp8, slot_scale)
    dev = runtime.device()
    pool.arena = pool.arena.to(dev)
    originals = {"codes": codes, "scales": scales, "slot_fp8": slot_fp8, "slot_scale": slot_scale}
    inputs = {name: t.clone().to(dev) for name, t in originals.items()}
    try:
        scatter_fn(pool.cache(layer), inputs["codes"], inputs["scales"], inputs["slot_fp8"], inputs["slot_scale"])
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("indexer_scatter", case, False, math.inf, detail=raised(err))
    got = pool.arena.cpu()
    notes = [_locate_arena_error(got, expected.arena, before, pool, layer, (slot_fp8, slot_scale), owners)]
    notes += [
        f"the scatter modified its input {n}" for n, t in originals.items() if not bits(inputs[n].cpu()).equal(bits(t))
    ]
    notes = [n for n in notes if n]
    ok = not notes
    return CaseResult("indexer_scatter", case, ok, 0.0 if ok else math.inf, detail="; ".join(notes),
                      tol_ratio=0.0 if ok else math.inf)  # fmt: skip


def block_copy_grid(full: bool = False) -> list[dict]:
    """Block-copy cases: layouts x dtypes, cycling layers, page sizes, heads, head sizes,
    pair counts and a second destination pool (6 cases; 12 with ``full``)."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "bf16", "fp16"],
        "num_layers": [3, 1, 2],
        "page_size": [5, 16],
        "num_heads": [2, 1],
        "head_dim": [8, 64, 24],
        "num_pairs": [4, 1, 3, 0] + ([9] if full else []),
        "into_other_pool": [False, True],
    }
    return cover(values, outer=3 if full else 2)


def block_copy_inputs(case: dict):
    """``(cache, dst_cache or None, src, dst, tokens)`` of a copy case, on the CPU: pools
    of random bits (every bit pattern, NaN payloads and signed zeros included) and
    ``num_pairs`` distinct pairs, their counts cycling ``[0, -1, 1, page_size - 1, 2]``
    (whole, whole, partial ...)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype = DTYPES[case["dtype"]]
    layout, ps, h, d, layers, n = (
        case[k] for k in ("layout", "page_size", "num_heads", "head_dim", "num_layers", "num_pairs")
    )
    pages = 2 * n + 2
    inner = (ps, h, d) if layout == "NHD" else (h, ps, d)

    def random_pool(num_pages: int) -> torch.Tensor:
        shape = (layers, num_pages, 2, *inner)
        raw = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),), generator=gen)
        return raw.to(torch.uint8).view(dtype).view(shape)

    cache = random_pool(pages)
    dst_cache = random_pool(pages + 1) if case["into_other_pool"] else None
    ids = torch.randperm(pages, generator=gen)
    src, dst = ids[:n], ids[n : 2 * n]
    counts = [0, -1, 1, ps - 1, 2]
    tokens = torch.tensor([min(counts[i % len(counts)], ps) for i in range(n)], dtype=torch.int64)
    return cache, dst_cache, src, dst, tokens


def block_copy_case(copy_fn, case: dict) -> CaseResult:
    """Run one copy case: every pool must equal the reference's bit for bit, and the
    pair tensors must be left as they were."""
    cache, dst_cache, src, dst, tokens = block_copy_inputs(case)
    layout = case["layout"]
    expected = cache.clone()
    expected_dst = None if dst_cache is None else dst_cache.clone()
    copy_blocks(expected, src, dst, tokens, layout, expected_dst)
    dev = runtime.device()
    pools = {"cache": cache.to(dev), "dst_cache": None if dst_cache is None else dst_cache.to(dev)}
    pairs = {name: t.clone().to(dev) for name, t in (("src_blocks", src), ("dst_blocks", dst), ("num_tokens", tokens))}
    try:
        copy_fn(pools["cache"], pairs["src_blocks"], pairs["dst_blocks"], pairs["num_tokens"], layout=layout,
                dst_cache=pools["dst_cache"])  # fmt: skip
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("block_copy", case, False, math.inf, detail=raised(err))
    notes = []
    for name, want in (("cache", expected), ("dst_cache", expected_dst)):
        if want is None:
            continue
        differ = bits(pools[name].cpu()) != bits(want)
        if differ.any():
            layer, page, kv, a, b, feat = (int(i) for i in torch.nonzero(differ)[0])
            row, head = (a, b) if layout == "NHD" else (b, a)
            notes.append(f"{name}: {int(differ.sum())} elements differ; first at layer {layer}, page {page}, "
                         f"{'KV'[kv]}, row {row}, head {head}, feature {feat}")  # fmt: skip
    for name, t in (("src_blocks", src), ("dst_blocks", dst), ("num_tokens", tokens)):
        if not pairs[name].cpu().equal(t):
            notes.append(f"the copy modified its input {name}")
    ok = not notes
    return CaseResult("block_copy", case, ok, 0.0 if ok else math.inf, detail="; ".join(notes),
                      tol_ratio=0.0 if ok else math.inf)  # fmt: skip

"""Prefill cases: several new queries per sequence (chunked prefill, prefix-cache hits,
speculative verification) attending to a paged pool, compared with the float64
reference by the pass rule; the pool and the inputs must be left exactly as they were.

Each case is a batch of requests ``(seq_len, q_len)``: the sequence's keys
``0 .. seq_len - 1`` are written (the new ones included) into a NaN-poisoned pool on
scattered pages, and its ``q_len`` queries sit at positions ``seq_len - q_len ..
seq_len - 1``. The batches hold a single-chunk prefill (``q_len == seq_len``), the
second and third chunk of a chunked prefill, a prefix-cache hit whose first query
starts mid-page, a decode step (``q_len == 1``), a request with keys but no queries
and an empty request; ring windows narrower than the chunk (so the window cuts the
chunk's own causal triangle); linear-cache windows (FlashInfer's ``window_left``)
over chunks far longer than a page, as narrow as one key and wider than the sequence;
and long requests over several query tiles and key tiles. A kernel whose causal mask
compares keys with the query's index inside its chunk instead of its absolute position
(fault ``chunk_local_mask``) is right on the single-chunk batches only, and fails the
others. Draft trees of speculative verification (a case's ``"tree"``: parents per
request, passed as ``tree_mask`` to a kernel that takes it) catch a kernel that ignores
the tree's mask (fault ``tree_mask_ignored``: siblings see each other).
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.contract import Contract, contract_of
from pagedkv_lab.verify.decode_checks import case_window, read_changes, write_sequence
from pagedkv_lab.verify.grid import accepts, cover, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.read_call import call_read, check_lse, score_mod_cases, score_mod_kwargs
from pagedkv_lab.verify.report import CaseResult, located
from pagedkv_lab.verify.stale import restrict_poison
from pagedkv_lib import reference, runtime
from pagedkv_lib.compare import DTYPES, compare
from pagedkv_lib.draft_tree import batch_tree_mask
from pagedkv_lib.formats import pad_block_tables, scatter_pages
from pagedkv_lib.pool import PagedKVPool, cache_dims
from pagedkv_lib.window import RingWindow

__all__ = [
    "prefill_grid",
    "long_prefill_cases",
    "window_prefill_cases",
    "linear_window_prefill_cases",
    "noncausal_prefill_cases",
    "tree_prefill_cases",
    "prefill_inputs",
    "prefill_case",
    "score_mod_prefill_cases",
    "split_new_tokens",
    "locate_row",
]

# Batches of (seq_len, q_len): what each one is there for.
BATCHES = [
    ((37, 37), (0, 0), (20, 1)),  # a whole prompt in one chunk; an empty request; a decode step
    ((32, 16), (48, 16), (21, 5)),  # the 2nd and 3rd chunk of 16; a 5-token chunk after 16 cached
    ((29, 13), (16, 0), (1, 1)),  # a prefix-cache hit of 16 (mid-page for pages of 5); keys, no queries
]


def long_prefill_cases() -> list[dict]:
    """Requests of a few hundred tokens: several query tiles and key tiles per request,
    the query range starting inside a key tile, and a whole long prompt at once."""
    base = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 4, "num_kv_heads": 2}
    return [
        {**base, "requests": ((300, 100), (129, 129))},
        {**base, "layout": "HND", "dtype": "bf16", "head_dim": 80, "page_size": 1, "group": 5,
         "num_kv_heads": 1, "requests": ((190, 63), (2, 1))},
    ]  # fmt: skip


def window_prefill_cases() -> list[dict]:
    """Ring windows (with ``one_more_block``, so that a chunk of up to ``page_size + 1``
    tokens fits) narrower than the chunk: the chunk's last queries no longer see its
    first keys, and the ring has wrapped several times."""
    base = {"dtype": "fp32", "head_dim": 64, "group": 2, "num_kv_heads": 2}
    return [
        {**base, "layout": "NHD", "page_size": 16, "window": (8, 2), "requests": ((37, 12), (20, 1), (60, 17))},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "window": (7, 3), "requests": ((40, 6), (9, 6))},
        {**base, "layout": "NHD", "dtype": "bf16", "page_size": 4, "window": (6, 0), "requests": ((23, 5), (3, 3))},
    ]


def linear_window_prefill_cases() -> list[dict]:
    """Linear-cache windows (``window_left``, a mask over absolute positions; no ring, so
    no chunk cap): chunks of 37 and 47 queries over pages of 16 with a window of 14 keys
    (FlashInfer's test shapes), a whole prompt next to a later chunk with a window of
    one key, and a window wider than every sequence (the causal result)."""
    base = {"head_dim": 64, "group": 2, "num_kv_heads": 2}
    return [
        {**base, "layout": "NHD", "dtype": "fp32", "page_size": 16, "window_left": 13,
         "requests": ((54, 37), (97, 47), (20, 1))},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "group": 5, "num_kv_heads": 1, "window_left": 0,
         "requests": ((40, 40), (33, 9), (12, 0))},
        {**base, "layout": "NHD", "dtype": "bf16", "page_size": 1, "window_left": 50, "requests": ((30, 12), (8, 8))},
    ]  # fmt: skip


def noncausal_prefill_cases() -> list[dict]:
    """``causal=False`` (every query sees all its request's keys; no window): a chunk in
    the middle of a sequence, over key tiles it would not reach causally, and a whole
    prompt (the first case: a causal kernel takes it and gets it wrong); more queries
    than keys and a request without keys (the second: a causal kernel refuses it). A
    kernel that ignores ``causal=False`` fails them. Not in :func:`prefill_grid` (whose
    results stay those of the causal kernels): run them with :func:`prefill_case` on a kernel that takes ``causal``."""
    base = {"head_dim": 64, "group": 2, "num_kv_heads": 2, "causal": False}
    return [
        {**base, "layout": "NHD", "dtype": "fp32", "page_size": 16, "requests": ((150, 20), (12, 0), (40, 40))},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "group": 5, "requests": ((33, 4), (5, 9), (0, 2))},
    ]


def tree_prefill_cases() -> list[dict]:
    """Speculative verification of draft trees (``"tree"``: the parents of each request's
    new tokens, :mod:`pagedkv_lib.draft_tree`; None for a plain causal request): a
    branchy tree after 33 cached tokens next to a whole prompt, an empty request and a
    wide forest (four alternatives for one position, each seeing the context and itself);
    a deeper tree through a linear window with GQA 5 next to a decode step. A kernel
    that ignores the mask (plain causal: siblings see each other) fails both."""
    base = {"head_dim": 64, "group": 2, "num_kv_heads": 2}
    return [
        {**base, "layout": "NHD", "dtype": "fp32", "page_size": 16, "requests": ((40, 7), (25, 25), (0, 0), (18, 4)),
         "tree": ((-1, 0, 0, 1, 1, 2, -1), None, None, (-1, -1, -1, -1))},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "group": 5, "num_kv_heads": 1, "window_left": 12,
         "requests": ((30, 9), (12, 1)), "tree": ((-1, 0, 1, 0, 3, 0, 5, 6, 6), (-1,))},
    ]  # fmt: skip


def score_mod_prefill_cases() -> list[dict]:
    """Cases with score modifiers (:func:`.read_call.score_mod_cases`), for a kernel that
    declares them: the soft cap over a whole prompt, an empty request and a decode step;
    ALiBi over later chunks; sinks next to a request without queries; all three over a
    long chunk of 100 queries after 200 cached tokens."""
    base = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 2, "num_kv_heads": 2}
    return score_mod_cases([
        {**base, "requests": BATCHES[0]},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 5, "requests": BATCHES[1]},
        {**base, "dtype": "bf16", "group": 4, "num_kv_heads": 1, "requests": BATCHES[2]},
        {**base, "requests": ((300, 100), (20, 20))},
    ])  # fmt: skip


def prefill_grid(full: bool = False) -> list[dict]:
    """Prefill cases: layouts x dtypes, cycling head dims, page sizes, GQA groups and the
    :data:`BATCHES`; a pool of finite stale values; a NaN in a query; then ring windows,
    long requests, linear windows and draft trees."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 80, 128] + ([256] if full else []),
        "page_size": [1, 5, 16] + ([64] if full else []),
        "group": [1, 4, 5, 8],
        "num_kv_heads": [2, 1],
        "requests": BATCHES,
    }
    extra = [
        {"layout": "HND", "dtype": "fp32", "head_dim": 48, "page_size": 8, "group": 3, "num_kv_heads": 2,
         "requests": ((24, 9), (9, 9)), "poison": False},
        {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 8, "group": 2, "num_kv_heads": 1,
         "requests": ((20, 6), (0, 0), (9, 3)), "nan_query": True},
        *window_prefill_cases(),
        *long_prefill_cases(),
        *linear_window_prefill_cases(),
        *tree_prefill_cases(),
    ]  # fmt: skip
    return cover(values, extra, outer=3 if full else 2)


def prefill_inputs(case: dict):
    """``(q, cache, qo_indptr, block_tables, seq_lens, window)`` of a prefill case, on the
    CPU. Every slot no sequence owns is NaN (unless ``poison=False``: finite random)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d = DTYPES[case["dtype"]], case["page_size"], case["num_kv_heads"], case["head_dim"]
    window = case_window(case, one_more_block=case.get("one_more_block", True))
    ring = window if isinstance(window, RingWindow) else None
    lens = [n for n, _ in case["requests"]]
    q_lens = [m for _, m in case["requests"]]
    pages_each = [int(ring.num_blocks(n)) if ring else -(-n // ps) for n in lens]
    num_pages = sum(pages_each) + 2
    pool = PagedKVPool(num_pages, ps, hk, d, dtype, case["layout"])
    if case.get("poison", True):
        pool.cache.fill_(float("nan"))
    else:
        pool.cache.copy_(rand(pool.cache.shape, dtype, gen))
    tables = pad_block_tables(scatter_pages(pages_each, num_pages, gen), max(pages_each, default=0) + 1)
    for b, n in enumerate(lens):
        # Positions 0..n-1 in order (the chunk's own keys included), as the earlier
        # chunks and this one left them: through a ring only the last writer of a row stays.
        write_sequence(pool, tables, b, n, window, gen)
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    q = rand((sum(q_lens), hk * case["group"], d), dtype, gen)
    if case.get("nan_query"):  # an honest kernel returns NaN for the first query's head 0
        q[0, 0, 0] = float("nan")
    restrict_poison([pool.cache], tables, case.get("poison", True), case.get("seed", 0))
    return q, pool.cache, qo_indptr, tables, torch.tensor(lens, dtype=torch.int32), window


def locate_row(row: int, qo_indptr, seq_lens) -> tuple[int, int, int]:
    """``(request, query index, absolute position)`` of row ``row`` of a ragged ``q``."""
    indptr = torch.as_tensor(qo_indptr).tolist()
    b = max(i for i in range(len(indptr) - 1) if indptr[i] <= row < indptr[i + 1])
    i = row - indptr[b]
    q_len = indptr[b + 1] - indptr[b]
    return b, i, int(seq_lens[b]) - q_len + i


def split_new_tokens(cache, tables, qo_indptr, seq_lens, layout: str, poison=True, seed: int = 0, overwrite=True):
    """``(k_new, v_new) [total_q, num_kv_heads, head_dim]``: the new tokens' K/V (request
    ``b``'s positions ``seq_lens[b] - q_len[b] ..``, in ``q``'s row order) copied out of
    the pool ``cache``, whose rows for them are then overwritten in place (unless
    ``overwrite`` is False: the ``"both"`` form): NaN (``poison`` True), else finite
    values unlike theirs. A kernel given them apart (the separate form) that reads the
    pool for them fails either way."""
    dims = cache_dims(cache, layout)
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    gen = torch.Generator().manual_seed(20_011 + seed)
    ks, vs = [], []
    for b, (n, m) in enumerate(zip(seq_lens.tolist(), q_lens)):
        k, v = reference.gather_paged_kv(cache, tables[b], n, layout)
        ks.append(k[n - m :].clone())
        vs.append(v[n - m :].clone())
        for pos in range(n - m, n) if overwrite else ():
            page, row = int(tables[b, pos // dims.page_size]), pos % dims.page_size
            rows = cache[page, :, row] if layout == "NHD" else cache[page, :, :, row]
            fill = rand(rows.shape, cache.dtype, gen) + 3.0 if poison is not True else float("nan")
            rows.copy_(torch.as_tensor(fill, dtype=cache.dtype).expand(rows.shape))
    return torch.cat(ks), torch.cat(vs)


def prefill_case(prefill_fn, case: dict, contract: Contract | None = None) -> CaseResult:
    """Run one prefill case: the output within tolerance of the float64 reference (the
    failure detail names the first (request, query, head, feature) beyond it) and the
    LSE for a kernel declaring one, and the pool, ``q`` and the index tensors
    bit-for-bit unchanged, nothing written next to them or past ``out=``. The pool is
    built in the kernel's declared cache layout (distinct K and V strides unless it
    declares them shared). A kernel declaring ``new_tokens="separate"`` gets the new
    tokens' K/V as ``k_new=``, ``v_new=`` and their pool rows poisoned
    (:func:`split_new_tokens`); ``"both"``, the same without the poisoning; both
    against the same reference, computed from the whole pool first."""
    contract = contract or contract_of(prefill_fn)
    reason = contract.outside(case) or _options_outside(prefill_fn, case)
    if reason:
        return CaseResult("prefill", case, None, outside=reason)
    q, cache, qo_indptr, tables, lens, window = prefill_inputs(case)
    layout, causal, mods = case["layout"], case.get("causal", True), score_mod_kwargs(case, q.shape[1])
    tree_mask = None if case.get("tree") is None else batch_tree_mask(case["tree"], qo_indptr)
    expected, expected_lse = reference.paged_prefill_attention(
        q, cache, qo_indptr, tables, lens, layout=layout, window=window, precision="fp64", causal=causal,
        return_lse=True, tree_mask=tree_mask, **mods,
    )  # fmt: skip
    atol, rtol = contract.tolerance(case["dtype"])
    originals = {"q": q, "qo_indptr": qo_indptr, "block_tables": tables, "seq_lens": lens}
    if tree_mask is not None:
        originals["tree_mask"] = tree_mask
    if contract.new_tokens != "cache":
        poison, overwrite = case.get("poison", True), contract.new_tokens == "separate"
        originals["k_new"], originals["v_new"] = split_new_tokens(
            cache, tables, qo_indptr, lens, layout, poison, overwrite=overwrite
        )
    dev, guards = runtime.device(), Guards()
    native = guards.place_pool(cache, contract.cache_layout, layout, dev, contract.pool_kv_strides())
    inputs = {name: guards.place(name, t.to(dev)) for name, t in originals.items()}
    kwargs = _prefill_kwargs(prefill_fn, inputs, layout, window, causal) | mods
    args = (inputs["q"], native, *(inputs[n] for n in ("qo_indptr", "block_tables", "seq_lens")))
    out, lse, error = call_read(prefill_fn, args, kwargs, contract, inputs["q"], guards)
    if error:
        return CaseResult("prefill", case, False, math.inf, math.inf, atol, error)
    result = compare(out, expected, atol, rtol)

    def where(idx):
        b, i, pos = locate_row(idx[0], qo_indptr, lens)
        q_len = int(qo_indptr[b + 1] - qo_indptr[b])
        text = f"request {b} (seq_len {int(lens[b])}, q_len {q_len}), query {i} (position {pos}), head {idx[1]}"
        return text + (f", feature {idx[2]}" if len(idx) > 2 else "")

    notes = [check_lse(lse, expected_lse, contract, case["dtype"], where)[1]] if contract.lse is not None else []
    notes += read_changes("prefill", case, cache, native, contract.cache_layout, originals, inputs)
    notes += guards.corrupted()
    notes = [n for n in notes if n]
    ok = result.passed and not notes
    detail = "; ".join([x for x in (located(result, where, out, expected), *notes) if x])
    return CaseResult("prefill", case, ok, result.max_abs, result.max_rel, atol, detail, result.tol_ratio)


def _options_outside(prefill_fn, case: dict) -> str | None:
    """A case option the kernel takes no argument for: ``causal=False``, a draft tree."""
    if not case.get("causal", True) and not accepts(prefill_fn, "causal"):
        return "the kernel takes no causal option"
    if case.get("tree") is not None and not accepts(prefill_fn, "tree_mask"):
        return "the kernel takes no tree_mask option"
    return None


def _prefill_kwargs(prefill_fn, inputs: dict, layout: str, window, causal: bool) -> dict:
    """The keyword arguments of a prefill call: ``layout`` when taken, ``k_new``/``v_new``
    (the separate and both forms), ``window``, ``causal=False``, ``tree_mask``."""
    kwargs = {"layout": layout} if accepts(prefill_fn, "layout") else {}
    if "k_new" in inputs:
        kwargs |= {"k_new": inputs["k_new"], "v_new": inputs["v_new"]}
    if window is not None:
        kwargs["window"] = window
    if not causal:
        kwargs["causal"] = False
    if "tree_mask" in inputs:
        kwargs["tree_mask"] = inputs["tree_mask"]
    return kwargs

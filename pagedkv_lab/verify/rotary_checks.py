"""Rotary-position cases: a CSR append whose RoPE position is not the cache position.

Each case builds one of TensorRT-LLM's three position sources
(:mod:`pagedkv_lib.rotary_positions`) over a few requests that continue mid-page on
scattered pages, and calls the callable under test with the signature of
``kernels.append_paged_kv_csr`` plus ``rope=``, ``q=`` and ``rope_positions=``:

* ``spec_tree``: every request verifies a tree of draft tokens; siblings share a
  rotary position (their depth) while each has its own cache row;
* ``mrope``: a per-request M-RoPE delta (negative, zero, positive) shifts every rotary
  position;
* ``helix``: a Helix position table (this rank holds every ``ranks``-th global
  position) with one request flagged inactive: its tokens are cache padding (nothing
  of them may reach the pool) but their Q is still rotated;
* ``helix_mrope``: the table plus a delta (the delta is added after the override).

Rotated K rows and rotated Q rows are compared by value with the float64 rotation at
the rotary positions (the dtype's tolerance); everything else, V and every row no
token addresses included, bit for bit. A kernel that rotates at the cache position
instead is off by whole radians and fails every case.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import checks, reference, runtime
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare, first_difference
from pagedkv_lib.formats import scatter_pages
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.rotary_positions import as_padding, draft_tree_offsets, inactive_tokens, rotary_positions

__all__ = ["ROTARY_SOURCES", "rotary_append_grid", "rotary_append_inputs", "rotary_append_case"]

ROTARY_SOURCES = ("spec_tree", "mrope", "helix", "helix_mrope")
_TREE = (-1, 0, 0, 1, 1, 2)  # a root, two drafts after it, two after the first, one after the second
_HELIX_RANKS, _HELIX_RANK = 4, 1


def rotary_append_grid(full: bool = False) -> list[dict]:
    """One case per source, cycling dtypes, layouts, RoPE styles, page sizes and head
    counts (4 cases; 8 with ``full``, each source again with the other style)."""
    rows = [  # (source, dtype, layout, rope, page_size, num_kv_heads, num_q_heads, head_dim)
        ("spec_tree", "fp16", "NHD", "neox", 4, 2, 4, 64),
        ("mrope", "bf16", "HND", "gptj", 5, 1, 2, 32),
        ("helix", "fp32", "NHD", "neox", 16, 2, 2, 64),
        ("helix_mrope", "fp16", "HND", "gptj", 3, 2, 6, 48),
    ]
    if full:
        rows += [(s, "fp32", "HND" if lay == "NHD" else "NHD", "gptj" if r == "neox" else "neox", 1, 1, 3, d)
                 for s, _, lay, r, _, _, _, d in rows]  # fmt: skip
    keys = ("source", "dtype", "layout", "rope", "page_size", "num_kv_heads", "num_q_heads", "head_dim")
    return [dict(zip(keys, row)) for row in rows]


def _sources(source: str, append_indptr, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rope_positions, inactive)`` of ``source`` (``inactive``: bool per token or None)."""
    counts = append_indptr[1:] - append_indptr[:-1]
    num_req = counts.numel()
    if source == "spec_tree":
        depth = draft_tree_offsets(_TREE)
        offsets = depth.expand(num_req, -1).clone()  # TensorRT-LLM's [batch, max_input_seq_len]
        return rotary_positions(append_indptr, past, spec_decoding_position_offsets=offsets), None
    if source == "mrope":
        deltas = torch.tensor([-2, 0, 37][:num_req])
        return rotary_positions(append_indptr, past, mrope_position_deltas=deltas), None
    # Helix: request b's global positions start at 4 * past[b] (the other ranks hold the
    # rest); this rank's token i sits at global 4 * (past + i) + rank.
    batch = torch.repeat_interleave(torch.arange(num_req), counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(append_indptr[:-1], counts)
    table = _HELIX_RANKS * (past[batch] + within) + _HELIX_RANK
    deltas = torch.tensor([5, 0, 9][:num_req]) if source == "helix_mrope" else None
    pos = rotary_positions(append_indptr, past, helix_position_offsets=table, mrope_position_deltas=deltas)
    flag = torch.zeros(num_req, dtype=torch.bool)
    flag[1 % num_req] = True  # one request's KV lives on another rank
    return pos, inactive_tokens(append_indptr, flag)


def rotary_append_inputs(case: dict) -> dict:
    """The tensors of a rotary case, on the CPU: ``cache`` (a random pool in
    ``case["layout"]``), ``k``, ``v``, ``q``, the CSR form ``batch_indices``,
    ``positions`` (the cache positions; ``-1`` for the inactive rank's tokens),
    ``kv_indices``, ``kv_indptr``, and ``rope_positions`` (from the case's source)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps = DTYPES[case["dtype"]], case["page_size"]
    hk, hq, d = case["num_kv_heads"], case["num_q_heads"], case["head_dim"]
    counts = torch.tensor([len(_TREE)] * 3 if case["source"] == "spec_tree" else [5, 3, 7])
    append_indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    past = torch.randint(2, 2 * ps + 3, (counts.numel(),), generator=gen)
    rope_pos, inactive = _sources(case["source"], append_indptr, past)
    pages_each = [-(-int(p + m) // ps) for p, m in zip(past, counts)]
    num_pages = sum(pages_each) + 2
    rows = scatter_pages(pages_each, num_pages, gen)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_each).cumsum(0).tolist()])
    kv_indices = torch.tensor([p for row in rows for p in row])
    n = int(counts.sum())
    batch = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    positions = past[batch] + torch.arange(n) - append_indptr[:-1][batch]
    if inactive is not None:
        positions = as_padding(positions, inactive)
    pool = PagedKVPool(num_pages, ps, hk, d, dtype, case["layout"])
    pool.cache.copy_(rand(pool.cache.shape, dtype, gen))
    return {
        "cache": pool.cache,
        "k": rand((n, hk, d), dtype, gen),
        "v": rand((n, hk, d), dtype, gen),
        "q": rand((n, hq, d), dtype, gen),
        "batch_indices": batch,
        "positions": positions,
        "kv_indices": kv_indices,
        "kv_indptr": kv_indptr,
        "rope_positions": rope_pos,
    }


def _k_rows(cache: torch.Tensor, layout: str, slots: torch.Tensor) -> torch.Tensor:
    """A view of K rows ``[n, num_kv_heads, head_dim]`` at host ``slots`` (a copy: advanced indexing)."""
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)
    ps = nhd.shape[2]
    return nhd[slots // ps, 0, slots % ps]


def _put_k_rows(cache: torch.Tensor, layout: str, slots: torch.Tensor, rows: torch.Tensor) -> None:
    nhd = cache if layout == "NHD" else cache.transpose(2, 3)
    ps = nhd.shape[2]
    nhd[slots // ps, 0, slots % ps] = rows


def rotary_append_case(append_fn, case: dict) -> CaseResult:
    """Run one rotary case (module docstring): written K rows and rotated Q rows within
    the dtype's tolerance of the float64 rotation at ``rope_positions``, the rest of the
    pool and of ``q`` bit for bit equal to the reference's, inputs other than ``q``
    unchanged, nothing written outside the given tensors."""
    name, layout, rope = "rotary_append", case["layout"], case["rope"]
    t = rotary_append_inputs(case)
    index = ("batch_indices", "positions", "kv_indices", "kv_indptr")
    slots = checks.check_csr_append_args(t["k"], t["v"], t["cache"], *(t[n] for n in index), layout)
    want_cache, want_q = t["cache"].clone(), t["q"].clone()
    reference.append_paged_kv_csr(
        t["k"], t["v"], want_cache, *(t[n] for n in index), layout, rope=rope, q=want_q,
        rope_positions=t["rope_positions"],
    )  # fmt: skip
    dev, guards = runtime.device(), Guards()
    placed = {n: guards.place(n, x.to(dev)) for n, x in t.items()}
    try:
        append_fn(
            placed["k"], placed["v"], placed["cache"], *(placed[n] for n in index), layout=layout, rope=rope,
            q=placed["q"], rope_positions=placed["rope_positions"],
        )  # fmt: skip
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult(name, case, False, math.inf, 0.0, 0.0, raised(err))
    got_cache, got_q = placed["cache"].cpu(), placed["q"].cpu()
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    pos = t["rope_positions"]
    written = slots >= 0
    rotated = checks.rotated_rows(slots, pos)
    notes, max_abs, ratio = [], 0.0, 0.0
    for what, got, x, rows in (
        ("K", _k_rows(got_cache, layout, slots[written]), t["k"][written], written),
        ("Q", got_q[rotated], t["q"][rotated], rotated),
    ):
        c = compare(got, reference.rope_reference(x, pos[rows], style=rope), atol, rtol)
        max_abs, ratio = max(max_abs, c.max_abs), max(ratio, c.tol_ratio)
        if not c.passed:
            detail = c.detail or f"max |err| {c.max_abs:.2e}"
            notes.append(f"rotated {what} beyond tolerance at rope_positions ({detail})")
    # The rotated rows are checked by value above; put the reference's bits there so the
    # bit comparison covers every other byte (V, untouched rows, unrotated q rows).
    _put_k_rows(got_cache, layout, slots[written], _k_rows(want_cache, layout, slots[written]))
    got_q[rotated] = want_q[rotated]
    for what, got, want in (("cache", got_cache, want_cache), ("q", got_q, want_q)):
        count, where = first_difference(got, want, layout if what == "cache" else None)
        if count:
            notes.append(f"{what}: {count} elements differ from the reference's, first at {where}")
    for n, before in t.items():
        if n not in ("cache", "q"):
            count, where = first_difference(placed[n].cpu(), before)
            if count:
                notes.append(f"append modified its input {n} ({where})")
    notes += guards.corrupted()
    ok = not notes
    return CaseResult(name, case, ok, max_abs, 0.0, 0.0, "; ".join(notes), ratio)

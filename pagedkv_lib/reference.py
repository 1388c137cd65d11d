"""Python references that every kernel is judged by.

``cache`` is always the raw 5-D pool tensor (see :mod:`pagedkv_lib.pool` for the NHD
and HND layouts), so any tensor of that shape works. Each operation comes twice: a
short loop (``*_loop``, for reading) and a vectorized torch form (for speed); the
tests hold them equal. Every entry point takes the same arguments as its Triton twin
in ``pagedkv_kernels`` and checks them with the same functions of :mod:`pagedkv_lib.checks`,
so the two accept exactly the same inputs.

Devices: the pool may live on any device (appends write it in place there); index
tensors are read on the host, and the attention references compute on the CPU and
return CPU tensors.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lib.checks import (
    check_append_args,
    check_csr_append_args,
    check_csr_decode_args,
    check_decode_args,
    check_merge_args,
    check_prefill_args,
    check_rope_args,
    check_v_tail_args,
    rope_position_source,
    rotated_rows,
)
from pagedkv_lib.formats import PAD, index_tensor
from pagedkv_lib.indexing import locate, split_slot
from pagedkv_lib.merge_state import merge_lse_weighted
from pagedkv_lib.pool import cache_dims
from pagedkv_lib.score_mods import alibi_bias, check_score_mods, sink_share, soft_cap
from pagedkv_lib.window import RingWindow, Window, window_mask

__all__ = [
    "append_paged_kv",
    "append_paged_kv_csr",
    "append_paged_kv_loop",
    "zero_paged_v_tail",
    "gather_paged_kv",
    "gather_paged_kv_loop",
    "paged_decode_attention",
    "paged_decode_attention_csr",
    "paged_decode_attention_loop",
    "paged_prefill_attention",
    "paged_prefill_attention_loop",
    "masked_softmax",
    "merge_partials",
    "rope_inv_freq",
    "rope_reference",
]


# --------------------------------------------------------------------------- append


def _row_index(layout: str, page, kv: int, offset):
    """Index tuple selecting ``[..., num_kv_heads, head_dim]`` rows of the raw cache."""
    return (page, kv, offset) if layout == "NHD" else (page, kv, slice(None), offset)


def _store(k, v, cache, slots: torch.Tensor, layout: str, rope, positions, rope_theta, q, q_rows=None) -> None:
    """Write the tokens whose slot is not ``-1`` (K rotated first with ``rope`` at
    ``positions``), and rotate the rows ``q_rows`` (host bool ``[num_tokens]``; default:
    the written tokens) of ``q`` in place."""
    keep = slots >= 0
    q_rows = keep if q_rows is None else q_rows
    page, offset = split_slot(slots[keep], cache_dims(cache, layout).page_size)
    keep_dev = keep.to(k.device)
    k, v = k[: slots.numel()], v[: slots.numel()]  # rows past the mapped tokens are not written
    k_new = k[keep_dev]
    if rope is not None:  # computed on the host in float64, rounded once to the storage dtype
        pos = positions[keep]
        k_new = rope_reference(k_new.cpu(), pos, rope_theta, rope).to(cache.dtype)
        if q is not None:
            q_keep = torch.cat([q_rows, torch.zeros(q.shape[0] - q_rows.numel(), dtype=torch.bool)]).to(q.device)
            rotated = rope_reference(q[q_keep].cpu(), positions[q_rows], rope_theta, rope)
            q[q_keep] = rotated.to(q.dtype).to(q.device)
    cache[_row_index(layout, page.to(cache.device), 0, offset.to(cache.device))] = k_new.to(cache.device)
    cache[_row_index(layout, page.to(cache.device), 1, offset.to(cache.device))] = v[keep_dev].to(cache.device)


def append_paged_kv(
    k,
    v,
    cache,
    slot_mapping,
    layout: str = "NHD",
    *,
    rope: str | None = None,
    positions=None,
    rope_theta: float = 10000.0,
    q=None,
    zero_v_tail=None,
) -> None:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``cache`` in place.

    Token ``i`` goes to flat slot ``slot_mapping[i]`` (``-1``: skipped); ``k`` and ``v``
    may have more rows than ``slot_mapping`` (vLLM pads them for CUDA graphs): only the
    first ``len(slot_mapping)`` are written. With
    ``rope="neox"|"gptj"`` K is stored rotated by RoPE at ``positions [num_tokens]``
    (computed in float64, then rounded to the cache dtype) and ``q [num_tokens,
    num_q_heads, head_dim]``, if given, is rotated in place (rows of padding tokens
    are left as they are). With ``zero_v_tail=(kv_indptr, kv_indices,
    kv_last_page_len)`` the unused V rows of every request's last page are zeroed
    afterwards (:func:`zero_paged_v_tail`). Arguments as ``kernels.append_paged_kv``;
    everything is validated (:mod:`pagedkv_lib.checks`) before the first write.
    """
    slots = check_append_args(k, v, cache, slot_mapping, layout)
    positions = check_rope_args(rope, positions, rope_theta, q, k, cache, layout, slots)
    tails = None if zero_v_tail is None else check_v_tail_args(cache, *zero_v_tail, layout=layout, written=slots)
    _store(k, v, cache, slots, layout, rope, positions, rope_theta, q)
    if tails is not None:
        _zero_tails(cache, tails, layout)


def append_paged_kv_csr(
    k,
    v,
    cache,
    batch_indices,
    positions,
    kv_indices,
    kv_indptr,
    layout: str = "NHD",
    *,
    window: RingWindow | None = None,
    rope: str | None = None,
    rope_theta: float = 10000.0,
    q=None,
    zero_v_tail=None,
    rope_positions=None,
) -> None:
    """Write ``k, v`` addressed by request and position over a CSR page table
    (FlashInfer's ``append_paged_kv_cache``), in place.

    Token ``i`` of request ``batch_indices[i]`` at position ``positions[i]`` (``-1`` in
    either: padding) goes to cache row ``positions[i]`` (or ``window.kv_token_idx`` of it)
    of the request's pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``. ``rope``,
    ``rope_theta``, ``q`` and ``zero_v_tail=(kv_indptr, kv_indices, kv_last_page_len)``
    as :func:`append_paged_kv` (RoPE at the absolute position). ``rope_positions
    [num_tokens]`` (needs ``rope``): the rotary position of each token apart from its
    cache position (:mod:`pagedkv_lib.rotary_positions`); K is rotated by it, and ``q``
    rows are rotated for every token whose ``rope_positions`` is >= 0, written or not.
    Arguments as ``kernels.append_paged_kv_csr``.
    """
    slots = check_csr_append_args(k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout, window)
    source, name = rope_position_source(rope, positions, rope_positions)
    pos = check_rope_args(rope, source, rope_theta, q, k, cache, layout, slots, name)
    tails = None if zero_v_tail is None else check_v_tail_args(cache, *zero_v_tail, layout=layout, written=slots)
    q_rows = None if rope_positions is None else rotated_rows(slots, pos)
    _store(k, v, cache, slots, layout, rope, pos, rope_theta, q, q_rows)
    if tails is not None:
        _zero_tails(cache, tails, layout)


def _zero_tails(cache, tails: list[tuple[int, int]], layout: str) -> None:
    for page, rows in tails:
        cache[_row_index(layout, page, 1, slice(rows, None))] = 0


def zero_paged_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> None:
    """Zero V rows ``kv_last_page_len[b] .. page_size - 1`` of every request's last page
    (a CSR page table), so a reader that loads whole pages never meets NaN or stale V.
    A tail page shared with another request is refused
    (:func:`pagedkv_lib.checks.check_v_tail_args`)."""
    _zero_tails(cache, check_v_tail_args(cache, kv_indptr, kv_indices, kv_last_page_len, layout), layout)


def append_paged_kv_loop(k, v, cache, slot_mapping, layout: str = "NHD") -> None:
    """Loop form of :func:`append_paged_kv` (no options): one token, one head at a time."""
    slots = check_append_args(k, v, cache, slot_mapping, layout)
    dims = cache_dims(cache, layout)
    for i, slot in enumerate(slots.tolist()):
        if slot == PAD:
            continue
        page, offset = split_slot(slot, dims.page_size)
        for h in range(dims.num_kv_heads):
            if layout == "NHD":
                cache[page, 0, offset, h] = k[i, h]
                cache[page, 1, offset, h] = v[i, h]
            else:
                cache[page, 0, h, offset] = k[i, h]
                cache[page, 1, h, offset] = v[i, h]


# --------------------------------------------------------------------------- gather


def _check_row(block_table_row, num_tokens: int, page_size: int, num_pages: int) -> torch.Tensor:
    row = index_tensor("block_table_row", block_table_row, 1)
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    needed = -(-num_tokens // page_size)
    if needed > row.numel():
        raise ValueError(f"num_tokens={num_tokens} needs {needed} pages; block_table_row has {row.numel()}")
    bad = (row[:needed] < 0) | (row[:needed] >= num_pages)
    if bad.any():
        j = int(torch.nonzero(bad)[0])
        raise ValueError(f"block_table_row[{j}]={int(row[j])} is not a page of the pool ({num_pages} pages)")
    return row


def gather_paged_kv(cache, block_table_row, num_tokens: int, layout: str = "NHD"):
    """Return ``(k, v)``, each ``[num_tokens, num_kv_heads, head_dim]``: the first
    ``num_tokens`` tokens of one sequence copied out of the pool, in order."""
    dims = cache_dims(cache, layout)
    row = _check_row(block_table_row, num_tokens, dims.page_size, dims.num_pages)
    block, offset = locate(torch.arange(num_tokens), dims.page_size)
    page = row[block]
    return cache[_row_index(layout, page, 0, offset)], cache[_row_index(layout, page, 1, offset)]


def gather_paged_kv_loop(cache, block_table_row, num_tokens: int, layout: str = "NHD"):
    """Loop form of :func:`gather_paged_kv`: one token at a time."""
    dims = cache_dims(cache, layout)
    row = _check_row(block_table_row, num_tokens, dims.page_size, dims.num_pages).tolist()
    ks, vs = [], []
    for t in range(num_tokens):
        block, offset = locate(t, dims.page_size)
        page = row[block]
        ks.append(cache[_row_index(layout, page, 0, offset)])
        vs.append(cache[_row_index(layout, page, 1, offset)])
    empty = cache.new_empty((0, dims.num_kv_heads, dims.head_dim))
    return (torch.stack(ks), torch.stack(vs)) if ks else (empty, empty.clone())


# --------------------------------------------------------------------------- attention


def _compute_dtype(precision: str) -> torch.dtype:
    if precision not in ("fp32", "fp64"):
        raise ValueError(f"precision={precision!r} must be 'fp32' or 'fp64'")
    return torch.float32 if precision == "fp32" else torch.float64


def _sequence_kv(cache, layout, table_row, seq_len: int, window: Window | None):
    """K and V ``[seq_len, num_kv_heads, head_dim]`` of positions ``0..seq_len-1`` as the
    cache holds them (through the ring with a ring window; a position the ring has
    overwritten comes back with the newer token's values, which the mask hides)."""
    page_size = cache_dims(cache, layout).page_size
    rows = torch.arange(seq_len)
    if window is not None:
        rows = window.kv_token_idx(rows)
    block, offset = locate(rows, page_size)
    page = table_row[block]
    return cache[_row_index(layout, page, 0, offset)], cache[_row_index(layout, page, 1, offset)]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` with invisible keys (``mask`` False,
    broadcast to ``scores``) removed. An empty row, one whose softmax mass is 0 (no
    visible key, or every visible score ``-inf``), returns zeros (the kernels'
    convention: an empty sequence attends to nothing); any other row is an honest
    softmax, so NaN in the query or in a visible key's score (or a ``+inf`` score)
    comes back NaN, as it does from the kernels (``nan_to_num`` would hide it)."""
    masked = scores.masked_fill(~mask.expand_as(scores), float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    return probs.masked_fill((masked == float("-inf")).all(dim=-1, keepdim=True), 0.0)


def base2_lse(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FlashInfer's log-sum-exp in base 2 over the last dim, in float64: ``log2(sum_j
    2**(s_j))`` with ``s_j = scores_j * log2(e)`` (``scores`` in natural units, ``scale *
    q.k``) over the keys ``mask`` (broadcast) keeps, which is ``logsumexp(scores) /
    ln 2``; ``-inf`` for an empty row (:func:`masked_softmax`), NaN for a row with a NaN
    or ``+inf`` score among its visible keys (whose output is NaN too)."""
    masked = scores.double().masked_fill(~mask.expand_as(scores), float("-inf"))
    lse = torch.logsumexp(masked, dim=-1) / math.log(2.0)
    return lse.masked_fill(torch.isposinf(lse) | masked.isnan().any(dim=-1), float("nan"))


def _attend(q, k, v, mask, scale: float, dtype: torch.dtype, qpos, mods: dict):
    """``(out, lse)``: softmax attention of ``q [nq, Hq, D]`` at positions ``qpos [nq]``
    over ``k, v [nk, Hk, D]`` (key ``j`` at position ``j``) under ``mask [nq, nk]`` (query
    head ``h`` reads KV head ``h // (Hq // Hk)``), with the score modifiers ``mods``
    (:mod:`pagedkv_lib.score_mods`), and its base-2 log-sum-exp ``[nq, Hq]`` float64
    (:func:`base2_lse`). Rows with nothing visible return zeros (lse ``-inf``); NaN in
    a query or visible key comes back NaN."""
    group = q.shape[1] // k.shape[1]
    k = k.cpu().to(dtype).repeat_interleave(group, dim=1)
    v = v.cpu().to(dtype).repeat_interleave(group, dim=1)
    scores = soft_cap(torch.einsum("qhd,khd->hqk", q.cpu().to(dtype), k) * scale, mods["logits_soft_cap"])
    distance = torch.arange(k.shape[0])[None, :] - qpos[:, None]  # key - query position [nq, nk]
    scores = scores + alibi_bias(mods["alibi_slopes"], distance[None], 0, 3, dtype)
    probs = masked_softmax(scores, mask[None])
    if mods["sinks"] is not None:
        probs = probs * sink_share(scores, mask[None], mods["sinks"].cpu().view(-1, 1, 1))
    return torch.einsum("hqk,khd->qhd", probs, v), base2_lse(scores, mask[None]).transpose(0, 1)


def paged_prefill_attention(
    q,
    cache,
    qo_indptr,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
    precision: str = "fp32",
    causal: bool = True,
    return_lse: bool = False,
    tree_mask=None,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
):
    """Attention of several new query tokens per sequence over the paged KV.

    ``q [total_q, num_q_heads, head_dim]`` is ragged by ``qo_indptr [batch + 1]``;
    ``seq_lens [batch]`` are KV lengths including the new tokens. The causal mask is
    aligned bottom-right: query ``i`` of a chunk of ``q_len`` sits at position
    ``seq_len - q_len + i`` and sees keys up to it (chunked prefill). With a
    :class:`~pagedkv_lib.window.RingWindow` it sees the sinks and the last ``window -
    sinks`` positions (read through the ring); with a
    :class:`~pagedkv_lib.window.LinearWindow` keys ``p - window_left .. p`` of the
    linear cache. ``causal=False`` (no ring): every query sees all ``seq_lens[b]`` keys
    of its request (from ``p - window_left`` on with a linear window), and a request may
    have more queries than keys. Softmax in fp32 (or fp64 with ``precision="fp64"``,
    returned in float64; else in ``q.dtype``). ``return_lse=True`` returns ``(out,
    lse)``, ``lse [total_q, num_q_heads]`` float64 the base-2 log-sum-exp of each row's
    scaled scores (:func:`base2_lse`; ``-inf`` for a row without keys).

    ``tree_mask [total_q, max_q_len]`` torch.bool (speculative verification of a draft
    tree, :mod:`pagedkv_lib.draft_tree`; causal only, no ring window): the keys before
    a request's new tokens stay visible to all its queries, and its ``j``-th new token
    is visible to row ``r`` only where ``tree_mask[r, j]`` (lower-triangular with a
    true diagonal, :func:`pagedkv_lib.checks.check_tree_mask`); a linear window masks
    on top of it.

    ``logits_soft_cap``, ``alibi_slopes``, ``sinks`` (``[num_q_heads]`` float32): the
    score modifiers of :mod:`pagedkv_lib.score_mods` (a query at position ``p``, key at
    ``j``: ALiBi adds ``slope * (j - p)``); the LSE is over the keys, without the sink.
    """
    dtype = _compute_dtype(precision)
    indptr, table, lens = check_prefill_args(
        q, cache, qo_indptr, block_tables, seq_lens, layout, window, scale, causal, tree_mask
    )
    check_score_mods(q.shape[1], logits_soft_cap, alibi_slopes, sinks)
    mods = {"logits_soft_cap": logits_soft_cap, "alibi_slopes": alibi_slopes, "sinks": sinks}
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape, dtype=dtype)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b in range(lens.numel()):
        lo, hi, n = int(indptr[b]), int(indptr[b + 1]), int(lens[b])
        if hi == lo:
            continue
        k, v = _sequence_kv(cache, layout, table[b], n, window)
        qpos = torch.arange(n - (hi - lo), n)
        mask = window_mask(qpos, torch.arange(n), window, causal)
        if tree_mask is not None:  # a new token is seen by the rows the tree says
            mask[:, n - (hi - lo) :] &= tree_mask[lo:hi, : hi - lo].cpu()
        out[lo:hi], lse[lo:hi] = _attend(q[lo:hi], k, v, mask, scale, dtype, qpos, mods)
    out = out if precision == "fp64" else out.to(q.dtype)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q,
    cache,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
    precision: str = "fp32",
    return_lse: bool = False,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
):
    """Decode attention: one query token per sequence, ``q [batch, num_q_heads, head_dim]``.

    The query is the sequence's last token (position ``seq_len - 1``, already written).
    ``window``: a :class:`~pagedkv_lib.window.RingWindow` (read through the ring) or a
    :class:`~pagedkv_lib.window.LinearWindow` (keys ``seq_len - 1 - window_left ..
    seq_len - 1`` of the linear cache).
    GQA maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``. A
    sequence of length 0 returns zeros. Returns ``[batch, num_q_heads, head_dim]`` in
    ``q.dtype`` (float64 with ``precision="fp64"``, the oracle setting); with
    ``return_lse=True`` ``(out, lse)``, ``lse [batch, num_q_heads]`` float64 the base-2
    log-sum-exp of the scaled scores (:func:`base2_lse`, ``-inf`` for length 0).
    ``logits_soft_cap``, ``alibi_slopes``, ``sinks``: as :func:`paged_prefill_attention`.
    """
    dtype = _compute_dtype(precision)
    table, lens = check_decode_args(q, cache, block_tables, seq_lens, layout, window, scale, linear=True)
    check_score_mods(q.shape[1], logits_soft_cap, alibi_slopes, sinks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    dims = cache_dims(cache, layout)
    # Gather every position up to the longest sequence at once; positions past a
    # sequence's end read page 0 (clamped) and are masked out.
    pos = torch.arange(max_len)
    rows = pos if window is None else window.kv_token_idx(pos)
    block, offset = locate(rows, dims.page_size)
    block = block.clamp(max=max(table.shape[1] - 1, 0))
    mask = window_mask(lens[:, None] - 1, pos.expand(batch, max_len), window)[:, 0] & (pos < lens[:, None])
    page = table[:, block] if table.shape[1] else torch.zeros((batch, max_len), dtype=torch.long)
    # Entries a sequence does not use may hold anything (the kernels never read them):
    # read page 0 for every invisible position instead.
    page = page.masked_fill(~mask, 0)
    offset = offset.expand(batch, max_len)
    k = cache[_row_index(layout, page, 0, offset)].cpu().to(dtype)  # [batch, max_len, Hk, D]
    v = cache[_row_index(layout, page, 1, offset)].cpu().to(dtype)
    group = q.shape[1] // dims.num_kv_heads
    # Rows past a sequence's end were read from whatever page 0 holds (NaN in a poisoned
    # pool); a zero probability does not cancel NaN (0 * NaN = NaN), so zero them.
    v = v.masked_fill(~mask[:, :, None, None], 0.0)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = soft_cap(torch.einsum("bhd,bthd->bht", q.cpu().to(dtype), k) * scale, logits_soft_cap)
    scores = scores + alibi_bias(alibi_slopes, (pos[None, :] - (lens[:, None] - 1))[:, None, :], 1, 3, dtype)
    probs = masked_softmax(scores, mask[:, None, :])
    if sinks is not None:
        probs = probs * sink_share(scores, mask[:, None, :], sinks.cpu().view(1, -1, 1))
    out = torch.einsum("bht,bthd->bhd", probs, v)
    out = out if precision == "fp64" else out.to(q.dtype)
    return (out, base2_lse(scores, mask[:, None, :])) if return_lse else out


def paged_decode_attention_loop(
    q,
    cache,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
    precision: str = "fp32",
):
    """Loop form of :func:`paged_decode_attention`: per sequence, per query head, one
    key at a time through the block table, then a plain softmax."""
    dtype = _compute_dtype(precision)
    table, lens = check_decode_args(q, cache, block_tables, seq_lens, layout, window, scale, linear=True)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dims = cache_dims(cache, layout)
    group = q.shape[1] // dims.num_kv_heads
    out = torch.zeros(q.shape, dtype=dtype)
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:
            continue
        visible = window_mask(torch.tensor([n - 1]), torch.arange(n), window)[0]
        for h in range(q.shape[1]):
            kv_head = h // group
            scores, values = [], []
            for t in range(n):
                if not visible[t]:
                    continue
                row = t if window is None else window.kv_token_idx(t)
                block, offset = locate(row, dims.page_size)
                page = int(table[b, block])
                key = cache[_row_index(layout, page, 0, offset)][kv_head].to(dtype)
                values.append(cache[_row_index(layout, page, 1, offset)][kv_head].to(dtype))
                scores.append(torch.dot(q[b, h].to(dtype), key) * scale)
            probs = torch.softmax(torch.stack(scores), dim=0)
            out[b, h] = (probs[:, None] * torch.stack(values)).sum(0)
    return out if precision == "fp64" else out.to(q.dtype)


def paged_prefill_attention_loop(
    q,
    cache,
    qo_indptr,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
    precision: str = "fp32",
):
    """Loop form of :func:`paged_prefill_attention`: each query token is a decode
    against the sequence truncated at its own position."""
    indptr, table, lens = check_prefill_args(q, cache, qo_indptr, block_tables, seq_lens, layout, window, scale)
    indptr, lens = indptr.tolist(), lens.tolist()
    rows = []
    for b, n in enumerate(lens):
        q_len = indptr[b + 1] - indptr[b]
        for i in range(q_len):
            qi = q[indptr[b] + i][None]
            # The query at position n - q_len + i sees exactly what a decode step of a
            # sequence of length n - q_len + i + 1 sees.
            rows.append(
                paged_decode_attention_loop(
                    qi, cache, table[b : b + 1], [n - q_len + i + 1], scale, layout, window, precision
                )[0]
            )
    dtype = torch.float64 if precision == "fp64" else q.dtype
    return torch.stack(rows).to(dtype) if rows else torch.zeros(q.shape, dtype=dtype)


def paged_decode_attention_csr(
    q,
    cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    scale: float | None = None,
    layout: str = "NHD",
    precision: str = "fp32",
    return_lse: bool = False,
    window=None,
):
    """Decode attention over a CSR page table (FlashInfer's format): request ``b`` owns
    pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills ``kv_last_page_len[b]``
    rows of the last one (length 0 without pages). Same result as
    :func:`paged_decode_attention` over the equivalent padded table (``return_lse`` and
    a :class:`~pagedkv_lib.window.LinearWindow` ``window`` as there; no ring)."""
    indptr, indices, _, lens = check_csr_decode_args(
        q, cache, kv_indptr, kv_indices, kv_last_page_len, layout, scale, window
    )
    rows = [indices[indptr[b] : indptr[b + 1]].tolist() for b in range(lens.numel())]
    width = max((len(r) for r in rows), default=0)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    return paged_decode_attention(q, cache, table, lens, scale, layout, window, precision, return_lse)


def merge_partials(partials, lse):
    """Merge split-KV partial outputs, in float64: ``sum_s w_s o_s / sum_s w_s`` with
    ``w_s = 2 ** (lse_s - max_s lse_s)``.

    ``partials [batch, heads, splits, head_dim]`` are each split's softmax-normalised
    output and ``lse [batch, heads, splits]`` its base-2 log-sum-exp of the scaled
    scores (``-inf`` for a split that saw no key, NaN for one that saw a NaN). An empty
    split contributes nothing, even if its partial holds NaN; a row whose splits are
    all ``-inf`` becomes zeros; a split whose lse is NaN or ``+inf`` makes its row NaN
    (:func:`pagedkv_lib.merge_state.merge_lse_weighted`). Returns ``[batch, heads,
    head_dim]`` float64.
    """
    check_merge_args(partials, lse)
    return merge_lse_weighted(partials, lse)[0]


# --------------------------------------------------------------------------- rope


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE frequencies ``theta ** (-2i / head_dim)`` of pairs ``i < head_dim / 2``, float64."""
    return theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) * 2 / head_dim)


def rope_reference(x, positions, theta: float = 10000.0, style: str = "neox"):
    """Rotary embedding of ``x [num_tokens, num_heads, head_dim]`` at ``positions
    [num_tokens]``, in float64, returned in float64.

    ``style="neox"`` pairs feature ``i`` with ``i + head_dim/2`` (GPT-NeoX, Llama);
    ``style="gptj"`` pairs ``2i`` with ``2i + 1`` (GPT-J). Pair ``i`` turns by
    ``position * theta ** (-2i / head_dim)`` radians.
    """
    if style not in ("neox", "gptj"):
        raise ValueError(f"style={style!r} must be 'neox' or 'gptj'")
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"head_dim={dim} must be even for RoPE")
    x = x.to(torch.float64)
    inv_freq = rope_inv_freq(dim, theta)
    angle = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq  # [n, dim/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    if style == "neox":
        a, b = x[..., : dim // 2], x[..., dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


# --------------------------------------------------------------------------- prefill over a CSR page table
# (added with kernels/pagedkv_kernels/prefill.py)

from pagedkv_lib.checks import check_csr_prefill_args  # noqa: E402
from pagedkv_lib.formats import csr_to_block_table  # noqa: E402

__all__ += ["paged_prefill_attention_csr", "contiguous_attention", "base2_lse"]


def paged_prefill_attention_csr(
    q,
    cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    scale: float | None = None,
    layout: str = "NHD",
    precision: str = "fp32",
    causal: bool = True,
    return_lse: bool = False,
    window=None,
    tree_mask=None,
):
    """:func:`paged_prefill_attention` over a CSR page table (FlashInfer's format):
    request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills
    ``kv_last_page_len[b]`` rows of the last one, so its KV length (new tokens
    included) is ``(pages - 1) * page_size + last``. ``window``: a
    :class:`~pagedkv_lib.window.LinearWindow` or None (no ring). Arguments as
    ``kernels.paged_prefill_attention_csr``; same result as the padded form (``causal``,
    ``return_lse`` and ``tree_mask`` as there)."""
    check_csr_prefill_args(
        q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout, scale, causal, window, tree_mask
    )
    table, lens = csr_to_block_table(kv_indptr, kv_indices, kv_last_page_len, cache_dims(cache, layout).page_size)
    return paged_prefill_attention(
        q, cache, qo_indptr, table, lens, scale, layout, window, precision, causal, return_lse, tree_mask
    )


def contiguous_attention(q, k, v, q_positions, window: Window | None = None, scale: float | None = None):
    """One-shot attention without pages: queries ``q [n, num_q_heads, head_dim]`` at
    absolute positions ``q_positions [n]`` over contiguous ``k, v [seq_len,
    num_kv_heads, head_dim]`` (key ``j`` at position ``j``), causal and through
    ``window``'s mask (:func:`pagedkv_lib.window.window_mask`), GQA by repetition.
    Computed by torch's ``scaled_dot_product_attention`` in float64 on the CPU, a route
    independent of the paged references: the oracle of "chunked prefill equals one
    attention over the whole prompt". Returns ``[n, num_q_heads, head_dim]`` float64."""
    group = q.shape[1] // k.shape[1]
    mask = window_mask(torch.as_tensor(q_positions).cpu(), torch.arange(k.shape[0]), window)
    q, k, v = (x.detach().cpu().double().transpose(0, 1) for x in (q, k, v))  # [heads, tokens, dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)

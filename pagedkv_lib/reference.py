"""Python references that every kernel is judged by.

``cache`` is always the raw 5-D pool tensor (see :mod:`pagedkv_lib.pool` for the NHD
and HND layouts), so any tensor of that shape works. Each operation comes twice: a
short loop (``*_loop``, for reading) and a vectorized torch form (for speed); the
tests hold them equal. The ``check_*_args`` functions are the one home of argument
checking; the Triton launchers call them too.

Devices: the pool may live on any device (appends write it in place there); index
tensors are read on the host, and the attention references compute on the CPU and
return CPU tensors.
"""

from __future__ import annotations

import math

import torch

from .formats import PAD, _int_tensor, check_csr
from .indexing import locate, split_slot
from .pool import cache_dims
from .window import RingWindow, window_mask

__all__ = [
    "check_append_args",
    "check_block_tables",
    "check_decode_args",
    "check_prefill_args",
    "append_paged_kv",
    "append_paged_kv_loop",
    "check_v_tail_args",
    "zero_paged_v_tail",
    "gather_paged_kv",
    "gather_paged_kv_loop",
    "paged_decode_attention",
    "paged_decode_attention_loop",
    "paged_prefill_attention",
    "paged_prefill_attention_loop",
    "rope_inv_freq",
    "rope_reference",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# --------------------------------------------------------------------------- checks


def check_append_args(k, v, cache, slot_mapping, layout: str = "NHD") -> torch.Tensor:
    """Validate an append and return ``slot_mapping`` as int64.

    ``k, v [num_tokens, num_kv_heads, head_dim]`` in the cache's dtype;
    ``slot_mapping [num_tokens]`` integer, each ``-1`` or in ``[0, num_pages * page_size)``
    and no slot twice (two writers of one row would race). Raises ValueError naming
    the argument.
    """
    dims = cache_dims(cache, layout)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim], got {shape}")
        if tuple(x.shape[1:]) != (dims.num_kv_heads, dims.head_dim):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but the cache holds {dims.num_kv_heads} KV heads of "
                f"head_dim {dims.head_dim}"
            )
        if x.dtype != cache.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from cache.dtype={cache.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    slots = _int_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {k.shape[0]} tokens")
    num_slots = dims.num_pages * dims.page_size
    bad = (slots < PAD) | (slots >= num_slots)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slots[i])} is outside the pool "
            f"({dims.num_pages} pages x {dims.page_size} slots; -1 marks padding)"
        )
    real = slots[slots >= 0]
    if real.numel() != torch.unique(real).numel():
        vals, counts = torch.unique(real, return_counts=True)
        raise ValueError(f"slot_mapping writes slot {int(vals[counts > 1][0])} more than once")
    return slots


def _check_q(q, cache, layout: str) -> None:
    dims = cache_dims(cache, layout)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got {getattr(q, 'shape', type(q))}")
    if q.dtype not in _FLOATS:
        raise ValueError(f"q.dtype={q.dtype} is not a float dtype")
    if q.shape[2] != dims.head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {dims.head_dim}")
    if q.shape[1] == 0 or q.shape[1] % dims.num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {dims.num_kv_heads} KV heads")


def check_block_tables(cache, block_tables, seq_lens, layout: str = "NHD", window: RingWindow | None = None):
    """Validate a padded page table against the pool; return ``(block_tables, seq_lens)`` as int64.

    ``block_tables [batch, max_blocks]``: the first ``ceil(rows / page_size)`` entries of
    row ``b`` must be page ids, where ``rows`` is ``seq_lens[b]`` (or the ring's cache
    length with a window); ``seq_lens [batch]`` >= 0.
    """
    dims = cache_dims(cache, layout)
    table = _int_tensor("block_tables", block_tables, 2)
    lens = _int_tensor("seq_lens", seq_lens, 1)
    if table.shape[0] != lens.numel():
        raise ValueError(f"block_tables has {table.shape[0]} rows but seq_lens has {lens.numel()} entries")
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    if window is not None and window.tokens_per_block != dims.page_size:
        raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={dims.page_size}")
    rows = lens if window is None else window.cache_len(lens)
    needed = torch.div(rows + dims.page_size - 1, dims.page_size, rounding_mode="floor")
    if (needed > table.shape[1]).any():
        b = int(torch.nonzero(needed > table.shape[1])[0])
        raise ValueError(
            f"seq_lens[{b}]={int(lens[b])} needs {int(needed[b])} pages; block_tables has {table.shape[1]} columns"
        )
    used = torch.arange(table.shape[1]) < needed[:, None]
    bad = used & ((table < 0) | (table >= dims.num_pages))
    if bad.any():
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {j}]={int(table[b, j])} is not a page of the pool ({dims.num_pages} pages) "
            f"but seq_lens[{b}]={int(lens[b])} reads it"
        )
    return table, lens


def check_decode_args(q, cache, block_tables, seq_lens, layout: str = "NHD", window: RingWindow | None = None):
    """Validate a decode-attention call; return ``(block_tables, seq_lens)`` as int64.

    ``q [batch, num_q_heads, head_dim]`` with ``num_q_heads`` a multiple of the cache's
    KV heads, and a page table as :func:`check_block_tables` wants it.
    """
    _check_q(q, cache, layout)
    table, lens = check_block_tables(cache, block_tables, seq_lens, layout, window)
    if q.shape[0] != lens.numel():
        raise ValueError(f"q has {q.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


def check_prefill_args(q, cache, qo_indptr, block_tables, seq_lens, layout: str = "NHD", window=None):
    """Validate a prefill-attention call; return ``(qo_indptr, block_tables, seq_lens)`` as
    int64. ``qo_indptr [batch + 1]`` must delimit ``q``'s rows into at most ``seq_lens[b]``
    queries each (at most ``window.max_chunk_len()`` with a ring window)."""
    indptr = _int_tensor("qo_indptr", qo_indptr, 1)
    lens = _int_tensor("seq_lens", seq_lens, 1)
    if indptr.numel() != lens.numel() + 1 or int(indptr[-1]) != q.shape[0]:
        raise ValueError(f"qo_indptr={indptr.tolist()} does not delimit q's {q.shape[0]} rows into {lens.numel()}")
    q_lens = indptr[1:] - indptr[:-1]
    if (q_lens > lens).any() or (q_lens < 0).any():
        b = int(torch.nonzero((q_lens > lens) | (q_lens < 0))[0])
        raise ValueError(f"request {b} has {int(q_lens[b])} queries but seq_lens[{b}]={int(lens[b])}")
    if window is not None and (q_lens > window.max_chunk_len()).any():
        raise ValueError(
            f"a chunk of {int(q_lens.max())} tokens overwrites ring slots its own queries need; "
            f"this window allows {window.max_chunk_len()} (use one_more_block for chunks)"
        )
    _check_q(q, cache, layout)
    table, lens = check_block_tables(cache, block_tables, lens, layout, window)
    return indptr, table, lens


# --------------------------------------------------------------------------- append


def _row_index(layout: str, page, kv: int, offset):
    """Index tuple selecting ``[..., num_kv_heads, head_dim]`` rows of the raw cache."""
    return (page, kv, offset) if layout == "NHD" else (page, kv, slice(None), offset)


def append_paged_kv(k, v, cache, slot_mapping, layout: str = "NHD", *, zero_v_tail=None) -> None:
    """Write ``k, v [num_tokens, num_kv_heads, head_dim]`` into ``cache`` in place.

    Token ``i`` goes to flat slot ``slot_mapping[i]`` (``-1``: skipped). With
    ``zero_v_tail=(kv_indptr, kv_indices, kv_last_page_len)`` the unused V rows of every
    request's last page are zeroed afterwards (:func:`zero_paged_v_tail`). Everything is
    validated before the first write.
    """
    slots = check_append_args(k, v, cache, slot_mapping, layout)
    if zero_v_tail is not None:
        check_v_tail_args(cache, *zero_v_tail, layout)
    keep = slots >= 0
    page, offset = split_slot(slots[keep], cache_dims(cache, layout).page_size)
    cache[_row_index(layout, page, 0, offset)] = k[keep]
    cache[_row_index(layout, page, 1, offset)] = v[keep]
    if zero_v_tail is not None:
        zero_paged_v_tail(cache, *zero_v_tail, layout=layout)


def check_v_tail_args(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> list[tuple[int, int]]:
    """Validate a V-tail zeroing request; return ``(last_page, rows_in_use)`` per non-empty
    request. A tail page named twice in ``kv_indices`` is refused: zeroing it would
    erase rows another request reads."""
    dims = cache_dims(cache, layout)
    check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    indptr, indices = _int_tensor("kv_indptr", kv_indptr, 1), _int_tensor("kv_indices", kv_indices, 1)
    last = _int_tensor("kv_last_page_len", kv_last_page_len, 1).tolist()
    tails = [(int(indices[indptr[b + 1] - 1]), last[b]) for b in range(len(last)) if indptr[b + 1] > indptr[b]]
    for page, _ in tails:
        if int((indices == page).sum()) > 1:
            raise ValueError(f"kv_indices names tail page {page} more than once: zeroing it would erase rows in use")
    return tails


def zero_paged_v_tail(cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD") -> None:
    """Zero V rows ``kv_last_page_len[b] .. page_size - 1`` of every request's last page
    (a CSR page table), so a reader that loads whole pages never meets NaN or stale V."""
    for page, rows in check_v_tail_args(cache, kv_indptr, kv_indices, kv_last_page_len, layout):
        cache[_row_index(layout, page, 1, slice(rows, None))] = 0


def append_paged_kv_loop(k, v, cache, slot_mapping, layout: str = "NHD") -> None:
    """Loop form of :func:`append_paged_kv`: one token, one head at a time."""
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
    row = _int_tensor("block_table_row", block_table_row, 1)
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


def _sequence_kv(cache, layout, table_row, seq_len: int, window: RingWindow | None):
    """K and V ``[seq_len, num_kv_heads, head_dim]`` of positions ``0..seq_len-1`` as the
    cache holds them (through the ring with a window; a position the ring has
    overwritten comes back with the newer token's values, which the mask hides)."""
    page_size = cache_dims(cache, layout).page_size
    rows = torch.arange(seq_len)
    if window is not None:
        rows = window.kv_token_idx(rows)
    block, offset = locate(rows, page_size)
    page = table_row[block]
    return cache[_row_index(layout, page, 0, offset)], cache[_row_index(layout, page, 1, offset)]


def _attend(q, k, v, mask, scale: float, dtype: torch.dtype):
    """Softmax attention of ``q [nq, Hq, D]`` over ``k, v [nk, Hk, D]`` under ``mask
    [nq, nk]``; query head ``h`` reads KV head ``h // (Hq // Hk)``. Rows with nothing
    visible return zeros."""
    group = q.shape[1] // k.shape[1]
    k = k.cpu().to(dtype).repeat_interleave(group, dim=1)
    v = v.cpu().to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.cpu().to(dtype), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_prefill_attention(
    q,
    cache,
    qo_indptr,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: RingWindow | None = None,
    precision: str = "fp32",
):
    """Attention of several new query tokens per sequence over the paged KV.

    ``q [total_q, num_q_heads, head_dim]`` is ragged by ``qo_indptr [batch + 1]``;
    ``seq_lens [batch]`` are KV lengths including the new tokens. The causal mask is
    aligned bottom-right: query ``i`` of a chunk of ``q_len`` sits at position
    ``seq_len - q_len + i`` and sees keys up to it (chunked prefill). With ``window``
    it sees the sinks and the last ``window - sinks`` positions. Softmax in fp32 (or
    fp64 with ``precision="fp64"``, returned in float64; else in ``q.dtype``).
    """
    dtype = _compute_dtype(precision)
    indptr, table, lens = check_prefill_args(q, cache, qo_indptr, block_tables, seq_lens, layout, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape, dtype=dtype)
    for b in range(lens.numel()):
        lo, hi, n = int(indptr[b]), int(indptr[b + 1]), int(lens[b])
        if hi == lo:
            continue
        k, v = _sequence_kv(cache, layout, table[b], n, window)
        qpos = torch.arange(n - (hi - lo), n)
        out[lo:hi] = _attend(q[lo:hi], k, v, window_mask(qpos, torch.arange(n), window), scale, dtype)
    return out if precision == "fp64" else out.to(q.dtype)


def paged_decode_attention(
    q,
    cache,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: RingWindow | None = None,
    precision: str = "fp32",
):
    """Decode attention: one query token per sequence, ``q [batch, num_q_heads, head_dim]``.

    The query is the sequence's last token (position ``seq_len - 1``, already written).
    GQA maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``. A
    sequence of length 0 returns zeros. Returns ``[batch, num_q_heads, head_dim]`` in
    ``q.dtype`` (float64 with ``precision="fp64"``, the oracle setting).
    """
    dtype = _compute_dtype(precision)
    table, lens = check_decode_args(q, cache, block_tables, seq_lens, layout, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    dims = cache_dims(cache, layout)
    # Gather every position up to the longest sequence at once; positions past a
    # sequence's end read page 0 (clamped) and are masked out.
    pos = torch.arange(max_len)
    rows = pos if window is None else window.kv_token_idx(pos)
    block, offset = locate(rows, dims.page_size)
    block = block.clamp(max=max(table.shape[1] - 1, 0))
    page = table[:, block].clamp(min=0) if table.shape[1] else torch.zeros((batch, max_len), dtype=torch.long)
    offset = offset.expand(batch, max_len)
    k = cache[_row_index(layout, page, 0, offset)].cpu().to(dtype)  # [batch, max_len, Hk, D]
    v = cache[_row_index(layout, page, 1, offset)].cpu().to(dtype)
    mask = window_mask(lens[:, None] - 1, pos.expand(batch, max_len), window)[:, 0] & (pos < lens[:, None])
    group = q.shape[1] // dims.num_kv_heads
    # Rows past a sequence's end were read from whatever page 0 holds (NaN in a poisoned
    # pool); a zero probability does not cancel NaN (0 * NaN = NaN), so zero them.
    v = v.masked_fill(~mask[:, :, None, None], 0.0)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.cpu().to(dtype), k) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bht,bthd->bhd", probs, v)
    return out if precision == "fp64" else out.to(q.dtype)


def paged_decode_attention_loop(
    q,
    cache,
    block_tables,
    seq_lens,
    scale: float | None = None,
    layout: str = "NHD",
    window: RingWindow | None = None,
    precision: str = "fp32",
):
    """Loop form of :func:`paged_decode_attention`: per sequence, per query head, one
    key at a time through the block table, then a plain softmax."""
    dtype = _compute_dtype(precision)
    table, lens = check_decode_args(q, cache, block_tables, seq_lens, layout, window)
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
    window: RingWindow | None = None,
    precision: str = "fp32",
):
    """Loop form of :func:`paged_prefill_attention`: each query token is a decode
    against the sequence truncated at its own position."""
    indptr, table, lens = check_prefill_args(q, cache, qo_indptr, block_tables, seq_lens, layout, window)
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

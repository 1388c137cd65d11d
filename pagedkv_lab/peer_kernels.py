"""Kernels written to other engines' interfaces, for bringing them to the harness.

Not the suite's kernels: two small Triton kernels with the calling conventions of
other engines, written here so that the conformance harness can be shown (and tested)
on code that was not written for it, including with the bugs such kernels ship with:

* :func:`store_kvcache_flat`: a store into a *flat slot cache*, as nano-vllm's
  ``store_kvcache`` addresses one: ``k_cache, v_cache [num_slots, num_kv_heads *
  head_dim]``, one program per token, ``slot_mapping`` with ``-1`` for padding;
* :func:`decode_kv_tuple`: decode attention over *separate K and V caches* in the
  layout of vLLM's flash-attention backend and FlashInfer's NHD tuple:
  ``key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]``; one
  program per (sequence, query head); ``block_size`` a power of two; no windows; it
  assumes every sequence has at least one token (as vLLM's decode does);
* :func:`prefill_kv_tuple`: the same kernel over ragged queries (``qo_indptr``), each
  query row seeing the keys up to its own position (chunked prefill, prefix hits), as
  vLLM's unified Triton attention serves prefill and decode with one kernel;
* :func:`store_kv_tuple`: the store into that layout (vLLM's
  ``reshape_and_cache_flash``): a ``[num_blocks, block_size, heads, dim]`` cache is a
  flat slot cache with ``block_size`` rows per block, so it is the flat store;
* :func:`unified_attention_kernel` (in the style of vLLM's Triton unified attention):
  the same rows over K and V caches addressed with *their own* strides, any page size
  (a runtime argument: a token's page is ``token // page_size``), and what real kernels
  of that kind take besides: per-head sink logits, ALiBi slopes, a logit soft cap, and
  fp32 dots on tf32 tensor cores (emulated: each factor rounded to tf32's 10-bit
  mantissa, as the hardware does; the interpreter's ``tl.dot`` would compute in fp32).
  Entries: :func:`decode_paged` and :func:`prefill_paged`; :func:`decode_flat`, a
  LightLLM-style slot-table read of a flat cache, which needs the page size the
  :class:`~pagedkv_lib.cache_layouts.FlatCache` carries;
* :func:`chunked_prefill_paged_decode` (vLLM's ``chunked_prefill_paged_decode``): the
  requests of more than one query through a prefill that reads the context from the
  cache and the new tokens from ``k_new``/``v_new`` (the suite's, as vLLM's
  ``context_attention_fwd``), every other request through :func:`decode_paged` over the
  cache, its output stored at the request's first query row. It needs the new tokens
  both in the cache and given apart, and every request to have a query: a request
  without one writes its decode into the next request's row, as vLLM's once did.

The kernels here are correct. The classic bugs such kernels ship with are faulty
copies of :func:`store_flat_kernel` and :func:`decode_tuple_kernel` in
:mod:`pagedkv_lab.faults.peer_kernels` (the registry, :data:`pagedkv_lab.faults.PEER_KERNEL_FAULTS`,
names them), launched by :func:`launch_store_flat` and :func:`launch_tuple_attention`
exactly as the kernels here are; the harness must report each with the element it got
wrong and never die of it.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math

import torch
import triton
import triton.language as tl

import pagedkv_kernels

__all__ = [
    "store_flat_kernel",
    "decode_tuple_kernel",
    "launch_store_flat",
    "launch_tuple_attention",
    "decode_rows",
    "prefill_rows",
    "store_kvcache_flat",
    "store_kv_tuple",
    "decode_kv_tuple",
    "prefill_kv_tuple",
    "unified_attention_kernel",
    "unified_attention",
    "decode_paged",
    "prefill_paged",
    "decode_flat",
    "chunked_prefill_paged_decode",
]


@triton.jit
def store_flat_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key,
    stride_value,
    row_width,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot == -1:  # a padding token: nothing to store
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < row_width
    key = tl.load(key_ptr + token * stride_key + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_value + offs, mask=mask)
    dst = slot.to(tl.int64) * row_width + offs
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def launch_store_flat(kernel, key, value, k_cache, v_cache, slot_mapping) -> None:
    """Launch ``kernel`` (:func:`store_flat_kernel` or a copy with its signature) as
    :func:`store_kvcache_flat` describes, one program per token."""
    num_tokens, heads, dim = key.shape
    width = heads * dim
    if key.stride(1) != dim or key.stride(2) != 1 or value.stride(1) != dim or value.stride(2) != 1:
        raise ValueError("key and value need each token's heads contiguous")
    if k_cache.shape[1] != width or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache/v_cache must be contiguous [num_slots, {width}]")
    if num_tokens:
        kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), width,
            BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip


def store_kvcache_flat(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Store ``key, value [num_tokens, num_kv_heads, head_dim]`` (each token's heads
    contiguous) into ``k_cache, v_cache [num_slots, num_kv_heads * head_dim]`` at rows
    ``slot_mapping [num_tokens]`` (``-1`` skipped). No argument checks beyond shapes:
    like the kernels it imitates, it trusts its caller."""
    launch_store_flat(store_flat_kernel, key, value, k_cache, v_cache, slot_mapping)


def store_kv_tuple(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Store ``key, value [num_tokens, num_kv_heads, head_dim]`` into ``key_cache,
    value_cache [num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous) at
    ``slot_mapping [num_tokens]`` (``slot = block * block_size + row``; ``-1`` skipped)."""
    blocks, block_size, heads, dim = key_cache.shape
    flat = (blocks * block_size, heads * dim)
    store_kvcache_flat(key, value, key_cache.view(flat), value_cache.view(flat), slot_mapping)


@triton.jit
def decode_tuple_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    row_seq_ptr,
    row_len_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    group,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (query row, query head). A row attends to the first row_len keys
    # of sequence row_seq: a decode row to the whole sequence, a prefill row to the
    # keys up to its own position.
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(row_seq_ptr + r)
    kv_head = h // group
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_SIZE)
    d_mask = offs_d < head_dim
    seq_len = tl.load(row_len_ptr + r)
    q = tl.load(q_ptr + r * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32) * scale
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    i = 0
    while i < num_blocks:  # a while loop: Triton 3.6's interpreter cannot range() over seq_len
        block = tl.load(block_tables_ptr + b * stride_tb + i).to(tl.int64)
        tokens = i * BLOCK_SIZE + offs_n
        mask = (tokens < seq_len)[:, None] & d_mask[None, :]
        offs = block * stride_kb + offs_n[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(key_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1)
        s = tl.where(tokens < seq_len, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        i += 1
    out = acc / l_i
    tl.store(out_ptr + r * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def launch_tuple_attention(kernel, query, key_cache, value_cache, block_tables, row_seq, row_len, scale=None):
    """Launch ``kernel`` (:func:`decode_tuple_kernel` or a copy with its signature): one
    program per (row of ``query``, query head), row ``r`` attending to the first
    ``row_len[r]`` keys of sequence ``row_seq[r]`` (both ``[rows]`` int32, from
    :func:`decode_rows` or :func:`prefill_rows`). Returns ``[rows, heads, dim]`` in
    ``query.dtype``; ``scale`` defaults to ``1 / sqrt(head_dim)``."""
    rows, num_q_heads, dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if key_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("key_cache and query need a contiguous last dimension")
    out = torch.empty_like(query)
    if rows:
        kernel[(rows, num_q_heads)](
            query, key_cache, value_cache, block_tables, row_seq, row_len, out,
            (1.0 / math.sqrt(dim)) if scale is None else scale,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1), num_q_heads // num_kv_heads, dim,
            BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out


def decode_rows(query, seq_lens):
    """``(row_seq, row_len)`` of a decode batch: row ``b`` is sequence ``b``'s one query,
    attending to all ``seq_lens[b]`` keys."""
    return torch.arange(query.shape[0], dtype=torch.int32, device=query.device), seq_lens


def prefill_rows(query, qo_indptr, seq_lens):
    """``(row_seq, row_len)`` (``[total_q]`` int32) of ragged queries: row ``i`` of
    request ``b`` sits at position ``seq_lens[b] - q_len + i`` and sees the keys up to it."""
    indptr = qo_indptr.long()
    q_lens = indptr[1:] - indptr[:-1]
    row_seq = torch.repeat_interleave(torch.arange(len(q_lens), device=query.device), q_lens)
    first = indptr[:-1][row_seq]  # the row index of each row's request's first query
    past = (seq_lens.long() - q_lens)[row_seq]
    row_len = past + torch.arange(query.shape[0], device=query.device) - first + 1
    return row_seq.int(), row_len.int()


def decode_kv_tuple(query, key_cache, value_cache, block_tables, seq_lens, scale=None):
    """Decode attention: ``query [batch, num_q_heads, head_dim]`` over ``key_cache,
    value_cache [num_blocks, block_size, num_kv_heads, head_dim]`` through
    ``block_tables [batch, max_blocks]`` and ``seq_lens [batch]`` (each >= 1). Returns
    ``[batch, num_q_heads, head_dim]`` in ``query.dtype``. Trusts its caller."""
    rows = decode_rows(query, seq_lens)
    return launch_tuple_attention(decode_tuple_kernel, query, key_cache, value_cache, block_tables, *rows, scale)


def prefill_kv_tuple(query, key_cache, value_cache, qo_indptr, block_tables, seq_lens, scale=None):
    """Causal attention of ragged queries: ``query [total_q, num_q_heads, head_dim]``, the
    rows ``qo_indptr[b] .. qo_indptr[b + 1] - 1`` those of sequence ``b`` at positions
    ``seq_lens[b] - q_len .. seq_lens[b] - 1`` (its last keys are its own), over the
    caches of :func:`decode_kv_tuple`. Returns ``[total_q, num_q_heads, head_dim]``."""
    rows = prefill_rows(query, qo_indptr, seq_lens)
    return launch_tuple_attention(decode_tuple_kernel, query, key_cache, value_cache, block_tables, *rows, scale)


@triton.jit
def _to_tf32(x):
    # fp32 -> tf32 (1 + 8 + 10 bits) by rounding the 13 dropped mantissa bits to nearest,
    # as tensor cores take fp32 factors; the result is an fp32 holding a tf32 value.
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def unified_attention_kernel(
    # pointers: q [rows, heads, dim]; K and V caches [blocks, page, kv_heads, dim] (their own
    # strides); block_tables [batch, max_blocks]; row_seq, row_len [rows]; out like q;
    # sinks, alibi_slopes [heads] fp32 (read only when used)
    q_ptr, k_ptr, v_ptr, block_tables_ptr, row_seq_ptr, row_len_ptr, out_ptr, sinks_ptr, alibi_ptr,
    # scalars
    scale, softcap, page_size, group, head_dim,
    # strides (elements)
    stride_qr, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb,
    stride_or, stride_oh,
    # constexprs
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_SINKS: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, TF32: tl.constexpr,
):  # fmt: skip
    # One program per (query row, query head): row r attends to the first row_len[r] keys
    # of sequence row_seq[r], BLOCK_N tokens at a time, each token's page looked up.
    r = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(row_seq_ptr + r).to(tl.int64)
    n = tl.load(row_len_ptr + r)
    kv_head = h // group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if TF32:
        q = _to_tf32(q)
    if USE_SINKS:  # the sink joins the softmax as a logit with no value: m starts there, l at 1
        m_i = tl.load(sinks_ptr + h + tl.zeros([1], tl.int32)).to(tl.float32)
        l_i = tl.full([1], 1.0, tl.float32)
    else:
        m_i = tl.full([1], float("-inf"), tl.float32)
        l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    start = 0
    while start < n:  # a while loop: Triton 3.6's interpreter cannot range() over n
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < n
        block = tl.load(block_tables_ptr + b * stride_tb + tokens // page_size, mask=valid, other=0).to(tl.int64)
        row = tokens % page_size
        mask = valid[:, None] & d_mask[None, :]
        k_offs = block[:, None] * stride_kb + row[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :]
        v_offs = block[:, None] * stride_vb + row[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :]
        k = tl.load(k_ptr + k_offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
        if TF32:
            k = _to_tf32(k)
            v = _to_tf32(v)
        s = tl.sum(q[None, :] * k, axis=1) * scale
        if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh by exp (no tl.tanh in every Triton)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        if USE_ALIBI:
            s += tl.load(alibi_ptr + h) * (tokens - (n - 1)).to(tl.float32)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        if TF32:
            p = _to_tf32(p)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        start += BLOCK_N
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)  # a row without keys (or only a sink): zeros
    tl.store(out_ptr + r * stride_or + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def unified_attention(query, key_cache, value_cache, block_tables, row_seq, row_len, page_size=None, *,
                      scale=None, sinks=None, alibi_slopes=None, softcap=None, tf32=False):  # fmt: skip
    """Launch :func:`unified_attention_kernel`: one program per (row of ``query [rows,
    heads, dim]``, head), row ``r`` over the first ``row_len[r]`` keys of sequence
    ``row_seq[r]`` (:func:`decode_rows`, :func:`prefill_rows`) in ``key_cache,
    value_cache [num_blocks, page_size, num_kv_heads, dim]`` (any strides, each its
    own), pages by ``block_tables``. ``sinks``, ``alibi_slopes`` ``[heads]`` fp32 and
    ``softcap`` as vLLM takes them; ``tf32``: fp32 factors rounded to tf32. Returns
    ``[rows, heads, dim]`` in ``query.dtype``."""
    rows, heads, dim = query.shape
    page_size = key_cache.shape[1] if page_size is None else page_size
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("key_cache, value_cache and query need a contiguous last dimension")
    out = torch.empty_like(query)
    dummy = torch.zeros(1, dtype=torch.float32, device=query.device)
    if rows:
        k, v = key_cache, value_cache
        unified_attention_kernel[(rows, heads)](
            query, k, v, block_tables, row_seq, row_len, out,
            dummy if sinks is None else sinks, dummy if alibi_slopes is None else alibi_slopes,
            (1.0 / math.sqrt(dim)) if scale is None else scale, 1.0 if softcap is None else float(softcap),
            page_size, heads // k.shape[2], dim,
            query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=16, BLOCK_D=triton.next_power_of_2(dim), USE_SINKS=sinks is not None,
            USE_ALIBI=alibi_slopes is not None, USE_SOFTCAP=softcap is not None, TF32=bool(tf32),
        )  # fmt: skip
    return out


def decode_paged(query, key_cache, value_cache, block_tables, seq_lens, **options):
    """Decode attention (:func:`unified_attention` options) over ``key_cache, value_cache
    [num_blocks, block_size, num_kv_heads, head_dim]``; a sequence of length 0 gives zeros."""
    return unified_attention(query, key_cache, value_cache, block_tables, *decode_rows(query, seq_lens), **options)


def prefill_paged(query, key_cache, value_cache, qo_indptr, block_tables, seq_lens, **options):
    """Causal attention of ragged queries (as :func:`prefill_kv_tuple`) through
    :func:`unified_attention` (its options)."""
    rows = prefill_rows(query, qo_indptr, seq_lens)
    return unified_attention(query, key_cache, value_cache, block_tables, *rows, **options)


def decode_flat(query, cache, block_tables, seq_lens, **options):
    """Decode over a flat slot cache ``cache = (k_cache, v_cache) [num_slots,
    num_kv_heads * head_dim]`` that carries its ``page_size``
    (:class:`~pagedkv_lib.cache_layouts.FlatCache`): the slots viewed as pages of that
    size, as a slot-table kernel (LightLLM's, SGLang's) reads a token pool. Without
    the page size, ``(page, row)`` could not become a slot."""
    k_cache, v_cache = cache
    page_size = cache.page_size
    heads = k_cache.shape[1] // query.shape[2]
    k, v = (t.view(t.shape[0] // page_size, page_size, heads, query.shape[2]) for t in (k_cache, v_cache))
    return decode_paged(query, k, v, block_tables, seq_lens, **options)


def chunked_prefill_paged_decode(query, key_cache, value_cache, k_new, v_new, qo_indptr, block_tables, seq_lens):
    """vLLM's ``chunked_prefill_paged_decode``, over ``key_cache, value_cache [num_blocks,
    block_size, num_kv_heads, head_dim]``: requests of more than one query through a
    prefill that reads the context from the cache and the new tokens' K/V from ``k_new,
    v_new [total_q, num_kv_heads, head_dim]`` (the suite's
    ``paged_prefill_attention(..., k_new=, v_new=)``, vLLM's ``context_attention_fwd``);
    every request of at most one query (vLLM's test is ``query_len > 1``) through
    :func:`decode_paged` over the cache, which must hold its new token, the result stored
    at row ``qo_indptr[b]``: for a request without queries, the next request's first
    row. Returns ``[total_q, num_q_heads, head_dim]``."""
    out = pagedkv_kernels.paged_prefill_attention(
        query, (key_cache, value_cache), qo_indptr, block_tables, seq_lens, k_new=k_new, v_new=v_new
    )
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    decode = torch.nonzero(q_lens <= 1).flatten()
    if decode.numel():
        rows = qo_indptr[:-1][decode].long()
        got = decode_paged(query[rows.clamp(max=max(query.shape[0] - 1, 0))], key_cache, value_cache,
                           block_tables[decode], seq_lens[decode])  # fmt: skip
        # One decode program per request, storing at its first query row: a request without
        # queries stores into the next request's row (past the output for the last one). A
        # GPU's programs store in no set order; here the later requests' land first.
        for i in reversed(range(decode.numel())):
            out[rows[i]] = got[i]
    return out

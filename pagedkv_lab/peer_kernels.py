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
  flat slot cache with ``block_size`` rows per block, so it is the flat store.

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

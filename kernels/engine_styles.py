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

``bug=`` plants one classic bug (see :data:`BUGS`); the harness must report each with
the element it got wrong and never die of it.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math

import torch
import triton
import triton.language as tl

__all__ = ["BUGS", "store_kvcache_flat", "store_kv_tuple", "decode_kv_tuple", "prefill_kv_tuple"]

BUGS = {
    None: "no planted bug",
    "no_minus_one_guard": "store: a -1 slot is not skipped, so the token is written before the cache's first row",
    "unguarded_v_store": "store: V is stored without the head_dim mask, spilling into the next slot's row",
    "off_by_one_block": "decode: block i of a sequence is read from table entry i + 1",
    "whole_page_loads": "decode: whole pages are loaded, masked by head_dim only, so NaN in the unwritten tail "
    "of a last page poisons the output (0 * NaN), as vLLM's Triton attention once did",
}
_CODES = {name: i for i, name in enumerate(BUGS)}


def _bug_code(bug) -> int:
    if bug not in _CODES:
        raise ValueError(f"bug={bug!r} must be one of {list(BUGS)}")
    return _CODES[bug]


@triton.jit
def _store_flat_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key,
    stride_value,
    row_width,
    BLOCK: tl.constexpr,
    BUG: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if BUG != 1:
        if slot == -1:  # a padding token: nothing to store
            return
    offs = tl.arange(0, BLOCK)
    mask = offs < row_width
    key = tl.load(key_ptr + token * stride_key + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_value + offs, mask=mask)
    dst = slot.to(tl.int64) * row_width + offs
    tl.store(k_cache_ptr + dst, key, mask=mask)
    if BUG == 2:
        tl.store(v_cache_ptr + dst, value)
    else:
        tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kvcache_flat(key, value, k_cache, v_cache, slot_mapping, bug=None) -> None:
    """Store ``key, value [num_tokens, num_kv_heads, head_dim]`` (each token's heads
    contiguous) into ``k_cache, v_cache [num_slots, num_kv_heads * head_dim]`` at rows
    ``slot_mapping [num_tokens]`` (``-1`` skipped). No argument checks beyond shapes:
    like the kernels it imitates, it trusts its caller."""
    num_tokens, heads, dim = key.shape
    width = heads * dim
    if key.stride(1) != dim or key.stride(2) != 1 or value.stride(1) != dim or value.stride(2) != 1:
        raise ValueError("key and value need each token's heads contiguous")
    if k_cache.shape[1] != width or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache/v_cache must be contiguous [num_slots, {width}]")
    if num_tokens:
        _store_flat_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0), width,
            BLOCK=triton.next_power_of_2(width), BUG=_bug_code(bug),
        )  # fmt: skip


def store_kv_tuple(key, value, key_cache, value_cache, slot_mapping, bug=None) -> None:
    """Store ``key, value [num_tokens, num_kv_heads, head_dim]`` into ``key_cache,
    value_cache [num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous) at
    ``slot_mapping [num_tokens]`` (``slot = block * block_size + row``; ``-1`` skipped)."""
    blocks, block_size, heads, dim = key_cache.shape
    flat = (blocks * block_size, heads * dim)
    store_kvcache_flat(key, value, key_cache.view(flat), value_cache.view(flat), slot_mapping, bug=bug)


@triton.jit
def _decode_tuple_kernel(
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
    BUG: tl.constexpr,
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
        entry = i + 1 if BUG == 3 else i
        block = tl.load(block_tables_ptr + b * stride_tb + entry).to(tl.int64)
        tokens = i * BLOCK_SIZE + offs_n
        if BUG == 4:
            mask = (offs_n >= 0)[:, None] & d_mask[None, :]
        else:
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


def _launch(query, key_cache, value_cache, block_tables, row_seq, row_len, scale, bug):
    """One program per (row of ``query``, query head); returns ``[rows, heads, dim]``."""
    rows, num_q_heads, dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if key_cache.stride(3) != 1 or query.stride(2) != 1:
        raise ValueError("key_cache and query need a contiguous last dimension")
    out = torch.empty_like(query)
    if rows:
        _decode_tuple_kernel[(rows, num_q_heads)](
            query, key_cache, value_cache, block_tables, row_seq, row_len, out,
            (1.0 / math.sqrt(dim)) if scale is None else scale,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1), num_q_heads // num_kv_heads, dim,
            BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(dim), BUG=_bug_code(bug),
        )  # fmt: skip
    return out


def decode_kv_tuple(query, key_cache, value_cache, block_tables, seq_lens, scale=None, bug=None):
    """Decode attention: ``query [batch, num_q_heads, head_dim]`` over ``key_cache,
    value_cache [num_blocks, block_size, num_kv_heads, head_dim]`` through
    ``block_tables [batch, max_blocks]`` and ``seq_lens [batch]`` (each >= 1). Returns
    ``[batch, num_q_heads, head_dim]`` in ``query.dtype``. Trusts its caller."""
    row_seq = torch.arange(query.shape[0], dtype=torch.int32, device=query.device)
    return _launch(query, key_cache, value_cache, block_tables, row_seq, seq_lens, scale, bug)


def prefill_kv_tuple(query, key_cache, value_cache, qo_indptr, block_tables, seq_lens, scale=None, bug=None):
    """Causal attention of ragged queries: ``query [total_q, num_q_heads, head_dim]``, the
    rows ``qo_indptr[b] .. qo_indptr[b + 1] - 1`` those of sequence ``b`` at positions
    ``seq_lens[b] - q_len .. seq_lens[b] - 1`` (its last keys are its own), over the
    caches of :func:`decode_kv_tuple`. Returns ``[total_q, num_q_heads, head_dim]``."""
    indptr = qo_indptr.long()
    q_lens = indptr[1:] - indptr[:-1]
    row_seq = torch.repeat_interleave(torch.arange(len(q_lens), device=query.device), q_lens)
    first = indptr[:-1][row_seq]  # the row index of each row's request's first query
    past = (seq_lens.long() - q_lens)[row_seq]
    row_len = past + torch.arange(query.shape[0], device=query.device) - first + 1
    return _launch(query, key_cache, value_cache, block_tables, row_seq.int(), row_len.int(), scale, bug)

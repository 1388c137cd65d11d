"""Faulty copies of :mod:`pagedkv_lab.peer_kernels`' kernels: the classic bugs of
kernels written to other engines' conventions, for the harness to catch.

Each ``*_kernel_<fault>`` is the correct kernel copied with its wrong line(s) changed
and marked ``# the fault``, so that a diff against the correct kernel shows just that
(notebook 08 shows them); each ``store_kvcache_flat_<fault>`` / ``decode_kv_tuple_<fault>``
is the correct entry point's launch with the faulty kernel, same signature. The
registry entries are in :data:`pagedkv_lab.faults.REGISTRY` (family ``peer kernel``).

This module imports triton (after :mod:`pagedkv_lib.runtime`) and :mod:`pagedkv_kernels`;
nothing in :mod:`pagedkv_lib` imports it: the registry loads it by name when asked.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

from pagedkv_lab import peer_kernels as peer

__all__ = [
    "store_flat_kernel_no_minus_one_guard",
    "store_flat_kernel_unguarded_v_store",
    "decode_tuple_kernel_off_by_one_block",
    "decode_tuple_kernel_whole_page_loads",
    "store_kvcache_flat_no_minus_one_guard",
    "store_kvcache_flat_unguarded_v_store",
    "decode_kv_tuple_off_by_one_block",
    "decode_kv_tuple_whole_page_loads",
]


@triton.jit
def store_flat_kernel_no_minus_one_guard(
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
    # the fault: no `if slot == -1: return`, a padding token is stored at row -1
    offs = tl.arange(0, BLOCK)
    mask = offs < row_width
    key = tl.load(key_ptr + token * stride_key + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_value + offs, mask=mask)
    dst = slot.to(tl.int64) * row_width + offs
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


@triton.jit
def store_flat_kernel_unguarded_v_store(
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
    tl.store(v_cache_ptr + dst, value)  # the fault: no mask=mask


@triton.jit
def decode_tuple_kernel_off_by_one_block(
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
        block = tl.load(block_tables_ptr + b * stride_tb + i + 1).to(tl.int64)  # the fault: + 1
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


@triton.jit
def decode_tuple_kernel_whole_page_loads(
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
        mask = (offs_n >= 0)[:, None] & d_mask[None, :]  # the fault: every row, not tokens < seq_len
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


def store_kvcache_flat_no_minus_one_guard(key, value, k_cache, v_cache, slot_mapping) -> None:
    """:func:`pagedkv_lab.peer_kernels.store_kvcache_flat` with
    :func:`store_flat_kernel_no_minus_one_guard`."""
    peer.launch_store_flat(store_flat_kernel_no_minus_one_guard, key, value, k_cache, v_cache, slot_mapping)


def store_kvcache_flat_unguarded_v_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    """:func:`pagedkv_lab.peer_kernels.store_kvcache_flat` with
    :func:`store_flat_kernel_unguarded_v_store`."""
    peer.launch_store_flat(store_flat_kernel_unguarded_v_store, key, value, k_cache, v_cache, slot_mapping)


def decode_kv_tuple_off_by_one_block(query, key_cache, value_cache, block_tables, seq_lens, scale=None):
    """:func:`pagedkv_lab.peer_kernels.decode_kv_tuple` with
    :func:`decode_tuple_kernel_off_by_one_block`."""
    rows = peer.decode_rows(query, seq_lens)
    kernel = decode_tuple_kernel_off_by_one_block
    return peer.launch_tuple_attention(kernel, query, key_cache, value_cache, block_tables, *rows, scale)


def decode_kv_tuple_whole_page_loads(query, key_cache, value_cache, block_tables, seq_lens, scale=None):
    """:func:`pagedkv_lab.peer_kernels.decode_kv_tuple` with
    :func:`decode_tuple_kernel_whole_page_loads`."""
    rows = peer.decode_rows(query, seq_lens)
    kernel = decode_tuple_kernel_whole_page_loads
    return peer.launch_tuple_attention(kernel, query, key_cache, value_cache, block_tables, *rows, scale)

"""Solution of exercise 08: a Triton paged decode kernel (no split)."""

from pagedkv_lib import runtime  # noqa: F401  (chooses the backend before triton is imported)

# isort: split
import math

import torch
import triton
import triton.language as tl

from pagedkv_lib.pool import cache_dims, cache_strides

BLOCK_N = 32  # tokens per loop iteration


@triton.jit
def decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    qk_scale, group, head_dim, page_size,
    stride_qb, stride_qh, stride_qd, stride_page, stride_kv, stride_n, stride_h, stride_d,
    stride_tb, stride_ob, stride_oh, stride_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)  # the sequence
    h = tl.program_id(1)  # the query head
    kv_head = h // group
    seq_len = tl.load(seq_lens_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d * stride_qd, mask=d_ok, other=0.0).to(tl.float32)
    q = q * qk_scale
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    start = 0
    while start < seq_len:  # a while loop: Triton 3.6's interpreter cannot range() over seq_len
        t = start + tl.arange(0, BLOCK_N)
        valid = t < seq_len
        page = tl.load(block_tables_ptr + b * stride_tb + t // page_size, mask=valid, other=0).to(tl.int64)
        rows = page * stride_page + (t % page_size).to(tl.int64) * stride_n + kv_head * stride_h
        offs = rows[:, None] + d[None, :] * stride_d
        mask = valid[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + stride_kv + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(q[None, :] * k, axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        start += BLOCK_N
    out = acc / tl.where(l_i > 0, l_i, 1.0)  # a sequence of length 0 returns zeros
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def decode(q, cache, block_tables, seq_lens, layout="NHD"):
    """Decode attention of ``q [batch, num_q_heads, head_dim]`` over the paged ``cache``."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = cache_dims(cache, layout).num_kv_heads
    out = torch.full_like(q, float("nan"))
    if batch == 0:
        return out
    decode_kernel[(batch, num_q_heads)](
        q, cache, block_tables, seq_lens, out,
        head_dim**-0.5 * math.log2(math.e), num_q_heads // num_kv_heads, head_dim,
        cache_dims(cache, layout).page_size, *q.stride(), *cache_strides(cache, layout),
        block_tables.stride(0), *out.stride(),
        BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out

"""Python references for quantized pools: append (quantize on the way in), V-tail
zeroing, and decode attention over the dequantized pool.

Each entry point takes the same arguments as its Triton twin in ``pagedkv_kernels.quant_write``
or ``pagedkv_kernels.quant_decode`` and validates them with the same functions of
:mod:`pagedkv_lib.checks` before anything is written. Codes and scales follow
:mod:`pagedkv_lib.quant` bit for bit.

Quantization acts on fp32 values: K and V are converted to fp32 (exact for
fp16/bf16/fp32 inputs). With RoPE, K is rotated first (in float64, rounded once to
fp32 here; the kernel rotates in fp32, so a rotated value may differ by an fp32 ulp
and, rarely, land on the other side of a rounding boundary: RoPE'd codes are
compared with the kernel's own rotation, see the tests) and then quantized.
"""

from __future__ import annotations

import torch

from pagedkv_lib import quant
from pagedkv_lib.checks import (
    check_csr_decode_args,
    check_decode_args,
    check_quant_append_args,
    check_quant_csr_append_args,
    check_quant_pool,
    check_rope_args,
    check_v_tail_args,
    rope_position_source,
    rotated_rows,
)
from pagedkv_lib.indexing import split_slot
from pagedkv_lib.reference import paged_decode_attention, paged_decode_attention_csr, rope_reference
from pagedkv_lib.window import RingWindow

__all__ = [
    "quantize_rows",
    "write_rows",
    "append_paged_kv_quant",
    "append_paged_kv_quant_csr",
    "zero_paged_v_tail_quant",
    "paged_decode_attention_quant",
    "paged_decode_attention_quant_csr",
]


def quantize_rows(x: torch.Tensor, pool, kv: int, quantizer=None):
    """``(codes, scales)`` of rows ``x [n, num_kv_heads, head_dim]`` for K (``kv=0``) or V
    (``kv=1``) of ``pool``'s format: ``codes`` uint8 ``[n, heads, data_width]``,
    ``scales`` ``[n, heads, groups]`` (float32 per token and head, uint8 E4M3 bits per
    NVFP4 block), ``[n, 1, 1]`` float32 per token across heads, or None per tensor or
    head. ``quantizer`` replaces :func:`quant.nvfp4_quantize` (the faults use it)."""
    x = x.detach().to(torch.float32).cpu()
    mode = pool.scale_mode
    if mode == "head":
        return quant.fp8_quantize(x, pool.global_scale[kv].cpu()[None, :, None]).view(torch.uint8), None
    gs = float(pool.global_scale[kv])
    if mode == "block_encode":
        packed, sf8 = (quantizer or quant.nvfp4_quantize)(x, global_scale_encode=gs)
        return packed, sf8.view(torch.uint8)
    if pool.kv_dtype == "nvfp4":
        packed, sf8 = (quantizer or quant.nvfp4_quantize)(x, gs)
        return packed, sf8.view(torch.uint8)
    if mode in ("token", "token_all_heads"):
        scales = quant.fp8_token_scales(x) if mode == "token" else quant.fp8_token_scales_all_heads(x)
        return quant.fp8_quantize(x, scales).view(torch.uint8), scales
    return quant.fp8_quantize(x, gs).view(torch.uint8), None


def _index(layout: str, page, kv: int, row):
    return (page, kv, row) if layout == "NHD" else (page, kv, slice(None), row)


def write_rows(pool, kv: int, page, row, x: torch.Tensor, quantizer=None) -> None:
    """Quantize ``x [n, num_kv_heads, head_dim]`` (:func:`quantize_rows`) into K or V rows
    ``row [n]`` of pages ``page [n]`` of ``pool`` (host int64 tensors, unchecked: the
    entry points check first)."""
    codes, scales = quantize_rows(x, pool, kv, quantizer)
    at = _index(pool.layout, page.to(pool.device), kv, row.to(pool.device))
    pool.data[at] = codes.to(pool.device)
    if scales is not None:
        pool.scales[at] = scales.to(pool.device)


def _store(k, v, pool, slots: torch.Tensor, rope, positions, rope_theta, q, q_rows=None) -> None:
    """Quantize and write the tokens whose slot is not ``-1`` (K rotated first with
    ``rope`` at ``positions``); rotate the rows ``q_rows`` (host bool; default: the
    written tokens) of ``q`` in place."""
    keep = slots >= 0
    q_rows = keep if q_rows is None else q_rows
    page, row = split_slot(slots[keep], pool.page_size)
    k_new = k[keep.to(k.device)].cpu()
    if rope is not None:  # rotated in float64, rounded once to fp32, then quantized
        pos = positions[keep]
        k_new = rope_reference(k_new, pos, rope_theta, rope).to(torch.float32)
        if q is not None:
            q_keep = torch.cat([q_rows, torch.zeros(q.shape[0] - q_rows.numel(), dtype=torch.bool)]).to(q.device)
            rotated = rope_reference(q[q_keep].cpu(), positions[q_rows], rope_theta, rope)
            q[q_keep] = rotated.to(q.dtype).to(q.device)
    write_rows(pool, 0, page, row, k_new)
    write_rows(pool, 1, page, row, v[keep.to(v.device)])


def _zero_tails(pool, tails) -> None:
    for page, first in tails:
        at = _index(pool.layout, page, 1, slice(first, None))
        pool.data[at] = 0
        if pool.scales is not None:
            pool.scales[at] = 0


def append_paged_kv_quant(
    k,
    v,
    pool,
    slot_mapping,
    *,
    rope: str | None = None,
    positions=None,
    rope_theta: float = 10000.0,
    q=None,
    zero_v_tail=None,
) -> None:
    """Quantize ``k, v [num_tokens, num_kv_heads, head_dim]`` (any float dtype) into the
    :class:`~pagedkv_lib.quant_pool.QuantizedKVPool` ``pool`` in place.

    Token ``i`` goes to flat slot ``slot_mapping[i]`` (``-1``: skipped). Its K and V
    codes (and per-token or block scales) are written at that page and row. ``rope``,
    ``positions``, ``rope_theta`` and ``q`` as :func:`pagedkv_lib.reference.append_paged_kv`
    (RoPE first, then K is quantized). ``zero_v_tail=(kv_indptr, kv_indices,
    kv_last_page_len)`` afterwards zeroes the V codes *and* scales of every request's
    unused last-page rows, so they read back as 0, never NaN. Arguments as
    ``kernels.append_paged_kv_quant_pool``; every check runs before the first write.
    """
    slots = check_quant_append_args(k, v, pool, slot_mapping)
    positions = check_rope_args(rope, positions, rope_theta, q, k, pool.shape_proxy, pool.layout, slots)
    tails = None
    if zero_v_tail is not None:
        tails = check_v_tail_args(pool.shape_proxy, *zero_v_tail, layout=pool.layout, written=slots)
    _store(k, v, pool, slots, rope, positions, rope_theta, q)
    if tails is not None:
        _zero_tails(pool, tails)


def append_paged_kv_quant_csr(
    k,
    v,
    pool,
    batch_indices,
    positions,
    kv_indices,
    kv_indptr,
    *,
    window: RingWindow | None = None,
    rope: str | None = None,
    rope_theta: float = 10000.0,
    q=None,
    kv_last_page_len=None,
    rope_positions=None,
) -> None:
    """:func:`append_paged_kv_quant` addressed by request and position over a CSR page
    table, as :func:`pagedkv_lib.reference.append_paged_kv_csr` (``window``, RoPE at the
    absolute position or at ``rope_positions``, ``kv_last_page_len`` zeroes the V tails
    afterwards)."""
    slots = check_quant_csr_append_args(k, v, pool, batch_indices, positions, kv_indices, kv_indptr, window)
    source, name = rope_position_source(rope, positions, rope_positions)
    pos = check_rope_args(rope, source, rope_theta, q, k, pool.shape_proxy, pool.layout, slots, name)
    tails = None
    if kv_last_page_len is not None:
        tails = check_v_tail_args(pool.shape_proxy, kv_indptr, kv_indices, kv_last_page_len, pool.layout, slots)
    _store(k, v, pool, slots, rope, pos, rope_theta, q, None if rope_positions is None else rotated_rows(slots, pos))
    if tails is not None:
        _zero_tails(pool, tails)


def zero_paged_v_tail_quant(pool, kv_indptr, kv_indices, kv_last_page_len) -> None:
    """Zero the V codes and scales of rows ``kv_last_page_len[b] .. page_size - 1`` of every
    request's last page (a CSR page table), so they dequantize to 0. Rules as
    :func:`pagedkv_lib.reference.zero_paged_v_tail`."""
    check_quant_pool(pool)
    _zero_tails(pool, check_v_tail_args(pool.shape_proxy, kv_indptr, kv_indices, kv_last_page_len, pool.layout))


def paged_decode_attention_quant(
    q,
    pool,
    block_tables,
    seq_lens,
    scale: float | None = None,
    window: RingWindow | None = None,
    precision: str = "fp32",
):
    """Decode attention over a quantized pool: :func:`pagedkv_lib.reference.paged_decode_attention`
    over ``pool.dequantize()`` (the fp32 values the codes stand for). ``q [batch,
    num_q_heads, head_dim]``; result in ``q.dtype`` (float64 with ``precision="fp64"``).
    Arguments as ``kernels.paged_decode_attention_quant_pool`` (which takes ``num_splits``
    instead of ``precision``)."""
    check_quant_pool(pool)
    check_decode_args(q, pool.shape_proxy, block_tables, seq_lens, pool.layout, window, scale)
    values = pool.dequantize().cpu()
    return paged_decode_attention(q, values, block_tables, seq_lens, scale, pool.layout, window, precision)


def paged_decode_attention_quant_csr(
    q, pool, kv_indptr, kv_indices, kv_last_page_len, scale: float | None = None, precision: str = "fp32"
):
    """:func:`paged_decode_attention_quant` over a CSR page table (FlashInfer's format)."""
    check_quant_pool(pool)
    check_csr_decode_args(q, pool.shape_proxy, kv_indptr, kv_indices, kv_last_page_len, pool.layout, scale)
    values = pool.dequantize().cpu()
    return paged_decode_attention_csr(q, values, kv_indptr, kv_indices, kv_last_page_len, scale, pool.layout, precision)

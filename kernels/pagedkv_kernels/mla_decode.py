"""The MLA decode kernels: attention over the latent cache in the absorbed form, with
split-KV.

The pool (:mod:`pagedkv_lib.mla`) is ``ckv_cache [num_pages, page_size, kv_lora_rank]``
and ``kpe_cache [num_pages, page_size, qk_rope_head_dim]``: one latent row per token,
one "head", each cache with its own page and row strides (the appends are
:mod:`pagedkv_kernels.mla_write`'s). :func:`mla_decode_attention` runs four launches:

1. absorb: ``q_latent[b, h] = q_nope[b, h] @ w_uk[h]`` (``[kv_lora_rank]`` fp32), a
   per-head projection (:func:`head_matvec_kernel`);
2. attention, grid ``(batch, cdiv(num_heads, BLOCK_H), num_splits)``
   (:func:`mla_split_kernel`): a ``while`` loop over tiles of ``BLOCK_N`` logical tokens
   of the split's range; each loaded ``c_kv`` / ``k_pe`` tile serves all ``BLOCK_H``
   heads of the program (MLA has one KV "head", so every query head is in its group).
   Scores ``scale * (q_latent . c_kv + q_pe . k_pe)``, online softmax in base 2,
   accumulator ``p . c_kv`` in latent space; each split writes its normalised partial
   and log-sum-exp. The span, split range, softmax step and store are
   :mod:`pagedkv_kernels.device.attention_core`'s, shared with the MHA decode;
3. the split-KV merge (:func:`pagedkv_kernels.merge.launch_merge`), skipped with one split;
4. up-projection: ``out[b, h] = w_uv[h] @ o_latent[b, h]``, the same projection kernel
   with the other weight's dimensions swapped by strides.

Numerics: every operand is converted to fp32 right after loading, ``q_latent`` and
``o_latent`` stay fp32 between the launches, and the output is rounded once to its
dtype, to nearest-even on both backends (:func:`pagedkv_kernels.device.rounding.round_to`: the
interpreter's own fp32-to-bf16 conversion truncates). Products are broadcast-multiply
and ``tl.sum`` (no ``tl.dot``: tf32 on a GPU, untrustworthy for fp16/bf16 in the
interpreter, and dims >= 16). Masked lanes load 0 and score ``-inf``, so a NaN in an
unused slot never reaches the output. Compiled, this is a correct but untuned kernel
(no tensor cores; production MLA kernels such as FlashMLA tile ``[64 heads, 512] x
[512, 64 tokens]`` on tensor cores); its speed has not been measured on a GPU.

The tile loops are ``while`` loops: Triton 3.6's interpreter cannot ``range()`` over a
runtime bound.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.mla import default_scale

from .decode import choose_num_splits
from .device.addressing import table_row_offset
from .device.attention_core import (
    load_scaled_queries,
    online_softmax_step,
    sequence_span,
    softmax_state,
    split_tiles,
    store_partial,
)
from .device.rounding import round_to
from .host.launch import PageTable, fingerprint, parallel_units
from .host.read_plan import split_outputs
from .host.tiles import head_matvec_tiles, mla_decode_tiles
from .host.validate import (
    MAX_HEAD_DIM,
    MAX_KV_LORA_RANK,
    check_device,
    check_num_splits,
    check_read_launch,
    check_same_layout,
    check_width,
    host_copy,
)
from .merge import finish_splits, launch_merge

__all__ = [
    "head_matvec_kernel",
    "mla_split_kernel",
    "LatentReadPlan",
    "latent_read_fields",
    "run_latent_attention",
    "MLADecodePlan",
    "plan_mla_decode",
    "run_mla_decode",
    "mla_decode_attention",
]


# --------------------------------------------------------------------------- device code


@triton.jit
def head_matvec_kernel(
    # pointers
    x_ptr, w_ptr, y_ptr,
    # sizes
    batch, in_dim, out_dim,
    # strides (elements): x [batch, heads, in]; w (head, in, out); y [batch, heads, out]
    stride_xb, stride_xh, stride_xi,
    stride_wh, stride_wi, stride_wo,
    stride_yb, stride_yh, stride_yo,
    # constexprs
    BLOCK_B: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
):  # fmt: skip
    """Program ``(h, o, bb)``: ``y[b, h, o] = sum_i x[b, h, i] * w[h, i, o]`` in fp32 for the
    ``BLOCK_B`` rows ``b`` of block ``bb`` and the ``BLOCK_O`` outputs of block ``o``. The
    weight is addressed by strides ``(head, in, out)``, so ``w_uk [h, nope, rank]`` (in =
    dim 1) and ``w_uv [h, v, rank]`` (in = dim 2) use the same code."""
    h = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_b = (tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    o_mask = offs_o < out_dim
    b_mask = offs_b < batch
    x_rows = x_ptr + offs_b[:, None] * stride_xb + h * stride_xh
    w_head = w_ptr + h * stride_wh + offs_o[None, :].to(tl.int64) * stride_wo
    acc = tl.zeros([BLOCK_B, BLOCK_O], tl.float32)
    i0 = 0
    while i0 < in_dim:
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs_i < in_dim
        x = tl.load(x_rows + offs_i[None, :] * stride_xi, mask=b_mask[:, None] & i_mask[None, :], other=0.0)
        w = tl.load(w_head + offs_i[:, None] * stride_wi, mask=i_mask[:, None] & o_mask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        i0 += BLOCK_I
    y_ptrs = y_ptr + offs_b[:, None] * stride_yb + h * stride_yh + offs_o[None, :] * stride_yo
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty), mask=b_mask[:, None] & o_mask[None, :])


@triton.jit
def mla_split_kernel(
    # pointers: the absorbed query's latent and RoPE parts, the two caches, the page table
    # (padded or CSR), each query row's request and key limit (PER_QUERY), the outputs
    q_latent_ptr, q_pe_ptr, ckv_cache_ptr, kpe_cache_ptr,
    block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    row_req_ptr, row_len_ptr,
    out_ptr, lse_ptr,
    # strides (elements): q_latent, q_pe [rows, heads, dim]; each cache's page, row, feature
    stride_qlb, stride_qlh, stride_qlr,
    stride_qpb, stride_qph, stride_qpd,
    stride_cc_page, stride_cc_n, stride_cc_d,
    stride_pc_page, stride_pc_n, stride_pc_d,
    stride_table,
    # strides: the partial output [batch, heads, split, rank] and its lse [batch, heads, split]
    stride_ob, stride_oh, stride_os, stride_or,
    stride_lb, stride_lh, stride_ls,
    # sizes
    qk_scale, num_heads, kv_lora_rank, rope_dim, page_size, num_splits,
    # constexprs
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    IS_CSR: tl.constexpr, PER_QUERY: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program ``(b, head block, split)``: the split's partial ``o_latent`` (softmax-
    normalised, ``[BLOCK_H, kv_lora_rank]``) of query row ``b`` and its base-2
    log-sum-exp. One query per request (a decode): row ``b`` is request ``b`` and sees
    all its keys. ``PER_QUERY`` (several queries per request): row ``b`` is a query of
    request ``row_req[b]`` and sees its first ``row_len[b]`` keys (the causal limit)."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if PER_QUERY:
        req = tl.load(row_req_ptr + b)
    else:
        req = b
    # No window for MLA: every position up to the row's limit is visible.
    seq_len, table_row = sequence_span(
        req, block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, IS_CSR,
    )  # fmt: skip
    if PER_QUERY:
        seq_len = tl.minimum(seq_len, tl.load(row_len_ptr + b))
    tile_lo, tile_hi = split_tiles(seq_len, split, num_splits, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = heads < num_heads
    r_mask = offs_r < kv_lora_rank
    p_mask = offs_p < rope_dim
    q_lat = load_scaled_queries(
        q_latent_ptr, b, heads, offs_r, h_mask, r_mask, stride_qlb, stride_qlh, stride_qlr, qk_scale
    )
    q_pe = load_scaled_queries(q_pe_ptr, b, heads, offs_p, h_mask, p_mask, stride_qpb, stride_qph, stride_qpd, qk_scale)

    feat_c = offs_r.to(tl.int64) * stride_cc_d
    feat_p = offs_p.to(tl.int64) * stride_pc_d
    m_i, l_i, acc = softmax_state(BLOCK_H, BLOCK_R)
    tile = tile_lo
    while tile < tile_hi:
        j = tile * BLOCK_N + offs_n
        valid = j < seq_len
        # The two caches have their own strides, so each row is addressed twice through
        # the one table formula; the second page-id load hits the cache line of the first.
        c_off = table_row_offset(table_row, j, page_size, valid, stride_cc_page, stride_cc_n)
        p_off = table_row_offset(table_row, j, page_size, valid, stride_pc_page, stride_pc_n)
        # other=0.0: masked lanes never carry a poisoned slot's NaN.
        ckv = tl.load(
            ckv_cache_ptr + c_off[:, None] + feat_c[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        kpe = tl.load(
            kpe_cache_ptr + p_off[:, None] + feat_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_P]
        s = tl.sum(q_lat[:, None, :] * ckv[None, :, :], axis=2) + tl.sum(q_pe[:, None, :] * kpe[None, :, :], axis=2)
        # [BLOCK_H, BLOCK_N] scores; the latent rows are the values too
        m_i, l_i, acc, _ = online_softmax_step(s, valid[None, :], m_i, l_i, acc, ckv, True)
        tile += 1

    store_partial(out_ptr, lse_ptr, acc, m_i, l_i, b, heads, split, offs_r, h_mask, r_mask,
                  stride_ob, stride_oh, stride_os, stride_or, stride_lb, stride_lh, stride_ls, WRITE_LSE)  # fmt: skip


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, kw_only=True)
class LatentReadPlan:
    """What every MLA read plan fixes for the attention in latent space (steps 2 and 3):
    the caches' fingerprints and widths, the query rows and their page table (int32,
    contiguous, on the device; padded or CSR), each row's request and key limit when a
    request has several queries, the tiles and the split count. :class:`MLADecodePlan`
    adds the projections, :class:`pagedkv_kernels.mla_latent.MLALatentPlan` FlashInfer's
    absorbed-query convention."""

    caches: tuple  # fingerprints (shape, strides, dtype, device) of ckv_cache, kpe_cache
    rows: int  # query rows: one per request for a decode
    num_heads: int
    qk_rope_head_dim: int
    kv_lora_rank: int
    page_size: int
    q_dtype: torch.dtype
    scale: float
    max_len: int  # tokens of the longest sequence
    block_h: int
    block_n: int
    block_r: int
    block_p: int
    num_warps: int
    num_splits: int
    table: PageTable
    row_req: torch.Tensor | None = None  # [rows] int32: each row's request (several queries per request)
    row_len: torch.Tensor | None = None  # [rows] int32: the keys each row sees (its causal limit)

    @property
    def head_blocks(self) -> int:
        return triton.cdiv(self.num_heads, self.block_h)


def latent_read_fields(ckv_cache, kpe_cache, q: torch.Tensor, max_len: int, scale: float, num_splits, table) -> dict:
    """The :class:`LatentReadPlan` fields of a launch with queries ``q [rows, num_heads,
    ...]`` over pages of ``table`` whose longest sequence has ``max_len`` tokens (values
    already checked); ``num_splits=None`` is :func:`pagedkv_kernels.decode.choose_num_splits`'s."""
    dims = checks.mla_cache_dims(ckv_cache, kpe_cache)
    check_width("kv_lora_rank", dims.kv_lora_rank, MAX_KV_LORA_RANK)
    check_width("qk_rope_head_dim", dims.qk_rope_head_dim, MAX_HEAD_DIM)
    rows, num_heads = q.shape[:2]
    block_h, block_n, block_r, block_p, num_warps = mla_decode_tiles(
        num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, max_len
    )
    if num_splits is None:
        head_blocks = triton.cdiv(num_heads, block_h)
        num_splits = choose_num_splits(rows, head_blocks, max_len, block_n, parallel_units(q.device))
    return {
        "caches": (fingerprint(ckv_cache), fingerprint(kpe_cache)),
        "rows": rows,
        "num_heads": num_heads,
        "qk_rope_head_dim": dims.qk_rope_head_dim,
        "kv_lora_rank": dims.kv_lora_rank,
        "page_size": dims.page_size,
        "q_dtype": q.dtype,
        "scale": scale,
        "max_len": max_len,
        "block_h": block_h,
        "block_n": block_n,
        "block_r": block_r,
        "block_p": block_p,
        "num_warps": num_warps,
        "num_splits": num_splits,
        "table": table,
    }


def run_latent_attention(plan: LatentReadPlan, q_latent, q_pe, ckv_cache, kpe_cache, out, return_lse=False):
    """Steps 2 and 3 without checks: attention of each query row's ``q_latent [rows,
    num_heads, kv_lora_rank]`` and ``q_pe [rows, num_heads, qk_rope_head_dim]`` over its
    latent rows, per split, then the splits merged, into ``out [rows, num_heads,
    kv_lora_rank]`` (fp32). Returns the base-2 log-sum-exp ``[rows, num_heads]`` fp32
    with ``return_lse``, else None."""
    splits = plan.num_splits
    part, lse, part_strides, lse_strides = split_outputs(out, splits, partials=False)
    total = None
    if return_lse:
        total = torch.empty((plan.rows, plan.num_heads), dtype=torch.float32, device=out.device)
        if part is out:  # one split writes the final output, and then the final lse (split stride 0)
            lse, lse_strides = total, (*total.stride(), 0)
    if plan.rows == 0:
        return total
    per_query = plan.row_req is not None
    row_req, row_len = (plan.row_req, plan.row_len) if per_query else (plan.table.pointers()[1],) * 2
    # fmt: off
    mla_split_kernel[(plan.rows, plan.head_blocks, splits)](
        # pointers
        q_latent, q_pe, ckv_cache, kpe_cache,
        *plan.table.pointers(),
        row_req, row_len,
        part, lse,
        # strides
        *q_latent.stride(),
        *q_pe.stride(),
        *ckv_cache.stride(),
        *kpe_cache.stride(),
        plan.table.stride,
        *part_strides,
        *lse_strides,
        # sizes
        plan.scale * math.log2(math.e), plan.num_heads, plan.kv_lora_rank, plan.qk_rope_head_dim, plan.page_size,
        splits,
        # constexprs
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, BLOCK_R=plan.block_r, BLOCK_P=plan.block_p,
        IS_CSR=plan.table.is_csr, PER_QUERY=per_query, WRITE_LSE=part is not out or total is not None,
        num_warps=plan.num_warps,
    )
    # fmt: on
    if total is None:
        finish_splits(out, part, lse, partials=False)
    elif part is not out:  # the splits' states merge into the output and its total lse
        launch_merge(part, lse, out, total)
    return total


@dataclass(frozen=True, kw_only=True)
class MLADecodePlan(LatentReadPlan):
    """A validated MLA decode: the latent attention's plan plus the weights and the tiles
    of the two projections, fixed once by :func:`plan_mla_decode` and launched by
    :func:`run_mla_decode`."""

    weights: tuple  # (shape, dtype, device) of w_uk, w_uv (any strides)
    qk_nope_head_dim: int
    v_head_dim: int
    absorb_tiles: tuple[int, int, int]  # (BLOCK_B, BLOCK_I, BLOCK_O) of q_nope @ w_uk
    up_tiles: tuple[int, int, int]  # the same for w_uv @ o_latent

    @property
    def batch(self) -> int:
        return self.rows


def plan_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> MLADecodePlan:
    """Validate an :func:`mla_decode_attention` call and fix its tiles and split count;
    nothing is launched. Arguments and errors as :func:`mla_decode_attention`."""
    table, lens = checks.check_mla_decode_args(
        q_nope, q_pe, ckv_cache, kpe_cache, host_copy(block_tables), host_copy(seq_lens), w_uk, w_uv, scale
    )
    tensors = {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache}
    check_read_launch(tensors | {"w_uk": w_uk, "w_uv": w_uv}, {"block_tables": block_tables, "seq_lens": seq_lens})
    check_num_splits(num_splits)
    batch, _, nope = q_nope.shape
    rank, v_head_dim = ckv_cache.shape[-1], w_uv.shape[1]
    scale = default_scale(nope, kpe_cache.shape[-1]) if scale is None else float(scale)
    max_len = int(lens.max()) if lens.numel() else 0
    fields = latent_read_fields(
        ckv_cache, kpe_cache, q_nope, max_len, scale, num_splits, PageTable.padded(table, lens, q_nope.device)
    )
    return MLADecodePlan(
        **fields,
        weights=tuple((tuple(w.shape), w.dtype, w.device) for w in (w_uk, w_uv)),
        qk_nope_head_dim=nope,
        v_head_dim=v_head_dim,
        absorb_tiles=head_matvec_tiles(batch, nope, rank),
        up_tiles=head_matvec_tiles(batch, rank, v_head_dim),
    )


def run_mla_decode(
    plan: MLADecodePlan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    return_latent: bool = False,
):
    """Launch a planned MLA decode. Returns ``out [batch, num_heads, v_head_dim]`` in
    ``q_nope.dtype``; with ``return_latent=True`` also ``o_latent [batch, num_heads,
    kv_lora_rank]`` fp32 (the attention output before ``w_uv``). The tensors must match
    the plan (the caches also in strides); anything else is a ValueError."""
    _check_planned_tensors(plan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv)
    dev, batch, heads, rank = q_nope.device, plan.batch, plan.num_heads, plan.kv_lora_rank
    out = torch.empty((batch, heads, plan.v_head_dim), dtype=q_nope.dtype, device=dev)
    o_latent = torch.empty((batch, heads, rank), dtype=torch.float32, device=dev)
    if batch == 0:
        return (out, o_latent) if return_latent else out
    # 1. absorb w_uk into the query: q_latent[b, h] = q_nope[b, h] @ w_uk[h] (w_uk's input is dim 1).
    q_latent = torch.empty((batch, heads, rank), dtype=torch.float32, device=dev)
    _head_matvec(q_nope, w_uk, q_latent, plan.qk_nope_head_dim, 1, plan.absorb_tiles)
    # 2.-3. attention in latent space (mla_split_kernel per split), the splits merged.
    run_latent_attention(plan, q_latent, q_pe, ckv_cache, kpe_cache, o_latent)
    # 4. up-project: out[b, h] = w_uv[h] @ o_latent[b, h] (w_uv's input, the rank, is dim 2).
    _head_matvec(o_latent, w_uv, out, rank, 2, plan.up_tiles)
    return (out, o_latent) if return_latent else out


def _check_planned_tensors(plan: MLADecodePlan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv) -> None:
    """ValueError unless the tensors have the planned shapes, dtypes and devices (the
    caches also the planned strides)."""
    check_same_layout("ckv_cache", ckv_cache, plan.caches[0])
    check_same_layout("kpe_cache", kpe_cache, plan.caches[1])
    want = {
        "q_nope": ((plan.batch, plan.num_heads, plan.qk_nope_head_dim), plan.q_dtype),
        "q_pe": ((plan.batch, plan.num_heads, plan.qk_rope_head_dim), plan.q_dtype),
    }
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        shape, dtype = want[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} of shape {shape} as planned, got {getattr(t, 'shape', t)}")
        check_device(name, t)
    for name, t, planned in (("w_uk", w_uk, plan.weights[0]), ("w_uv", w_uv, plan.weights[1])):
        if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype, t.device) != planned:
            raise ValueError(f"{name} must be {planned[1]} of shape {planned[0]} on {planned[2]} as planned")


def _head_matvec(x, w, y, in_dim: int, w_in_dim: int, tiles: tuple[int, int, int]) -> None:
    """``y[b, h] = x[b, h] @ W[h]`` where ``W[h]`` is ``w[h]`` read with its input along
    ``w_in_dim`` (1 or 2) and its output along the other."""
    batch, num_heads, out_dim = y.shape
    block_b, block_i, block_o = tiles
    stride_wh = w.stride(0)
    stride_wi, stride_wo = (w.stride(1), w.stride(2)) if w_in_dim == 1 else (w.stride(2), w.stride(1))
    grid = (num_heads, triton.cdiv(out_dim, block_o), triton.cdiv(batch, block_b))
    # fmt: off
    head_matvec_kernel[grid](
        # pointers
        x, w, y,
        # sizes
        batch, in_dim, out_dim,
        # strides
        *x.stride(),
        stride_wh, stride_wi, stride_wo,
        *y.stride(),
        # constexprs
        BLOCK_B=block_b, BLOCK_I=block_i, BLOCK_O=block_o,
    )
    # fmt: on


# --------------------------------------------------------------------------- entry point


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """MLA decode attention over a paged latent pool, in the absorbed form, one query
    token per sequence.

    Args:
        q_nope: ``[batch, num_heads, qk_nope_head_dim]``, the non-RoPE part of each
            sequence's query (position ``seq_lens[b] - 1``, already written).
        q_pe: ``[batch, num_heads, qk_rope_head_dim]``, its RoPE part, already rotated;
            the dtype of ``q_nope``.
        ckv_cache: ``[num_pages, page_size, kv_lora_rank]``; kpe_cache: ``[num_pages,
            page_size, qk_rope_head_dim]``; fp32/fp16/bf16, any strides. Only read.
        block_tables: ``[batch, max_blocks]`` int32/int64, padded with ``-1``; the first
            ``ceil(seq_lens[b] / page_size)`` entries of row ``b`` are page ids.
        seq_lens: ``[batch]`` int32/int64, >= 0.
        w_uk: ``[num_heads, qk_nope_head_dim, kv_lora_rank]``, ``k_nope[h] = w_uk[h] @ c_kv``
            (an ``nn.Linear`` weight per head, ``[out, in]``). Absorbed into the query as
            ``q_latent[b, h] = w_uk[h]^T @ q_nope[b, h]`` = ``q_nope[b, h] @ w_uk[h]``.
        w_uv: ``[num_heads, v_head_dim, kv_lora_rank]``, ``v[h] = w_uv[h] @ c_kv``; applied
            to the latent output as ``out[b, h] = w_uv[h] @ o_latent[b, h]`` (not
            transposed).
        scale: softmax scale, default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
        num_splits: KV splits per sequence (split-KV), 1 to ``MAX_SPLITS``; None picks
            one with :func:`pagedkv_kernels.decode.choose_num_splits`.

    Scores are ``scale * (q_latent . c_kv + q_pe . k_pe)`` over the sequence's rows, the
    softmax-weighted sum of ``c_kv`` is ``o_latent [kv_lora_rank]``; all in fp32. A
    sequence of length 0 returns zeros. Equal, within rounding, to the naive form
    :func:`pagedkv_lib.mla.mla_decode_naive` (every ``c_kv`` projected up to K and V).

    Returns:
        ``[batch, num_heads, v_head_dim]`` in ``q_nope.dtype``.

    Raises:
        ValueError naming the argument (shapes, dtypes, devices, page ids, lengths,
        ``num_splits``, ``scale``, a rank above ``MAX_KV_LORA_RANK``) before anything is
        launched.
    """
    plan = plan_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale, num_splits)
    return run_mla_decode(plan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv)

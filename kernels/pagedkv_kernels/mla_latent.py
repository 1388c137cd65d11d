"""MLA attention in FlashInfer's convention: the absorbed query in, the latent output out.

:mod:`pagedkv_kernels.mla_decode` takes the query before absorption (``q_nope`` of width
``qk_nope_head_dim``) with the weights ``w_uk`` and ``w_uv`` and returns the heads'
outputs. FlashInfer's ``BatchMLAPagedAttentionWrapper`` starts and ends one step
inside that: its ``q_nope`` is already ``q_nope @ w_uk`` (``[rows, num_heads,
kv_lora_rank]``), it returns the latent output ``o`` (``[rows, num_heads,
kv_lora_rank]``, before ``w_uv``) and, if asked, the base-2 log-sum-exp, and a request
may bring several queries at once (``qo_indptr``, causal or not: the prefill of a
latent cache). This module is that convention, on the same kernel
(:func:`pagedkv_kernels.mla_decode.mla_split_kernel`, split-KV, then the merge):

* :func:`mla_latent_attention`: one query per request, padded page table;
* :func:`mla_latent_attention_csr`: FlashInfer's form, ``qo_indptr``, ``kv_indptr``,
  ``kv_indices`` and ``kv_len`` (keys per request; the suite's CSR tables elsewhere
  give ``kv_last_page_len``, :func:`pagedkv_lib.checks.mla_kv_last_page_len` converts).

Several queries per request run as one program row per query (``PER_QUERY``): row
``r`` reads its request's pages up to its own causal limit ``kv_len - q_len + i + 1``.
Each query row re-reads its prefix (no K/V tile is shared between a request's
queries, as a prefill kernel's query tiles would share it): correct, simple, and
as fast as the decode per query. ``scale`` is required, as FlashInfer's ``sm_scale``
is: the absorbed query no longer says its head width. The float64 oracle is
:func:`pagedkv_lib.mla.mla_latent_attention_ref`.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch

from pagedkv_lib import checks

from .host.launch import PageTable, int32_on_device
from .host.validate import (
    check_device,
    check_num_splits,
    check_read_launch,
    check_same_layout,
    host_copy,
)
from .mla_decode import LatentReadPlan, latent_read_fields, run_latent_attention

__all__ = [
    "MLALatentPlan",
    "plan_mla_latent",
    "plan_mla_latent_csr",
    "run_mla_latent",
    "mla_latent_attention",
    "mla_latent_attention_csr",
]


@dataclass(frozen=True, kw_only=True)
class MLALatentPlan(LatentReadPlan):
    """A validated latent-space MLA attention, fixed once by :func:`plan_mla_latent` or
    :func:`plan_mla_latent_csr` and launched by :func:`run_mla_latent`."""

    causal: bool


def _query_rows(qo: torch.Tensor, kv_len: torch.Tensor, causal: bool, device) -> tuple:
    """``(row_req, row_len)`` int32 ``[rows]`` on ``device``: each query row's request and
    the keys it sees (``kv_len - q_len + i + 1`` for query ``i`` when causal, else
    ``kv_len``); ``(None, None)`` when every request has exactly one query and it sees
    every key (a decode, no per-row limit needed)."""
    q_lens = qo[1:] - qo[:-1]
    if bool((q_lens == 1).all()):
        return None, None
    row_req = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
    i = torch.arange(int(qo[-1])) - qo[row_req]
    row_len = kv_len[row_req] - q_lens[row_req] + i + 1 if causal else kv_len[row_req]
    return int32_on_device(row_req, device), int32_on_device(row_len, device)


def plan_mla_latent(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale: float, num_splits=None):
    """Validate an :func:`mla_latent_attention` call and fix its tiles and split count;
    nothing is launched. Arguments and errors as :func:`mla_latent_attention`."""
    table, lens = checks.check_mla_latent_args(
        q_nope, q_pe, ckv_cache, kpe_cache, host_copy(block_tables), host_copy(seq_lens), scale
    )
    tensors = {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache}
    check_read_launch(tensors, {"block_tables": block_tables, "seq_lens": seq_lens})
    check_num_splits(num_splits)
    max_len = int(lens.max()) if lens.numel() else 0
    page_table = PageTable.padded(table, lens, q_nope.device)
    fields = latent_read_fields(ckv_cache, kpe_cache, q_nope, max_len, float(scale), num_splits, page_table)
    return MLALatentPlan(**fields, causal=True)


def plan_mla_latent_csr(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, scale: float, causal=True,
    num_splits=None,
):  # fmt: skip
    """Validate an :func:`mla_latent_attention_csr` call and fix its tiles, split count
    and query rows; nothing is launched. Arguments and errors as
    :func:`mla_latent_attention_csr`."""
    index = {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len": kv_len}
    host = {name: host_copy(t) for name, t in index.items()}
    qo, indptr, indices, last, lens = checks.check_mla_latent_csr_args(
        q_nope, q_pe, ckv_cache, kpe_cache, *host.values(), causal, scale
    )
    tensors = {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache}
    check_read_launch(tensors, index)
    check_num_splits(num_splits)
    max_len = int(lens.max()) if lens.numel() else 0
    page_table = PageTable.csr(indptr, indices, last, q_nope.device)
    fields = latent_read_fields(ckv_cache, kpe_cache, q_nope, max_len, float(scale), num_splits, page_table)
    row_req, row_len = _query_rows(qo, lens, causal, q_nope.device)
    return MLALatentPlan(**fields, row_req=row_req, row_len=row_len, causal=causal)


def run_mla_latent(plan: MLALatentPlan, q_nope, q_pe, ckv_cache, kpe_cache, return_lse: bool = False):
    """Launch a planned latent-space MLA attention. Returns ``o [rows, num_heads,
    kv_lora_rank]`` in ``q_nope.dtype`` (computed in fp32, rounded once), and with
    ``return_lse=True`` ``(o, lse)``, ``lse [rows, num_heads]`` fp32 base 2. The tensors
    must match the plan (the caches also in strides); anything else is a ValueError."""
    checks.check_flag("return_lse", return_lse)
    check_same_layout("ckv_cache", ckv_cache, plan.caches[0])
    check_same_layout("kpe_cache", kpe_cache, plan.caches[1])
    for name, t, width in (("q_nope", q_nope, plan.kv_lora_rank), ("q_pe", q_pe, plan.qk_rope_head_dim)):
        shape = (plan.rows, plan.num_heads, width)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != plan.q_dtype:
            raise ValueError(f"{name} must be {plan.q_dtype} of shape {shape} as planned, got {getattr(t, 'shape', t)}")
        check_device(name, t)
    out = torch.empty((plan.rows, plan.num_heads, plan.kv_lora_rank), dtype=torch.float32, device=q_nope.device)
    lse = run_latent_attention(plan, q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse)
    o = out.to(plan.q_dtype)
    return (o, lse) if return_lse else o


def mla_latent_attention(
    q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale: float, num_splits=None, return_lse=False
):
    """Latent-space MLA decode, one absorbed query per request, padded page table.

    Args:
        q_nope: ``[batch, num_heads, kv_lora_rank]``, the query already absorbed
            (``q_nope @ w_uk`` of :func:`pagedkv_kernels.mla_decode.mla_decode_attention`), at
            position ``seq_lens[b] - 1`` (already written).
        q_pe: ``[batch, num_heads, qk_rope_head_dim]``, rotated; ``q_nope``'s dtype.
        ckv_cache, kpe_cache: the latent pool as in :func:`pagedkv_kernels.mla_decode.mla_decode_attention`.
        block_tables, seq_lens: the padded page table (``-1`` padding), lengths >= 0.
        scale: the softmax scale (FlashInfer's ``sm_scale``), required.
        num_splits: KV splits per sequence, None to choose (:func:`pagedkv_kernels.decode.choose_num_splits`).
        return_lse: also return the base-2 log-sum-exp.

    Returns ``o [batch, num_heads, kv_lora_rank]`` in ``q_nope.dtype``, the softmax-
    weighted sum of ``c_kv`` under scores ``scale * (q_nope . c_kv + q_pe . k_pe)`` (with
    ``return_lse``: ``(o, lse [batch, num_heads] fp32)``); length 0 gives zeros, ``-inf``;
    a row that saw a NaN gives NaN, ``o`` and ``lse``, with any number of splits.

    Raises ValueError naming the argument (shapes, a ``q_nope`` not as wide as the latent,
    dtypes, devices, page ids, lengths, ``scale``, ``num_splits``) before any launch.
    """
    plan = plan_mla_latent(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale, num_splits)
    return run_mla_latent(plan, q_nope, q_pe, ckv_cache, kpe_cache, return_lse)


def mla_latent_attention_csr(
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_len,
    scale: float,
    causal: bool = True,
    num_splits=None,
    return_lse: bool = False,
):
    """Latent-space MLA attention in FlashInfer's CSR form, one or several queries per
    request (``BatchMLAPagedAttentionWrapper``'s ``plan`` and ``run`` in one call).

    Args:
        q_nope: ``[rows, num_heads, kv_lora_rank]``, absorbed queries, request by request;
            q_pe: ``[rows, num_heads, qk_rope_head_dim]``, rotated, the same dtype.
        ckv_cache, kpe_cache: the latent pool.
        qo_indptr: ``[batch + 1]``: request ``b``'s queries are rows ``qo_indptr[b] ..
            qo_indptr[b + 1] - 1``, its last ``q_len`` positions.
        kv_indptr, kv_indices: ``[batch + 1]`` and ``[pages]``: each request's pages.
        kv_len: ``[batch]``: its keys, the new queries' included (FlashInfer's
            ``kv_len_arr``; it must fit the request's pages).
        scale: ``sm_scale``, required. causal: query ``i`` of ``q_len`` sees keys ``0 ..
            kv_len - q_len + i`` (then ``q_len <= kv_len``); False: every key.
        num_splits, return_lse: as :func:`mla_latent_attention`.

    Returns ``o [rows, num_heads, kv_lora_rank]`` in ``q_nope.dtype`` (and ``lse [rows,
    num_heads]`` fp32 base 2 with ``return_lse``). Raises ValueError naming the argument
    before any launch.
    """
    plan = plan_mla_latent_csr(
        q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, scale, causal, num_splits
    )
    return run_mla_latent(plan, q_nope, q_pe, ckv_cache, kpe_cache, return_lse)

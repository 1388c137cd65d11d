"""Argument rules of the MLA (multi-head latent attention) pool, its append and its
absorbed decode, shared by the references in :mod:`pagedkv_lib.mla` and the MLA kernels.

The page-table and slot rules are the MHA ones (:mod:`.mha`, :mod:`.shared`): the MLA
pool has the same pages and rows, only its row holds one latent
``[kv_lora_rank + qk_rope_head_dim]`` instead of K and V per head.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv_lib.checks.mha import check_block_tables
from pagedkv_lib.checks.shared import (
    FLOAT_DTYPES,
    check_float_tensor,
    check_rope_positions,
    check_rope_style,
    check_scale,
    check_slots,
)
from pagedkv_lib.formats import check_csr, csr_slot_mapping, index_tensor
from pagedkv_lib.pool import CacheDims


class MLACacheDims(NamedTuple):
    """The sizes of an MLA pool (:func:`mla_cache_dims`): pages, rows per page, and the
    widths of the latent and of the shared RoPE key."""

    num_pages: int
    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int


def mla_cache_dims(ckv_cache, kpe_cache) -> MLACacheDims:
    """``(num_pages, page_size, kv_lora_rank, qk_rope_head_dim)`` of an MLA pool.

    ``ckv_cache [num_pages, page_size, kv_lora_rank]`` and ``kpe_cache [num_pages,
    page_size, qk_rope_head_dim]`` (FlashInfer's layout) must be 3-D float tensors of
    one dtype with the same pages and page size, every dimension > 0. Any strides:
    two views of one ``[num_pages, page_size, rank + rope]`` buffer (vLLM's layout)
    are fine.
    """
    for name, x, last in (("ckv_cache", ckv_cache, "kv_lora_rank"), ("kpe_cache", kpe_cache, "qk_rope_head_dim")):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be [num_pages, page_size, {last}], got {got}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not a float dtype")
        if 0 in x.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: an empty dimension holds no row")
    if tuple(ckv_cache.shape[:2]) != tuple(kpe_cache.shape[:2]):
        raise ValueError(
            f"ckv_cache has {tuple(ckv_cache.shape[:2])} (num_pages, page_size) but kpe_cache has "
            f"{tuple(kpe_cache.shape[:2])}: the two halves of one pool must have the same pages"
        )
    if ckv_cache.dtype != kpe_cache.dtype:
        raise ValueError(f"ckv_cache.dtype={ckv_cache.dtype} differs from kpe_cache.dtype={kpe_cache.dtype}")
    return MLACacheDims(*ckv_cache.shape[:2], ckv_cache.shape[2], kpe_cache.shape[2])


def _mla_page_geometry(dims: MLACacheDims) -> torch.Tensor:
    """A stand-in 5-D pool on the meta device (no memory) with the MLA pool's pages and
    page size, so the page-table rules above (:func:`check_block_tables`) apply as they
    are: they read only ``num_pages`` and ``page_size``."""
    return torch.empty((dims.num_pages, 2, dims.page_size, 1, 1), device="meta")


def _check_mla_rows(ckv, kpe, dims: MLACacheDims, dtype: torch.dtype) -> int:
    """``ckv [num_tokens, kv_lora_rank]`` and ``kpe [num_tokens, qk_rope_head_dim]`` in the
    pool's dtype; returns ``num_tokens``."""
    for name, x, width, width_name in (
        ("ckv", ckv, dims.kv_lora_rank, "kv_lora_rank"),
        ("kpe", kpe, dims.qk_rope_head_dim, "qk_rope_head_dim"),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be [num_tokens, {width_name}], got {got}")
        if x.shape[1] != width:
            raise ValueError(f"{name} has width {x.shape[1]} but the pool's {width_name} is {width}")
        if x.dtype != dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from the pool's {dtype}")
    if ckv.shape[0] != kpe.shape[0]:
        raise ValueError(f"ckv has {ckv.shape[0]} tokens but kpe has {kpe.shape[0]}")
    return ckv.shape[0]


def check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping) -> torch.Tensor:
    """Validate an MLA slot-mapping append; return ``slot_mapping`` as host int64.

    ``ckv [num_tokens, kv_lora_rank]``, ``kpe [num_tokens, qk_rope_head_dim]`` in the
    pool's dtype (:func:`mla_cache_dims`); ``slot_mapping [num_tokens]`` integer, each
    ``-1`` (padding) or in ``[0, num_pages * page_size)``, no slot twice.
    """
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    n = _check_mla_rows(ckv, kpe, dims, ckv_cache.dtype)
    slots = index_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() != n:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {n} tokens")
    check_slots(slots, CacheDims(dims.num_pages, dims.page_size, 1, dims.kv_lora_rank))
    return slots


def check_mla_csr_append_args(
    ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr
) -> torch.Tensor:
    """Validate an MLA CSR append (FlashInfer's ``append_paged_mla_kv_cache`` addressing);
    return each token's flat slot as host int64 (``-1`` for padding). Rules as
    :func:`check_csr_append_args` (no ring window: MLA models attend to everything)."""
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    n = _check_mla_rows(ckv, kpe, dims, ckv_cache.dtype)
    batch = index_tensor("batch_indices", batch_indices, 1)
    if batch.numel() != n:
        raise ValueError(f"batch_indices has {batch.numel()} entries for {n} tokens")
    slots = csr_slot_mapping(batch, positions, kv_indices, kv_indptr, dims.page_size, None, dims.num_pages)
    check_slots(
        slots, CacheDims(dims.num_pages, dims.page_size, 1, dims.kv_lora_rank), "the slots of batch_indices/positions"
    )
    return slots


def check_mla_rope_args(rope, positions, rope_theta, kpe, slots: torch.Tensor, name: str = "positions"):
    """Validate the RoPE options of an MLA append; return ``positions`` as host int64
    (None without RoPE).

    ``rope`` is None, ``"neox"`` or ``"gptj"`` (DeepSeek-V2 as vLLM runs it: ``"gptj"``).
    With it: an even ``qk_rope_head_dim``, ``rope_theta`` a finite number > 1,
    ``positions [num_tokens]`` integers >= 0 for every token that is written. Without
    it, ``positions`` is ignored. The same rules as :func:`check_rope_args`, for the
    one shared RoPE key instead of per-head K; ``name`` as there.
    """
    check_rope_style(rope)
    if rope is None:
        return None
    if kpe.shape[1] % 2:
        raise ValueError(f"rope needs an even qk_rope_head_dim, kpe has {kpe.shape[1]}")
    pos = check_rope_positions(rope_theta, positions, kpe.shape[0], slots, name)
    return pos


def check_mla_weights(w_uk, w_uv, num_heads: int, qk_nope_head_dim: int, kv_lora_rank: int) -> int:
    """The up-projections of the latent, per head, as ``nn.Linear`` weights ``[out, in]``:
    ``w_uk [num_heads, qk_nope_head_dim, kv_lora_rank]`` (``k_nope[h] = w_uk[h] @ c_kv``)
    and ``w_uv [num_heads, v_head_dim, kv_lora_rank]`` (``v[h] = w_uv[h] @ c_kv``), float
    tensors. Returns ``v_head_dim``."""
    for name, w, doc in (
        ("w_uk", w_uk, "[num_heads, qk_nope_head_dim, kv_lora_rank]"),
        ("w_uv", w_uv, "[num_heads, v_head_dim, kv_lora_rank]"),
    ):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name} must be {doc}, got {got}")
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={w.dtype} is not a float dtype")
    if tuple(w_uk.shape) != (num_heads, qk_nope_head_dim, kv_lora_rank):
        raise ValueError(
            f"w_uk has shape {tuple(w_uk.shape)}; q_nope and the pool need "
            f"[{num_heads}, {qk_nope_head_dim}, {kv_lora_rank}] (num_heads, qk_nope_head_dim, kv_lora_rank)"
        )
    if w_uv.shape[0] != num_heads or w_uv.shape[2] != kv_lora_rank or w_uv.shape[1] == 0:
        raise ValueError(
            f"w_uv has shape {tuple(w_uv.shape)}; q_nope and the pool need "
            f"[{num_heads}, v_head_dim > 0, {kv_lora_rank}] (num_heads, v_head_dim, kv_lora_rank)"
        )
    return w_uv.shape[1]


def _check_q_pe(q_pe, q_nope, dims: MLACacheDims) -> None:
    """``q_pe`` is ``[rows, num_heads, qk_rope_head_dim]`` in ``q_nope``'s rows, heads and dtype."""
    if tuple(q_pe.shape) != (*q_nope.shape[:2], dims.qk_rope_head_dim):
        raise ValueError(
            f"q_pe has shape {tuple(q_pe.shape)}; q_nope and kpe_cache need "
            f"[{q_nope.shape[0]}, {q_nope.shape[1]}, {dims.qk_rope_head_dim}]"
        )
    if q_pe.dtype != q_nope.dtype:
        raise ValueError(f"q_pe.dtype={q_pe.dtype} differs from q_nope.dtype={q_nope.dtype}")


def check_mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale=None):
    """Validate an MLA decode call; return ``(block_tables, seq_lens)`` as host int64.

    ``q_nope [batch, num_heads, qk_nope_head_dim]`` and ``q_pe [batch, num_heads,
    qk_rope_head_dim]`` float tensors of one dtype (``q_pe`` as wide as ``kpe_cache``);
    the pool as :func:`mla_cache_dims`; the weights as :func:`check_mla_weights`; a page
    table as :func:`check_block_tables`; ``scale`` as :func:`check_scale`.
    """
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    check_float_tensor("q_nope", q_nope, "[batch, num_heads, qk_nope_head_dim]")
    check_float_tensor("q_pe", q_pe, "[batch, num_heads, qk_rope_head_dim]")
    if q_nope.shape[1] == 0 or q_nope.shape[2] == 0:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: num_heads and qk_nope_head_dim must be > 0")
    _check_q_pe(q_pe, q_nope, dims)
    check_mla_weights(w_uk, w_uv, q_nope.shape[1], q_nope.shape[2], dims.kv_lora_rank)
    check_scale(scale)
    table, lens = check_block_tables(_mla_page_geometry(dims), block_tables, seq_lens)
    if q_nope.shape[0] != lens.numel():
        raise ValueError(f"q_nope has {q_nope.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


def check_mla_latent_q(q_nope, q_pe, dims: MLACacheDims) -> None:
    """FlashInfer's MLA queries: ``q_nope [rows, num_heads, kv_lora_rank]``, already
    absorbed into latent space (``q_nope @ w_uk``), and ``q_pe [rows, num_heads,
    qk_rope_head_dim]``, rotated; float tensors of one dtype, at least one head."""
    check_float_tensor("q_nope", q_nope, "[rows, num_heads, kv_lora_rank] (absorbed)")
    check_float_tensor("q_pe", q_pe, "[rows, num_heads, qk_rope_head_dim]")
    if q_nope.shape[1] == 0:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: num_heads must be > 0")
    if q_nope.shape[2] != dims.kv_lora_rank:
        raise ValueError(
            f"q_nope is {q_nope.shape[2]} wide but ckv_cache's kv_lora_rank is {dims.kv_lora_rank}: "
            "FlashInfer's convention takes the absorbed query (q_nope @ w_uk), as wide as the latent"
        )
    _check_q_pe(q_pe, q_nope, dims)


def _check_required_scale(scale) -> float:
    if scale is None:
        raise ValueError("scale is required: the absorbed query no longer says its head width (FlashInfer's sm_scale)")
    return float(check_scale(scale))


def check_mla_latent_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, scale):
    """Validate a latent-space MLA decode (one absorbed query per request, padded page
    table); return ``(block_tables, seq_lens)`` as host int64. ``scale`` is required."""
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    check_mla_latent_q(q_nope, q_pe, dims)
    _check_required_scale(scale)
    table, lens = check_block_tables(_mla_page_geometry(dims), block_tables, seq_lens)
    if q_nope.shape[0] != lens.numel():
        raise ValueError(f"q_nope has {q_nope.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


def mla_kv_last_page_len(kv_indptr: torch.Tensor, kv_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """``kv_last_page_len [batch]`` int64 of FlashInfer's MLA ``kv_len`` (keys per
    request) over ``kv_indptr``'s pages: ``kv_len - (pages - 1) * page_size``, 0 without
    pages. ValueError unless ``(pages - 1) * page_size < kv_len <= pages * page_size``
    (or ``kv_len == 0`` with no pages)."""
    pages = kv_indptr[1:] - kv_indptr[:-1]
    if kv_len.numel() != pages.numel():
        raise ValueError(f"kv_len has {kv_len.numel()} entries; kv_indptr needs {pages.numel()} (batch)")
    bad = torch.where(pages > 0, (kv_len <= (pages - 1) * page_size) | (kv_len > pages * page_size), kv_len != 0)
    if bad.any():
        b = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"kv_len[{b}]={int(kv_len[b])} does not fit its {int(pages[b])} pages of {page_size} "
            f"(it must be in ({max(int(pages[b]) - 1, 0) * page_size}, {int(pages[b]) * page_size}])"
        )
    return torch.where(pages > 0, kv_len - (pages - 1) * page_size, 0)


def check_mla_latent_csr_args(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, causal, scale
):
    """Validate a latent-space MLA attention in FlashInfer's CSR form; return
    ``(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kv_len)`` as host int64.

    ``qo_indptr [batch + 1]`` delimits ``q_nope``'s rows by request; ``kv_indptr [batch +
    1]`` and ``kv_indices`` are the pages, ``kv_len [batch]`` the keys of each request
    (:func:`mla_kv_last_page_len`). With ``causal`` (a bool) query ``i`` of a request of
    ``q_len`` queries and ``kv_len`` keys sees keys ``0 .. kv_len - q_len + i``, so
    ``q_len <= kv_len``. ``scale`` is required.
    """
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    check_mla_latent_q(q_nope, q_pe, dims)
    _check_required_scale(scale)
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be a bool")
    indptr = index_tensor("kv_indptr", kv_indptr, 1)
    lens = index_tensor("kv_len", kv_len, 1)
    if indptr.numel() == 0 or int(indptr[0]) != 0 or (indptr[1:] < indptr[:-1]).any():
        raise ValueError(f"kv_indptr={indptr.tolist()} must start at 0 and never decrease")
    if (lens < 0).any():
        raise ValueError(f"kv_len must be >= 0, got {lens.tolist()}")
    last = mla_kv_last_page_len(indptr, lens, dims.page_size)
    indptr, indices, last = check_csr(indptr, kv_indices, last, dims.page_size, dims.num_pages)
    qo = index_tensor("qo_indptr", qo_indptr, 1)
    if qo.numel() != lens.numel() + 1 or int(qo[0]) != 0 or (qo[1:] < qo[:-1]).any():
        raise ValueError(f"qo_indptr={qo.tolist()} must start at 0, never decrease and have {lens.numel() + 1} entries")
    if int(qo[-1]) != q_nope.shape[0]:
        raise ValueError(f"qo_indptr[-1]={int(qo[-1])} but q_nope has {q_nope.shape[0]} rows")
    q_lens = qo[1:] - qo[:-1]
    if causal and (q_lens > lens).any():
        b = int(torch.nonzero(q_lens > lens)[0])
        raise ValueError(f"request {b} has {int(q_lens[b])} queries but kv_len[{b}]={int(lens[b])} (causal)")
    return qo, indptr, indices, last, lens

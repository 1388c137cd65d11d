"""MLA, multi-head latent attention (DeepSeek-V2/V3): the latent KV pool and its
float64 references.

**What is cached.** Per token and layer MLA stores one compressed vector ``c_kv`` of
width ``kv_lora_rank`` (512 in DeepSeek-V2) and one RoPE key ``k_pe`` of width
``qk_rope_head_dim`` (64) shared by every head, instead of K and V per head: a pool
with ``kv_factor = 1`` and a single "head". As FlashInfer lays it out, two tensors
with the same pages and rows:

* ``ckv_cache [num_pages, page_size, kv_lora_rank]``
* ``kpe_cache [num_pages, page_size, qk_rope_head_dim]``

(vLLM keeps one ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` buffer;
its two slices along the last dimension are valid ``ckv_cache`` / ``kpe_cache`` here.)

**The weights**, per head, as ``nn.Linear`` weights ``[out_features, in_features]``:

* ``w_uk [num_heads, qk_nope_head_dim, kv_lora_rank]``: ``k_nope[t, h] = w_uk[h] @ c_kv[t]``;
* ``w_uv [num_heads, v_head_dim, kv_lora_rank]``: ``v[t, h] = w_uv[h] @ c_kv[t]``.

DeepSeek-V2's ``kv_b_proj.weight [num_heads * (qk_nope_head_dim + v_head_dim),
kv_lora_rank]`` viewed as ``[num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]``
and split along dim 1 gives both.

**Two ways to read it.** A decode query of head ``h`` is ``q_nope[h]`` (width
``qk_nope_head_dim``) and ``q_pe[h]`` (``qk_rope_head_dim``, already rotated).

* *naive* (:func:`mla_decode_naive`): project every cached ``c_kv`` up to per-head
  ``K_h = [w_uk[h] @ c_kv, k_pe]`` and ``V_h = w_uv[h] @ c_kv``, then ordinary attention
  with ``q_h = [q_nope[h], q_pe[h]]``;
* *absorbed* (:func:`mla_decode_absorbed`, the kernel's form): since
  ``q_nope[h] . (w_uk[h] @ c) = (w_uk[h]^T @ q_nope[h]) . c``, move ``w_uk`` into the query,
  ``q_latent[h] = w_uk[h]^T @ q_nope[h]`` (``[kv_lora_rank]``, i.e. ``q_nope[h] @ w_uk[h]``);
  score ``scale * (q_latent[h] . c_kv + q_pe[h] . k_pe)``; output ``o_latent[h] = sum_t
  p[h, t] c_kv[t]`` in latent space; then ``out[h] = w_uv[h] @ o_latent[h]`` (the
  softmax weights sum to 1, so ``w_uv`` moves out of the sum).

Both give ``out [batch, num_heads, v_head_dim]``. The absorbed form touches each cached
row once per head with ``2 * kv_lora_rank + qk_rope_head_dim`` multiply-adds instead of
projecting it up (:func:`decode_flops`).

``scale`` defaults to ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (the query/key
width); DeepSeek-V2's YaRN context extension multiplies it by ``mscale**2``, which the
caller passes in.

**FlashInfer's convention** (``BatchMLAPagedAttentionWrapper``) starts one step later:
its ``q_nope`` is already absorbed (``[rows, num_heads, kv_lora_rank]``), its output is
the latent ``o`` before ``w_uv``, several queries of a request may attend at once
(``qo_indptr``, causal or not), the pages are a CSR table with ``kv_len`` keys per
request, and ``sm_scale`` has no default (the absorbed query no longer says its head
width). :func:`mla_latent_attention_ref` is its float64 oracle.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedkv_lib.checks import (
    MLACacheDims,
    check_int,
    check_mla_append_args,
    check_mla_csr_append_args,
    check_mla_decode_args,
    check_mla_latent_csr_args,
    check_mla_rope_args,
    check_positive_int,
    mla_cache_dims,
    rope_position_source,
)
from pagedkv_lib.formats import PAD, index_tensor
from pagedkv_lib.indexing import locate, split_slot
from pagedkv_lib.memory import ModelSpec
from pagedkv_lib.reference import base2_lse, masked_softmax, rope_reference

__all__ = [
    "MLAShape",
    "DEEPSEEK_V2",
    "MLACacheDims",
    "mla_cache_dims",
    "MLAPool",
    "default_scale",
    "append_paged_mla_kv",
    "append_paged_mla_kv_csr",
    "append_paged_mla_kv_loop",
    "gather_mla_latent",
    "expand_latent",
    "mla_decode_naive",
    "mla_decode_naive_loop",
    "mla_decode_absorbed",
    "mla_latent_attention_ref",
    "FLOP_FORMS",
    "decode_flops",
]


class MLAShape(NamedTuple):
    """The dimensions of one MLA attention layer."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# deepseek-ai/DeepSeek-V2 config.json (DeepSeek-V3 has the same attention dimensions):
# 128 heads, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
DEEPSEEK_V2 = MLAShape(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def default_scale(qk_nope_head_dim: int, qk_rope_head_dim: int) -> float:
    """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``: the softmax scale of a 192-wide
    query/key head in DeepSeek-V2 (before any YaRN ``mscale``)."""
    return 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)


# --------------------------------------------------------------------------- the pool


class MLAPool:
    """One layer's latent pool: ``num_pages`` pages of ``page_size`` token rows, each row
    one ``c_kv`` (``kv_lora_rank`` wide) and one ``k_pe`` (``qk_rope_head_dim`` wide).

    ``ckv_cache [num_pages, page_size, kv_lora_rank]`` and ``kpe_cache [num_pages,
    page_size, qk_rope_head_dim]``, zero-filled at creation; page ids are the first
    index, the flat slot of row ``r`` of page ``p`` is ``p * page_size + r`` (as in
    :class:`pagedkv_lib.pool.PagedKVPool`). A model has one such pool per layer.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_rope_head_dim", qk_rope_head_dim),
        ):
            check_positive_int(name, value, "MLAPool")
        self.ckv_cache = torch.zeros((num_pages, page_size, kv_lora_rank), dtype=dtype, device=device)
        self.kpe_cache = torch.zeros((num_pages, page_size, qk_rope_head_dim), dtype=dtype, device=device)

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> MLAPool:
        """One layer's pool for an MLA :class:`~pagedkv_lib.memory.ModelSpec` (``kv_lora_rank >
        0``); ValueError for a model that does not cache a latent."""
        if not spec.is_mla:
            raise ValueError(f"spec {spec.name!r} is {spec.attention}, not MLA: it caches K and V per head")
        return cls(num_pages, page_size, spec.kv_lora_rank, spec.qk_rope_head_dim, dtype, device)

    @property
    def dims(self) -> MLACacheDims:
        return mla_cache_dims(self.ckv_cache, self.kpe_cache)

    @property
    def num_pages(self) -> int:
        return self.ckv_cache.shape[0]

    @property
    def page_size(self) -> int:
        return self.ckv_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.ckv_cache.dtype

    @property
    def num_slots(self) -> int:
        """Token rows in the pool: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of both tensors, as allocated."""
        return self.ckv_cache.nbytes + self.kpe_cache.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes one token costs in this layer: ``(kv_lora_rank + qk_rope_head_dim) * itemsize``."""
        return self.nbytes // self.num_slots


# --------------------------------------------------------------------------- append


def _store(ckv, kpe, ckv_cache, kpe_cache, slots: torch.Tensor, rope, positions, rope_theta) -> None:
    """Write the tokens whose slot is not ``-1`` (``kpe`` rotated first with ``rope``, in
    float64 on the host, rounded once to the pool's dtype)."""
    keep = slots >= 0
    page, row = split_slot(slots[keep], ckv_cache.shape[1])
    kpe_new = kpe[keep.to(kpe.device)]
    if rope is not None:
        kpe_new = rope_reference(kpe_new.cpu()[:, None, :], positions[keep], rope_theta, rope)[:, 0]
    for cache, new in ((ckv_cache, ckv[keep.to(ckv.device)]), (kpe_cache, kpe_new)):
        cache[page.to(cache.device), row.to(cache.device)] = new.to(device=cache.device, dtype=cache.dtype)


def append_paged_mla_kv(
    ckv, kpe, ckv_cache, kpe_cache, slot_mapping, *, rope: str | None = None, positions=None, rope_theta=10000.0
) -> None:
    """Write ``ckv [num_tokens, kv_lora_rank]`` and ``kpe [num_tokens, qk_rope_head_dim]``
    into the pool in place; token ``i`` goes to flat slot ``slot_mapping[i]`` (``-1``:
    skipped). With ``rope="neox"|"gptj"`` ``kpe`` is stored rotated at ``positions
    [num_tokens]`` (computed in float64, rounded once). Arguments and errors as
    ``kernels.append_paged_mla_kv``; everything is validated before the first write."""
    slots = check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)
    positions = check_mla_rope_args(rope, positions, rope_theta, kpe, slots)
    _store(ckv, kpe, ckv_cache, kpe_cache, slots, rope, positions, rope_theta)


def append_paged_mla_kv_csr(
    ckv,
    kpe,
    ckv_cache,
    kpe_cache,
    batch_indices,
    positions,
    kv_indices,
    kv_indptr,
    *,
    rope: str | None = None,
    rope_theta=10000.0,
    rope_positions=None,
) -> None:
    """Write ``ckv, kpe`` addressed by request and position over a CSR page table
    (FlashInfer's ``append_paged_mla_kv_cache``), in place: token ``i`` of request
    ``batch_indices[i]`` at position ``positions[i]`` (``-1`` in either: padding) goes to
    row ``positions[i] % page_size`` of page ``kv_indices[kv_indptr[b] + positions[i] //
    page_size]``. ``rope`` rotates ``kpe`` at ``positions``, or at ``rope_positions
    [num_tokens]`` when given (the rotary position apart from the cache position,
    :mod:`pagedkv_lib.rotary_positions`). Arguments as ``kernels.append_paged_mla_kv_csr``."""
    slots = check_mla_csr_append_args(ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr)
    source, name = rope_position_source(rope, positions, rope_positions)
    pos = check_mla_rope_args(rope, source, rope_theta, kpe, slots, name)
    _store(ckv, kpe, ckv_cache, kpe_cache, slots, rope, pos, rope_theta)


def append_paged_mla_kv_loop(ckv, kpe, ckv_cache, kpe_cache, slot_mapping) -> None:
    """Loop form of :func:`append_paged_mla_kv` (no RoPE): one token at a time."""
    slots = check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)
    for i, slot in enumerate(slots.tolist()):
        if slot == PAD:
            continue
        page, row = split_slot(slot, ckv_cache.shape[1])
        ckv_cache[page, row] = ckv[i]
        kpe_cache[page, row] = kpe[i]


# --------------------------------------------------------------------------- read


def gather_mla_latent(ckv_cache, kpe_cache, block_table_row, num_tokens: int):
    """``(ckv [num_tokens, kv_lora_rank], kpe [num_tokens, qk_rope_head_dim])``: the first
    ``num_tokens`` latent rows of one sequence, copied out of the pool in order. Every
    page the tokens need must be a page of the pool (ValueError otherwise)."""
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    row = index_tensor("block_table_row", block_table_row, 1)
    check_int("num_tokens", num_tokens)
    block, offset = locate(torch.arange(num_tokens), dims.page_size)
    if num_tokens and int(block[-1]) >= row.numel():
        raise ValueError(f"num_tokens={num_tokens} needs {int(block[-1]) + 1} pages; block_table_row has {row.numel()}")
    page = row[block]
    if ((page < 0) | (page >= dims.num_pages)).any():
        raise ValueError(f"block_table_row {row.tolist()} names a page outside the pool ({dims.num_pages} pages)")
    return ckv_cache[page, offset], kpe_cache[page, offset]


def expand_latent(ckv, kpe, w_uk, w_uv):
    """The naive decompression, in float64: ``(k [T, num_heads, qk_nope_head_dim +
    qk_rope_head_dim], v [T, num_heads, v_head_dim])`` of latent rows ``ckv [T,
    kv_lora_rank]`` and ``kpe [T, qk_rope_head_dim]``: ``k[t, h] = [w_uk[h] @ ckv[t],
    kpe[t]]`` (the RoPE key is shared by every head) and ``v[t, h] = w_uv[h] @ ckv[t]``."""
    ckv, kpe = ckv.cpu().double(), kpe.cpu().double()
    w_uk, w_uv = w_uk.cpu().double(), w_uv.cpu().double()
    k_nope = torch.einsum("hdr,tr->thd", w_uk, ckv)
    k_pe = kpe[:, None, :].expand(-1, w_uk.shape[0], -1)
    return torch.cat([k_nope, k_pe], dim=-1), torch.einsum("hvr,tr->thv", w_uv, ckv)


def _compute_dtype(precision: str) -> torch.dtype:
    if precision not in ("fp32", "fp64"):
        raise ValueError(f"precision={precision!r} must be 'fp32' or 'fp64'")
    return torch.float32 if precision == "fp32" else torch.float64


def _padded_latent(ckv_cache, kpe_cache, table, lens, dtype):
    """Latent rows ``[batch, max_len, width]`` of every sequence (rows past a sequence's
    end zeroed, so a NaN-poisoned unused slot never reaches the arithmetic: a zero
    probability does not cancel NaN) and the mask ``[batch, max_len]`` of real rows."""
    page_size = ckv_cache.shape[1]
    batch, max_len = lens.numel(), int(lens.max()) if lens.numel() else 0
    pos = torch.arange(max_len)
    block, row = locate(pos, page_size)
    mask = pos < lens[:, None]
    if table.shape[1]:
        # Entries past a sequence's pages may hold anything (the kernels never read
        # them): rows past the end read page 0 instead.
        page = table[:, block.clamp(max=table.shape[1] - 1)].masked_fill(~mask, 0)
    else:
        page = torch.zeros((batch, max_len), dtype=torch.long)
    row = row.expand(batch, max_len)
    ckv = ckv_cache[page.to(ckv_cache.device), row.to(ckv_cache.device)].cpu().to(dtype)
    kpe = kpe_cache[page.to(kpe_cache.device), row.to(kpe_cache.device)].cpu().to(dtype)
    return ckv.masked_fill(~mask[..., None], 0.0), kpe.masked_fill(~mask[..., None], 0.0), mask


def mla_decode_naive(
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    block_tables,
    seq_lens,
    w_uk,
    w_uv,
    scale: float | None = None,
    precision: str = "fp64",
):
    """MLA decode the naive way: every cached ``c_kv`` projected up to per-head K and V,
    ``k_pe`` concatenated to K, then ordinary softmax attention.

    Args (as ``kernels.mla_decode_attention``): ``q_nope [batch, num_heads,
    qk_nope_head_dim]``, ``q_pe [batch, num_heads, qk_rope_head_dim]`` (rotated);
    ``ckv_cache [num_pages, page_size, kv_lora_rank]``, ``kpe_cache [num_pages,
    page_size, qk_rope_head_dim]``; ``block_tables [batch, max_blocks]``, ``seq_lens
    [batch]``; ``w_uk [num_heads, qk_nope_head_dim, kv_lora_rank]``, ``w_uv [num_heads,
    v_head_dim, kv_lora_rank]`` (module docstring); ``scale`` default
    :func:`default_scale`. A sequence of length 0 returns zeros.

    Returns ``[batch, num_heads, v_head_dim]`` float64 (the oracle; with
    ``precision="fp32"`` computed in fp32 and returned in ``q_nope.dtype``).
    """
    dtype = _compute_dtype(precision)
    table, lens = check_mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale)
    scale = default_scale(q_nope.shape[2], q_pe.shape[2]) if scale is None else scale
    ckv, kpe, mask = _padded_latent(ckv_cache, kpe_cache, table, lens, dtype)
    w_uk, w_uv = w_uk.cpu().to(dtype), w_uv.cpu().to(dtype)
    num_heads = q_nope.shape[1]
    k = torch.cat(
        [torch.einsum("hdr,btr->bthd", w_uk, ckv), kpe[:, :, None, :].expand(-1, -1, num_heads, -1)], dim=-1
    )  # [batch, max_len, num_heads, qk_nope_head_dim + qk_rope_head_dim]
    v = torch.einsum("hvr,btr->bthv", w_uv, ckv)  # [batch, max_len, num_heads, v_head_dim]
    q = torch.cat([q_nope, q_pe], dim=-1).cpu().to(dtype)
    scores = torch.einsum("bhd,bthd->bht", q, k) * scale
    probs = masked_softmax(scores, mask[:, None, :])
    out = torch.einsum("bht,bthv->bhv", probs, v)
    return out if precision == "fp64" else out.to(q_nope.dtype)


def mla_decode_naive_loop(
    q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale: float | None = None
):
    """Loop form of :func:`mla_decode_naive` (float64): per sequence, gather its latent
    rows, expand them (:func:`expand_latent`), then per head a plain softmax."""
    table, lens = check_mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale)
    scale = default_scale(q_nope.shape[2], q_pe.shape[2]) if scale is None else scale
    batch, num_heads = q_nope.shape[:2]
    out = torch.zeros((batch, num_heads, w_uv.shape[1]), dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        k, v = expand_latent(*gather_mla_latent(ckv_cache, kpe_cache, table[b], n), w_uk, w_uv)
        for h in range(num_heads):
            q = torch.cat([q_nope[b, h], q_pe[b, h]]).cpu().double()
            probs = torch.softmax(k[:, h] @ q * scale, dim=0)
            out[b, h] = probs @ v[:, h]
    return out


def mla_decode_absorbed(
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    block_tables,
    seq_lens,
    w_uk,
    w_uv,
    scale: float | None = None,
    return_latent: bool = False,
):
    """MLA decode in the absorbed form, in float64 (the kernel's algebra, without its
    tiles): ``q_latent[b, h] = q_nope[b, h] @ w_uk[h]`` (= ``w_uk[h]^T q_nope[b, h]``,
    ``[kv_lora_rank]``), scores ``scale * (q_latent . c_kv + q_pe . k_pe)``, softmax,
    ``o_latent = p . c_kv``, ``out[b, h] = w_uv[h] @ o_latent[b, h]``.

    Arguments as :func:`mla_decode_naive`. Returns ``out [batch, num_heads, v_head_dim]``
    float64, and with ``return_latent=True`` also ``o_latent [batch, num_heads,
    kv_lora_rank]``."""
    table, lens = check_mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale)
    scale = default_scale(q_nope.shape[2], q_pe.shape[2]) if scale is None else scale
    ckv, kpe, mask = _padded_latent(ckv_cache, kpe_cache, table, lens, torch.float64)
    q_latent = torch.einsum("bhd,hdr->bhr", q_nope.cpu().double(), w_uk.cpu().double())
    scores = torch.einsum("bhr,btr->bht", q_latent, ckv) + torch.einsum("bhp,btp->bht", q_pe.cpu().double(), kpe)
    probs = masked_softmax(scores * scale, mask[:, None, :])
    o_latent = torch.einsum("bht,btr->bhr", probs, ckv)
    out = torch.einsum("hvr,bhr->bhv", w_uv.cpu().double(), o_latent)
    return (out, o_latent) if return_latent else out


def mla_latent_attention_ref(
    q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, scale: float, causal: bool = True
):
    """MLA attention in FlashInfer's latent-space convention, in float64, one query at a
    time: the oracle of :mod:`pagedkv_kernels.mla_latent`.

    Args: ``q_nope [rows, num_heads, kv_lora_rank]``, the query already absorbed
    (``q_nope @ w_uk``); ``q_pe [rows, num_heads, qk_rope_head_dim]``, rotated; the pool
    as :func:`mla_cache_dims`; ``qo_indptr [batch + 1]`` (request ``b``'s queries are rows
    ``qo_indptr[b] .. qo_indptr[b + 1] - 1``), ``kv_indptr [batch + 1]`` and
    ``kv_indices`` (its pages), ``kv_len [batch]`` (its keys); ``scale`` the softmax
    scale (required); ``causal``: query ``i`` of ``q_len`` sees keys ``0 .. kv_len - q_len
    + i``, else all ``kv_len``.

    Returns ``(o [rows, num_heads, kv_lora_rank], lse [rows, num_heads])`` float64: ``o``
    the softmax-weighted sum of the visible ``c_kv`` rows under scores ``scale * (q_nope .
    c_kv + q_pe . k_pe)``, ``lse`` their base-2 log-sum-exp (FlashInfer's); a row that
    sees no key gives zeros and ``-inf``. A NaN in a visible row or in a query reaches
    ``o`` (nothing is masked but positions), and makes the row's ``lse`` NaN.
    """
    qo, indptr, indices, _, lens = check_mla_latent_csr_args(
        q_nope, q_pe, ckv_cache, kpe_cache, qo_indptr, kv_indptr, kv_indices, kv_len, causal, scale
    )
    rows, num_heads, rank = q_nope.shape
    o = torch.zeros((rows, num_heads, rank), dtype=torch.float64)
    lse = torch.full((rows, num_heads), float("-inf"), dtype=torch.float64)
    for b in range(lens.numel()):
        n, first, last = int(lens[b]), int(qo[b]), int(qo[b + 1])
        ckv, kpe = gather_mla_latent(ckv_cache, kpe_cache, indices[indptr[b] : indptr[b + 1]], n)
        ckv, kpe = ckv.cpu().double(), kpe.cpu().double()
        for i, r in enumerate(range(first, last)):
            seen = n - (last - first) + i + 1 if causal else n
            if seen <= 0:
                continue
            scores = scale * (q_nope[r].cpu().double() @ ckv[:seen].T + q_pe[r].cpu().double() @ kpe[:seen].T)
            every = torch.ones_like(scores, dtype=torch.bool)
            o[r] = masked_softmax(scores, every) @ ckv[:seen]
            lse[r] = base2_lse(scores, every)  # NaN for a row that saw a NaN (the kernels' rule)
    return o, lse


# --------------------------------------------------------------------------- cost

FLOP_FORMS = ("naive", "absorbed", "mha")


def decode_flops(shape: MLAShape, seq_len: int, form: str) -> int:
    """FLOPs of one decoded token's attention in one layer, over ``seq_len`` cached tokens
    (a multiply-add counts 2; the softmax's ``seq_len`` exponentials per head are the
    same in every form and not counted).

    * ``"naive"``: project every cached latent up (``kv_lora_rank * (qk_nope_head_dim +
      v_head_dim)`` per token and head), then attention with ``qk_nope + qk_rope``-wide
      keys and ``v_head_dim``-wide values;
    * ``"absorbed"``: ``q_nope`` into latent space once (``qk_nope_head_dim *
      kv_lora_rank`` per head), scores over ``kv_lora_rank + qk_rope_head_dim``, the
      output over ``kv_lora_rank``, one up-projection (``kv_lora_rank * v_head_dim``);
    * ``"mha"``: the MHA whose cache holds those K and V per head: attention alone.
    """
    if form not in FLOP_FORMS:
        raise ValueError(f"form={form!r} must be one of {FLOP_FORMS}")
    check_int("seq_len", seq_len)
    h, r, dn, dr, dv = shape
    qk, n = dn + dr, seq_len
    if form == "naive":
        per_head = n * r * (dn + dv) + n * (qk + dv)
    elif form == "absorbed":
        per_head = dn * r + n * (r + dr) + n * r + r * dv
    else:
        per_head = n * (qk + dv)
    return 2 * h * per_head

"""Triton kernels for the MLA latent cache: append ``c_kv``/``k_pe`` rows.

The pool (:mod:`pagedkv_lib.mla`) is ``ckv_cache [num_pages, page_size, kv_lora_rank]``
and ``kpe_cache [num_pages, page_size, qk_rope_head_dim]``: one latent row per token,
one "head". Rows are addressed through :mod:`pagedkv_kernels.device.addressing` with each cache's own
page and row strides (``row_offset``, ``table_row_offset``), exactly as the K/V pool is.

**Append** (:func:`append_paged_mla_kv`, slot mapping; :func:`append_paged_mla_kv_csr`,
FlashInfer's ``batch_indices``/``positions`` over a CSR page table): grid
``cdiv(num_tokens, BLOCK_T)``; each program copies ``BLOCK_T`` latent rows without
leaving the storage dtype (bit-exact, NaN payloads included) and writes their ``k_pe``,
rotated by RoPE (fp32 math, angle reduced in fp64) when ``rope`` is given. The token
addressing (:mod:`pagedkv_kernels.device.addressing`), the tile copy and the RoPE angle, pairing and
rotation (:mod:`pagedkv_kernels.device.rope`) are the MHA write's jit helpers, so the two appends
cannot disagree on a slot or a rotated value; only the rounding is MLA's own.

**Decode** in the absorbed form with split-KV is :mod:`pagedkv_kernels.mla_decode`.

Numerics: a computed value (a rotated RoPE key) is rounded once to its dtype, to
nearest-even on both backends (:func:`round_to`: the interpreter's own fp32-to-bf16
conversion truncates).
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks, reference

from .device.addressing import row_offset, token_rows
from .device.rope import (
    ROPE_CODES,
    copy_tile,
    rope_cos_sin,
    rope_pair_features,
    rope_rotate_first,
    rope_rotate_second,
    rotary_positions,
)
from .device.rounding import round_to
from .host import validate
from .host.launch import TokenIndex, csr_index, fingerprint, memory_key, slot_index
from .host.tiles import mla_append_block_t, pow2

__all__ = [
    "mla_append_kernel",
    "MLAAppendPlan",
    "plan_append_mla",
    "plan_append_mla_csr",
    "run_append_mla",
    "append_paged_mla_kv",
    "append_paged_mla_kv_csr",
]


# --------------------------------------------------------------------------- device code


# fmt: off
@triton.jit
def _rope_rows(
    # source and destination: per-token base offsets [BLOCK_T], feature stride
    src_ptr, src_base, src_sd,
    dst_ptr, dst_base, dst_sd,
    # valid tokens [BLOCK_T]; rope_cos_sin of the tokens [BLOCK_T, BLOCK_P], pairs per row
    valid, cos, sin, half,
    NEOX: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate ``[BLOCK_T, 2 * half]`` RoPE rows from ``src`` into ``dst`` with the halves of
    :func:`pagedkv_kernels.device.rope.rope_rotate` (pairs of :func:`pagedkv_kernels.device.rope.rope_pair_features`),
    in fp32, rounded once to nearest-even (:func:`round_to`)."""
    pair = tl.arange(0, BLOCK_P)
    f1, f2 = rope_pair_features(pair, half, NEOX)
    mask = valid[:, None] & (pair < half)[None, :]
    src = src_ptr + src_base[:, None]
    x1 = tl.load(src + f1[None, :].to(tl.int64) * src_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + f2[None, :].to(tl.int64) * src_sd, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + dst_base[:, None]
    # Each half stored as soon as it is computed: rope_rotate's pair, formed before the
    # first store, costs two registers on sm_90.
    r1 = rope_rotate_first(x1, x2, cos, sin)
    tl.store(dst + f1[None, :].to(tl.int64) * dst_sd, round_to(r1, out_ty), mask=mask)
    r2 = rope_rotate_second(x1, x2, cos, sin)
    tl.store(dst + f2[None, :].to(tl.int64) * dst_sd, round_to(r2, out_ty), mask=mask)
# fmt: on


# fmt: off
@triton.jit
def mla_append_kernel(
    # pointers: inputs, the two caches, token addressing, RoPE positions and frequencies
    ckv_ptr, kpe_ptr, ckv_cache_ptr, kpe_cache_ptr,
    slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
    rope_pos_ptr, inv_freq_ptr,
    # sizes
    num_tokens, kv_lora_rank, rope_dim, page_size,
    # strides of ckv and kpe [token, feature]
    stride_ct, stride_cd,
    stride_pt, stride_pd,
    # strides of ckv_cache and kpe_cache [page, row, feature]
    stride_cc_page, stride_cc_n, stride_cc_d,
    stride_pc_page, stride_pc_n, stride_pc_d,
    # constexprs: addressing form, RoPE code; tiles
    CSR: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program ``t``: tokens ``t*BLOCK_T ...``, their latent row and their RoPE key, rotated at
    ``rope_pos_ptr`` (the cache positions, or ``rope_positions`` of their own: with no Q
    to rotate, only the written tokens' positions are read either way)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # No ring window for MLA: (sinks, bubble, cyclic length) are unused with HAS_WINDOW off.
    page, row, valid = token_rows(
        tokens, num_tokens,
        slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
        page_size, 0, 0, 1,
        CSR, False,
    )
    tok = tokens.to(tl.int64)
    head = tl.arange(0, 1)  # the pool's single "head": head strides are 0
    mask_th = valid[:, None]
    dst_c = row_offset(page, row, stride_cc_page, stride_cc_n)
    dst_p = row_offset(page, row, stride_pc_page, stride_pc_n)
    copy_tile(
        ckv_ptr, tok * stride_ct, 0, stride_cd,
        ckv_cache_ptr, dst_c, 0, stride_cc_d,
        head, mask_th, kv_lora_rank,
        BLOCK_R,
    )
    if ROPE != 0:
        pair = tl.arange(0, BLOCK_P // 2)
        pos, _ = rotary_positions(tokens, num_tokens, valid, rope_pos_ptr, False)
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, pair, pair < rope_dim // 2)
        _rope_rows(
            kpe_ptr, tok * stride_pt, stride_pd,
            kpe_cache_ptr, dst_p, stride_pc_d,
            valid, cos, sin, rope_dim // 2,
            ROPE == 1, BLOCK_P // 2,
        )
    else:
        copy_tile(
            kpe_ptr, tok * stride_pt, 0, stride_pd,
            kpe_cache_ptr, dst_p, 0, stride_pc_d,
            head, mask_th, rope_dim,
            BLOCK_P,
        )
# fmt: on


# --------------------------------------------------------------------------- launch checks


def _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index: dict) -> None:
    for name, t in (("ckv", ckv), ("kpe", kpe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        validate.check_device(name, t)
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        validate.check_kernel_dtype(name, t)
        validate.check_no_self_overlap(name, t)
        validate.check_in_storage(name, t)
        for src_name, src in (("ckv", ckv), ("kpe", kpe)):
            validate.check_no_overlap(name, t, src_name, src)
    validate.check_caches_disjoint(ckv_cache, kpe_cache)
    given = validate.check_write_index(index)
    for cache in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):  # apart from each other: above
        validate.check_disjoint([cache], given)


# --------------------------------------------------------------------------- append


@dataclass(frozen=True)
class MLAAppendPlan:
    """A validated MLA append: everything :func:`run_append_mla` launches, checked once.
    ``ckv_cache``/``kpe_cache`` given to :func:`run_append_mla` must have the planned
    shapes, strides, dtype and device (slots were checked against them), ``ckv``/``kpe``
    the planned shapes, dtype and device."""

    caches: tuple  # fingerprints (shape, strides, dtype, device) of ckv_cache, kpe_cache
    num_tokens: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    page_size: int
    dtype: torch.dtype
    index: TokenIndex  # slot or CSR form (positions also for RoPE)
    rope: str | None
    inv_freq: torch.Tensor | None  # float64 [qk_rope_head_dim / 2] on the device, with rope
    block_t: int
    block_r: int
    block_p: int
    checked: tuple  # memory_key(ckv, kpe, ckv_cache, kpe_cache) of the tensors planned with

    @property
    def grid(self) -> tuple[int]:
        return (triton.cdiv(self.num_tokens, self.block_t),)


def _append_plan(ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, index: dict) -> MLAAppendPlan:
    dims = checks.mla_cache_dims(ckv_cache, kpe_cache)
    block_r, block_p = pow2(dims.kv_lora_rank), pow2(dims.qk_rope_head_dim)
    inv_freq = reference.rope_inv_freq(dims.qk_rope_head_dim, rope_theta).to(ckv_cache.device) if rope else None
    return MLAAppendPlan(
        caches=(fingerprint(ckv_cache), fingerprint(kpe_cache)),
        num_tokens=ckv.shape[0],
        kv_lora_rank=dims.kv_lora_rank,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        page_size=dims.page_size,
        dtype=ckv_cache.dtype,
        rope=rope,
        inv_freq=inv_freq,
        block_t=mla_append_block_t(ckv.shape[0], block_r + block_p),
        block_r=block_r,
        block_p=block_p,
        checked=memory_key(ckv, kpe, ckv_cache, kpe_cache),
        index=TokenIndex.of(**index),
    )


def plan_append_mla(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rope: str | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> MLAAppendPlan:
    """Validate an :func:`append_paged_mla_kv` call once and return its plan (nothing is
    written). Arguments and errors as :func:`append_paged_mla_kv`."""
    slots = checks.check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)
    checks.check_mla_rope_args(rope, positions, rope_theta, kpe, slots)
    index = slot_index(slot_mapping, positions if rope is not None else None)
    _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index)
    return _append_plan(ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, index)


def plan_append_mla_csr(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    rope: str | None = None,
    rope_theta: float = 10000.0,
    rope_positions: torch.Tensor | None = None,
) -> MLAAppendPlan:
    """Validate an :func:`append_paged_mla_kv_csr` call once and return its plan (nothing
    is written). Arguments and errors as :func:`append_paged_mla_kv_csr`."""
    slots = checks.check_mla_csr_append_args(
        ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr
    )
    source, name = checks.rope_position_source(rope, positions, rope_positions)
    checks.check_mla_rope_args(rope, source, rope_theta, kpe, slots, name)
    index = csr_index(batch_indices, positions, kv_indices, kv_indptr, rope_positions)
    _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index)
    return _append_plan(ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, index)


def run_append_mla(
    plan: MLAAppendPlan, ckv: torch.Tensor, kpe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor
) -> None:
    """Launch a planned MLA append, in place. The tensors may be other than those planned
    with, of the same shapes, dtype and device (the caches also of the same strides);
    anything else is a ValueError. The very tensors planned with (same addresses and
    layouts) are not checked again."""
    if memory_key(ckv, kpe, ckv_cache, kpe_cache) != plan.checked:
        _check_append_run(plan, ckv, kpe, ckv_cache, kpe_cache)
    if plan.num_tokens:
        _launch_append(plan, ckv, kpe, ckv_cache, kpe_cache)


def _check_append_run(plan: MLAAppendPlan, ckv, kpe, ckv_cache, kpe_cache) -> None:
    """The tensors given to :func:`run_append_mla` must be what the plan was made for."""
    validate.check_same_layout("ckv_cache", ckv_cache, plan.caches[0])
    validate.check_same_layout("kpe_cache", kpe_cache, plan.caches[1])
    for name, t, width in (("ckv", ckv, plan.kv_lora_rank), ("kpe", kpe, plan.qk_rope_head_dim)):
        want = (plan.num_tokens, width)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != plan.dtype:
            raise ValueError(f"{name} must be {plan.dtype} of shape {want} as planned, got {getattr(t, 'shape', t)}")
        validate.check_device(name, t)
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        validate.check_no_overlap(name, t, "ckv", ckv)
        validate.check_no_overlap(name, t, "kpe", kpe)
    index = plan.index.named()
    for cache in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):  # two slices of one buffer may interleave
        validate.check_disjoint([cache], index)


def _launch_append(plan: MLAAppendPlan, ckv, kpe, ckv_cache, kpe_cache) -> None:
    # fmt: off
    mla_append_kernel[plan.grid](
        ckv, kpe, ckv_cache, kpe_cache,
        *plan.index.launch_args(),
        ckv if plan.inv_freq is None else plan.inv_freq,
        plan.num_tokens, plan.kv_lora_rank, plan.qk_rope_head_dim, plan.page_size,
        *ckv.stride(),
        *kpe.stride(),
        *ckv_cache.stride(),
        *kpe_cache.stride(),
        CSR=plan.index.csr, ROPE=ROPE_CODES[plan.rope],
        BLOCK_T=plan.block_t, BLOCK_R=plan.block_r, BLOCK_P=plan.block_p,
    )
    # fmt: on


def append_paged_mla_kv(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rope: str | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> None:
    """Write new tokens' latent rows into the MLA pool in place (returns None).

    Args:
        ckv: ``[num_tokens, kv_lora_rank]``, the compressed ``c_kv`` of each token.
        kpe: ``[num_tokens, qk_rope_head_dim]``, the shared RoPE key, not yet rotated
            when ``rope`` is given (``kpe`` itself is never modified).
        ckv_cache: ``[num_pages, page_size, kv_lora_rank]``; kpe_cache: ``[num_pages,
            page_size, qk_rope_head_dim]``: fp32, fp16 or bf16, the dtype of ``ckv`` and
            ``kpe``; any strides (two column slices of one ``[num_pages, page_size,
            rank + rope]`` buffer work).
        slot_mapping: ``[num_tokens]`` int32 or int64, flat slot ``page * page_size +
            row`` of each token; ``-1``: skipped; no slot twice.
        rope: ``None``, ``"neox"`` or ``"gptj"`` (DeepSeek-V2 as vLLM runs it); with it
            ``kpe`` is stored rotated at ``positions [num_tokens]`` (required then) with
            base ``rope_theta``.

    The latent row is copied bit for bit; the RoPE key too without ``rope``, else it is
    rotated in fp32 (angle reduced in fp64). All tensors on
    :func:`pagedkv_lib.runtime.device`. Raises ValueError naming the argument (shape,
    dtype, device, slot range or duplicate, overlapping memory) before anything is
    written. The Python twin is :func:`pagedkv_lib.mla.append_paged_mla_kv`.
    """
    # fmt: off
    return run_append_mla(
        plan_append_mla(
            ckv, kpe, ckv_cache, kpe_cache, slot_mapping, rope=rope, positions=positions, rope_theta=rope_theta,
        ),
        ckv, kpe, ckv_cache, kpe_cache,
    )
    # fmt: on


def append_paged_mla_kv_csr(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    rope: str | None = None,
    rope_theta: float = 10000.0,
    rope_positions: torch.Tensor | None = None,
) -> None:
    """Write new tokens' latent rows addressed by request and position (FlashInfer's
    ``append_paged_mla_kv_cache``), in place; returns None.

    Token ``i`` of request ``b = batch_indices[i]`` at position ``p = positions[i]``
    (both ``[num_tokens]``; ``-1`` in either marks padding) goes to row ``p % page_size``
    of page ``kv_indices[kv_indptr[b] + p // page_size]``; the kernel computes this
    itself, the launcher checks beforehand that every token lands on one of its
    request's pages, inside the pool. ``rope`` rotates ``kpe`` at ``p``, or at
    ``rope_positions [num_tokens]`` (needs ``rope``; >= 0 for a written token) given
    apart from it, as :func:`pagedkv_kernels.write.append_paged_kv_csr` takes it. Other
    arguments and errors as :func:`append_paged_mla_kv`.
    """
    # fmt: off
    return run_append_mla(
        plan_append_mla_csr(
            ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr,
            rope=rope, rope_theta=rope_theta, rope_positions=rope_positions,
        ),
        ckv, kpe, ckv_cache, kpe_cache,
    )
    # fmt: on

"""What the MHA and the quantized K/V write launches fix on the host, written once: the
plan fields both write plans share (:class:`WritePlan`, its grid), and the launch
arguments and constexprs both kernels take in the same order (:func:`write_launch_args`,
:func:`write_constexprs`). The device side of the same writes starts with
:func:`pagedkv_kernels.device.addressing.kv_write_start`; the index tensors' launch checks
are :func:`pagedkv_kernels.host.validate.check_write_index`.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton

from pagedkv_lib import reference
from pagedkv_lib.window import RingWindow

from ..device.rope import ROPE_CODES
from .launch import TokenIndex

__all__ = ["WritePlan", "write_plan_fields", "write_launch_args", "write_constexprs"]


@dataclass(frozen=True)
class WritePlan:
    """What every K/V write plan fixes (:class:`pagedkv_kernels.write.AppendPlan` and
    :class:`pagedkv_kernels.quant_write.QuantAppendPlan` add their pool's fingerprint, their
    dtypes and their V-tail plan): the tokens and heads, the index tensors, the window,
    RoPE, the tiles and the memory key of the tensors planned with."""

    num_tokens: int  # tokens written (the index tensors' length)
    num_kv_heads: int
    num_q_heads: int  # 0 without q
    head_dim: int
    page_size: int
    q_dtype: torch.dtype | None
    index: TokenIndex  # slot or CSR form (positions, or rope_positions, for RoPE)
    window: RingWindow | None
    rope: str | None
    inv_freq: torch.Tensor | None  # float64 [head_dim / 2] on the device, with rope
    tiles: tuple[int, int, int]  # (BLOCK_T, BLOCK_H, BLOCK_D)
    checked: tuple  # memory_key of the tensors planned with

    @property
    def grid(self) -> tuple[int, int]:
        """``(token blocks, KV head blocks + Q head blocks)``."""
        block_t, block_h, _ = self.tiles
        heads = triton.cdiv(self.num_kv_heads, block_h) + triton.cdiv(self.num_q_heads, block_h)
        return triton.cdiv(self.num_tokens, block_t), heads


def write_plan_fields(
    num_tokens: int, num_kv_heads: int, head_dim: int, page_size: int, q, window, rope, rope_theta, device, index: dict
) -> dict:
    """The :class:`WritePlan` fields but ``tiles`` and ``checked`` of a write of
    ``num_tokens`` tokens (values already checked): ``q [tokens, num_q_heads, head_dim]``
    or None, the RoPE frequencies on ``device`` with ``rope``, ``index`` the index tensors
    by name (None for the absent ones)."""
    return {
        "num_tokens": num_tokens,
        "num_kv_heads": num_kv_heads,
        "num_q_heads": 0 if q is None else q.shape[1],
        "head_dim": head_dim,
        "page_size": page_size,
        "q_dtype": None if q is None else q.dtype,
        "index": TokenIndex.of(**index),
        "window": window,
        "rope": rope,
        "inv_freq": reference.rope_inv_freq(head_dim, rope_theta).to(device) if rope else None,
    }


def write_launch_args(plan: WritePlan, k: torch.Tensor, v: torch.Tensor, q) -> tuple:
    """The arguments both write kernels take after their pool and ``q`` pointers, in their
    order: the index tensors and the rotary positions (:meth:`TokenIndex.launch_args`),
    the RoPE frequencies, the sizes, and the strides of ``k``, ``v`` and ``q`` (zeros
    without ``q``). A pointer the kernel never dereferences (no RoPE) is ``k``."""
    return (
        *plan.index.launch_args(),
        k if plan.inv_freq is None else plan.inv_freq,
        plan.num_tokens, plan.num_kv_heads, plan.num_q_heads, plan.head_dim, plan.page_size,
        *k.stride(),
        *v.stride(),
        *((0, 0, 0) if q is None else q.stride()),
    )  # fmt: skip


def write_constexprs(plan: WritePlan, q) -> dict:
    """The constexprs both write kernels take: addressing form, window, RoPE code, rotary
    positions of their own, ``q`` given, tiles."""
    block_t, block_h, block_d = plan.tiles
    return {
        "CSR": plan.index.csr,
        "HAS_WINDOW": plan.window is not None,
        "ROPE": ROPE_CODES[plan.rope],
        "ROPE_POS": plan.index.own_rope_positions,
        "HAS_Q": q is not None,
        "BLOCK_T": block_t,
        "BLOCK_H": block_h,
        "BLOCK_D": block_d,
    }

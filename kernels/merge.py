"""The split-KV merge: stage 2 of the decode kernel (flash-decoding).

Each split ``s`` of a row left a softmax-normalised partial output ``o_s`` and the
base-2 log-sum-exp ``lse_s`` of its scaled scores. The merge weighs them by their share
of the row's softmax mass:

    out = sum_s 2**(lse_s - m) * o_s / sum_s 2**(lse_s - m),   m = max_s lse_s

A split that saw no key has ``lse_s = -inf`` and weight exactly 0; its partial is
never multiplied (``0 * NaN`` would be NaN), and a row whose splits are all empty
becomes zeros. :func:`pagedkv_lib.reference.merge_partials` is the float64 twin.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import torch
import triton
import triton.language as tl

from pagedkv_lib import checks

from .tiles import merge_tiles
from .validate import MAX_SPLITS, check_device

__all__ = ["merge_kernel", "merge_partials", "launch_merge"]


@triton.jit
def merge_kernel(
    # pointers: the partials [batch, heads, splits, dim], their lse [batch, heads, splits], the output
    part_ptr, lse_ptr, out_ptr,
    # strides (elements)
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    # sizes
    num_splits, head_dim,
    # constexprs
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program ``(b, h)``: merge the ``num_splits`` partials of row ``b``, head ``h``."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s * stride_ls, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh exactly 0
    part_ptrs = part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd
    part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    part = tl.where(w[:, None] > 0.0, part, 0.0)  # a weightless split adds nothing, NaN included
    num = tl.sum(w[:, None] * part, axis=0)
    den = tl.sum(w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)  # every split empty (length 0): zeros, not NaN
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def launch_merge(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Launch the merge without checks (the decode kernel's own stage 2): ``part [batch,
    heads, splits, head_dim]`` and ``lse [batch, heads, splits]`` fp32 into ``out [batch,
    heads, head_dim]``."""
    batch, num_q_heads, splits, head_dim = part.shape
    if batch == 0:
        return
    block_s, block_d = merge_tiles(splits, head_dim)
    # fmt: off
    merge_kernel[(batch, num_q_heads)](
        # pointers
        part, lse, out,
        # strides
        *part.stride(),
        *lse.stride(),
        *out.stride(),
        # sizes
        splits, head_dim,
        # constexprs
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    # fmt: on


def merge_partials(partials: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stage 2 alone: merge ``partials [batch, heads, splits, head_dim]`` fp32 with their
    base-2 ``lse [batch, heads, splits]`` fp32 into ``[batch, heads, head_dim]`` of
    ``dtype`` (default fp32). Rows whose splits are all ``-inf`` become zeros; a split
    of weight 0 contributes nothing even if its partial holds NaN. Raises ValueError
    naming the argument (shapes, dtypes other than fp32, device, 1 to ``MAX_SPLITS``
    splits)."""
    checks.check_merge_args(partials, lse)
    for name, t in (("partials", partials), ("lse", lse)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name}.dtype={t.dtype}; the merge kernel takes float32 (stage 1's output)")
        check_device(name, t)
    if partials.shape[2] > MAX_SPLITS:
        raise ValueError(f"partials has {partials.shape[2]} splits; 1 to {MAX_SPLITS} are supported")
    batch, heads, _, head_dim = partials.shape
    out = torch.empty((batch, heads, head_dim), dtype=dtype or torch.float32, device=partials.device)
    launch_merge(partials, lse, out)
    return out

"""The merge of attention states: stage 2 of the decode kernel (flash-decoding), and
FlashInfer's ``merge_state`` / ``merge_states`` (:mod:`pagedkv_kernels.cascade`).

Each split ``s`` of a row (or each state of a cascade) left a softmax-normalised
partial output ``o_s`` and the base-2 log-sum-exp ``lse_s`` of its scaled scores. The
merge weighs them by their share of the row's softmax mass:

    out = sum_s 2**(lse_s - m) * o_s / sum_s 2**(lse_s - m),   m = max_s lse_s
    lse = m + log2(sum_s 2**(lse_s - m))                        (with WRITE_LSE)

NaN is never an empty state (the rule of :mod:`pagedkv_kernels.device.attention_core`):

* an *empty* split (``lse_s = -inf``: it saw no key) weighs exactly 0 and its partial
  is never multiplied (``0 * NaN`` would be NaN); a row whose splits are all empty
  becomes zeros and ``lse = -inf``;
* a split whose ``lse_s`` is NaN (it saw a NaN) or ``+inf`` (no finite scores give it)
  makes the whole row NaN, output and ``lse``. It is detected explicitly, with an
  ordered comparison (``lse_s < inf`` is false for both), not left to ``max``, which a
  GPU computes without NaN (the NaN split would drop out and the others give a
  plausible, wrong answer);
* every other split is multiplied by its weight, even one that underflows to 0, so a
  NaN in its partial (NaN in a visible value) reaches the output as it does unsplit.

:func:`pagedkv_lib.reference.merge_partials` and :func:`pagedkv_lib.merge_state.merge_states`
are the float64 twins.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import torch
import triton
import triton.language as tl

from pagedkv_lib import checks

from .device.rounding import round_to
from .host.tiles import merge_tiles
from .host.validate import MAX_SPLITS, check_device

__all__ = ["merge_kernel", "merge_partials", "launch_merge", "finish_splits"]


@triton.jit
def merge_kernel(
    # pointers: the partials [batch, heads, splits, dim] and their lse [batch, heads, splits]
    # (any strides); the merged output [batch, heads, dim] and, with WRITE_LSE, its lse [batch, heads]
    part_ptr, lse_ptr, out_ptr, out_lse_ptr,
    # strides (elements)
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    stride_olb, stride_olh,
    # sizes
    num_splits, head_dim,
    # constexprs
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program ``(b, h)``: merge the ``num_splits`` partials of row ``b``, head ``h`` (fp32
    arithmetic; the output rounded to its dtype to nearest-even)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s * stride_ls, mask=s_mask, other=float("-inf"))
    # NaN or +inf: the row is NaN. Found by an ordered comparison, never by max (see above).
    nan_row = tl.max(tl.where(lse < float("inf"), 0, 1), axis=0) != 0
    lse = tl.where(lse < float("inf"), lse, float("-inf"))  # the rest merges as if that split were empty
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh exactly 0
    part_ptrs = part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd
    part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    part = tl.where(lse[:, None] == float("-inf"), 0.0, part)  # an empty split adds nothing, NaN included
    num = tl.sum(w[:, None] * part, axis=0)
    den = tl.sum(w, axis=0)
    has = den > 0.0
    out = num / tl.where(has, den, 1.0)  # every split empty (length 0): zeros, not NaN
    out = tl.where(nan_row, float("nan"), out)
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, round_to(out, out_ptr.dtype.element_ty), mask=d_mask)
    if WRITE_LSE:
        merged = tl.where(has, m + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
        tl.store(out_lse_ptr + b * stride_olb + h * stride_olh, tl.where(nan_row, float("nan"), merged))


def launch_merge(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor | None = None) -> None:
    """Launch the merge without checks: ``part [batch, heads, splits, head_dim]`` (fp32,
    or any float dtype for merged states) and ``lse [batch, heads, splits]`` fp32, views
    of any strides, into ``out [batch, heads, head_dim]`` and, if given, ``out_lse
    [batch, heads]`` fp32. The decode's own stage 2 passes no ``out_lse``."""
    batch, num_q_heads, splits, head_dim = part.shape
    if batch == 0 or num_q_heads == 0:
        return
    block_s, block_d = merge_tiles(splits, head_dim)
    lse_strides = (0, 0) if out_lse is None else out_lse.stride()
    # fmt: off
    merge_kernel[(batch, num_q_heads)](
        # pointers (without out_lse, a tensor the kernel never dereferences)
        part, lse, out, lse if out_lse is None else out_lse,
        # strides
        *part.stride(),
        *lse.stride(),
        *out.stride(),
        *lse_strides,
        # sizes
        splits, head_dim,
        # constexprs
        BLOCK_S=block_s, BLOCK_D=block_d, WRITE_LSE=out_lse is not None,
    )
    # fmt: on


def merge_partials(partials: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stage 2 alone: merge ``partials [batch, heads, splits, head_dim]`` fp32 with their
    base-2 ``lse [batch, heads, splits]`` fp32 into ``[batch, heads, head_dim]`` of
    ``dtype`` (default fp32). Rows whose splits are all ``-inf`` become zeros; an empty
    split contributes nothing even if its partial holds NaN; a split whose lse is NaN or
    ``+inf`` makes its row NaN (the module docstring's rules). Raises ValueError
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


def finish_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor, partials: bool):
    """What a split-KV launch returns once its kernel ran: ``(part, lse)`` when partials
    were asked for, else ``out``, merged from the partials (:func:`launch_merge`)
    unless the kernel wrote it directly."""
    if partials:
        return part, lse
    if part is not out:
        launch_merge(part, lse, out)
    return out

"""Solution of exercise 07: a Triton split-KV merge."""

from pagedkv_lib import runtime  # noqa: F401  (chooses the backend before triton is imported)

# isort: split
import torch
import triton
import triton.language as tl


@triton.jit
def merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, head_dim,
    stride_pb, stride_ph, stride_ps, stride_pd, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s * stride_ls, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for an empty split, never NaN
    mask = (s < num_splits)[:, None] & (d < head_dim)[None, :]
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :] * stride_pd,
                   mask=mask, other=0.0)  # fmt: skip
    part = tl.where(w[:, None] > 0, part, 0.0)  # a weightless split adds nothing, even NaN
    den = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * part, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out, mask=d < head_dim)


def merge(partials, lse):
    """Merge ``partials [batch, heads, splits, head_dim]`` with their base-2 ``lse [batch,
    heads, splits]`` into ``[batch, heads, head_dim]`` fp32."""
    batch, heads, splits, head_dim = partials.shape
    out = torch.full((batch, heads, head_dim), float("nan"), dtype=torch.float32, device=partials.device)
    merge_kernel[(batch, heads)](
        partials, lse, out, splits, head_dim, *partials.stride(), *lse.stride(), *out.stride(),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out

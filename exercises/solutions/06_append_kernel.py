"""Solution of exercise 06: a Triton append kernel addressed by slot_mapping."""

from pagedkv_lib import runtime  # noqa: F401  (chooses the backend before triton is imported)

# isort: split
import triton
import triton.language as tl

from pagedkv_lib.pool import cache_dims, cache_strides


@triton.jit
def append_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    num_heads, head_dim, page_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)  # this program's token
    slot = tl.load(slot_mapping_ptr + t)
    page = (slot // page_size).to(tl.int64)  # int64 before any stride multiplies it
    row = (slot % page_size).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # Padding (slot -1) writes no head; the scalar test is folded into the bound because
    # the interpreter refuses a mask built as scalar & tile.
    mask = (h < tl.where(slot >= 0, num_heads, 0)) & (d < head_dim)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = page * stride_page + row * stride_n + h * stride_h + d * stride_d
    tl.store(cache_ptr + dst, k, mask=mask)
    tl.store(cache_ptr + stride_kv + dst, v, mask=mask)


def append(k, v, cache, slot_mapping, layout="NHD"):
    """Write ``k, v [num_tokens, num_heads, head_dim]`` into ``cache`` at ``slot_mapping``."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    append_kernel[(num_tokens,)](
        k, v, cache, slot_mapping, num_heads, head_dim, cache_dims(cache, layout).page_size,
        *k.stride(), *v.stride(), *cache_strides(cache, layout),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip

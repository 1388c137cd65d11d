"""Tile sizes per backend: the one place that decides how much work one program does.

Compiled on a GPU a tile must fit the registers of one program (a few thousand fp32
values at 4-8 warps) while the grid holds enough programs to fill every SM. Triton's
interpreter runs programs one after another on numpy and pays per executed ``tl``
operation, not per element, so there the tiles are made as large as memory allows:
fewer, bigger operations. Every kernel asks this module; none picks its own sizes.
"""

from pagedkv_lib import runtime

# isort: split
import triton

__all__ = ["pow2", "write_tiles", "decode_tiles", "gather_block_t", "merge_tiles"]


def pow2(n: int) -> int:
    """The smallest power of two >= ``max(n, 1)``."""
    return triton.next_power_of_2(max(int(n), 1))


def _interpreted() -> bool:
    return runtime.BACKEND.interpreted


def write_tiles(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` of a write (append or V-tail) launch: tokens x heads x
    the whole head (``BLOCK_D = next_pow2(head_dim)``, masked). Compiled: tiles of about
    2048 elements, so even a short prefill spreads over the SMs. Interpreted: about 2**17
    elements, all heads at once."""
    block_d = pow2(head_dim)
    heads = pow2(num_heads)
    if _interpreted():
        block_h, budget = heads, 2**17
    else:
        block_h, budget = min(heads, max(1, 512 // block_d)), 2048
    block_t = max(1, min(pow2(num_tokens), budget // (block_h * block_d)))
    return block_t, block_h, block_d


def decode_tiles(group: int, head_dim: int, max_visible: int) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_N, BLOCK_D, num_warps)`` of a decode launch.

    ``BLOCK_G = next_pow2(group)`` query heads share each K/V tile; ``BLOCK_N`` keys per
    loop iteration. Compiled, the ``[BLOCK_G, BLOCK_N, BLOCK_D]`` fp32 products must fit
    registers (about 16K elements per program, untuned: no GPU has measured them yet);
    interpreted, up to 128 keys per iteration (about 2**18 elements). Never much wider
    than the longest sequence."""
    block_g, block_d = pow2(group), pow2(head_dim)
    per_key = block_g * block_d
    if _interpreted():
        n, floor = min(128, max(16, (1 << 18) // per_key)), 16
    else:
        n, floor = min(64, max(4, (1 << 14) // per_key)), 4
    n = 1 << (n.bit_length() - 1)  # a power of two
    block_n = max(min(n, pow2(max_visible)), floor)
    num_warps = 8 if block_g * block_n * block_d >= 1 << 14 else 4
    return block_g, block_n, block_d, num_warps


def gather_block_t(num_kv_heads: int, head_dim: int, max_len: int) -> int:
    """Tokens per program of the materializing gather (a copy of ``BLOCK_T`` token rows x
    all heads): about 2**12 elements compiled, 2**16 interpreted, a power of two."""
    budget = (1 << 16) if _interpreted() else (1 << 12)
    block_t = max(1, min(pow2(max_len), budget // (pow2(num_kv_heads) * pow2(head_dim))))
    return 1 << (block_t.bit_length() - 1)


def merge_tiles(num_splits: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_D)`` of the split-KV merge: all splits and the whole head at once."""
    return pow2(num_splits), pow2(head_dim)


# =========================================================================== quantized KV
# Tiles of kernels/quant_write.py (kernels/quant_decode.py uses decode_tiles).

__all__ += ["quant_write_tiles"]


def quant_write_tiles(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` of a quantizing append: tokens x heads x the whole head
    (``BLOCK_D = next_pow2(head_dim)``, at least 16 so an NVFP4 head splits into blocks of
    16). Interpreted: as :func:`write_tiles`. Compiled: half its budget (about 1024
    elements), as each element keeps its fp32 value, its code and a share of a block's
    amax and scale live at once; untuned, no GPU has measured it yet."""
    block_d = max(pow2(head_dim), 16)
    heads = pow2(num_heads)
    if _interpreted():
        block_h, budget = heads, 2**17
    else:
        block_h, budget = min(heads, max(1, 256 // block_d)), 1024
    block_t = max(1, min(pow2(num_tokens), budget // (block_h * block_d)))
    return block_t, block_h, block_d

"""Tile sizes per backend: the one place that decides how much work one program does.

Compiled on a GPU a tile must fit the registers of one program (a few thousand fp32
values at 4-8 warps) while the grid holds enough programs to fill every SM. The
compiled sizes are measured, not guessed: ``python -m pagedkv_kernels.tools.compile_check`` compiles
every launch the suite makes for sm_80 and sm_90 and fails when one spills or needs
255 registers (Triton's bundled ``ptxas -v``); the figures quoted below are its
maxima over the recorded specializations. No GPU has timed them yet. Triton's
interpreter runs programs one after another on numpy and pays per executed ``tl``
operation, not per element, so there the tiles are made as large as memory allows:
fewer, bigger operations. Every kernel asks this module; none picks its own sizes.
"""

from pagedkv_lib import runtime

# isort: split
import triton

__all__ = [
    "pow2",
    # write
    "write_tiles",
    # decode and its split-KV merge
    "decode_tiles",
    "descriptor_decode_tiles",
    "merge_tiles",
    # quantized KV (FP8 / NVFP4)
    "quant_write_tiles",
    "quant_decode_tiles",
    "PTXAS_SPILL_QUIRKS",
    # prefill
    "prefill_tiles",
    # gather
    "gather_block_t",
    # MLA latent cache
    "mla_append_block_t",
    "mla_decode_tiles",
    "head_matvec_tiles",
]


def pow2(n: int) -> int:
    """The smallest power of two >= ``max(n, 1)``."""
    return triton.next_power_of_2(max(int(n), 1))


def _interpreter_plans() -> bool:
    # Interpreter tiles unless planning as on a GPU (compiled, or PAGEDKV_PLAN=gpu).
    return not runtime.gpu_plans()


# --------------------------------------------------------------------------------- write


def write_tiles(num_tokens: int, num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` of a write (append or V-tail) launch: tokens x heads x
    the whole head (``BLOCK_D = next_pow2(head_dim)``, masked). Compiled: tiles of about
    2048 elements, so even a short prefill spreads over the SMs. Interpreted: about 2**17
    elements, all heads at once."""
    block_d = pow2(head_dim)
    heads = pow2(num_heads)
    if _interpreter_plans():
        block_h, budget = heads, 2**17
    else:
        block_h, budget = min(heads, max(1, 512 // block_d)), 2048
    block_t = max(1, min(pow2(num_tokens), budget // (block_h * block_d)))
    return block_t, block_h, block_d


# ------------------------------------------------- decode (decode.py) and the split-KV merge (merge.py)


def decode_tiles(group: int, head_dim: int, max_visible: int) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_N, BLOCK_D, num_warps)`` of a decode launch.

    ``BLOCK_G = next_pow2(group)`` query heads share each K/V tile; ``BLOCK_N`` keys per
    loop iteration. Compiled, the ``[BLOCK_G, BLOCK_N, BLOCK_D]`` fp32 products get
    2**13 elements per program, with 8 warps from 2**12 on: at 2**14 elements and 8
    warps ptxas capped the decode kernel at 128 registers and spilled (12 B on sm_90,
    fp16, group 4, head 128); with these sizes the maxima are
    about 120 registers, no spills. Interpreted, up to 128 keys per iteration (about
    2**18 elements). Never much wider than the longest sequence."""
    block_g, block_d = pow2(group), pow2(head_dim)
    per_key = block_g * block_d
    if _interpreter_plans():
        n, floor = min(128, max(16, (1 << 18) // per_key)), 16
    else:
        n, floor = min(64, max(4, (1 << 13) // per_key)), 4
    n = 1 << (n.bit_length() - 1)  # a power of two
    block_n = max(min(n, pow2(max_visible)), floor)
    num_warps = 8 if block_g * block_n * block_d >= 1 << 12 else 4
    return block_g, block_n, block_d, num_warps


def descriptor_decode_tiles(group: int, head_dim: int, page_size: int, max_visible: int) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_N, BLOCK_D, num_warps)`` of the descriptor (TMA) decode
    (:mod:`pagedkv_kernels.decode_descriptors`): :func:`decode_tiles`' with ``BLOCK_N``
    at most a page (a box never straddles two pages; both powers of two, so it divides
    the page). Compiled, 8 warps only above 2**12 product elements, where
    :func:`decode_tiles` takes 8 from 2**12 on: at exactly 2**12 (bf16, group 2, 32 keys,
    head 64, HND, linear window) 8 warps spilled 4 B on sm_90 at 80 registers, 4 warps
    none at 105; at 2**13 4 warps spilled 8 B on sm_80 (bf16, group 8, 8 keys, head
    128), 8 warps none (every specialization of the decode grid under GPU plans,
    measured with Triton 3.9)."""
    block_g, block_n, block_d, num_warps = decode_tiles(group, head_dim, max_visible)
    block_n = min(block_n, page_size)
    if not _interpreter_plans():
        num_warps = 8 if block_g * block_n * block_d > 1 << 12 else 4
    return block_g, block_n, block_d, num_warps


def merge_tiles(num_splits: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_D)`` of the split-KV merge: all splits and the whole head at once."""
    return pow2(num_splits), pow2(head_dim)


# ------------------------------------------------- quantized KV (quant_write.py, quant_decode.py)


def quant_write_tiles(num_tokens: int, num_heads: int, head_dim: int, min_heads: int = 1) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D)`` of a quantizing append: tokens x heads x the whole head
    (``BLOCK_D = next_pow2(head_dim)``, at least 16 so an NVFP4 head splits into blocks of
    16). Interpreted: as :func:`write_tiles`. Compiled: half its budget (about 1024
    elements), as each element keeps its fp32 value, its code and a share of a block's
    amax and scale live at once; untuned, no GPU has measured it yet. ``BLOCK_H`` is at
    least ``min_heads`` (FP8 per token across heads needs every KV head in one program)."""
    block_d = max(pow2(head_dim), 16)
    heads = pow2(num_heads)
    if _interpreter_plans():
        block_h, budget = heads, 2**17
    else:
        block_h, budget = min(heads, max(1, 256 // block_d, pow2(min_heads))), 1024
    block_t = max(1, min(pow2(num_tokens), budget // (block_h * block_d)))
    return block_t, block_h, block_d


def quant_decode_tiles(group: int, head_dim: int, max_visible: int) -> tuple[int, int, int, int]:
    """``(BLOCK_G, BLOCK_N, BLOCK_D, num_warps)`` of a quantized (FP8/NVFP4) decode launch:
    as :func:`decode_tiles` in the interpreter. Compiled, half the budget (2**12
    elements) and always 8 warps, because each element also holds its code, its share
    of a block scale and the dequantized value: the NVFP4 kernel reached 255 registers
    at 2**12 elements and 4 warps (sm_90), and spilled 4 B at 2**13 and 8 warps (sm_80);
    with these sizes its maximum is about 165 registers, no spills."""
    if _interpreter_plans():
        return decode_tiles(group, head_dim, max_visible)
    block_g, block_d = pow2(group), pow2(head_dim)
    n = min(64, max(4, (1 << 12) // (block_g * block_d)))
    n = 1 << (n.bit_length() - 1)  # a power of two
    return block_g, max(min(n, pow2(max_visible)), 4), block_d, 8


# Spills that are not register pressure, measured and allowed by pagedkv_kernels.tools.compile_check
# (any other spill fails it): ptxas spills 4 B on sm_80 in a few NVFP4 decode
# specializations at 64-96 registers, where larger tiles of the same kernel (more
# registers) spill nothing, and the same tiles on sm_90 spill nothing. Likewise 4 B on
# sm_90 in the MHA write with rotary positions of their own (``ROPE_POS``, fused Q) at
# 80 registers (fp16/bf16, tiles 16 x 2 x 32 and 4 x 4 x 128), where the 16 x 2 x 64 tile
# of the same branch takes 108 registers and spills nothing, as do the same tiles on
# sm_80; moving the Q mask or the angles into the branches only moved the 4 B to other
# tiles or to sm_80 (measured with Triton 3.9). (kernel, arch): bytes stored per thread.
PTXAS_SPILL_QUIRKS = {("quant_decode_split_kernel", 80): 4, ("append_kernel", 90): 4}


# ---------------------------------------------------------- prefill (kernels/pagedkv_kernels/prefill.py)


# Compiled prefill tiles ``(BLOCK_M, BLOCK_N, num_warps)`` by product mode and BLOCK_D:
# the largest that kept every recorded specialization on sm_80 and sm_90 under 255
# registers without a spill (pagedkv_kernels.tools.compile_check; registers on sm_80 / sm_90 for the
# bf16 mode, which holds two P tiles, and for fp32). The fp32 mode is an FMA loop
# (tl.dot with input_precision="ieee" has no tensor-core path), so it holds both
# operands and the product in registers and needs tiles about four times smaller.
_PREFILL_TILES = {
    "fp32": {  # 16: 158/128, 32: 216/210, 64: 212/210, 128: 210/210 registers
        16: (32, 32, 4),
        32: (64, 32, 8),
        64: (32, 32, 8),
        128: (16, 16, 8),
        # 256 spills (~700 B per thread) even at 16 x 16, the smallest tile tl.dot takes:
        # an fp32 prefill with heads over 128 wide is correct but slow on a GPU.
        256: (16, 16, 8),
    },
    "16-bit": {  # bf16: 32: 128/111, 64: 171/117, 128: 238/225, 256: 174/171 registers
        16: (64, 64, 4),
        32: (64, 64, 4),
        64: (64, 64, 8),
        128: (32, 32, 4),
        256: (16, 32, 8),
    },
}


def prefill_tiles(
    group: int, head_dim: int, max_rows: int, max_keys: int, dot_mode: str = "sum", gathered: bool = False
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D, num_warps)`` of a prefill launch.

    ``BLOCK_M`` rows of (query, GQA head) pairs of one request and one KV head (the
    group's query heads folded into M, so each K/V tile serves all of them) times
    ``BLOCK_N`` keys per loop iteration; ``BLOCK_D = next_pow2(head_dim)``, masked.
    Every block is at least 16, the smallest ``tl.dot`` a GPU takes. ``max_rows`` is
    the longest request's ``q_len * group``, ``max_keys`` its longest ``seq_len``: no
    tile is made much larger than the work. ``dot_mode`` is the kernel's product mode
    (:func:`pagedkv_kernels.prefill.dot_mode`). ``gathered``: each key tile is gathered from
    vLLM's x-packed key or merged from the cache and the new tokens given apart; compiled,
    such a launch takes at least 8 warps (at 4, the 16-bit 32 x 32 tile of head dim 128
    needed 255 registers and spilled up to 20 B on sm_80 and sm_90; at 8 about 215).

    GPU plans: the table ``_PREFILL_TILES`` above, per mode (``"fp32"`` or the 16-bit
    ``tl.dot`` modes) and head size. Interpreted: up to 128 rows, and as many keys as
    keep the ``[BLOCK_M, BLOCK_N, BLOCK_D]`` products of the interpreter's
    multiply-and-sum path at 2**19 elements (measured about as fast as 2**20, Triton's
    limit), since the interpreter pays mostly per executed ``tl`` operation.
    """
    block_d = max(16, pow2(head_dim))
    if _interpreter_plans():  # [BLOCK_M, BLOCK_N, BLOCK_D] products of 2**19 elements (Triton's limit: 2**20)
        block_m = max(16, min(128, pow2(max_rows)))
        block_n = min(128, max(16, (1 << 19) // (block_m * block_d)))
        num_warps = 4
    else:
        table = _PREFILL_TILES["fp32" if dot_mode in ("fp32", "sum") else "16-bit"]
        block_m, block_n, num_warps = table[min(block_d, 256)]
        num_warps = max(num_warps, 8) if gathered else num_warps
    block_m = max(16, min(block_m, pow2(max_rows)))
    block_n = max(16, min(block_n, pow2(max_keys)))
    return block_m, block_n, block_d, num_warps


# ------------------------------------------------------------ gather (kernels/pagedkv_kernels/gather.py)


def gather_block_t(num_kv_heads: int, head_dim: int, max_len: int) -> int:
    """Tokens per program of the materializing gather (a copy of ``BLOCK_T`` token rows x
    all heads): about 2**12 elements compiled, 2**16 interpreted, a power of two."""
    budget = (1 << 16) if _interpreter_plans() else (1 << 12)
    block_t = max(1, min(pow2(max_len), budget // (pow2(num_kv_heads) * pow2(head_dim))))
    return 1 << (block_t.bit_length() - 1)


# ------------------------------------------------- MLA latent cache (mla_write.py, mla_decode.py)


def mla_append_block_t(num_tokens: int, row_width: int) -> int:
    """Tokens per program of an MLA append (each token one latent row of ``row_width =
    next_pow2(kv_lora_rank) + next_pow2(qk_rope_head_dim)`` lanes): about 2**11 elements
    compiled, 2**17 interpreted, as :func:`write_tiles`."""
    budget = (1 << 17) if _interpreter_plans() else (1 << 11)
    return max(1, min(pow2(num_tokens), budget // pow2(row_width)))


def mla_decode_tiles(num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, max_len: int):
    """``(BLOCK_H, BLOCK_N, BLOCK_R, BLOCK_P, num_warps)`` of the MLA split-KV attention.

    ``BLOCK_H`` heads share each loaded ``c_kv`` / ``k_pe`` tile of ``BLOCK_N`` tokens;
    ``BLOCK_R`` and ``BLOCK_P`` hold a whole latent and RoPE row. The
    ``[BLOCK_H, BLOCK_N, BLOCK_R]`` fp32 products must fit one program: about 2**14
    elements compiled (untuned: no GPU has measured them), 2**19 interpreted (where a
    program's cost is per ``tl`` operation, so few large ones win). Never much wider
    than the longest sequence."""
    block_r, block_p = pow2(kv_lora_rank), pow2(qk_rope_head_dim)
    if _interpreter_plans():
        block_h, budget, cap, floor = min(pow2(num_heads), 32), 1 << 19, 128, 16
    else:
        block_h, budget, cap, floor = min(pow2(num_heads), 16), 1 << 14, 64, 2
    n = min(cap, max(floor, budget // (block_h * block_r)))
    n = 1 << (n.bit_length() - 1)  # a power of two
    block_n = max(min(n, pow2(max_len)), floor)
    num_warps = 8 if block_h * block_n * block_r >= 1 << 14 else 4
    return block_h, block_n, block_r, block_p, num_warps


def head_matvec_tiles(batch: int, in_dim: int, out_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_B, BLOCK_I, BLOCK_O)`` of the per-head projection ``y[b, h] = x[b, h] @ W[h]``:
    ``BLOCK_B`` batch rows share each weight tile of ``BLOCK_I`` inputs x ``BLOCK_O``
    outputs; the input dimension is looped. About 2**13 elements per product compiled
    (at most 64 outputs: 4 x 16 x 128 spilled 72 B on sm_90, 4 x 32 x 64 takes about
    120 registers on sm_80 and sm_90), 2**19 interpreted."""
    if _interpreter_plans():
        block_b, block_o, budget = min(pow2(batch), 16), min(pow2(out_dim), 1024), 1 << 19
    else:
        block_b, block_o, budget = min(pow2(batch), 4), min(pow2(out_dim), 64), 1 << 13
    block_i = max(16, min(pow2(in_dim), budget // (block_b * block_o)))
    return block_b, 1 << (block_i.bit_length() - 1), block_o

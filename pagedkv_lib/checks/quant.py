"""Argument rules of quantized pools (FP8 E4M3 and NVFP4, :mod:`pagedkv_lib.quant`),
shared by the references of :mod:`pagedkv_lib.quant_reference` and the quantized kernels.

A quantized pool is passed whole (a :class:`pagedkv_lib.quant_pool.QuantizedKVPool`);
the shape-only MHA rules (:mod:`.mha`: RoPE, V tails, page tables, queries) are applied
to its ``shape_proxy``, a meta tensor of the logical ``[num_pages, 2, ..., head_dim]``
shape.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lib.checks.scalars import is_number
from pagedkv_lib.checks.shared import check_kv_rows, check_slots, check_window
from pagedkv_lib.formats import csr_slot_mapping, index_tensor
from pagedkv_lib.pool import CacheDims, cache_dims

# kv_dtype -> its scale modes, the default first:
#   fp8 "tensor"           one K and one V scale (pool.global_scale [2])
#   fp8 "token"            amax / 448 per token and head, stored beside the row
#   fp8 "head"             one K and one V scale per KV head (vLLM's per-head k_scale/v_scale,
#                          pool.global_scale [2, num_kv_heads])
#   fp8 "token_all_heads"  vLLM's per-token mode: max(amax / 448, 1e-6) over all heads of a
#                          token, one scale per row (the scale pool's head dim is 1)
#   nvfp4 "block"          global scale = decode multiplier, sf = amax / (6 * gs)
#   nvfp4 "block_encode"   global scale = TensorRT-LLM's / FlashInfer's encode scale,
#                          sf = gs * (amax * (1/6)) (pagedkv_lib.quant states both formulas)
QUANT_FORMATS = {
    "fp8": ("tensor", "token", "head", "token_all_heads"),
    "nvfp4": ("block", "block_encode"),
}
NVFP4_BLOCK = 16  # elements per NVFP4 block scale
FP8_TOKEN_SCALE_FLOOR = 1e-6  # vLLM's per-token mode never stores a smaller scale


def check_global_scale(name: str, value) -> float:
    """A per-tensor scale: return ``value`` rounded to fp32 as a Python float.

    ValueError naming ``name`` unless it is a real number (or a one-element tensor)
    whose fp32 value is finite and > 0, with ``6 * value`` finite too (NVFP4 divides by
    it). A zero, negative, NaN or infinite scale would turn every code into 0, NaN or
    +-max without any error, so it is refused here."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if not is_number(value):
        raise ValueError(f"{name}={value!r} must be a positive finite number")
    as32 = torch.tensor(float(value), dtype=torch.float32)
    if not (math.isfinite(float(value)) and float(as32) > 0 and math.isfinite(float(as32 * 6))):
        raise ValueError(f"{name}={value!r} must be a positive finite number (in fp32, and 6x it finite)")
    return float(as32)


def check_kv_format(kv_dtype, scale_mode=None) -> tuple[str, str]:
    """``(kv_dtype, scale_mode)``: ``kv_dtype`` ``"fp8"`` (``scale_mode`` ``"tensor"``, the
    default, ``"token"``, ``"head"`` or ``"token_all_heads"``) or ``"nvfp4"``
    (``"block"``, the default, or ``"block_encode"``); see :data:`QUANT_FORMATS`."""
    if kv_dtype not in QUANT_FORMATS:
        raise ValueError(f"kv_dtype={kv_dtype!r} must be one of {sorted(QUANT_FORMATS)}")
    modes = QUANT_FORMATS[kv_dtype]
    mode = modes[0] if scale_mode is None else scale_mode
    if mode not in modes:
        raise ValueError(f"scale_mode={scale_mode!r} is not a scale mode of {kv_dtype}; use one of {modes}")
    return kv_dtype, mode


def check_nvfp4_head_dim(head_dim: int) -> None:
    """NVFP4 scales blocks of 16 consecutive features: ``head_dim`` must be a multiple of 16."""
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs head_dim to be a multiple of {NVFP4_BLOCK}, got {head_dim}")


def quant_widths(kv_dtype: str, scale_mode: str, head_dim: int) -> tuple[int, int]:
    """``(data_width, scale_groups)``: bytes of one stored K or V vector (``head_dim``,
    or ``head_dim / 2`` for NVFP4's packed nibbles) and scales per vector (0 per
    tensor or per head, 1 per token (and head), ``head_dim / 16`` per NVFP4 block)."""
    if kv_dtype == "nvfp4":
        return head_dim // 2, head_dim // NVFP4_BLOCK
    return head_dim, 1 if scale_mode in ("token", "token_all_heads") else 0


def scale_pool_shape(data_shape, layout: str, scale_mode: str, groups: int) -> tuple:
    """The shape of a pool's scale tensor beside codes of shape ``data_shape``: the codes'
    ``[num_pages, 2, rows/heads]`` with last dim ``groups``, and the head dim 1 for
    ``"token_all_heads"`` (one scale per token, shared by its heads)."""
    shape = [*data_shape[:4], groups]
    if scale_mode == "token_all_heads":
        shape[3 if layout == "NHD" else 2] = 1
    return tuple(shape)


def global_scale_shape(scale_mode: str, num_kv_heads: int) -> tuple:
    """The shape of ``pool.global_scale``: ``[2, num_kv_heads]`` per head, else ``[2]``."""
    return (2, num_kv_heads) if scale_mode == "head" else (2,)


def check_quant_pool(pool) -> CacheDims:
    """A quantized pool's tensors must agree with its format; return its logical dims
    ``(num_pages, page_size, num_kv_heads, head_dim)``.

    ``pool.data``: uint8, the pool's layout, last dim ``data_width`` (:func:`quant_widths`);
    ``pool.scales``: None per tensor or per head, else :func:`scale_pool_shape`, float32
    per token, uint8 (E4M3 bits) per NVFP4 block; ``pool.global_scale``: float32 ``[2]``
    (K, V), or ``[2, num_kv_heads]`` per head, each finite and > 0.
    """
    kv_dtype, mode = check_kv_format(pool.kv_dtype, pool.scale_mode)
    layout = pool.layout
    dims = cache_dims(pool.data, layout)
    if pool.data.dtype != torch.uint8:
        raise ValueError(f"pool.data.dtype={pool.data.dtype}; quantized codes are stored as uint8")
    head_dim = pool.head_dim
    if kv_dtype == "nvfp4":
        check_nvfp4_head_dim(head_dim)
    width, groups = quant_widths(kv_dtype, mode, head_dim)
    if dims.head_dim != width:
        raise ValueError(
            f"pool.data has last dim {dims.head_dim}; {kv_dtype} stores {width} bytes for head_dim {head_dim}"
        )
    if groups == 0:
        if pool.scales is not None:
            raise ValueError("pool.scales must be None with per-tensor fp8 scales")
    else:
        want_dtype = torch.uint8 if kv_dtype == "nvfp4" else torch.float32
        want_shape = scale_pool_shape(pool.data.shape, layout, mode, groups)
        if not isinstance(pool.scales, torch.Tensor) or tuple(pool.scales.shape) != want_shape:
            got = tuple(pool.scales.shape) if isinstance(pool.scales, torch.Tensor) else pool.scales
            raise ValueError(f"pool.scales has shape {got}; {kv_dtype} ({mode} scales) needs {want_shape}")
        if pool.scales.dtype != want_dtype:
            raise ValueError(f"pool.scales.dtype={pool.scales.dtype}; {kv_dtype} ({mode} scales) needs {want_dtype}")
    gs = pool.global_scale
    want = global_scale_shape(mode, dims.num_kv_heads)
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or tuple(gs.shape) != want:
        raise ValueError(f"pool.global_scale must be a float32 tensor {list(want)} holding the K and V scales")
    if gs.device.type == "meta":
        raise ValueError("pool.global_scale is on the meta device and holds no values")
    for name, values in zip(("k_scale", "v_scale"), gs.reshape(2, -1).tolist()):
        for value in values:
            check_global_scale(f"pool.global_scale ({name})", value)
    return CacheDims(dims.num_pages, dims.page_size, dims.num_kv_heads, head_dim)


def _check_quant_kv(k, v, pool) -> CacheDims:
    """``k, v [num_tokens, num_kv_heads, head_dim]`` float tensors of equal shape, with the
    pool's heads and head_dim (any float dtype: they are quantized on the way in)."""
    dims = check_quant_pool(pool)
    check_kv_rows(k, v, dims, "pool")
    return dims


def check_quant_append_args(k, v, pool, slot_mapping) -> torch.Tensor:
    """Validate a slot-mapping append into a quantized pool; return ``slot_mapping`` as
    host int64. The pool as :func:`check_quant_pool`, ``k, v`` float
    ``[num_tokens, num_kv_heads, head_dim]``, slots as :func:`check_append_args`."""
    dims = _check_quant_kv(k, v, pool)
    slots = index_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {k.shape[0]} tokens")
    check_slots(slots, dims)
    return slots


def check_quant_csr_append_args(k, v, pool, batch_indices, positions, kv_indices, kv_indptr, window=None):
    """Validate a CSR append into a quantized pool; return each token's flat slot as host
    int64 (``-1`` for padding). Rules as :func:`check_csr_append_args`."""
    dims = _check_quant_kv(k, v, pool)
    check_window(window)
    batch = index_tensor("batch_indices", batch_indices, 1)
    if batch.numel() != k.shape[0]:
        raise ValueError(f"batch_indices has {batch.numel()} entries for {k.shape[0]} tokens")
    slots = csr_slot_mapping(batch, positions, kv_indices, kv_indptr, dims.page_size, window, dims.num_pages)
    check_slots(slots, dims, name="the slots of batch_indices/positions")
    return slots

"""The quantized pools' faults (:mod:`pagedkv_lib.quant`): a faulty quantizer, a wrapper
that makes a quantized append write its codes, and the scales of a writer that shares
one global scale between K and V."""

from __future__ import annotations

import math

import torch

from pagedkv_lib import quant
from pagedkv_lib.quant_reference import write_rows
from pagedkv_lib.reference import rope_reference

__all__ = ["nvfp4_quantize_unrounded_scale", "unrounded_block_scale", "shared_kv_scale"]


def nvfp4_quantize_unrounded_scale(x, global_scale):
    """:func:`pagedkv_lib.quant.nvfp4_quantize` with the bug: the codes use ``q_scale = 1
    / (sf * global_scale)`` from the unrounded ``sf``, while the stored block scale is
    still ``fp8(sf)`` (the correct quantizer computes the codes from ``fp8(sf)``)."""
    blocks = quant.nvfp4_blocks(x, global_scale)
    unrounded = torch.where(blocks.has_nan, math.nan, blocks.sf)  # the wrong line: fp8_decode(blocks.sf8)
    return quant.nvfp4_codes(blocks, unrounded), blocks.sf8.view(torch.float8_e4m3fn)


def unrounded_block_scale(quant_append_fn):
    """Wrap a quantized append (slot-mapping form, ``fn(k, v, pool, slot_mapping, ...)``)
    so that the NVFP4 rows it writes hold the codes of a writer with the bug of
    :func:`nvfp4_quantize_unrounded_scale`: the append runs, then its rows are
    re-quantized that way (K rotated by the reference RoPE when ``rope`` is given)."""

    def append(k, v, pool, slot_mapping, *args, **kwargs):
        quant_append_fn(k, v, pool, slot_mapping, *args, **kwargs)
        if pool.kv_dtype != "nvfp4":
            return
        slots = torch.as_tensor(slot_mapping).cpu().long()
        keep = slots >= 0
        page, row = slots[keep] // pool.page_size, slots[keep] % pool.page_size
        k_rows = k.cpu()[keep]
        if kwargs.get("rope"):
            k_rows = rope_reference(
                k_rows, kwargs["positions"].cpu()[keep], kwargs.get("rope_theta", 1e4), kwargs["rope"]
            )
        for kv, x in ((0, k_rows.float()), (1, v.cpu()[keep].float())):
            write_rows(pool, kv, page, row, x, quantizer=nvfp4_quantize_unrounded_scale)

    return append


def shared_kv_scale(k_scale: float, v_scale: float) -> tuple[float, float]:
    """The global scales a writer with the bug uses: V's for both K and V."""
    return v_scale, v_scale

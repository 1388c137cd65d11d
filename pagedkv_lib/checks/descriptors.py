"""The shape rule of a pool read through tensor (TMA) descriptors, page tile by page tile.

A tensor descriptor (Triton's ``tl.make_tensor_descriptor``, CUDA's ``CUtensorMap``)
describes a box the hardware copies with one instruction. Its rules, as Triton and
the Hopper TMA unit state them, fix which pools the descriptor decode
(:mod:`pagedkv_kernels.decode_descriptors`) can read:

* every box dimension is a power of two: a page tile is ``page_size`` rows (or a
  power-of-two part of them) of one head's ``head_dim`` features, so both are powers
  of two;
* a box dimension spans at most 256 elements: ``page_size`` and ``head_dim`` at most 256;
* the contiguous dimension spans at least 16 bytes: ``head_dim * element_size >= 16``
  (8 fp16/bf16 features, 4 fp32).

The descriptor's memory rules (a 16-byte-aligned base, 16-byte-aligned strides, a
contiguous feature dimension) are about where a pool lives, not its shape; the launch
checks them (:func:`pagedkv_kernels.host.validate.check_descriptor_pool`).
"""

from __future__ import annotations

import torch

from pagedkv_lib.indexing import is_power_of_two
from pagedkv_lib.pool import cache_dims

__all__ = ["MAX_BOX_DIM", "MIN_BOX_ROW_BYTES", "check_descriptor_tiles"]

MAX_BOX_DIM = 256  # elements per box dimension (TMA)
MIN_BOX_ROW_BYTES = 16  # bytes in the box's contiguous dimension (TMA; Triton refuses fewer)


def check_descriptor_tiles(cache: torch.Tensor, layout: str = "NHD") -> None:
    """``cache`` (a 5-D pool in ``layout``) must have a page size and a head dim that
    are powers of two of at most :data:`MAX_BOX_DIM`, and rows of at least
    :data:`MIN_BOX_ROW_BYTES` bytes; ValueError naming the rule otherwise."""
    dims = cache_dims(cache, layout)
    for name, value in (("page_size", dims.page_size), ("head_dim", dims.head_dim)):
        if not is_power_of_two(value) or value > MAX_BOX_DIM:
            raise ValueError(
                f"{name}={value}: a tensor-descriptor (TMA) tile has power-of-two sides of at most "
                f"{MAX_BOX_DIM} elements, so the descriptor decode reads pools whose page_size and head_dim "
                "are powers of two up to 256; use paged_decode_attention (or the page-pointer route) for this pool"
            )
    row_bytes = dims.head_dim * cache.element_size()
    if row_bytes < MIN_BOX_ROW_BYTES:
        raise ValueError(
            f"head_dim={dims.head_dim} of {cache.dtype} is {row_bytes} bytes: a tensor-descriptor (TMA) tile's "
            f"contiguous dimension spans at least {MIN_BOX_ROW_BYTES} bytes"
        )

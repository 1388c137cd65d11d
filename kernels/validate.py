"""Launcher validation shared by the write and read kernels.

Every check runs before a launch and raises ValueError naming the argument. The
value checks that a Python reference also needs live in :mod:`pagedkv_lib.reference`
(``check_append_args``, ``check_decode_args``); this module adds what only a launch
needs: devices, strides, index widths and address bounds.
"""

from __future__ import annotations

import torch

from pagedkv_lib import runtime

INT32_MAX = 2**31 - 1


def check_device(name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    """``t`` must live on the backend's device (CUDA compiled, CPU in the interpreter)."""
    want = runtime.device() if device is None else device
    if t.device.type != want.type:
        raise ValueError(f"{name} is on {t.device} but kernels run on {want} ({runtime.BACKEND.name} backend)")


def max_element_offset(t: torch.Tensor) -> int:
    """Largest element offset any index of ``t`` reaches from its data pointer."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))

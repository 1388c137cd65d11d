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


# --------------------------------------------------------------------------- read kernel

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SPLITS = 256  # the split-KV merge loads all of a row's splits at once
MAX_HEAD_DIM = 256  # one head is one register tile of next_pow2(head_dim) lanes


def check_kernel_dtype(name: str, t: torch.Tensor) -> None:
    """``t`` must be fp32, fp16 or bf16 (the kernels compute in fp32; fp64 would be
    silently rounded, so it is refused)."""
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype}; the kernels take float32, float16 or bfloat16")


def check_index_tensor(name: str, t) -> None:
    """An index argument of a launch: an integer torch tensor on the kernels' device
    whose values fit int32 (the kernels index with int32 and widen to int64 only for
    element offsets)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor on {runtime.device()}, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    check_device(name, t)
    if t.numel() and (int(t.max()) > INT32_MAX or int(t.min()) < -INT32_MAX - 1):
        raise ValueError(f"{name} has values outside int32 ({int(t.min())}..{int(t.max())})")


def _check_attention_launch(q, cache, scale, num_splits) -> None:
    for name, t in (("q", q), ("cache", cache)):
        check_device(name, t)
        check_kernel_dtype(name, t)
    if q.shape[1] == 0:
        raise ValueError("q has 0 query heads")
    if not 0 < q.shape[2] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={q.shape[2]} must be in [1, {MAX_HEAD_DIM}]")
    if scale is not None:
        import math

        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scale={scale!r} must be a finite number or None")
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"num_splits={num_splits!r} must be None or an int in [1, {MAX_SPLITS}]")


def check_decode_launch(q, cache, block_tables, seq_lens, *, scale=None, num_splits=None, window=None) -> None:
    """Launch-only checks of the padded decode kernel, after
    :func:`pagedkv_lib.reference.check_decode_args` has checked the values: devices,
    kernel dtypes, int32 index tensors, ``head_dim <= 256``, ``scale``, ``num_splits``
    and the window's type. Raises ValueError naming the argument."""
    from pagedkv_lib.window import RingWindow

    if window is not None and not isinstance(window, RingWindow):
        raise ValueError(f"window must be a RingWindow or None, got {type(window).__name__}")
    check_index_tensor("block_tables", block_tables)
    check_index_tensor("seq_lens", seq_lens)
    _check_attention_launch(q, cache, scale, num_splits)


def check_csr_decode_launch(
    q, cache, kv_indptr, kv_indices, kv_last_page_len, layout="NHD", *, scale=None, num_splits=None
) -> torch.Tensor:
    """All checks of the CSR decode kernel (values and launch); returns the sequence
    lengths ``[batch]`` as int64 on the CPU. Raises ValueError naming the argument."""
    from pagedkv_lib.formats import check_csr, csr_seq_lens
    from pagedkv_lib.pool import cache_dims
    from pagedkv_lib.reference import _check_q

    _check_q(q, cache, layout)
    dims = cache_dims(cache, layout)
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        check_index_tensor(name, t)
    indptr, indices, last = kv_indptr.cpu(), kv_indices.cpu(), kv_last_page_len.cpu()
    check_csr(indptr, indices, last, dims.page_size)
    if indices.numel() and int(indices.max()) >= dims.num_pages:
        i = int(torch.nonzero(indices >= dims.num_pages)[0])
        raise ValueError(f"kv_indices[{i}]={int(indices[i])} is not a page of the pool ({dims.num_pages} pages)")
    if q.shape[0] != last.numel():
        raise ValueError(f"q has {q.shape[0]} rows but kv_last_page_len has {last.numel()} entries")
    _check_attention_launch(q, cache, scale, num_splits)
    return csr_seq_lens(indptr, last, dims.page_size).to(torch.int64)


def check_gather_launch(cache, block_tables, seq_lens) -> None:
    """Launch-only checks of the gather kernel (after
    :func:`pagedkv_lib.reference.check_block_tables`): devices and index tensors."""
    check_device("cache", cache)
    check_index_tensor("block_tables", block_tables)
    check_index_tensor("seq_lens", seq_lens)


def check_window(window) -> None:
    """``window`` must be a :class:`~pagedkv_lib.window.RingWindow` or None (checked
    first: the value checks read its fields)."""
    from pagedkv_lib.window import RingWindow

    if window is not None and not isinstance(window, RingWindow):
        raise ValueError(f"window must be a RingWindow or None, got {type(window).__name__}")

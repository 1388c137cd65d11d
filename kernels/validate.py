"""Launcher validation shared by the write and read kernels.

Every check runs before a launch and raises ValueError naming the argument. The
value checks that a Python reference also needs live in :mod:`pagedkv_lib.reference`
(``check_append_args``, ``check_decode_args``); this module adds what only a launch
needs: devices, strides, index widths and address bounds.
"""

from __future__ import annotations

import torch

from pagedkv_lib import runtime
from pagedkv_lib.formats import csr_slot_mapping

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


# --------------------------------------------------------------------------- write kernel


def check_integer_tensor(name: str, t) -> None:
    """An index argument of the write kernel: an integer torch tensor on the kernels'
    device. Unlike :func:`check_index_tensor` values need not fit int32 (the write
    kernel loads slots as they are and widens every offset to int64)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor on {runtime.device()}, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got dtype {t.dtype}")
    check_device(name, t)


def check_no_self_overlap(name: str, t: torch.Tensor) -> None:
    """A tensor a kernel writes must not reach one element through two indices (an
    expanded view, stride 0), or two programs would race. Sufficient test: with the
    dimensions sorted by stride, each stride exceeds the span of the smaller ones."""
    span = 0
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if stride <= span:
            raise ValueError(
                f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) reaches some elements twice; "
                "a kernel cannot write it"
            )
        span += (size - 1) * stride


def check_in_storage(name: str, t: torch.Tensor) -> None:
    """Every address of ``t`` must lie inside its storage: the kernels compute offsets
    from ``t``'s strides and would write past the allocation otherwise."""
    end = t.storage_offset() + max_element_offset(t)
    if t.numel() and end >= t.untyped_storage().nbytes() // t.element_size():
        raise ValueError(f"{name} reaches element {end} but its storage holds fewer")


def check_append_launch(k, v, cache, layout: str = "NHD", **index_tensors) -> None:
    """Launch-only checks of the write kernel, after
    :func:`pagedkv_lib.reference.check_append_args` has checked the values: devices,
    the kernel dtypes, index tensors, and a cache that can be written (no element
    reached twice, every address inside its storage). Raises ValueError naming the
    argument."""
    for name, t in (("k", k), ("v", v), ("cache", cache)):
        check_device(name, t)
    check_kernel_dtype("cache", cache)
    for name, t in index_tensors.items():
        check_integer_tensor(name, t)
    check_no_self_overlap("cache", cache)
    check_in_storage("cache", cache)
    if k.shape[0] > INT32_MAX:
        raise ValueError(f"k has {k.shape[0]} tokens; token indices must fit int32")


def _cpu_1d(name: str, t, numel: int | None = None) -> torch.Tensor:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} entries for {numel} tokens")
    return t.detach().to("cpu", torch.int64)


def check_csr_append_args(k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout="NHD", window=None):
    """All value checks of the CSR write: the index tensors' shapes, every token on a
    page of its own request (:func:`csr_slot_mapping`), then
    :func:`pagedkv_lib.reference.check_append_args` on the resulting slots (shapes,
    dtypes, slot range, no slot twice). Returns ``(slots, batch_indices, positions)``:
    the slots as int64 on the CPU, the other two unchanged."""
    from pagedkv_lib.pool import cache_dims
    from pagedkv_lib.reference import check_append_args

    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        check_integer_tensor(name, t)
    for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
        check_index_tensor(name, t)
    if isinstance(k, torch.Tensor) and k.dim() and batch_indices.numel() != k.shape[0]:
        raise ValueError(f"batch_indices has {batch_indices.numel()} entries for {k.shape[0]} tokens")
    page_size = cache_dims(cache, layout).page_size
    slots = csr_slot_mapping(batch_indices, positions, kv_indices, kv_indptr, page_size, window)
    check_append_args(k, v, cache, slots, layout)
    return slots, batch_indices, positions


def check_rope_launch(k, cache, layout, rope, positions, rope_theta, q, valid) -> torch.Tensor | None:
    """Checks of the fused RoPE options; returns ``positions`` (None without RoPE).

    ``rope`` is None, ``"neox"`` or ``"gptj"``; with it ``head_dim`` is even,
    ``rope_theta`` a finite number > 1 and ``positions [num_tokens]`` an integer tensor
    on the device, >= 0 where ``valid``. ``q [num_tokens, num_q_heads, head_dim]``
    (fp32/fp16/bf16, rotated in place) needs ``rope``, no element twice, and no memory
    shared with ``cache``."""
    import math

    from pagedkv_lib.pool import cache_dims

    if rope not in (None, "neox", "gptj"):
        raise ValueError(f"rope={rope!r} must be None, 'neox' or 'gptj'")
    if rope is None:
        if q is not None:
            raise ValueError("q is given but rope is None: q is only touched to rotate it")
        return None
    head_dim = cache_dims(cache, layout).head_dim
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, the cache has {head_dim}")
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not math.isfinite(rope_theta):
        raise ValueError(f"rope_theta={rope_theta!r} must be a finite number")
    if rope_theta <= 1:
        raise ValueError(f"rope_theta={rope_theta!r} must be > 1")
    if positions is None:
        raise ValueError("rope needs positions [num_tokens], the tokens' absolute positions")
    check_integer_tensor("positions", positions)
    pos = _cpu_1d("positions", positions, k.shape[0])
    bad = valid.cpu() & (pos < 0)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"positions[{i}]={int(pos[i])} must be >= 0 for a token that is written")
    if q is not None:
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {getattr(q, 'shape', type(q))}")
        if q.shape[0] != k.shape[0] or q.shape[2] != head_dim:
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [{k.shape[0]}, num_q_heads, {head_dim}]")
        check_device("q", q)
        check_kernel_dtype("q", q)
        check_no_self_overlap("q", q)
        if q.numel() and q.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr():
            raise ValueError("q shares memory with cache; it is rotated in place, so it must not")
    return positions


def check_v_tail_args(cache, layout, kv_indptr, kv_indices, kv_last_page_len, written=None):
    """Checks of V-tail zeroing; returns ``(kv_indptr, kv_indices, kv_last_page_len)``.

    A valid CSR page table (:func:`pagedkv_lib.formats.check_csr`) of integer tensors
    on the device, with page ids inside the pool; a last page with a tail appears only
    once in ``kv_indices`` (zeroing it must not erase rows another request reads); and
    no ``written`` slot (``[num_tokens]``, ``-1`` ignored) lies in a tail, where the
    zeroing would erase it. Raises ValueError naming the argument."""
    from pagedkv_lib.formats import check_csr
    from pagedkv_lib.pool import cache_dims

    check_device("cache", cache)
    check_kernel_dtype("cache", cache)
    check_no_self_overlap("cache", cache)
    dims = cache_dims(cache, layout)
    names = ("kv_indptr", "kv_indices", "kv_last_page_len")
    for name, t in zip(names, (kv_indptr, kv_indices, kv_last_page_len)):
        check_index_tensor(name, t)
    indptr, indices, last = (t.detach().to("cpu", torch.int64) for t in (kv_indptr, kv_indices, kv_last_page_len))
    check_csr(indptr, indices, last, dims.page_size)
    if indices.numel() and int(indices.max()) >= dims.num_pages:
        i = int(torch.nonzero(indices >= dims.num_pages)[0])
        raise ValueError(f"kv_indices[{i}]={int(indices[i])} is not a page of the pool ({dims.num_pages} pages)")
    has_tail = (indptr[1:] > indptr[:-1]) & (last < dims.page_size)
    tail_pages = indices[indptr[1:][has_tail] - 1]
    uses = (indices[None, :] == tail_pages[:, None]).sum(1)
    if (uses > 1).any():
        page = int(tail_pages[uses > 1][0])
        raise ValueError(f"kv_indices holds page {page} more than once; its V tail cannot be zeroed")
    if written is not None and tail_pages.numel():
        rows = torch.arange(dims.page_size)
        in_tail = rows[None, :] >= last[has_tail][:, None]
        tail_slots = (tail_pages[:, None] * dims.page_size + rows[None, :])[in_tail]
        hit = torch.isin(written.cpu(), tail_slots)
        if hit.any():
            i = int(torch.nonzero(hit)[0])
            raise ValueError(
                f"token {i} is written to slot {int(written[i])}, inside a V tail that kv_last_page_len zeroes"
            )
    return kv_indptr, kv_indices, kv_last_page_len

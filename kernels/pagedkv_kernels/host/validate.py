"""Launch checks: what only a kernel launch needs, on top of the shared value rules.

The value rules (shapes, dtypes, page ids, lengths, padding, V tails, RoPE options)
live in :mod:`pagedkv_lib.checks` and are called by the references and the kernels
alike. This module adds what a launch alone requires: tensors on the backend's
device, the dtypes the kernels compute in, integer index tensors whose values fit the
kernels' int32 indexing, no written tensor that reaches an element twice or overlaps
the pool, and every address inside its storage. Each check raises ValueError naming
the argument, before anything is launched.
"""

from __future__ import annotations

import torch

from pagedkv_lib import checks, runtime
from pagedkv_lib.cache_layouts import KVCacheView, kv_cache_view

from .launch import cache_fingerprint, fingerprint

__all__ = [
    "INT32_MAX",
    "KERNEL_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_SPLITS",
    "check_device",
    "host_copy",
    "check_kernel_dtype",
    "check_index_tensor",
    "check_write_index",
    "check_head_dim",
    "check_num_splits",
    "max_element_offset",
    "check_no_self_overlap",
    "check_no_overlap",
    "check_disjoint",
    "check_in_storage",
    "check_same_layout",
    "check_same_cache",
    "check_read_launch",
    "check_cache_launch",
    "check_planned_read",
    "check_planned",
    "MAX_KV_LORA_RANK",
    "check_width",
    "check_caches_disjoint",
]

INT32_MAX = 2**31 - 1
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_SPLITS = 256  # the split-KV merge loads all of a row's splits at once
MAX_HEAD_DIM = 256  # one head is one register tile of next_pow2(head_dim) lanes
MAX_KV_LORA_RANK = 1024  # one MLA latent row is one register tile of next_pow2(rank) lanes


def check_device(name: str, t: torch.Tensor) -> None:
    """``t`` must live on the backend's device (CUDA compiled, CPU in the interpreter)."""
    want = runtime.device()
    if t.device.type != want.type:
        raise ValueError(f"{name} is on {t.device} but kernels run on {want} ({runtime.BACKEND.name} backend)")


def host_copy(x):
    """A host copy of ``x`` for the library's value checks (they build CPU index tensors),
    always a copy (``x.cpu()`` of a CPU tensor would be ``x`` itself, and a plan may keep
    what was checked); anything else as it is. A ``meta`` tensor is passed through
    uncopied (it holds no values to copy), so that the value checks refuse it by name
    (:func:`pagedkv_lib.formats.index_tensor`) instead of torch raising
    NotImplementedError."""
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.detach().to("cpu", copy=True)
    return x


def check_kernel_dtype(name: str, t: torch.Tensor) -> None:
    """``t`` must be fp32, fp16 or bf16: the kernels compute in fp32, and float64 would be
    silently rounded, so it is refused (the references take it)."""
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}.dtype={t.dtype}; the kernels take float32, float16 or bfloat16")


def check_index_tensor(name: str, t, fits_int32: bool = True) -> None:
    """An index argument of a launch: an int32 or int64 torch tensor on the kernels'
    device. With ``fits_int32`` its values must fit int32 (the read kernels index
    with int32 and widen to int64 only for element offsets); the write kernel loads
    slots as they are and widens every offset, so its slots need not."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor on {runtime.device()}, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got dtype {t.dtype}")
    check_device(name, t)
    if fits_int32 and t.dtype == torch.int64 and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if hi > INT32_MAX or lo < -INT32_MAX - 1:
            raise ValueError(f"{name} has values outside int32 ({lo}..{hi})")


def check_write_index(index: dict) -> list[tuple[str, torch.Tensor]]:
    """Launch checks of a write's index tensors ``{name: tensor or None}``, in the dict's
    order (:func:`check_index_tensor`; None: absent). The CSR page table (``kv_indptr``,
    ``kv_indices``) must fit int32, as every page table the kernels take; the per-token
    tensors (slots, requests, positions) need not, the write kernels widen them. Returns
    the given ones as ``(name, tensor)`` pairs, for :func:`check_disjoint`."""
    given = [(name, t) for name, t in index.items() if t is not None]
    for name, t in given:
        check_index_tensor(name, t, fits_int32=name in ("kv_indptr", "kv_indices"))
    return given


def check_head_dim(head_dim: int) -> None:
    """One head must fit one register tile of ``next_pow2(head_dim)`` lanes."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")


def check_num_splits(num_splits) -> None:
    """``num_splits`` is None (the heuristic) or an int in ``[1, MAX_SPLITS]``."""
    if num_splits is not None and (not checks.is_int(num_splits) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits={num_splits!r} must be None or an int in [1, {MAX_SPLITS}]")


def max_element_offset(t: torch.Tensor) -> int:
    """Largest element offset any index of ``t`` reaches from its data pointer."""
    if t.numel() == 0:
        return 0
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory that ``t``'s elements may occupy."""
    start = t.data_ptr()
    return start, start + (max_element_offset(t) + 1) * t.element_size()


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


def _shared_bytes(t: torch.Tensor, other: torch.Tensor):
    """The byte ranges of ``t`` and ``other`` when they overlap (same device), else None."""
    if t.numel() == 0 or other.numel() == 0 or t.device != other.device:
        return None
    (a0, a1), (b0, b1) = _byte_range(t), _byte_range(other)
    return ((a0, a1), (b0, b1)) if a0 < b1 and b0 < a1 else None


def check_no_overlap(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """The memory ``t`` spans must not overlap the memory ``other`` spans. Compared as
    byte ranges, not storages: two storages (``torch.from_numpy``, ``from_blob``, an
    arena) can alias the same bytes."""
    if ranges := _shared_bytes(t, other):
        (a0, a1), (b0, b1) = ranges
        raise ValueError(
            f"{name} overlaps the memory of {other_name} (bytes {a0:#x}..{a1:#x} and {b0:#x}..{b1:#x}); "
            f"the kernel writes {other_name if other_name == 'cache' else name}, so they must not share memory"
        )


def check_disjoint(written, read) -> None:
    """No tensor a launch writes may share memory with another it writes or with any it
    reads (a program could overwrite a value a later program still reads, as a global
    scale inside the scale pool would be). ``written`` and ``read`` are sequences of
    ``(name, tensor or None)``; None entries (absent options) are skipped. Reads may
    share memory with each other (``k is v`` is fine)."""
    written = [(n, t) for n, t in written if t is not None]
    read = [(n, t) for n, t in read if t is not None]
    for i, (name, t) in enumerate(written):
        for other_name, other in written[i + 1 :] + read:
            if ranges := _shared_bytes(t, other):
                (a0, a1), (b0, b1) = ranges
                raise ValueError(
                    f"{other_name} overlaps the memory of {name} (bytes {b0:#x}..{b1:#x} and {a0:#x}..{a1:#x}); "
                    f"the kernel writes {name}, so no other argument may share its memory"
                )


def check_in_storage(name: str, t: torch.Tensor) -> None:
    """Every address of ``t`` must lie inside its storage: the kernels compute offsets
    from ``t``'s strides and would write past the allocation otherwise."""
    end = t.storage_offset() + max_element_offset(t)
    if t.numel() and end >= t.untyped_storage().nbytes() // t.element_size():
        raise ValueError(f"{name} reaches element {end} but its storage holds fewer")


def check_same_layout(name: str, t: torch.Tensor, planned: tuple) -> None:
    """``t`` must have the ``(shape, strides, dtype, device)`` a plan was made for:
    page ids and offsets were checked against those, so anything else could address
    memory outside ``t``."""
    got = fingerprint(t)
    if got != planned:
        raise ValueError(
            f"{name} has shape {got[0]}, strides {got[1]}, {got[2]} on {got[3]}; the plan was made for "
            f"shape {planned[0]}, strides {planned[1]}, {planned[2]} on {planned[3]}"
        )


def check_same_cache(cache, planned: tuple) -> None:
    """``cache`` (the pool, or a ``(key_cache, value_cache)`` pair) must be the one a plan
    recorded (:func:`pagedkv_kernels.host.launch.cache_fingerprint`): :func:`check_same_layout` on each
    of its tensors, named ``cache``, ``cache[0]``, ``cache[1]``."""
    if cache_fingerprint(cache) == planned:
        return
    pool_planned = len(planned) == 4  # a pair records two fingerprints
    if isinstance(cache, torch.Tensor) and pool_planned:
        check_same_layout("cache", cache, planned)
    if isinstance(cache, (tuple, list)) and len(cache) == 2 and not pool_planned:
        for i, (t, want) in enumerate(zip(cache, planned)):
            if isinstance(t, torch.Tensor):
                check_same_layout(f"cache[{i}]", t, want)
    what = "the 5-D pool" if pool_planned else "a (key_cache, value_cache) pair"
    raise ValueError(f"cache is not what the plan was made for: {what} of the planned shapes, strides and dtype")


def check_read_launch(tensors: dict, index_tensors: dict, head_dim: int | None = None, num_splits=None) -> None:
    """The launch checks of a read kernel: every tensor of ``tensors`` (name -> tensor) on
    the kernels' device in a kernel dtype, ``head_dim`` (unless None) one register tile,
    ``num_splits`` None or ``1 .. MAX_SPLITS``, and every index tensor an int32/int64
    tensor on the device whose values fit int32."""
    for name, t in tensors.items():
        check_device(name, t)
        check_kernel_dtype(name, t)
    if head_dim is not None:
        check_head_dim(head_dim)
    check_num_splits(num_splits)
    for name, t in index_tensors.items():
        check_index_tensor(name, t)


def check_cache_launch(q, view: KVCacheView, k_new, v_new, index_tensors: dict) -> None:
    """The launch checks of a read over a cache given as the pool or a pair
    (:func:`pagedkv_lib.cache_layouts.kv_cache_view`), with the new tokens' ``k_new`` and
    ``v_new`` given apart or None (:func:`pagedkv_lib.checks.check_new_kv`): every tensor
    on the device in a kernel dtype (named ``cache``, or ``cache[0]`` and ``cache[1]``),
    the index tensors as :func:`check_read_launch` wants them."""
    checks.check_new_kv(k_new, v_new, q, view.dims, view.key.dtype)
    tensors = {"q": q}
    if view.cache_layout == "paged":
        tensors["cache"] = view.key
    else:
        tensors |= {"cache[0]": view.key, "cache[1]": view.value}
    if k_new is not None:
        tensors |= {"k_new": k_new, "v_new": v_new}
    check_read_launch(tensors, index_tensors, q.shape[2])


def check_planned_read(plan, q, cache, k_new, v_new, out) -> KVCacheView:
    """What a ``run_*`` of a read plan (:class:`pagedkv_kernels.prefill.PrefillPlan`) is given must
    be what was planned: ``cache`` (:func:`check_same_cache`), ``q``, ``k_new``/``v_new``
    exactly when the plan has ``new_kv``, and ``out`` (None, or the output's shape in
    ``q``'s dtype, sharing no memory with an input). Returns the cache's view."""
    check_same_cache(cache, plan.cache)
    check_planned("q", q, (plan.total_q, plan.num_q_heads, plan.head_dim), plan.q_dtype)
    view = kv_cache_view(cache, plan.layout)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if plan.new_kv:
            check_planned(name, t, (plan.total_q, plan.num_kv_heads, plan.head_dim), view.key.dtype)
        elif t is not None:
            raise ValueError(f"{name} is given but the plan was made without the new tokens apart")
    if out is not None:
        check_planned("out", out, (plan.total_q, plan.num_q_heads, plan.head_dim), q.dtype)
        read = [("q", q), ("cache[0]", view.key), ("cache[1]", view.value), ("k_new", k_new), ("v_new", v_new)]
        check_disjoint([("out", out)], read)
    return view


def check_planned(name: str, t, shape: tuple, dtype: torch.dtype) -> None:
    """A query given to a ``run_*`` must have the ``shape`` and ``dtype`` its plan was
    made for, on the kernels' device (the tiles and the output were sized for them)."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(getattr(t, 'shape', ()))}; the plan was made for another {name}")
    if t.dtype != dtype:
        raise ValueError(f"{name}.dtype={t.dtype}; the plan was made for {dtype}")
    check_device(name, t)


def check_width(name: str, width: int, limit: int) -> None:
    """A row of ``width`` features must fit one register tile (``limit`` lanes)."""
    if width > limit:
        raise ValueError(f"{name}={width} is wider than one register tile allows ({limit})")


def check_caches_disjoint(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> None:
    """The MLA append writes both caches, so no element may belong to both. Disjoint
    byte ranges pass. Overlapping ranges pass only as two column slices of one
    ``[num_pages, page_size, width]`` buffer (vLLM's layout): the same page and row
    strides, unit feature strides, the latent and RoPE parts side by side, and the
    combined row not reaching into the next one."""
    try:
        check_no_overlap("kpe_cache", kpe_cache, "ckv_cache", ckv_cache)
        return
    except ValueError as err:
        overlap = err
    size = ckv_cache.element_size()
    gap = kpe_cache.data_ptr() - ckv_cache.data_ptr()
    rank, rope = ckv_cache.shape[2], kpe_cache.shape[2]
    delta = gap // size
    side_by_side = (
        ckv_cache.stride()[:2] == kpe_cache.stride()[:2]
        and ckv_cache.stride(2) == 1
        and kpe_cache.stride(2) == 1
        and gap % size == 0
        and (delta >= rank or delta <= -rope)
    )
    if side_by_side:
        width = max(rank, delta + rope) - min(0, delta)
        rows = torch.empty_strided((*ckv_cache.shape[:2], width), (*ckv_cache.stride()[:2], 1), device="meta")
        try:
            check_no_self_overlap("the combined latent rows", rows)
            return
        except ValueError:
            pass
    raise overlap

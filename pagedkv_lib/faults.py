"""Named, switchable faults: the silent bugs of paged KV caches, made reproducible.

A fault is switched on by name, explicitly, where it acts: :mod:`pagedkv_lib.verify`
takes ``faults={"past_len_zero", ...}`` and swaps the one component the fault is
about (the chunk positions, the manager, the table a reader holds, the window a
reader is given, the offset arithmetic) or wraps the callable under test. Nothing is
patched globally, so a fault never leaks into the next cell or test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import get_batch_indices_positions
from .indexing import element_offset
from .manager import KVCacheManager
from .pool import cache_dims
from .window import RingWindow

__all__ = [
    "FAULTS",
    "check_faults",
    "chunk_positions",
    "AbsolutePositionWindow",
    "NoCopyOnWriteManager",
    "minus_one_as_index",
    "element_offset_int32",
    "whole_page_decode",
]

FAULTS: dict[str, str] = {
    "past_len_zero": "chunked prefill writes every chunk from position 0 instead of past_len = cache_len - chunk_len",
    "window_write_only": "the ring mapping is used when writing, but the reader is not given the window",
    "v_tail_not_zeroed": "prefill leaves the unused V rows of each last page as they were (NaN in a poisoned pool)",
    "no_copy_on_write": "a fork shares pages, but a write into a shared page is not preceded by a copy",
    "minus_one_as_index": "a padding slot -1 is used as an index, so the token lands in the pool's last row",
    "stale_block_table": "a reader keeps a block table from before its pages were freed and reused",
    "int32_offset": "element offsets are computed in int32 and wrap on a pool of more than 2**31 elements",
    # added with the prefill kernel (see chunk_local_mask below)
    "chunk_local_mask": "prefill's causal mask compares keys with the query's index in its chunk, not its position",
}


def check_faults(faults) -> frozenset[str]:
    """Return ``faults`` as a frozenset; ValueError names any unknown fault."""
    faults = frozenset(faults or ())
    unknown = sorted(faults - FAULTS.keys())
    if unknown:
        raise ValueError(f"faults={unknown} unknown; known faults: {sorted(FAULTS)}")
    return faults


def chunk_positions(append_indptr, seq_lens, fault: bool = False):
    """``(batch_indices, positions)`` of appended tokens; with ``fault`` every chunk
    starts at position 0 (the forgotten ``past_len``)."""
    batch, positions = get_batch_indices_positions(append_indptr, seq_lens)
    if fault:
        counts = torch.as_tensor(append_indptr)[1:] - torch.as_tensor(append_indptr)[:-1]
        past = (torch.as_tensor(seq_lens) - counts).to(positions.dtype)
        positions = positions - past[batch.long()]
    return batch, positions


@dataclass(frozen=True)
class AbsolutePositionWindow(RingWindow):
    """A reader that forgets the ring: it looks a token up at its absolute position
    (wrapped into the sequence's pages only so that the read stays in bounds) instead
    of :meth:`RingWindow.kv_token_idx`. Give it to a *read*; the write keeps the real
    :class:`RingWindow`. Honoured by the Python references; a kernel that takes only
    the window's numbers (sinks, bubble, cyclic length) keeps the right mapping."""

    def kv_token_idx(self, t):
        return t % self.max_cache_len


class NoCopyOnWriteManager(KVCacheManager):
    """A manager whose forks share pages but whose writes never copy them first."""

    def _needs_copy(self, block: int) -> bool:
        return False


def minus_one_as_index(append_fn, cache_arg: int = 2, slots_arg: int = 3):
    """Wrap an append callable so that padding slots ``-1`` become the pool's last slot,
    as ``cache.view(-1, ...)[slot]`` does with a negative index."""

    def append(*args, **kwargs):
        args = list(args)
        cache, slots = args[cache_arg], args[slots_arg]
        layout = kwargs.get("layout", args[4] if len(args) > 4 else "NHD")
        dims = cache_dims(cache, layout)
        args[slots_arg] = torch.where(slots < 0, slots + dims.num_pages * dims.page_size, slots)
        return append_fn(*args, **kwargs)

    return append


def element_offset_int32(strides, page, kv, head, entry, feat):
    """:func:`pagedkv_lib.indexing.element_offset` evaluated in int32 tensors, which
    wrap silently on overflow exactly as 32-bit GPU index arithmetic does."""
    as32 = [torch.as_tensor(x, dtype=torch.int32) for x in (page, kv, head, entry, feat)]
    return element_offset(tuple(torch.tensor(s, dtype=torch.int32) for s in strides), *as32)


def whole_page_decode(q, cache, block_tables, seq_lens, layout: str = "NHD"):
    """Decode attention that loads every row of every page a sequence names, then gives
    the rows past its end probability 0 (as kernels that load whole pages do). Correct
    only if those rows hold finite values: ``0 * NaN`` is NaN. Float64 result."""
    dims = cache_dims(cache, layout)
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // dims.num_kv_heads
    for b, n in enumerate(torch.as_tensor(seq_lens).tolist()):
        pages = torch.as_tensor(block_tables)[b, : -(-n // dims.page_size)].long().cpu()
        if n == 0:
            continue
        blocks = cache[pages].cpu().double()  # [pages, 2, ...]
        if layout == "HND":
            blocks = blocks.transpose(2, 3)
        k = blocks[:, 0].reshape(-1, dims.num_kv_heads, dims.head_dim).repeat_interleave(group, 1)
        v = blocks[:, 1].reshape(-1, dims.num_kv_heads, dims.head_dim).repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) / dims.head_dim**0.5
        scores[:, n:] = float("-inf")
        probs = torch.softmax(scores, dim=-1)  # exactly 0 past the end
        out[b] = torch.einsum("ht,thd->hd", probs, v)
    return out


# --------------------------------------------------------------------------- prefill
# (added with kernels/prefill.py)

__all__ += ["chunk_local_mask"]


def chunk_local_mask(prefill_fn):
    """Wrap a prefill callable (the signature of ``kernels.paged_prefill_attention``) so
    that query ``i`` of every request sees keys ``0 .. i``: the causal mask of a kernel
    that compares key positions with the query's index inside its chunk instead of its
    absolute position ``seq_len - q_len + i``.

    Modelled by handing the callable ``seq_lens = q_len`` with the same page tables: the
    keys are still read at their true positions, only the limit is the chunk-local
    one. Right for a first chunk (``q_len == seq_len``), which is why tests that only
    prefill whole prompts miss it; wrong for every later chunk, every prefix-cache hit
    and every decode step (query 0 then sees key 0 alone)."""

    def prefill(q, cache, qo_indptr, block_tables, seq_lens, *args, **kwargs):
        indptr = torch.as_tensor(qo_indptr)
        q_lens = (indptr[1:] - indptr[:-1]).to(device=seq_lens.device, dtype=seq_lens.dtype)
        return prefill_fn(q, cache, qo_indptr, block_tables, q_lens, *args, **kwargs)

    return prefill


# =========================================================================== quantized KV
# Two silent bugs of quantized pools (pagedkv_lib.quant), in the one table of faults.

FAULTS |= {
    "nvfp4_unrounded_scale": "NVFP4 codes are computed from the unrounded block scale sf, but fp8(sf) is stored "
    "and read: writer and reader disagree by sf8 / sf (up to 6 %)",
    "shared_kv_scale": "one global scale for K and V (V's): K, whose range is wider after RoPE, saturates at the "
    "format's largest value",
}

__all__ += ["nvfp4_quantize_unrounded_scale", "unrounded_block_scale", "shared_kv_scale"]


def nvfp4_quantize_unrounded_scale(x, global_scale):
    """:func:`pagedkv_lib.quant.nvfp4_quantize` with the bug: ``q_scale = 1 / (sf *
    global_scale)`` from the unrounded ``sf``, while the stored block scale is still
    ``fp8(sf)``."""
    from .quant import nvfp4_quantize

    return nvfp4_quantize(x, global_scale, round_scale=False)


def unrounded_block_scale(quant_append_fn):
    """Wrap a quantized append (slot-mapping form, ``fn(k, v, pool, slot_mapping, ...)``)
    so that the NVFP4 rows it writes hold the codes of a writer with the bug of
    :func:`nvfp4_quantize_unrounded_scale`: the append runs, then its rows are
    re-quantized that way (K rotated by the reference RoPE when ``rope`` is given)."""
    from .quant_reference import write_rows
    from .reference import rope_reference

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

"""The harness's faults: replacement parts and wrappers for the bugs the conformance
harness (:mod:`pagedkv_lab.verify`) switches on by name.

Each is a part the harness swaps in, or a wrapper around the callable under test, for
one case only: nothing is patched globally, so a fault never leaks into the next cell
or test. The registry (names, the wrong line of each) is :mod:`pagedkv_lab.faults`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv_lib.checks import is_int
from pagedkv_lib.formats import PAD, get_batch_indices_positions, index_tensor
from pagedkv_lib.indexing import Index
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.pool import cache_dims
from pagedkv_lib.window import RingWindow

__all__ = [
    "chunk_positions",
    "chunk_positions_from_zero",
    "AbsolutePositionWindow",
    "NoCopyOnWriteManager",
    "minus_one_as_index",
    "element_offset_int32",
    "whole_page_decode",
    "chunk_local_mask",
    "rotary_at_cache_position",
    "tree_mask_ignored",
]


# A copy of pagedkv_lib.formats.get_batch_indices_positions with one line changed (the
# fault past_len_zero), so that notebook 08 shows the correct function and its wrong line.
def chunk_positions_from_zero(append_indptr, seq_lens, nnz: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Request and position ``[nnz]`` (int32) of every appended token.

    ``append_indptr [batch + 1]`` delimits each request's new tokens in the ragged
    batch; ``seq_lens [batch]`` are the lengths after the append, so the new tokens of
    request ``b`` take its last ``append_indptr[b+1] - append_indptr[b]`` positions.
    ``nnz`` (FlashInfer's argument) sizes the output beyond ``append_indptr[-1]``, for a
    padded batch: the tail entries are padding, request ``-1`` at position 0.
    """
    indptr = index_tensor("append_indptr", append_indptr, 1)
    lens = index_tensor("seq_lens", seq_lens, 1)
    if indptr.numel() != lens.numel() + 1:
        raise ValueError(f"append_indptr needs {lens.numel() + 1} entries for {lens.numel()} seq_lens")
    counts = indptr[1:] - indptr[:-1]
    if (counts < 0).any() or (counts > lens).any():
        b = int(torch.nonzero((counts < 0) | (counts > lens))[0])
        raise ValueError(f"request {b} appends {int(counts[b])} tokens but seq_lens[{b}]={int(lens[b])}")
    total = int(counts.sum())
    if nnz is not None and (not is_int(nnz) or nnz < total):
        raise ValueError(f"nnz={nnz!r} must be an int >= the {total} appended tokens")
    batch = torch.repeat_interleave(torch.arange(lens.numel()), counts)
    within = torch.arange(total) - torch.repeat_interleave(indptr[:-1], counts)
    positions = within  # the wrong line: past_len = seq_len - chunk_len forgotten
    pad = (nnz or total) - total
    batch = torch.cat([batch, torch.full((pad,), PAD, dtype=batch.dtype)])
    positions = torch.cat([positions, torch.zeros(pad, dtype=positions.dtype)])
    return batch.to(torch.int32), positions.to(torch.int32)


def chunk_positions(append_indptr, seq_lens, fault: bool = False):
    """``(batch_indices, positions)`` of appended tokens, as the harness's chunked
    scenarios ask for them: the correct ones, or with ``fault`` (``past_len_zero``)
    those of :func:`chunk_positions_from_zero`."""
    builder = chunk_positions_from_zero if fault else get_batch_indices_positions
    return builder(append_indptr, seq_lens)


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
        """A write into ``block`` must go to a private copy: another table (or the prefix
        cache) still reads it."""
        return False


def minus_one_as_index(append_fn, cache_arg: int = 2, slots_arg: int = 3):
    """Wrap an append callable so that padding slots ``-1`` become the pool's last slot,
    as ``cache.view(-1, ...)[slot]`` does with a negative index."""

    def append(*args, **kwargs):
        args = list(args)
        cache, slots = args[cache_arg], args[slots_arg]
        layout = kwargs.get("layout", args[4] if len(args) > 4 else "NHD")
        dims = cache_dims(cache, layout)
        args[slots_arg] = torch.where(slots < 0, slots + dims.num_pages * dims.page_size, slots)  # the wrong line
        return append_fn(*args, **kwargs)

    return append


# A copy of pagedkv_lib.indexing.element_offset with one line changed (the fault
# int32_offset): the strides become int32 tensors, so with integer indices every product
# and sum is 32-bit and wraps silently, as a kernel's int32 index arithmetic does.
def element_offset_int32(
    strides: tuple[int, int, int, int, int],
    page: Index,
    kv: Index,
    head: Index,
    entry: Index,
    feat: Index,
) -> Index:
    """Element offset of ``cache[page, kv, ...]`` from the pool's 5 strides (in elements).

    ``strides`` are ``(stride_page, stride_kv, stride_n, stride_h, stride_d)`` in the
    layout-independent order page, K/V, token row, head, feature, so NHD
    ``[pages, 2, page_size, heads, dim]`` and HND ``[pages, 2, heads, page_size, dim]``
    share one formula: ``page*sp + kv*skv + entry*sn + head*sh + feat*sd``.
    Multiply by the element size for bytes.
    """
    sp, skv, sn, sh, sd = torch.tensor(strides, dtype=torch.int32)  # the wrong line: 32-bit offsets
    return page * sp + kv * skv + entry * sn + head * sh + feat * sd


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
        return prefill_fn(q, cache, qo_indptr, block_tables, q_lens, *args, **kwargs)  # the fault: q_lens

    return prefill


def tree_mask_ignored(prefill_fn):
    """Wrap a prefill callable (the signature of ``kernels.paged_prefill_attention``) so
    that the draft tree's ``tree_mask`` is dropped: every new token of a request then sees
    all earlier new tokens (plain causal), its siblings and cousins included, as in a
    kernel that verifies a draft tree like a chain. Right for chains and plain prefill
    chunks, which is why tests without branching trees miss it."""

    def prefill(*args, tree_mask=None, **kwargs):
        return prefill_fn(*args, **kwargs)  # the fault: tree_mask dropped

    return prefill


def rotary_at_cache_position(append_fn):
    """Wrap a CSR append (the harness's ``rotary_append_fn``) so that it rotates by the
    cache position: the ``rope_positions`` it is given are dropped, as by a write kernel
    that reads its RoPE angle from ``positions``. TensorRT-LLM's speculative-decoding
    offsets, M-RoPE deltas and Helix table are then ignored, and an inactive rank's Q
    (cache position ``-1``) is left unrotated."""

    def append(*args, rope_positions=None, **kwargs):
        return append_fn(*args, **kwargs)  # the fault: rope_positions dropped

    return append

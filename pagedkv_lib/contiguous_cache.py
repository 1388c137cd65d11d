"""The KV caches that came before paging: each sequence's K/V in one contiguous run of rows.

Three ways to keep the keys and values of earlier tokens, and an attention layer that
uses them (the PagedAttention exercise set's sections 2 to 7, built correctly here). Each
one shows a cost that paging removes:

* :class:`SimpleKVCache`: one tensor per (layer, sequence), grown with ``torch.cat`` (as
  Hugging Face's ``DynamicCache``). Nothing is reserved ahead, but every append copies
  the whole history into a new tensor (:attr:`SimpleKVCache.bytes_copied`): a sequence of
  ``n`` tokens grown one at a time copies ``n (n - 1) / 2`` rows.
* :class:`PreallocKVCache`: one pool per layer ``[max_batch, max_seq_len, num_kv_heads,
  head_dim]``, allocated once and written by index (``StaticCache``, FlashAttention's
  ``flash_attn_with_kvcache``): nothing is copied, but every slot reserves
  ``max_seq_len`` rows whether its sequence uses them or not. The write rules are
  :func:`prefill_write`, :func:`append_write` and :func:`decode_write`, on one layer's pool.
* :class:`VariableLengthKVCache`: a batch packed back to back, ``[total_tokens,
  num_kv_heads, head_dim]`` with ``cu_seqlens`` (FlashAttention's varlen format): no
  padding, but no sequence can grow without moving every token after it
  (:attr:`VariableLengthKVCache.bytes_moved`).
* :class:`MHAWithCache`: self-attention that writes its K/V into a cache and reads them
  back (MHA, GQA, MQA). Only ``num_kv_heads`` heads are stored; a query head ``h`` reads KV
  head ``h // group`` through :func:`broadcast_kv_for_gqa`, a view that copies nothing.

Layout: token-major (NHD) like the paged pool: one token's K is a ``[num_kv_heads,
head_dim]`` row. A cache has one float dtype and refuses K/V of another (rather than round
them silently). Lengths and positions count tokens; sizes are bytes. Every method raises
ValueError naming the argument before anything is written.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lib.checks import FLOAT_DTYPES, check_kv_rows, check_positive_int, check_scale, is_int
from pagedkv_lib.pool import CacheDims
from pagedkv_lib.reference import masked_softmax

__all__ = [
    "SimpleKVCache",
    "PreallocKVCache",
    "VariableLengthKVCache",
    "MHAWithCache",
    "prefill_write",
    "append_write",
    "decode_write",
    "broadcast_kv_for_gqa",
    "varlen_attention",
    "full_causal_attention",
]


def _positive(name: str, value) -> int:
    check_positive_int(name, value)
    return value


def _float_dtype(dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {FLOAT_DTYPES}")
    return dtype


def _layer(layer, num_layers: int) -> int:
    if not is_int(layer) or not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer!r} is not a layer of this cache (0..{num_layers - 1})")
    return layer


# --------------------------------------------------------------------------- the dictionary cache


class SimpleKVCache:
    """K/V of each (layer, sequence) as one tensor ``[seq_len, num_kv_heads, head_dim]``,
    grown by ``torch.cat`` at every append.

    ``bytes_copied``: the bytes of history (K and V) that ``torch.cat`` has copied again
    into a new tensor, summed over every append; the new rows themselves are not counted
    (every cache writes them once). ``nbytes``: the bytes held now (nothing is reserved
    ahead). Sequences are created by their first append, under any hashable ``seq_id``.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype=torch.float32, device="cpu") -> None:
        self.num_layers = _positive("num_layers", num_layers)
        self.dims = CacheDims(0, 0, _positive("num_kv_heads", num_kv_heads), _positive("head_dim", head_dim))
        self.dtype, self.device = _float_dtype(dtype), torch.device(device)
        self._kv: list[dict] = [{} for _ in range(num_layers)]  # layer -> seq_id -> (k, v)
        self.bytes_copied = 0

    def append(self, layer, seq_id, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v [n, num_kv_heads, head_dim]`` to ``seq_id`` at ``layer``; return the
        sequence's whole K and V (``[seq_len, num_kv_heads, head_dim]``, the new tensors)."""
        _layer(layer, self.num_layers)
        check_kv_rows(k, v, self.dims, "cache", self.dtype)
        empty = torch.empty((0, *self.dims[2:]), dtype=self.dtype, device=self.device)
        old_k, old_v = self._kv[layer].get(seq_id, (empty, empty))
        self.bytes_copied += old_k.nbytes + old_v.nbytes  # the history torch.cat moves again
        new = (torch.cat([old_k, k.to(self.device)]), torch.cat([old_v, v.to(self.device)]))
        self._kv[layer][seq_id] = new
        return new

    def get(self, layer, seq_id, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[start, end)`` (default: all) of ``seq_id``'s K and V at ``layer``, as views."""
        _layer(layer, self.num_layers)
        if seq_id not in self._kv[layer]:
            raise ValueError(f"seq_id={seq_id!r} has no K/V at layer {layer}")
        k, v = self._kv[layer][seq_id]
        end = k.shape[0] if end is None else end
        if not 0 <= start <= end <= k.shape[0]:
            raise ValueError(f"rows [{start}, {end}) are not inside seq_id={seq_id!r}'s {k.shape[0]} tokens")
        return k[start:end], v[start:end]

    def seq_len(self, seq_id, layer: int = 0) -> int:
        """Tokens ``seq_id`` holds at ``layer`` (0 for a sequence never appended to)."""
        entry = self._kv[_layer(layer, self.num_layers)].get(seq_id)
        return 0 if entry is None else entry[0].shape[0]

    def free_sequence(self, seq_id) -> None:
        """Drop ``seq_id`` at every layer (a sequence never appended to is ignored)."""
        for kv in self._kv:
            kv.pop(seq_id, None)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for kv in self._kv for k, v in kv.values())


# --------------------------------------------------------------------------- the preallocated pool


def check_pool(k_cache, v_cache, seq_lens) -> CacheDims:
    """The write functions' rule for one layer's pool: ``k_cache, v_cache [max_batch,
    max_seq_len, num_kv_heads, head_dim]`` of one float dtype and ``seq_lens`` int64
    ``[max_batch]``. Returns the dims (``num_pages`` is max_batch and ``page_size``
    max_seq_len: each slot is one "page" of the longest sequence)."""
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or pool.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float tensor [max_batch, max_seq_len, num_kv_heads, head_dim]")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache differ in shape or dtype")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int64 or seq_lens.shape != k_cache.shape[:1]:
        raise ValueError(f"seq_lens must be an int64 tensor [max_batch] = [{k_cache.shape[0]}]")
    return CacheDims(*k_cache.shape)


def check_slot(slot, max_batch: int, name: str = "slot") -> int:
    """``slot`` must be an int in ``0 .. max_batch - 1`` (ValueError naming ``name``)."""
    if not is_int(slot) or not 0 <= slot < max_batch:
        raise ValueError(f"{name}={slot!r} is not a slot of the pool (0..{max_batch - 1})")
    return slot


def prefill_write(k_cache, v_cache, seq_lens, slot, k, v) -> None:
    """Start a new sequence in ``slot`` with its prompt: ``k, v [n, num_kv_heads, head_dim]``
    into rows ``0 .. n - 1`` of one layer's pool ``k_cache, v_cache [max_batch, max_seq_len,
    num_kv_heads, head_dim]``; ``seq_lens[slot] = n`` (whatever the slot held before)."""
    dims = check_pool(k_cache, v_cache, seq_lens)
    check_slot(slot, dims.num_pages)
    check_kv_rows(k, v, dims, "pool", k_cache.dtype)
    if k.shape[0] > dims.page_size:
        raise ValueError(f"k holds {k.shape[0]} tokens, more than max_seq_len={dims.page_size}")
    seq_lens[slot] = 0
    append_write(k_cache, v_cache, seq_lens, slot, k, v)


def append_write(k_cache, v_cache, seq_lens, slot, k, v) -> None:
    """Append ``k, v [n, num_kv_heads, head_dim]`` (a decode token, a prompt chunk, drafts)
    to the sequence in ``slot``: rows ``seq_lens[slot] .. seq_lens[slot] + n - 1``, then
    ``seq_lens[slot] += n``."""
    dims = check_pool(k_cache, v_cache, seq_lens)
    check_slot(slot, dims.num_pages)
    check_kv_rows(k, v, dims, "pool", k_cache.dtype)
    start, n = int(seq_lens[slot]), k.shape[0]
    if start + n > dims.page_size:
        raise ValueError(f"slot {slot} holds {start} tokens: {n} more pass max_seq_len={dims.page_size}")
    k_cache[slot, start : start + n] = k
    v_cache[slot, start : start + n] = v
    seq_lens[slot] += n


def decode_write(k_cache, v_cache, seq_lens, slots, k, v) -> None:
    """One decode step: token ``i`` (``k[i], v[i]``, of ``k, v [batch, num_kv_heads,
    head_dim]``) goes to row ``seq_lens[slots[i]]`` of slot ``slots[i]`` (distinct slots, a
    list or int64 tensor), then every ``seq_lens[slots[i]] += 1``; one indexed write."""
    dims = check_pool(k_cache, v_cache, seq_lens)
    slots = torch.as_tensor(slots, dtype=torch.int64).cpu()
    check_kv_rows(k, v, dims, "pool", k_cache.dtype)
    if slots.dim() != 1 or slots.numel() != k.shape[0]:
        raise ValueError(f"slots must name one slot per token of k: {k.shape[0]} slots, got {tuple(slots.shape)}")
    for slot in slots.tolist():
        check_slot(slot, dims.num_pages, "slots[...]")
        if int(seq_lens[slot]) >= dims.page_size:
            raise ValueError(f"slot {slot} is full: it holds max_seq_len={dims.page_size} tokens")
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"slots={slots.tolist()} names a slot twice: two tokens would land in one row")
    rows = seq_lens[slots]
    k_cache[slots, rows] = k
    v_cache[slots, rows] = v
    seq_lens[slots] += 1


class PreallocKVCache:
    """A pool per layer ``[max_batch, max_seq_len, num_kv_heads, head_dim]``, allocated once
    and written by index; a sequence holds one slot (a row of ``max_seq_len`` tokens).

    ``k, v [num_layers, max_batch, max_seq_len, num_kv_heads, head_dim]`` (``k[layer]`` is
    one layer's pool); ``seq_lens`` int64 ``[num_layers, max_batch]``: tokens each slot holds
    at each layer. Each layer keeps its own length (as Hugging Face's ``StaticLayer``), so a
    model's layers, which write one after another, each append at their own first free row.
    ``nbytes`` is what the pool reserves; :meth:`used_bytes` what its sequences hold.
    ``device="meta"`` gives the shapes and bytes without memory.
    """

    def __init__(
        self, num_layers, max_batch, max_seq_len, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"
    ) -> None:
        sizes = dict(num_layers=num_layers, max_batch=max_batch, max_seq_len=max_seq_len)
        sizes.update(num_kv_heads=num_kv_heads, head_dim=head_dim)
        shape = tuple(_positive(name, size) for name, size in sizes.items())
        self.k = torch.zeros(shape, dtype=_float_dtype(dtype), device=device)
        self.v = torch.zeros_like(self.k)
        self.seq_lens = torch.zeros(num_layers, max_batch, dtype=torch.int64)
        self.slot_of: dict = {}  # seq_id -> its slot

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def used_bytes(self) -> int:
        """Bytes of rows holding a token of a live sequence (K and V, every layer)."""
        row = self.k[0, 0, 0].nbytes
        return 2 * row * int(self.seq_lens[:, sorted(self.slot_of.values())].sum())

    def add_sequence(self, seq_id) -> int:
        """Give ``seq_id`` the lowest free slot (length 0 at every layer); return it."""
        if seq_id in self.slot_of:
            raise ValueError(f"seq_id={seq_id!r} already holds slot {self.slot_of[seq_id]}")
        free = [s for s in range(self.max_batch) if s not in self.slot_of.values()]
        if not free:
            raise ValueError(f"no free slot for seq_id={seq_id!r}: all max_batch={self.max_batch} hold a sequence")
        slot = free[0]
        self.slot_of[seq_id] = slot
        self.seq_lens[:, slot] = 0
        return slot

    def free_sequence(self, seq_id) -> None:
        """Give ``seq_id``'s slot back (its rows stay as they are, unreachable)."""
        self.slot(seq_id)
        del self.slot_of[seq_id]

    def slot(self, seq_id) -> int:
        if seq_id not in self.slot_of:
            raise ValueError(f"seq_id={seq_id!r} holds no slot: add_sequence first")
        return self.slot_of[seq_id]

    def seq_len(self, seq_id, layer: int = 0) -> int:
        return int(self.seq_lens[_layer(layer, self.k.shape[0]), self.slot(seq_id)])

    def pool(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache, seq_lens)`` of ``layer``: its pool and lengths (views), as the
        write functions take them."""
        layer = _layer(layer, self.k.shape[0])
        return self.k[layer], self.v[layer], self.seq_lens[layer]

    def prefill(self, layer, seq_id, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`prefill_write` of ``seq_id``'s prompt at ``layer``; returns :meth:`get`."""
        prefill_write(*self.pool(layer), self.slot(seq_id), k, v)
        return self.get(layer, seq_id)

    def append(self, layer, seq_id, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`append_write` of ``n`` tokens at ``layer``; returns :meth:`get`."""
        append_write(*self.pool(layer), self.slot(seq_id), k, v)
        return self.get(layer, seq_id)

    def decode(self, layer, seq_ids, k, v) -> None:
        """:func:`decode_write` of one token per sequence of ``seq_ids`` at ``layer``."""
        decode_write(*self.pool(layer), [self.slot(s) for s in seq_ids], k, v)

    def get(self, layer, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_id``'s K and V at ``layer``, ``[seq_len, num_kv_heads, head_dim]``: views of the pool."""
        slot, n = self.slot(seq_id), self.seq_len(seq_id, layer)
        return self.k[layer, slot, :n], self.v[layer, slot, :n]


# --------------------------------------------------------------------------- the packed batch


def _check_cu_seqlens(name: str, cu, total: int, batch: int | None = None) -> torch.Tensor:
    """``cu`` (int32 or int64) ``[batch + 1]``: 0 first, non-decreasing, ``total`` last."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 tensor [batch + 1]")
    cu = cu.cpu().to(torch.int64)
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries; a batch of {batch} needs {batch + 1}")
    if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu.diff() < 0).any()):
        raise ValueError(f"{name}={cu.tolist()} must start at 0, never decrease and end at {total} tokens")
    return cu


class VariableLengthKVCache:
    """A batch of ``batch_size`` sequences of different lengths, packed back to back per
    layer: ``k[layer], v[layer] [total_tokens, num_kv_heads, head_dim]``, sequence ``b`` in
    rows ``cu_seqlens[layer][b] .. cu_seqlens[layer][b + 1] - 1`` (int32 ``[batch_size + 1]``,
    FlashAttention's varlen convention). No row is padding; reads are views.

    The price: a sequence cannot grow in place (the next one starts right after it), so
    :meth:`append` builds a new packed tensor and moves every row already cached;
    ``bytes_moved`` sums those bytes (K and V) over every append.
    """

    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, dtype=torch.float32, device="cpu") -> None:
        self.dims = CacheDims(0, 0, _positive("num_kv_heads", num_kv_heads), _positive("head_dim", head_dim))
        self.batch_size = _positive("batch_size", batch_size)
        empty = torch.empty((0, num_kv_heads, head_dim), dtype=_float_dtype(dtype), device=device)
        self.k = [empty] * _positive("num_layers", num_layers)
        self.v = [empty] * num_layers
        self.cu_seqlens = [torch.zeros(batch_size + 1, dtype=torch.int32) for _ in range(num_layers)]
        self.bytes_moved = 0

    def append(self, layer, k, v, cu_seqlens_new) -> None:
        """Append a packed batch of new tokens at ``layer``: sequence ``b`` gets rows
        ``cu_seqlens_new[b] .. cu_seqlens_new[b + 1] - 1`` of ``k, v [total_new,
        num_kv_heads, head_dim]`` (possibly none) after its cached ones."""
        _layer(layer, len(self.k))
        check_kv_rows(k, v, self.dims, "cache", self.k[layer].dtype)
        cu_new = _check_cu_seqlens("cu_seqlens_new", cu_seqlens_new, k.shape[0], self.batch_size)
        cu_old = self.cu_seqlens[layer].to(torch.int64)
        cu = cu_old + cu_new
        seq_old = torch.repeat_interleave(torch.arange(self.batch_size), cu_old.diff())
        seq_new = torch.repeat_interleave(torch.arange(self.batch_size), cu_new.diff())
        # old row i of sequence b moves by the new rows of the sequences before b; new row j of
        # b lands after b's old rows
        dest_old = torch.arange(int(cu_old[-1])) + cu_new[seq_old]
        dest_new = torch.arange(k.shape[0]) + cu_old[seq_new + 1]
        for store, new in ((self.k, k), (self.v, v)):
            packed = torch.empty((int(cu[-1]), *self.dims[2:]), dtype=new.dtype, device=store[layer].device)
            packed[dest_old] = store[layer]
            packed[dest_new] = new.to(packed.device)
            self.bytes_moved += store[layer].nbytes
            store[layer] = packed
        self.cu_seqlens[layer] = cu.to(torch.int32)

    def get(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k, v, cu_seqlens)`` of ``layer``: the packed tensors themselves."""
        return self.k[_layer(layer, len(self.k))], self.v[layer], self.cu_seqlens[layer]

    def sequence(self, layer, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s K and V at ``layer``, ``[seq_len, num_kv_heads, head_dim]`` views."""
        check_slot(b, self.batch_size, "b")
        lo, hi = self.cu_seqlens[_layer(layer, len(self.k))][b : b + 2].tolist()
        return self.k[layer][lo:hi], self.v[layer][lo:hi]

    def seq_lens(self, layer: int = 0) -> torch.Tensor:
        """Tokens of each sequence at ``layer``, int64 ``[batch_size]``."""
        return self.cu_seqlens[_layer(layer, len(self.k))].diff().to(torch.int64)


# --------------------------------------------------------------------------- attention over a cache


def broadcast_kv_for_gqa(kv, num_q_heads) -> torch.Tensor:
    """``kv [..., num_kv_heads, head_dim]`` as ``[..., num_kv_heads, group, head_dim]``,
    ``group = num_q_heads // num_kv_heads``: query head ``h`` reads ``out[..., h // group,
    h % group]``, which is KV head ``h // group``. A view (stride 0 along ``group``): it
    copies nothing, whatever ``kv``'s strides (a slice of a pool included).
    ValueError unless ``num_q_heads`` is a positive multiple of ``num_kv_heads``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() < 2:
        raise ValueError("kv must be a tensor [..., num_kv_heads, head_dim]")
    num_kv_heads = kv.shape[-2]
    check_positive_int("num_q_heads", num_q_heads)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    return kv.unsqueeze(-2).expand(*kv.shape[:-1], group, kv.shape[-1])


def _token_positions(cu: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequence, position in it)`` of every packed token, int64 ``[total]`` each."""
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
    return seq.to(device), (torch.arange(int(cu[-1])) - cu[:-1][seq]).to(device)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal: bool = True) -> torch.Tensor:
    """Attention of a packed batch (FlashAttention's ``flash_attn_varlen_func`` convention):
    ``q [total_q, num_q_heads, head_dim]``, ``k, v [total_k, num_kv_heads, head_dim]``,
    sequence ``b``'s rows between ``cu_seqlens_*[b]`` and ``cu_seqlens_*[b + 1]``. Causal
    masks align the last query with the last key (query ``i`` of a sequence with ``n_q``
    queries and ``n_k`` keys sees keys ``0 .. n_k - n_q + i``: the new tokens after a
    cached prefix). Returns ``[total_q, num_q_heads, head_dim]`` in ``q``'s dtype; a query
    that sees no key gets zeros.

    One masked softmax over all packed tokens: a key is visible to a query of the same
    sequence only (a block-diagonal mask built from ``cu_seqlens``), GQA through
    :func:`broadcast_kv_for_gqa`. ``scale`` defaults to ``1 / sqrt(head_dim)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float tensor [tokens, heads, head_dim]")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit one attention")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], cu_q.numel() - 1)
    group = q.shape[1] // k.shape[1]
    kb, vb = broadcast_kv_for_gqa(k, q.shape[1]), broadcast_kv_for_gqa(v, q.shape[1])  # views
    scale = check_scale(scale) or 1.0 / math.sqrt(q.shape[2])
    seq_q, pos_q = _token_positions(cu_q, q.device)
    seq_k, pos_k = _token_positions(cu_k, q.device)
    mask = seq_q[:, None] == seq_k[None, :]
    if causal:  # bottom-right aligned: the queries are the last tokens of their sequence
        offset = (cu_k.diff() - cu_q.diff()).to(q.device)[seq_q]
        mask &= pos_k[None, :] <= (pos_q + offset)[:, None]
    qg = q.reshape(q.shape[0], k.shape[1], group, q.shape[2])
    scores = torch.einsum("qhgd,khgd->hgqk", qg, kb) * scale
    probs = masked_softmax(scores, mask)
    return torch.einsum("hgqk,khgd->qhgd", probs, vb).reshape(q.shape)


class MHAWithCache(torch.nn.Module):
    """Self-attention that carries its KV cache: ``forward(x, seq_ids)`` projects ``x [batch,
    n, d_model]`` (``n`` new tokens of each sequence: a prompt, a chunk or one decode
    token), writes each sequence's K/V into ``cache`` at ``layer``, reads the sequence back
    and attends causally over it. Returns ``[batch, n, d_model]``.

    ``num_heads`` query heads of ``head_dim = d_model // num_heads``; ``num_kv_heads``
    (default ``num_heads``: MHA; fewer: GQA; 1: MQA) K/V heads, the only ones projected and
    stored. ``cache`` is a :class:`PreallocKVCache` (sequences added with
    ``add_sequence`` first) or a :class:`SimpleKVCache`: anything whose ``append(layer,
    seq_id, k, v)`` stores the new rows and returns the sequence's whole K and V.
    """

    def __init__(self, d_model, num_heads, cache, layer: int = 0, num_kv_heads=None, dtype=torch.float32) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if _positive("d_model", d_model) % _positive("num_heads", num_heads):
            raise ValueError(f"d_model={d_model} is not a multiple of num_heads={num_heads}")
        if num_heads % _positive("num_kv_heads", num_kv_heads):
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, d_model // num_heads
        self.cache, self.layer = cache, layer
        kv_width = num_kv_heads * self.head_dim
        self.q_proj = torch.nn.Linear(d_model, d_model, bias=False, dtype=dtype)
        self.k_proj = torch.nn.Linear(d_model, kv_width, bias=False, dtype=dtype)
        self.v_proj = torch.nn.Linear(d_model, kv_width, bias=False, dtype=dtype)
        self.o_proj = torch.nn.Linear(d_model, d_model, bias=False, dtype=dtype)

    def forward(self, x, seq_ids) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.q_proj.in_features:
            raise ValueError(f"x must be [batch, n, d_model={self.q_proj.in_features}]")
        if len(seq_ids) != x.shape[0]:
            raise ValueError(f"seq_ids names {len(seq_ids)} sequences for a batch of {x.shape[0]}")
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim)
        out = torch.stack([self.attend(q[b], k[b], v[b], seq_id) for b, seq_id in enumerate(seq_ids)])
        return self.o_proj(out.reshape(batch, n, -1))

    def attend(self, q, k, v, seq_id) -> torch.Tensor:
        """One sequence: write its new ``k, v [n, num_kv_heads, head_dim]``, then attend with
        ``q [n, num_heads, head_dim]`` over everything it holds."""
        k_all, v_all = self.cache.append(self.layer, seq_id, k, v)  # write first: a token attends to itself
        cu_q, cu_k = torch.tensor([0, q.shape[0]]), torch.tensor([0, k_all.shape[0]])
        return varlen_attention(q, k_all, v_all, cu_q, cu_k)


def full_causal_attention(layer: MHAWithCache, x: torch.Tensor) -> torch.Tensor:
    """The oracle of an :class:`MHAWithCache`: its projections of the whole of ``x [batch,
    n, d_model]`` and one causal ``torch.nn.functional.scaled_dot_product_attention`` over
    them (K/V heads repeated for GQA), without any cache; ``[batch, n, d_model]``, ``x``'s
    dtype. Whatever path a layer served the tokens by, its output must equal this."""
    b, n, _ = x.shape
    q = layer.q_proj(x).view(b, n, layer.num_heads, layer.head_dim).transpose(1, 2)
    k, v = (p(x).view(b, n, layer.num_kv_heads, layer.head_dim).transpose(1, 2) for p in (layer.k_proj, layer.v_proj))
    group = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return layer.o_proj(out.transpose(1, 2).reshape(b, n, -1))

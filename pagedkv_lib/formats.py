"""Batch formats for page tables, and conversions between them (int32 torch tensors).

* padded block table (vLLM): ``block_tables [batch, max_blocks]``, ``-1`` where unused,
  with ``seq_lens [batch]``;
* CSR page table (FlashInfer): ``kv_indptr [batch + 1]``, ``kv_indices [nnz_pages]``,
  ``kv_last_page_len [batch]``; request ``b`` owns pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills ``kv_last_page_len[b]`` rows of
  the last one (``1 <= last <= page_size``; an empty request has no pages and 0);
* ``slot_mapping [num_tokens]`` (vLLM): the flat slot ``page * page_size + offset`` of
  every new token, ``-1`` for padding tokens that must not be written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv_lib.checks.scalars import is_int
from pagedkv_lib.indexing import check_page_size, locate, slot_of
from pagedkv_lib.window import RingWindow

__all__ = [
    "PAD",
    "check_has_values",
    "index_tensor",
    "padding_mask",
    "pad_block_tables",
    "scatter_pages",
    "csr_seq_lens",
    "check_csr_lengths",
    "check_csr",
    "block_table_to_csr",
    "csr_to_block_table",
    "slot_mapping",
    "csr_slot_mapping",
    "get_batch_indices_positions",
]

PAD = -1  # the padding value of block tables, slot mappings, batch indices and positions

_NOT_INTEGER = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool)


def check_has_values(name: str, x) -> None:
    """A ``meta`` tensor holds no values to check: ValueError naming it (torch would raise
    NotImplementedError on the first copy of it)."""
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device and holds no values")


def index_tensor(name: str, x, dims: int) -> torch.Tensor:
    """``x`` (a tensor, list or array of integers) as a ``dims``-D int64 tensor on the host.

    Index bookkeeping stays on the host whatever the pool's device. Raises ValueError
    naming ``name`` for None, non-numbers, floats, bools, complex numbers, tensors on
    the ``meta`` device (they hold no values) and the wrong number of dimensions.
    """
    if x is None:
        raise ValueError(f"{name} is None; expected a {dims}-D integer tensor")
    check_has_values(name, x)
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a {dims}-D integer tensor, got {type(x).__name__}: {err}") from None
    if t.numel() == 0 and not isinstance(x, torch.Tensor):
        t = t.to(torch.int64)  # an empty Python list is an empty index list, not float32
    if t.dtype in _NOT_INTEGER or t.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int64)


def padding_mask(**indices: torch.Tensor) -> torch.Tensor:
    """True where any of the given host index tensors (equal lengths) is ``-1``, the one
    padding value. Any other negative value is a ValueError naming it: treating it as
    padding would silently drop a token whose index was computed wrong."""
    pad = None
    for name, t in indices.items():
        bad = t < PAD
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"{name}[{i}]={int(t[i])} is negative; only -1 marks a padding token")
        pad = (t == PAD) if pad is None else pad | (t == PAD)
    return pad


def pad_block_tables(tables: Sequence[Sequence[int]], max_blocks: int | None = None) -> torch.Tensor:
    """Stack per-sequence page lists into ``[batch, max_blocks]`` int32, padded with ``-1``."""
    width = max((len(t) for t in tables), default=0) if max_blocks is None else max_blocks
    out = torch.full((len(tables), width), PAD, dtype=torch.int32)
    for b, row in enumerate(tables):
        if len(row) > width:
            raise ValueError(f"tables[{b}] has {len(row)} pages, more than max_blocks={width}")
        out[b, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
    return out


def scatter_pages(pages_per_seq: Sequence[int], num_pages: int, generator: torch.Generator) -> list[list[int]]:
    """Disjoint, randomly scattered physical pages for sequences needing
    ``pages_per_seq[b]`` pages each, out of ``num_pages`` (as a long-running allocator
    leaves them): test and harness data whose tables are not simply ``0, 1, 2, ...``."""
    if sum(pages_per_seq) > num_pages:
        raise ValueError(f"pages_per_seq asks for {sum(pages_per_seq)} pages of num_pages={num_pages}")
    order = torch.randperm(num_pages, generator=generator).tolist()
    rows, used = [], 0
    for n in pages_per_seq:
        rows.append(order[used : used + n])
        used += n
    return rows


def check_csr_lengths(kv_indptr, kv_last_page_len, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one length rule of a CSR page table; returns ``(kv_indptr, kv_last_page_len)``
    as host int64 tensors.

    ``kv_indptr [batch + 1]`` starts at 0 and never decreases; a request with pages
    fills ``1 <= kv_last_page_len[b] <= page_size`` rows of its last one, a request
    without pages has ``kv_last_page_len[b] == 0`` (length 0). Raises ValueError naming
    the first violated rule.
    """
    check_page_size(page_size)
    indptr = index_tensor("kv_indptr", kv_indptr, 1)
    last = index_tensor("kv_last_page_len", kv_last_page_len, 1)
    if indptr.numel() != last.numel() + 1:
        raise ValueError(
            f"kv_indptr has {indptr.numel()} entries; kv_last_page_len has {last.numel()}, so "
            f"kv_indptr needs {last.numel() + 1}"
        )
    if indptr[0] != 0:
        raise ValueError(f"kv_indptr[0]={int(indptr[0])} must be 0")
    pages = indptr[1:] - indptr[:-1]
    if (pages < 0).any():
        b = int(torch.nonzero(pages < 0)[0])
        raise ValueError(f"kv_indptr decreases at {b}: {int(indptr[b])} -> {int(indptr[b + 1])}")
    empty_bad = (pages == 0) & (last != 0)
    if empty_bad.any():
        b = int(torch.nonzero(empty_bad)[0])
        raise ValueError(f"kv_last_page_len[{b}]={int(last[b])} for a request with no pages (must be 0)")
    full_bad = (pages > 0) & ((last < 1) | (last > page_size))
    if full_bad.any():
        b = int(torch.nonzero(full_bad)[0])
        raise ValueError(f"kv_last_page_len[{b}]={int(last[b])} must be in [1, page_size={page_size}]")
    return indptr, last


def csr_seq_lens(kv_indptr, kv_last_page_len, page_size: int) -> torch.Tensor:
    """Sequence lengths ``[batch]`` (int32) of a CSR page table:
    ``(pages - 1) * page_size + last_page_len``, and 0 for a request without pages.
    The table must satisfy :func:`check_csr_lengths` (ValueError otherwise)."""
    indptr, last = check_csr_lengths(kv_indptr, kv_last_page_len, page_size)
    pages = indptr[1:] - indptr[:-1]
    return torch.where(pages > 0, (pages - 1) * page_size + last, 0).to(torch.int32)


def check_csr(
    kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a whole CSR page table; return ``(kv_indptr, kv_indices, kv_last_page_len)``
    as host int64 tensors. The lengths follow :func:`check_csr_lengths`;
    ``kv_indptr[-1]`` must equal ``len(kv_indices)``, and every page id must be >= 0
    (and < ``num_pages`` when given). Raises ValueError naming the first violated rule."""
    indptr, last = check_csr_lengths(kv_indptr, kv_last_page_len, page_size)
    indices = index_tensor("kv_indices", kv_indices, 1)
    if indptr[-1] != indices.numel():
        raise ValueError(f"kv_indptr[-1]={int(indptr[-1])} but kv_indices has {indices.numel()} entries")
    bad = indices < 0
    if num_pages is not None:
        bad |= indices >= num_pages
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        pool = f" of the pool ({num_pages} pages)" if num_pages is not None else ""
        raise ValueError(f"kv_indices[{i}]={int(indices[i])} is not a page id{pool}")
    return indptr, indices, last


def block_table_to_csr(block_tables, seq_lens, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded table -> ``(kv_indptr, kv_indices, kv_last_page_len)``.

    Request ``b`` keeps its first ``ceil(seq_lens[b] / page_size)`` table entries;
    each of them must be a page id (not ``-1``).
    """
    check_page_size(page_size)
    table = index_tensor("block_tables", block_tables, 2)
    lens = index_tensor("seq_lens", seq_lens, 1)
    if lens.numel() != table.shape[0]:
        raise ValueError(f"seq_lens has {lens.numel()} entries for {table.shape[0]} block_tables rows")
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    num_pages = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")
    if (num_pages > table.shape[1]).any():
        b = int(torch.nonzero(num_pages > table.shape[1])[0])
        raise ValueError(
            f"seq_lens[{b}]={int(lens[b])} needs {int(num_pages[b])} pages but block_tables has "
            f"{table.shape[1]} columns"
        )
    used = torch.arange(table.shape[1]) < num_pages[:, None]
    indices = table[used]
    if (indices < 0).any():
        b, j = (int(x) for x in torch.nonzero(used & (table < 0))[0])
        raise ValueError(f"block_tables[{b}, {j}]={int(table[b, j])} lies inside seq_lens[{b}]={int(lens[b])}")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(num_pages, 0)
    last = torch.where(lens > 0, lens - (num_pages - 1) * page_size, 0)
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


def csr_to_block_table(
    kv_indptr, kv_indices, kv_last_page_len, page_size: int, max_blocks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR page table -> ``(block_tables [batch, max_blocks], seq_lens [batch])``, int32,
    padded with ``-1``. ``max_blocks`` defaults to the longest request's page count."""
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, page_size)
    rows = [indices[indptr[b] : indptr[b + 1]].tolist() for b in range(indptr.numel() - 1)]
    table = pad_block_tables(rows, max_blocks)
    return table, csr_seq_lens(indptr, last, page_size)


def _window_rows(pos: torch.Tensor, page_size: int, window: RingWindow | None) -> torch.Tensor:
    """Cache rows of positions (the ring's ``kv_token_idx`` with a window)."""
    if window is None:
        return pos
    if not isinstance(window, RingWindow):
        raise ValueError(f"window must be a RingWindow or None, got {type(window).__name__}")
    if window.tokens_per_block != page_size:
        raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={page_size}")
    return window.kv_token_idx(pos)


def slot_mapping(
    block_tables, batch_indices, positions, page_size: int, window: RingWindow | None = None
) -> torch.Tensor:
    """Flat slots ``[num_tokens]`` (int64) of tokens given by request and position.

    ``slot = block_tables[b, block] * page_size + offset`` with
    ``(block, offset) = locate(row, page_size)`` and ``row = position`` (or
    ``window.kv_token_idx(position)`` with a ring window). A token whose batch index or
    position is ``-1`` is padding and maps to ``-1``; any other negative value is a
    ValueError. A real token whose table entry is ``-1`` or beyond the table raises
    ValueError: indexing with ``-1`` would silently hit the last page.
    """
    check_page_size(page_size)
    table = index_tensor("block_tables", block_tables, 2)
    batch = index_tensor("batch_indices", batch_indices, 1)
    pos = index_tensor("positions", positions, 1)
    if batch.numel() != pos.numel():
        raise ValueError(f"batch_indices has {batch.numel()} entries but positions has {pos.numel()}")
    pad = padding_mask(batch_indices=batch, positions=pos)
    if (batch >= table.shape[0]).any():
        i = int(torch.nonzero(batch >= table.shape[0])[0])
        raise ValueError(f"batch_indices[{i}]={int(batch[i])} but block_tables has {table.shape[0]} rows")
    rows = _window_rows(torch.where(pad, 0, pos), page_size, window)
    block, offset = locate(rows, page_size)
    b = torch.where(pad, 0, batch)
    outside = ~pad & (block >= table.shape[1])
    if outside.any():
        i = int(torch.nonzero(outside)[0])
        raise ValueError(
            f"positions[{i}]={int(pos[i])} falls in logical block {int(block[i])} but block_tables has "
            f"{table.shape[1]} columns"
        )
    page = table[b, torch.clamp(block, max=max(table.shape[1] - 1, 0))] if table.shape[1] else b
    missing = ~pad & (page < 0)
    if missing.any():
        i = int(torch.nonzero(missing)[0])
        raise ValueError(
            f"positions[{i}]={int(pos[i])} of request {int(batch[i])} falls in logical block "
            f"{int(block[i])}, whose block_tables entry is -1 (no page allocated)"
        )
    return torch.where(pad, PAD, slot_of(page, offset, page_size))


def csr_slot_mapping(
    batch_indices, positions, kv_indices, kv_indptr, page_size: int, window=None, num_pages: int | None = None
) -> torch.Tensor:
    """Flat slots ``[num_tokens]`` (int64, CPU) of tokens given by request and position
    over a CSR page table, ``-1`` for padding (request or position ``-1``): the host
    twin of the write kernel's CSR addressing, which both the reference and the
    kernel's launcher use to validate a CSR append.

    Raises ValueError naming the argument when a batch index or position is negative
    but not ``-1``, ``kv_indptr`` is not a non-decreasing ``[batch + 1]`` array inside
    ``kv_indices``, a request id is not in ``[0, batch)``, a token's page lies past its
    request's pages, or the page id it lands on is negative (or ``>= num_pages`` when
    given): the message names the ``kv_indices`` entry, not a slot the caller never
    passed.
    """
    check_page_size(page_size)
    batch, pos = index_tensor("batch_indices", batch_indices, 1), index_tensor("positions", positions, 1)
    if pos.numel() != batch.numel():
        raise ValueError(f"positions has {pos.numel()} entries for {batch.numel()} tokens")
    indptr, indices = index_tensor("kv_indptr", kv_indptr, 1), index_tensor("kv_indices", kv_indices, 1)
    if indptr.numel() == 0 or int(indptr[0]) != 0:
        raise ValueError(f"kv_indptr must start with 0, got {indptr[:1].tolist()}")
    if (indptr[1:] < indptr[:-1]).any() or int(indptr[-1]) > indices.numel():
        raise ValueError(f"kv_indptr={indptr.tolist()} must be non-decreasing and end <= {indices.numel()}")
    pad = padding_mask(batch_indices=batch, positions=pos)
    bad = ~pad & (batch >= indptr.numel() - 1)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"batch_indices[{i}]={int(batch[i])} but kv_indptr describes {indptr.numel() - 1} requests")
    b = torch.where(pad, 0, batch)
    block, offset = locate(_window_rows(torch.where(pad, 0, pos), page_size, window), page_size)
    owned = indptr[b + 1] - indptr[b]
    outside = ~pad & (block >= owned)
    if outside.any():
        i = int(torch.nonzero(outside)[0])
        raise ValueError(
            f"positions[{i}]={int(pos[i])} falls in block {int(block[i])} but request {int(batch[i])} "
            f"owns {int(owned[i])} pages in kv_indices"
        )
    entry = torch.where(pad, 0, indptr[b] + block).clamp(max=max(indices.numel() - 1, 0))
    page = indices[entry] if indices.numel() else torch.zeros_like(entry)
    bad = ~pad & ((page < 0) | (page >= (num_pages if num_pages is not None else 2**62)))
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        pool = f" of the pool ({num_pages} pages)" if num_pages is not None else ""
        raise ValueError(
            f"kv_indices[{int(entry[i])}]={int(page[i])} is not a page id{pool}; token {i} "
            f"(request {int(batch[i])}, position {int(pos[i])}) would be written there"
        )
    return torch.where(pad, PAD, slot_of(page, offset, page_size))


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    positions = lens[batch] - counts[batch] + within
    pad = (nnz or total) - total
    batch = torch.cat([batch, torch.full((pad,), PAD, dtype=batch.dtype)])
    positions = torch.cat([positions, torch.zeros(pad, dtype=positions.dtype)])
    return batch.to(torch.int32), positions.to(torch.int32)

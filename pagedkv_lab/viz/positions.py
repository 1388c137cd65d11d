"""Pictures of positions in the pool (notebook 13): the rotary position every written row
was rotated at, against the cache position it is stored at (TensorRT-LLM's three
sources, :mod:`pagedkv_lib.rotary_positions`), and one sequence's speculative step
before and after its rejected drafts are rolled back.

Both draw the pool as a grid, one column per page and one cell per row of a page. Each
picture has a data function that computes what is drawn (a category per row and the
positions written in the cells, a :class:`PoolRows`), so a notebook or a test asserts on
the same numbers the figure shows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch

from pagedkv_lab.viz.style import PALETTE
from pagedkv_lib.formats import get_batch_indices_positions, index_tensor
from pagedkv_lib.indexing import locate

ROTARY_ROWS = {
    0: "free page",
    1: "cached before this step",
    2: "written, rotated at its cache position",
    3: "written, rotated at another position",
    4: "reserved, not written (inactive rank)",
}
_ROTARY_COLORS = ["white", "0.82", PALETTE[4], PALETTE[1], PALETTE[5]]

SPECULATIVE_ROWS = {
    0: "free row",
    1: "earlier tokens",
    2: "last sampled token",
    3: "draft, awaiting verification",
    4: "draft accepted",
    5: "draft rejected, still in the table",
    6: "rolled back: stale K/V in a free slot",
}
_SPECULATIVE_COLORS = ["white", "0.82", PALETTE[0], PALETTE[6], PALETTE[2], PALETTE[3], PALETTE[5]]


class PoolRows(NamedTuple):
    """What :func:`rotary_rows` and :func:`speculative_rows` return, each
    ``[num_pages, page_size]`` int: ``codes`` (a category per row of every page),
    ``cache`` (the cache position the row holds or was reserved for, ``-1`` for none)
    and ``rope`` (the rotary position it was rotated at, ``-1`` where not drawn)."""

    codes: np.ndarray
    cache: np.ndarray
    rope: np.ndarray


def _empty(num_pages: int, page_size: int) -> PoolRows:
    shape = (num_pages, page_size)
    return PoolRows(np.zeros(shape, dtype=int), np.full(shape, -1), np.full(shape, -1))


def _place(rows: PoolRows, pages: Sequence[int], position: int, what: str) -> tuple[int, int]:
    """``(page, row)`` of cache position ``position`` through the page list ``pages``."""
    ps = rows.codes.shape[1]
    if not 0 <= position < len(pages) * ps:
        raise ValueError(f"{what}: cache position {position} is outside its {len(pages)} pages of {ps} rows")
    block, row = locate(position, ps)
    page = int(pages[block])
    if not 0 <= page < rows.codes.shape[0]:
        raise ValueError(f"{what}: page {page} is outside the pool ({rows.codes.shape[0]} pages)")
    return page, row


def rotary_rows(
    num_pages: int, page_size: int, kv_indices, kv_indptr, append_indptr, past_lens, rope_positions, inactive=None
) -> PoolRows:
    """Per row of every page of a pool: a :data:`ROTARY_ROWS` category, the cache
    position it holds and the rotary position it was rotated at, after a CSR append.

    Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``; its first
    ``past_lens[b]`` positions were cached before (drawn with their cache position); its
    appended tokens (``append_indptr [batch + 1]``) sit at cache positions
    ``past_lens[b] + i``, rotated at ``rope_positions [num_tokens]``. ``inactive
    [num_tokens]`` (bool, optional): tokens this rank must not write (a Helix inactive
    rank), drawn on the rows reserved for them. Raises ValueError for a position outside
    its request's pages or a page outside the pool."""
    indices, indptr = index_tensor("kv_indices", kv_indices, 1), index_tensor("kv_indptr", kv_indptr, 1)
    append, past = index_tensor("append_indptr", append_indptr, 1), index_tensor("past_lens", past_lens, 1)
    rope = index_tensor("rope_positions", rope_positions, 1)
    counts = append[1:] - append[:-1]
    batch, cache = get_batch_indices_positions(append, past + counts)
    if rope.numel() != batch.numel():
        raise ValueError(f"rope_positions has {rope.numel()} entries for {batch.numel()} appended tokens")
    skip = torch.zeros(batch.numel(), dtype=torch.bool) if inactive is None else torch.as_tensor(inactive).cpu()
    rows = _empty(num_pages, page_size)
    tables = [indices[int(indptr[b]) : int(indptr[b + 1])].tolist() for b in range(past.numel())]
    for b, n in enumerate(past.tolist()):
        for p in range(n):
            page, row = _place(rows, tables[b], p, f"request {b}")
            rows.codes[page, row], rows.cache[page, row] = 1, p
    for i, (b, p, r) in enumerate(zip(batch.tolist(), cache.tolist(), rope.tolist())):
        page, row = _place(rows, tables[int(b)], int(p), f"token {i}")
        rows.codes[page, row] = 4 if skip[i] else (2 if p == r else 3)
        rows.cache[page, row], rows.rope[page, row] = p, r
    return rows


def speculative_rows(
    num_pages: int,
    page_size: int,
    table: Sequence[int],
    start: int,
    num_drafts: int,
    accepted: int | None = None,
    released: Sequence[int] | None = None,
) -> PoolRows:
    """Per row of every page of a pool: a :data:`SPECULATIVE_ROWS` category and the cache
    position it holds, for one sequence's speculative step.

    ``table``: the sequence's block table; its positions before ``start`` are earlier
    tokens, ``start`` is the last sampled token and the next ``num_drafts`` positions
    are its drafts, all written by the step's forward. ``accepted=None``: before
    verification (every draft awaiting); else the first ``accepted`` drafts are accepted
    and the others rejected. ``released=None``: not rolled back yet; after the rollback,
    pass the shorter table and the pages it released (possibly none), which follow the
    table in position order: the rejected drafts are then drawn rolled back, on a kept
    page or a released one. Raises ValueError for a position outside the pages given, a
    page outside the pool, or ``accepted`` outside ``[0, num_drafts]``."""
    if accepted is not None and not 0 <= accepted <= num_drafts:
        raise ValueError(f"accepted={accepted} must lie in [0, num_drafts={num_drafts}]")
    if released is not None and accepted is None:
        raise ValueError("a rollback (released=...) needs accepted=: which drafts were rejected")
    rows = _empty(num_pages, page_size)
    pages = list(table) + list(released or ())
    rejected = 5 if released is None else 6
    for p in range(start + 1 + num_drafts):
        page, row = _place(rows, pages, p, "the sequence")
        if p <= start:
            code = 1 if p < start else 2
        elif accepted is None:
            code = 3
        else:
            code = 4 if p - start - 1 < accepted else rejected
        rows.codes[page, row], rows.cache[page, row] = code, p
    return rows


def _draw(ax, rows: PoolRows, colors: Sequence[str], title: str, label) -> None:
    """One pool grid on ``ax``: pages as columns, rows of a page downwards, each cell
    coloured by its code and written with ``label(code, cache, rope)`` ("" for none)."""
    norm = BoundaryNorm(np.arange(len(colors) + 1) - 0.5, len(colors))
    ax.imshow(rows.codes.T, aspect="auto", cmap=ListedColormap(colors), norm=norm, interpolation="nearest")
    num_pages, ps = rows.codes.shape
    for x in np.arange(num_pages + 1) - 0.5:
        ax.axvline(x, color="0.35", lw=1.0)
    for y in np.arange(ps + 1) - 0.5:
        ax.axhline(y, color="0.75", lw=0.5)
    for (page, row), code in np.ndenumerate(rows.codes):
        text = label(int(code), int(rows.cache[page, row]), int(rows.rope[page, row]))
        if text:
            ax.text(page, row, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(num_pages))
    ax.set_yticks(range(ps))
    ax.set(title=title, xlabel="page id", ylabel="row in page")
    ax.grid(False)


def _legend(fig, panels: Mapping[str, PoolRows], categories: Mapping[int, str], colors: Sequence[str]) -> None:
    used = sorted(set().union(*(np.unique(r.codes).tolist() for r in panels.values())))
    handles = [Patch(facecolor=colors[k], edgecolor="0.5", label=categories[k]) for k in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), fontsize=9, frameon=False)


def _figure(panels: Mapping[str, PoolRows], title: str, width: float):
    num_pages, ps = next(iter(panels.values())).codes.shape
    height = 0.9 + len(panels) * (0.75 + 0.42 * ps)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, height), squeeze=False)
    fig.suptitle(title, fontsize=12)
    return fig, axes[:, 0]


def _rotary_label(code: int, cache: int, rope: int) -> str:
    if code == 1:
        return str(cache)
    return f"{cache}→{rope}" if code in (2, 3, 4) else ""


def plot_rotary_rows(
    panels: Mapping[str, PoolRows], title: str = "cache position → rotary position of every row written"
):
    """One pool grid per :class:`PoolRows` of :func:`rotary_rows` (its title the key):
    rows cached before show their cache position, rows of this step ``cache→rotary``,
    coloured by :data:`ROTARY_ROWS`; one legend entry per category drawn. Returns the
    figure."""
    num_pages = next(iter(panels.values())).codes.shape[0]
    fig, axes = _figure(panels, title, max(6.0, 0.62 * num_pages + 1.2))
    for ax, (name, rows) in zip(axes, panels.items()):
        _draw(ax, rows, _ROTARY_COLORS, name, _rotary_label)
    _legend(fig, panels, ROTARY_ROWS, _ROTARY_COLORS)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot_speculative_rows(
    panels: Mapping[str, PoolRows], title: str = "a speculative step in the pool (cell: cache position)"
):
    """One pool grid per :class:`PoolRows` of :func:`speculative_rows` (its title the
    key), every row holding a token written with its cache position, coloured by
    :data:`SPECULATIVE_ROWS`; one legend entry per category drawn. Returns the figure."""
    num_pages = next(iter(panels.values())).codes.shape[0]
    fig, axes = _figure(panels, title, max(6.0, 0.4 * num_pages + 1.2))
    for ax, (name, rows) in zip(axes, panels.items()):
        _draw(ax, rows, _SPECULATIVE_COLORS, name, lambda code, cache, rope: str(cache) if code else "")
    _legend(fig, panels, SPECULATIVE_ROWS, _SPECULATIVE_COLORS)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig

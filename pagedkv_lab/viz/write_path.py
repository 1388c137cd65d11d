"""Pictures of the write path's extras (notebook 14): which bytes of a segmented
indexer-K arena a scatter wrote, which rows of a multi-layer pool a block copy moved,
and a two-level pool (primary and secondary blocks) over the steps of an engine run.

Each picture has a data function that computes what is drawn (an integer category per
byte, per row or per step), so a notebook or a test asserts on the same numbers the
figure shows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from pagedkv_lab.viz.style import FAIL_RED, FREE, OK_GREEN, PALETTE, integer_ticks
from pagedkv_lib.block_copy import check_block_copy_args
from pagedkv_lib.compare import bits

# --------------------------------------------------------------------------- indexer-K bytes

INDEXER_BYTES = {
    0: "another layer's block",
    1: "padding between blocks",
    2: "this layer: code area",
    3: "this layer: scale area",
    4: "written: FP8 codes",
    5: "written: fp32 scale",
}
_INDEXER_COLORS = ["0.82", "white", "#CFE3F1", "#F6E2B8", PALETTE[0], PALETTE[1]]


class IndexerByteMap(NamedTuple):
    """What :func:`indexer_byte_map` returns: ``codes`` int ``[num_blocks, row_bytes]``
    (a key of :data:`INDEXER_BYTES` per byte of the arena, one row per block),
    ``segment`` (bytes of one layer's block plus its padding) and ``layer`` (the layer
    written)."""

    codes: np.ndarray
    segment: int
    layer: int


def indexer_byte_map(pool, layer: int, slot_fp8, slot_scale, contiguous: bool = False) -> IndexerByteMap:
    """Per byte of ``pool.arena`` (an :class:`~pagedkv_lib.indexer_cache.IndexerKPool`):
    the region it belongs to, or that a scatter of the given flat slots into layer
    ``layer``'s view writes it. The written bytes are found with torch's own unravelling
    of the view's shape and strides (the reference's rule). ``contiguous=True`` instead
    marks the bytes a kernel that takes the flat index for a memory offset would write
    (right only for a one-layer pool without padding). Padding tokens (``-1``) write
    nothing. Raises ValueError for a byte written outside the arena."""
    view = pool.cache(layer)
    arena = pool.arena
    blocks, layers, segment = arena.shape
    row = layers * segment
    offset = np.arange(blocks * row) % row
    in_block = offset % segment
    codes = np.where(in_block >= pool.block_bytes, 1, np.where(in_block < pool.block_size * pool.head_dim, 2, 3))
    codes = np.where((offset // segment != layer) & (codes != 1), 0, codes)
    base = view.storage_offset() - arena.storage_offset()
    for slots, size, code in ((slot_fp8, pool.head_dim, 4), (slot_scale, 4, 5)):
        starts = torch.as_tensor(slots).cpu().long()
        starts = starts[starts >= 0]
        flat = (starts[:, None] + torch.arange(size)).flatten()
        if flat.numel() and int(flat.max()) >= view.numel():  # torch.unravel_index would wrap it around
            raise ValueError(f"flat index {int(flat.max())} is outside the arena's view ({view.numel()} bytes)")
        if contiguous:
            where = base + flat
        else:
            index = torch.unravel_index(flat, tuple(view.shape))
            where = base + sum(i * s for i, s in zip(index, view.stride()))
        where = where.numpy()
        if where.size and (where.min() < 0 or where.max() >= codes.size):
            raise ValueError(f"a scatter byte lands at {int(where.max())}, outside the arena ({codes.size} bytes)")
        codes[where] = code
    return IndexerByteMap(codes.reshape(blocks, row), segment, layer)


INDEXER_ROW_INCHES = 0.3
"""Height of one block's row in :func:`plot_indexer_bytes` (30 px at the suite's 100 dpi)."""
INDEXER_STRAY_LABEL = "outlined: written outside this layer's segments"


def _stray_runs(byte_map: IndexerByteMap) -> list[tuple[int, int, int]]:
    """``(block, first byte, length)`` of each run of written bytes that lies outside the
    segments of the layer ``byte_map`` was meant to write (none for a one-layer arena)."""
    codes = byte_map.codes
    stray = (codes >= 4) & ((np.arange(codes.shape[1]) // byte_map.segment) != byte_map.layer)[None, :]
    runs = []
    for block, row in enumerate(stray):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        runs += [(block, int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
    return runs


def _draw_byte_panel(ax, name: str, byte_map: IndexerByteMap, cmap, norm) -> int:
    """One arena panel of :func:`plot_indexer_bytes`; returns how many stray runs it outlined."""
    codes = byte_map.codes
    ax.imshow(codes, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    for r in range(1, codes.shape[0]):  # a white rule between blocks, so each row reads as one block
        ax.axhline(r - 0.5, color="white", lw=1.5)
    for s in range(byte_map.segment, codes.shape[1], byte_map.segment):
        ax.axvline(s - 0.5, color="k", ls="--", lw=0.8)
    if codes.shape[1] > byte_map.segment:
        above = ax.get_xaxis_transform()  # x in bytes, y in axes fraction
        for i, s in enumerate(range(0, codes.shape[1], byte_map.segment)):
            ax.text(s + byte_map.segment / 2, 1.02, f"layer {i}", ha="center", va="bottom", transform=above)
    runs = _stray_runs(byte_map)
    for block, start, length in runs:
        ax.add_patch(Rectangle((start - 0.5, block - 0.45), length, 0.9, fill=False, ec=FAIL_RED, lw=2.5))
    ax.set_title(name, pad=16)
    ax.set(xlabel="byte within the block's row of the arena (bytes)", ylabel="block")
    ax.set_yticks(range(codes.shape[0]))
    ax.grid(False)
    return len(runs)


def plot_indexer_bytes(panels: Mapping[str, IndexerByteMap], title: str = "indexer-K arena: bytes a scatter wrote"):
    """One panel per :class:`IndexerByteMap` (its title the key): every byte of the arena
    as a cell (x: byte within the block's row of the arena, y: block, each row
    :data:`INDEXER_ROW_INCHES` tall), coloured by its :data:`INDEXER_BYTES` category, with a
    dashed line between layers' segments and a red outline around written bytes outside
    the segments of the layer meant (:data:`INDEXER_STRAY_LABEL`). Returns the figure."""
    rows = [m.codes.shape[0] for m in panels.values()]
    heights = [INDEXER_ROW_INCHES * r + 1.1 for r in rows]  # + title, layer names and x axis
    fig, axes = plt.subplots(len(panels), 1, figsize=(9.0, 1.2 + sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": [INDEXER_ROW_INCHES * r for r in rows]})  # fmt: skip
    cmap = ListedColormap(_INDEXER_COLORS)
    norm = BoundaryNorm(np.arange(len(_INDEXER_COLORS) + 1) - 0.5, len(_INDEXER_COLORS))
    used: set[int] = set()
    strays = 0
    for ax, (name, byte_map) in zip(axes[:, 0], panels.items()):
        used |= set(np.unique(byte_map.codes).tolist())
        strays += _draw_byte_panel(ax, name, byte_map, cmap, norm)
    handles = [Patch(facecolor=_INDEXER_COLORS[k], edgecolor="0.5", label=INDEXER_BYTES[k]) for k in sorted(used)]
    if strays:
        handles.append(Patch(facecolor="none", edgecolor=FAIL_RED, lw=2.5, label=INDEXER_STRAY_LABEL))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=10, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.8 / (1.2 + sum(heights)), 1, 1))  # 0.8 in: the legend's 3 rows
    return fig


# --------------------------------------------------------------------------- block copy rows

COPY_ROWS = {
    0: "untouched",
    1: "source rows (read)",
    2: "copied: equal to the source row",
    3: "kept: past num_tokens, unchanged",
    4: "wrong: differs from what it should hold",
}
_COPY_COLORS = [FREE, "#CFE3F1", OK_GREEN, "#F6E2B8", FAIL_RED]


def block_copy_rows(
    before, after, src_blocks, dst_blocks, num_tokens, layout: str = "NHD", dst_before=None, dst_after=None
) -> np.ndarray:
    """Per row of a multi-layer pool after a block copy: ``[num_layers, num_pages, 2 *
    page_size]`` ints (K rows, then V rows), keys of :data:`COPY_ROWS`, judged bit for bit
    against ``before``. For a copy into a second pool give its ``dst_before`` and
    ``dst_after``: the map is then of the destination pool, and source rows are not
    marked. Arguments as :func:`pagedkv_lib.block_copy.copy_blocks`."""
    src, dst, tokens = check_block_copy_args(before, src_blocks, dst_blocks, num_tokens, layout, dst_before)

    def rows(t):
        t = t.detach().cpu()
        if layout == "HND":
            t = t.transpose(3, 4)
        return bits(t).flatten(4)  # [layers, pages, 2, page_size, heads * dim]

    old, new = rows(before), rows(after)
    d_old, d_new = (old, new) if dst_before is None else (rows(dst_before), rows(dst_after))
    layers, pages, _, page_size, _ = d_old.shape
    status = np.where((d_new == d_old).all(-1).numpy(), 0, 4)
    for s, d, n in zip(src.tolist(), dst.tolist(), tokens.tolist()):
        if dst_before is None:
            status[:, s, :, :n] = np.where(status[:, s, :, :n] == 0, 1, status[:, s, :, :n])
        same = (d_new[:, d, :, :n] == old[:, s, :, :n]).all(-1).numpy()
        status[:, d, :, :n] = np.where(same, 2, 4)
        kept = (d_new[:, d, :, n:] == d_old[:, d, :, n:]).all(-1).numpy()
        status[:, d, :, n:] = np.where(kept, 3, 4)
    return status.reshape(layers, pages, 2 * page_size)


def plot_block_copy(status: np.ndarray, title: str = "block copy: rows of every layer"):
    """One panel per layer of a :func:`block_copy_rows` map: x the page, y its K rows then
    its V rows (row 0 at the top), each cell coloured by its :data:`COPY_ROWS` category.
    Returns the figure."""
    status = np.asarray(status)
    layers, pages, rows = status.shape
    fig, axes = plt.subplots(
        1, layers, figsize=(min(1.6 + 1.3 * layers * max(pages, 2) / 2, 11.0), 3.6), squeeze=False, sharey=True
    )
    cmap = ListedColormap(_COPY_COLORS)
    norm = BoundaryNorm(np.arange(len(_COPY_COLORS) + 1) - 0.5, len(_COPY_COLORS))
    for layer, ax in enumerate(axes[0]):
        ax.imshow(status[layer].T, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.axhline(rows / 2 - 0.5, color="k", lw=1.0)
        ax.set(title=f"layer {layer}", xlabel="page")
        ax.set_xticks(range(pages))
        ax.set_yticks(range(rows), [f"{'KV'[r // (rows // 2)]} {r % (rows // 2)}" for r in range(rows)], fontsize=8)
        ax.grid(False)
    axes[0, 0].set_ylabel("row in page (K rows, then V rows)")
    used = sorted(set(np.unique(status).tolist()))
    handles = [Patch(facecolor=_COPY_COLORS[k], edgecolor="0.5", label=COPY_ROWS[k]) for k in used]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    return fig


# --------------------------------------------------------------------------- a two-level pool


class PoolLevels(NamedTuple):
    """Blocks of a two-level pool at one moment (:func:`pool_levels`): primary blocks
    named by a live block table, primary blocks held only by the prefix cache, free
    primary blocks; secondary blocks holding an offloaded block, free secondary blocks."""

    in_use: int
    cached: int
    free: int
    secondary_used: int
    secondary_free: int


def pool_levels(manager) -> PoolLevels:
    """The :class:`PoolLevels` of a :class:`~pagedkv_lib.manager.KVCacheManager` now
    (secondary counts 0 without a secondary pool)."""
    named = {b for s in manager.sequences for b in manager.block_table(s)}
    cache = manager.prefix_cache
    cached = len(cache.evictable_blocks()) if cache is not None else 0
    sec = manager.secondary
    used, free = (len(sec), sec.num_free) if sec is not None else (0, 0)
    return PoolLevels(len(named), cached, manager.num_free, used, free)


def plot_pool_levels(
    levels: Sequence[PoolLevels],
    events: Mapping[str, Sequence[int]] | None = None,
    title: str = "a two-level pool over the run",
):
    """Two stacked bar charts over the steps (one bar per step): the primary pool's blocks
    in use, cached only and free, and the secondary pool's used and free blocks.
    ``events`` maps a label (e.g. "restore") to the steps where it happened, marked
    with a marker above the bars of both panels. Returns the figure."""
    data = np.asarray(levels, dtype=int).reshape(-1, 5)
    steps = np.arange(len(data))
    fig, axes = plt.subplots(2, 1, figsize=(8.0, 5.2), sharex=True, height_ratios=(3, 2))
    parts = [
        (
            axes[0],
            [(0, "in use by a request", PALETTE[0]), (1, "cached only (evictable)", PALETTE[4]), (2, "free", FREE)],
            "primary pool",
        ),
        (axes[1], [(3, "holding an offloaded block", PALETTE[1]), (4, "free", FREE)], "secondary pool"),
    ]
    markers = [("v", PALETTE[3]), ("^", PALETTE[2]), ("D", PALETTE[5]), ("s", PALETTE[7])]
    for ax, columns, name in parts:
        bottom = np.zeros(len(data))
        for col, label, color in columns:
            ax.bar(steps, data[:, col], bottom=bottom, color=color, edgecolor="0.5", width=0.85, label=label)
            bottom += data[:, col]
        top = int(bottom.max()) if len(bottom) else 0
        for i, (label, at) in enumerate((events or {}).items()):
            at = list(at)
            marker, color = markers[i % len(markers)]
            ax.plot(at, [top + 0.6 + 0.8 * i] * len(at), marker, color=color, ls="none", label=label)
        ax.set(ylabel="blocks", title=f"{name} ({top} blocks)")
        ax.set_ylim(0, top + 1.0 + 0.8 * len(events or {}))
        integer_ticks(ax, steps, data)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    axes[1].set_xlabel("engine step")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return fig


def plot_offload_cost(runs: Mapping[str, tuple[int, int]], title: str = "offload: bytes moved vs tokens recomputed"):
    """Two bar panels, one bar per run: prompt tokens computed by prefill (tokens) and
    bytes moved between the two levels (MiB). ``runs`` maps a label to ``(prefill
    tokens, bytes moved)``; each bar has its value written on it. Returns the figure."""
    labels = list(runs)
    tokens = [int(runs[k][0]) for k in labels]
    mib = [runs[k][1] / 2**20 for k in labels]
    fig, axes = plt.subplots(1, 2, figsize=(8.0, 3.4))
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(labels))]
    for ax, values, ylabel, fmt in (
        (axes[0], tokens, "prefill tokens computed (tokens)", "{:d}"),
        (axes[1], mib, "moved between levels (MiB)", "{:.2f}"),
    ):
        bars = ax.bar(labels, values, color=colors, edgecolor="0.4")
        for bar, v in zip(bars, values):
            ax.annotate(
                fmt.format(v),
                (bar.get_x() + bar.get_width() / 2, v),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=10,
            )
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max(max(values), 1e-9) * 1.2)
        ax.grid(axis="x", visible=False)
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title("prefill: prompt tokens computed")
    axes[1].set_title("offload and restore: bytes copied")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return fig

"""Pictures of the bookkeeping (notebooks 02-05): which sequence owns each page, a block
table's arrows to physical pages, where a layout puts each element, a ring window's rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from pagedkv_lab.viz.style import FREE, PALETTE, SHARED, sequence_colors
from pagedkv_lib.pool import cache_dims, cache_strides


def occupancy(manager, order: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per page of a :class:`KVCacheManager`: ``owner`` (index of the owning sequence in
    ``order``, default ``manager.sequences``; ``-1`` free, ``-2`` shared by several) and
    ``rows`` (token rows filled, 0..page_size)."""
    order = manager.sequences if order is None else order
    owner = np.full(manager.num_blocks, -1)
    rows = np.zeros(manager.num_blocks, dtype=int)
    ps = manager.page_size
    for seq_id in manager.sequences:
        i = order.index(seq_id)
        table, n = manager.block_table(seq_id), manager.seq_len(seq_id)
        used_rows = n if manager.window is None else manager.window.cache_len(n)
        for j, page in enumerate(table):
            owner[page] = i if owner[page] in (-1, i) else -2
            rows[page] = max(rows[page], min(ps, used_rows - j * ps))
    return owner, rows


def _draw_occupancy(ax, manager, title: str, columns: int, order: list) -> None:
    owner, rows = occupancy(manager, order)
    colors = sequence_colors(order)
    n = manager.num_blocks
    nrows = -(-n // columns)
    for page in range(n):
        r, c = divmod(page, columns)
        y = nrows - 1 - r
        ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor=FREE, edgecolor="0.6"))
        if owner[page] != -1:
            shared = owner[page] == -2
            color, hatch = (SHARED, "//") if shared else colors[order[owner[page]]]
            height = 0.92 * rows[page] / manager.page_size
            ax.add_patch(Rectangle((c, y), 0.92, height, facecolor=color, hatch=hatch, edgecolor="0.25"))
        ax.text(c + 0.46, y + 0.46, str(page), ha="center", va="center", fontsize=10, color="0.15")
    present = [s for s in order if s in manager.sequences]
    handles = [Patch(facecolor=colors[s][0], hatch=colors[s][1], edgecolor="0.25", label=str(s)) for s in present]
    if (owner == -2).any():
        handles.append(Patch(facecolor=SHARED, hatch="//", edgecolor="0.25", label="shared"))
    handles.append(Patch(facecolor=FREE, edgecolor="0.6", label="free"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, handlelength=1.2)
    ax.set(xlim=(0, columns), ylim=(0, nrows))
    ax.set_title(title)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_occupancy(manager, title: str = "pool occupancy", columns: int = 16, order: list | None = None):
    """The pool as a grid of pages coloured by owning sequence; the filled fraction of
    each page is the coloured height, so partial last pages show. Shared pages hatched
    grey. Pass the same ``order`` (every sequence that ever appears) to every view of one
    story, so a sequence keeps its colour."""
    return plot_occupancy_steps([manager], [title], columns, order)


def plot_occupancy_steps(managers, titles, columns: int = 16, order: list | None = None):
    """:func:`plot_occupancy` for several snapshots side by side (two per row); a
    sequence keeps its colour across snapshots (and across figures given one ``order``)."""
    if order is None:
        order = list(dict.fromkeys(s for m in managers for s in m.sequences))
    nrows_pool = -(-managers[0].num_blocks // columns)
    per_row = 1 if len(managers) == 1 else 2
    grid_rows = -(-len(managers) // per_row)
    width = per_row * (0.55 * columns + 1.3)
    height = grid_rows * (0.55 * nrows_pool + 0.6)
    fig, axes = plt.subplots(grid_rows, per_row, figsize=(width, height), squeeze=False)
    for ax, manager, title in zip(axes.flat, managers, titles):
        _draw_occupancy(ax, manager, title, columns, order)
    for ax in list(axes.flat)[len(managers) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_block_table(
    tables: Mapping[str, Sequence[int]], num_pages: int, title: str = "block tables", order: list | None = None
):
    """Logical blocks of each sequence (left) with arrows to the physical pages they name
    (right); each page box takes its owner's colour, so a glance pairs both sides. A page
    named by more than one sequence (shared, e.g. after a fork) is grey and hatched,
    labelled with its sequences, and gets a legend entry."""
    colors = sequence_colors(list(tables) if order is None else order)
    rows = sum(len(t) for t in tables.values()) + 0.5 * (len(tables) - 1)
    height = max(rows, num_pages)
    fig, ax = plt.subplots(figsize=(7.0, 0.9 + 0.42 * height))
    owner: dict[int, list[str]] = {}
    y = 0.0
    for name, table in tables.items():
        color, hatch = colors[name]
        for j, page in enumerate(table):
            owner.setdefault(page, []).append(name)
            ax.add_patch(Rectangle((0.2, y - 0.38), 1.4, 0.76, facecolor=color, hatch=hatch, edgecolor="0.25"))
            ax.text(0.9, y, f"{name}[{j}]", ha="center", va="center", fontsize=11, color="white", weight="bold")
            ax.annotate(
                "",
                xy=(3.4, page),
                xytext=(1.62, y),
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": 2.0, "mutation_scale": 18, "shrinkB": 2},
            )
            y += 1
        y += 0.5
    shared = sorted(p for p, names in owner.items() if len(set(names)) > 1)
    for page in range(num_pages):
        names = sorted(set(owner.get(page, [])), key=list(tables).index)
        face, hatch = (SHARED, "//") if len(names) > 1 else colors[names[0]] if names else (FREE, None)
        ax.add_patch(Rectangle((3.4, page - 0.38), 1.6, 0.76, facecolor=face, hatch=hatch, edgecolor="0.25"))
        label = f"page {page} ({', '.join(names)})" if len(names) > 1 else f"page {page}"
        ax.text(4.2, page, label, ha="center", va="center", fontsize=11, color="white" if names else "k",
                bbox={"facecolor": SHARED, "edgecolor": "none", "pad": 1} if len(names) > 1 else None)  # fmt: skip
    if shared:
        handle = Patch(facecolor=SHARED, hatch="//", edgecolor="0.25", label="shared: named by several sequences")
        ax.legend(handles=[handle], loc="upper center", bbox_to_anchor=(0.5, 0.02), frameon=False, fontsize=10)
    ax.text(0.9, -1.0, "logical block", ha="center", va="center", fontsize=11, style="italic")
    ax.text(4.2, -1.0, "physical page", ha="center", va="center", fontsize=11, style="italic")
    ax.set(xlim=(0, 5.2), ylim=(height - 0.4, -1.5), title=title)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_address_map(cache: torch.Tensor, layout: str, page: int = 0, kv: int = 0, title: str | None = None):
    """Element offset of feature 0 of every (token row, head) of one page: NHD puts one
    token's heads side by side, HND one head's rows."""
    dims = cache_dims(cache, layout)
    sp, skv, sn, sh, _ = cache_strides(cache, layout)
    offsets = np.array(
        [
            [page * sp + kv * skv + entry * sn + head * sh for head in range(dims.num_kv_heads)]
            for entry in range(dims.page_size)
        ]
    )
    fig, ax = plt.subplots(figsize=(5.0, 3.8))
    im = ax.imshow(offsets, cmap="viridis", aspect="auto")
    mid = (offsets.min() + offsets.max()) / 2
    for (entry, head), value in np.ndenumerate(offsets):
        ax.text(head, entry, str(value), ha="center", va="center", fontsize=10, color="k" if value > mid else "w")
    ax.set(xlabel="head", ylabel="token row in page", title=title or f"{layout}: element offset of feature 0")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="elements from the pool's start")
    fig.tight_layout()
    return fig


def plot_ring_slots(window, num_tokens: int, title: str | None = None, upto: int | None = None):
    """Which token position each cache row holds after each step of a sequence written
    through a :class:`RingWindow` (rows on y, steps on x; empty white, bubble grey).

    With ``upto=t`` the history stops at step ``t`` and a second panel shows the cache at
    that step: the token in every row, the row just written outlined, and which token it
    overwrote."""
    rows = window.max_cache_len
    last = num_tokens - 1 if upto is None else upto
    held = np.full((rows, num_tokens), np.nan)
    current = np.full(rows, np.nan)
    evicted = None
    for t in range(last + 1):
        row = window.kv_token_idx(t)
        if t == last and not np.isnan(current[row]):
            evicted = int(current[row])
        current[row] = t
        held[:, t] = current
    bubble = (window.sink_tokens - 0.5, window.sink_tokens + window.bubble_len - 0.5)
    name = (
        title or f"ring: window {window.max_attention_window}, {window.sink_tokens} sinks, bubble {window.bubble_len}"
    )
    if upto is None:
        fig, ax = plt.subplots()
    else:
        fig, (ax, side) = plt.subplots(1, 2, figsize=(9.5, 4.0), gridspec_kw={"width_ratios": [4, 1]})
    ax.axhspan(*bubble, color="0.85", zorder=0)
    im = ax.imshow(
        held, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest", vmin=0, vmax=num_tokens - 1
    )
    ax.set(xlabel="step (token position written)", ylabel="cache row", title=name, xlim=(-0.5, num_tokens - 0.5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    cbar = fig.colorbar(im, ax=ax, label="token position held")
    cbar.locator = MaxNLocator(integer=True)
    cbar.update_ticks()
    if upto is not None:
        row = window.kv_token_idx(last)
        ax.axvline(last, color=PALETTE[3], lw=1.5)
        side.axhspan(*bubble, color="0.85", zorder=0)
        for r in range(rows):
            text = "" if np.isnan(current[r]) else str(int(current[r]))
            side.text(0.5, r, text, ha="center", va="center", fontsize=10)
        side.add_patch(Rectangle((0.05, row - 0.5), 0.9, 1.0, fill=False, edgecolor=PALETTE[3], lw=2.5))
        side.set(xlim=(0, 1), ylim=(-0.5, rows - 0.5), xticks=[], ylabel="cache row")
        side.yaxis.set_major_locator(MaxNLocator(integer=True))
        side.grid(False)
        what = f"token {last} -> row {row}" + (f"\noverwrites {evicted}" if evicted is not None else "")
        side.set_title(f"cache after step {last}\n{what}", fontsize=11)
    fig.tight_layout()
    return fig

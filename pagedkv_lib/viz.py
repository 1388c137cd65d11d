"""Plot helpers for the notebooks: the one home of every figure the suite draws.

Every function returns a matplotlib ``Figure`` (and draws nothing else), so a
notebook cell can assert on the data and end with ``plt.show()``. Figures are kept
small (``use_style``) because notebooks are committed with their outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from .pool import cache_dims, cache_strides

__all__ = [
    "use_style",
    "line_plot",
    "bar_plot",
    "occupancy",
    "plot_occupancy",
    "plot_occupancy_steps",
    "plot_block_table",
    "plot_address_map",
    "plot_ring_slots",
    "plot_heatmap",
    "plot_histogram",
]

_SEQ_CMAP = "tab20"


def use_style() -> None:
    """Small, legible figures (about 40-80 kB per PNG at this size and dpi)."""
    plt.rcParams.update(
        {
            "figure.figsize": (6.4, 3.4),
            "figure.dpi": 72,
            "savefig.dpi": 72,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "font.size": 9,
        }
    )


def line_plot(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    marker: str = "o",
):
    """One line per entry of ``series`` (label -> y values) over ``x``."""
    fig, ax = plt.subplots()
    for label, y in series.items():
        ax.plot(x, y, marker=marker, markersize=3, label=label)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bar_plot(labels: Sequence[str], values: Sequence[float], title: str, ylabel: str, annotate: str = "{:.1f}"):
    """Bars with their values written on top."""
    fig, ax = plt.subplots()
    bars = ax.bar(labels, values, color="tab:blue")
    for bar, value in zip(bars, values):
        ax.annotate(
            annotate.format(value),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set(title=title, ylabel=ylabel)
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    return fig


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
    cmap = plt.get_cmap(_SEQ_CMAP)
    n = manager.num_blocks
    nrows = -(-n // columns)
    for page in range(n):
        r, c = divmod(page, columns)
        y = nrows - 1 - r
        ax.add_patch(plt.Rectangle((c, y), 0.92, 0.92, facecolor="0.93", edgecolor="0.7"))
        if owner[page] != -1:
            shared = owner[page] == -2
            ax.add_patch(
                plt.Rectangle(
                    (c, y),
                    0.92,
                    0.92 * rows[page] / manager.page_size,
                    facecolor="0.45" if shared else cmap(owner[page] % 20),
                    hatch="//" if shared else None,
                    edgecolor="0.3",
                )
            )
        ax.text(c + 0.46, y + 0.46, str(page), ha="center", va="center", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(order.index(s) % 20)) for s in manager.sequences]
    labels = [str(s) for s in manager.sequences]
    if (owner == -2).any():
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="0.45", hatch="//"))
        labels.append("shared")
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set(xlim=(0, columns), ylim=(0, nrows))
    ax.set_title(title, fontsize=9)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_occupancy(manager, title: str = "pool occupancy", columns: int = 16):
    """The pool as a grid of pages coloured by owning sequence; the filled fraction of
    each page is the coloured height, so partial last pages show. Shared pages hatched."""
    return plot_occupancy_steps([manager], [title], columns)


def plot_occupancy_steps(managers, titles, columns: int = 16):
    """:func:`plot_occupancy` for several snapshots side by side (two per row); a
    sequence keeps its colour across snapshots."""
    order = list(dict.fromkeys(s for m in managers for s in m.sequences))
    nrows_pool = -(-managers[0].num_blocks // columns)
    per_row = 1 if len(managers) == 1 else 2
    grid_rows = -(-len(managers) // per_row)
    width = per_row * (0.42 * columns + 0.9)
    fig, axes = plt.subplots(grid_rows, per_row, figsize=(width, grid_rows * (0.42 * nrows_pool + 0.45)), squeeze=False)
    for ax, manager, title in zip(axes.flat, managers, titles):
        _draw_occupancy(ax, manager, title, columns, order)
    for ax in list(axes.flat)[len(managers) :]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_block_table(tables: Mapping[str, Sequence[int]], num_pages: int, title: str = "block tables"):
    """Logical blocks of each sequence (left) with arrows to the physical pages they name (right)."""
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.3 * max(num_pages, 4)))
    cmap = plt.get_cmap(_SEQ_CMAP)
    y = 0
    for i, (name, table) in enumerate(tables.items()):
        for j, page in enumerate(table):
            ax.annotate("", xy=(3.0, page), xytext=(1.0, y), arrowprops={"arrowstyle": "->", "color": cmap(i % 20)})
            ax.text(0.95, y, f"{name}[{j}]", ha="right", va="center", fontsize=7, color=cmap(i % 20))
            y += 1
        y += 0.5
    for page in range(num_pages):
        ax.text(3.05, page, f"page {page}", ha="left", va="center", fontsize=7)
    ax.set(xlim=(0, 4), ylim=(max(y, num_pages), -1), title=title)
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
    fig, ax = plt.subplots(figsize=(3.6, 3.0))
    im = ax.imshow(offsets, cmap="viridis", aspect="auto")
    for (entry, head), value in np.ndenumerate(offsets):
        ax.text(head, entry, str(value), ha="center", va="center", fontsize=6, color="w")
    ax.set(xlabel="head", ylabel="token row in page", title=title or f"{layout}: element offset of feature 0")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="elements")
    fig.tight_layout()
    return fig


def plot_ring_slots(window, num_tokens: int, title: str | None = None, highlight: int | None = None):
    """Which token position each cache row holds after each step of a sequence written
    through a :class:`RingWindow` (rows on y, steps on x; empty white, bubble grey)."""
    rows = window.max_cache_len
    held = np.full((rows, num_tokens), np.nan)
    current = np.full(rows, np.nan)
    for t in range(num_tokens):
        current[window.kv_token_idx(t)] = t
        held[:, t] = current
    fig, ax = plt.subplots()
    ax.axhspan(window.sink_tokens - 0.5, window.sink_tokens + window.bubble_len - 0.5, color="0.85", zorder=0)
    im = ax.imshow(held, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    if highlight is not None:
        ax.axvline(highlight, color="r", lw=1)
    ax.set(
        xlabel="step (token position written)",
        ylabel="cache row",
        title=title
        or (f"ring: window {window.max_attention_window}, {window.sink_tokens} sinks, bubble {window.bubble_len}"),
    )
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="token position held")
    fig.tight_layout()
    return fig


def plot_heatmap(
    values, title: str, xlabel: str, ylabel: str, cmap: str = "viridis", label: str = "", annotate: bool = False
):
    """A labelled heatmap of a 2-D array (e.g. a diff against a reference, refcounts)."""
    values = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=float)
    fig, ax = plt.subplots()
    im = ax.imshow(values, aspect="auto", cmap=cmap, interpolation="nearest")
    if annotate:
        mid = (np.nanmin(values) + np.nanmax(values)) / 2
        for (r, c), v in np.ndenumerate(values):
            ax.text(c, r, f"{v:g}", ha="center", va="center", fontsize=7, color="k" if v > mid else "w")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(False)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    return fig


def plot_histogram(samples: Mapping[str, Sequence[float]], title: str, xlabel: str, bins: int = 40, logx=True):
    """Overlaid histograms (e.g. absolute errors per dtype), log-spaced bins by default."""
    fig, ax = plt.subplots()
    for label, values in samples.items():
        v = np.asarray(values, dtype=float).ravel()
        v = v[v > 0] if logx else v
        if v.size == 0:
            continue
        edges = np.logspace(np.log10(v.min()), np.log10(v.max()) + 1e-9, bins) if logx else bins
        ax.hist(v, bins=edges, alpha=0.6, label=label)
    if logx:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# =========================================================================== chunked prefill
# (added with notebook 10 and kernels/prefill.py)

__all__ += ["plot_chunk_masks"]

_MASK_COLORS = ["white", "tab:blue", "tab:orange", "tab:red", "mistyrose"]
_MASK_LABELS = ["hidden", "earlier chunks' key", "own chunk's key", "seen, should not be", "missed, should be seen"]


def plot_chunk_masks(masks: Mapping[str, torch.Tensor], past_len: int, correct: torch.Tensor | None = None, title=""):
    """Side-by-side masks of one prefill chunk over absolute key positions.

    ``masks`` maps a panel title to a bool ``[q_len, seq_len]`` mask (query ``i`` at
    absolute position ``past_len + i``; key ``j`` at position ``j``). A visible key is
    blue before ``past_len`` (written by earlier chunks or the prefix cache) and orange
    from it on (the chunk's own keys, the causal triangle). With ``correct`` given,
    cells where a mask disagrees with it are red (seen, should not be) or pink
    (missed). The dashed line separates cached keys from the chunk's own.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, len(masks), figsize=(3.3 * len(masks), 3.2), squeeze=False)
    used = set()
    for ax, (name, mask) in zip(axes[0], masks.items()):
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        q_len, seq_len = mask.shape
        own = torch.arange(seq_len)[None, :] >= past_len
        cat = torch.where(mask, torch.where(own, 2, 1), 0)
        if correct is not None:
            cat = torch.where(mask & ~correct, 3, torch.where(~mask & correct, 4, cat))
        used |= set(cat.unique().tolist())
        ax.imshow(cat.numpy(), cmap=ListedColormap(_MASK_COLORS), vmin=0, vmax=4, interpolation="nearest",
                  aspect="auto", extent=(-0.5, seq_len - 0.5, past_len + q_len - 0.5, past_len - 0.5))  # fmt: skip
        ax.axvline(past_len - 0.5, color="k", ls="--", lw=0.8)
        ax.set(title=name, xlabel="key position (token)", ylabel="query position (token)")
        ax.grid(False)
    handles = [Patch(facecolor=_MASK_COLORS[i], edgecolor="0.6", label=_MASK_LABELS[i]) for i in sorted(used)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))


# =========================================================================== quantized KV
# Figures of notebook 09 (pagedkv_lib.quant). Kept to new functions at the end.

__all__ += ["plot_e2m1_grid", "plot_grouped_bars"]


def plot_e2m1_grid(samples: Mapping[str, float] | None = None, title: str = "E2M1: the 8 magnitudes and where ties go"):
    """The E2M1 magnitudes on a number line, the rounding threshold between each pair (a
    tie goes to the neighbour with the even index, drawn as an arrow), and optional
    labelled ``samples`` (name -> value in block units) with the value each rounds to."""
    from .quant import E2M1_VALUES, e2m1_decode, e2m1_encode

    samples = samples or {}
    fig, ax = plt.subplots(figsize=(6.4, 2.2 + 0.3 * len(samples)))
    grid = np.array(E2M1_VALUES)
    ax.scatter(grid, np.zeros_like(grid), s=40, color="tab:blue", zorder=3)
    for i, g in enumerate(grid):
        ax.annotate(f"{g:g}\nidx {i}", (g, 0), xytext=(0, 10), textcoords="offset points", ha="center", fontsize=7)
    for i in range(1, len(grid)):
        mid = (grid[i - 1] + grid[i]) / 2
        even = grid[i] if i % 2 == 0 else grid[i - 1]
        ax.axvline(mid, color="0.6", lw=0.8, ls=":")
        ax.annotate("", xy=(mid + 0.35 * (even - mid), -0.5), xytext=(mid, -0.5), arrowprops={"arrowstyle": "->"})
    for j, (name, value) in enumerate(samples.items()):
        y = -1.1 - 0.45 * j
        rounded = float(e2m1_decode(e2m1_encode(torch.tensor([value])))[0])
        ax.annotate("", xy=(abs(rounded), y), xytext=(min(abs(value), 7.0), y),
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})  # fmt: skip
        ax.text(7.1, y, f"{name}: {value:.3g} -> {rounded:g}", va="center", fontsize=7, color="tab:red")
    ax.set(title=title, xlabel="magnitude (units of block scale x global scale)", xlim=(-0.3, 9.5))
    ax.set_ylim(-1.4 - 0.45 * len(samples), 1.0)
    ax.set_yticks([])
    ax.grid(False)


# --------------------------------------------------------------------------- teaching: pool rows
# Pictures for notebooks 06-07 and the exercise checker (pagedkv_lib.exercises): which
# rows of the pool one program touches, and which rows a wrong kernel got wrong. Both
# draw the pool as a grid, one column per page and one cell per token row.

_ROW_STATUS = {
    0: ("untouched, as it should be", "0.93"),
    1: ("written, right", "tab:green"),
    2: ("should be written: wrong or missing", "tab:red"),
    3: ("should be untouched: changed", "tab:orange"),
}


def _pool_grid(ax, colours, text, title: str, pages: Sequence[int] | None = None, hatched=None) -> None:
    """Draw ``colours [num_pages, page_size]`` (matplotlib colours) as one column per page,
    row 0 at the top; ``text`` (same shape, str or None) is written in the cells."""
    from matplotlib.colors import to_rgb

    num_pages, page_size = len(colours), len(colours[0]) if len(colours) else 0
    for p in range(num_pages):
        for r in range(page_size):
            y = page_size - 1 - r
            hatch = "//" if hatched is not None and hatched[p][r] else None
            ax.add_patch(plt.Rectangle((p, y), 0.94, 0.94, facecolor=colours[p][r], edgecolor="0.6", hatch=hatch))
            if text is not None and text[p][r]:
                dark = sum(to_rgb(colours[p][r])) < 1.5
                ax.text(p + 0.47, y + 0.47, text[p][r], ha="center", va="center", fontsize=7,
                        color="w" if dark else "k")  # fmt: skip
    ax.set(xlim=(0, max(num_pages, 1)), ylim=(0, max(page_size, 1)), title=title)
    ax.set_xticks([p + 0.47 for p in range(num_pages)], [str(p) for p in (pages or range(num_pages))], fontsize=7)
    ax.set_yticks([page_size - 1 - r + 0.47 for r in range(page_size)], [str(r) for r in range(page_size)], fontsize=7)
    ax.set_xlabel("physical page")
    ax.set_ylabel("row in page")
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)


def plot_access_pattern(order, title: str, masked=None, label: str = "loop iteration"):
    """Which pool rows one program touches, and when.

    ``order [num_pages, page_size]`` (ints): ``-1`` for a row the program never touches,
    else the step at which it touches it (a loop iteration, or a token index), written
    in the cell and coloured. ``masked [num_pages, page_size]`` (bools, optional): rows
    that a masked lane addresses but never loads or stores (hatched).
    """
    order = np.asarray(order.cpu() if isinstance(order, torch.Tensor) else order)
    masked = None if masked is None else np.asarray(masked.cpu() if isinstance(masked, torch.Tensor) else masked)
    steps = max(int(order.max()) + 1, 1) if order.size else 1
    cmap = plt.get_cmap("viridis")
    colours = [[("0.93" if o < 0 else cmap(0.15 + 0.7 * o / max(steps - 1, 1))) for o in page] for page in order]
    if masked is not None:
        colours = [[("white" if m else c) for c, m in zip(cp, mp)] for cp, mp in zip(colours, masked)]
    text = [[("" if o < 0 else str(int(o))) for o in page] for page in order]
    fig, ax = plt.subplots(figsize=(min(1.0 + 0.45 * len(order), 9.0), 0.9 + 0.32 * order.shape[1]))
    _pool_grid(ax, colours, text, title, hatched=masked)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=cmap(0.5)), plt.Rectangle((0, 0), 1, 1, facecolor="0.93")]
    names = [f"touched (number: {label})", "not touched"]
    if masked is not None and masked.any():
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="//", edgecolor="0.6"))
        names.append("masked lane: not loaded")
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_grouped_bars(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    ylabel: str,
    logy: bool = False,
    annotate: str | None = "{:.3g}",
):
    """Bars grouped by ``labels``, one colour per entry of ``series`` (name -> one value
    per label), values written on top."""
    fig, ax = plt.subplots()
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
        if annotate:
            for bar, value in zip(bars, values):
                ax.annotate(annotate.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=6)  # fmt: skip
    ax.set_xticks(x, labels)
    ax.tick_params(axis="x", labelrotation=20)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def row_status(got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, layout: str = "NHD") -> np.ndarray:
    """Status ``[num_pages, 2, page_size]`` of every pool row (K and V) after a write:
    0 untouched as it should be, 1 written right, 2 should be written but is wrong, 3
    should be untouched but changed (keys of :func:`plot_wrong_rows`'s legend). Rows
    are compared bit for bit, so NaN payloads count."""
    from .verify.compare import _bits  # one home for the bit view

    def rows(t):
        t = t.detach().cpu()
        if layout == "HND":
            t = t.transpose(2, 3)
        return _bits(t).flatten(3)  # [pages, 2, page_size, heads * dim]

    g, e, b = rows(got), rows(expected), rows(before)
    right = (g == e).all(-1).numpy()
    should = (e != b).any(-1).numpy()
    return np.where(should, np.where(right, 1, 2), np.where(right, 0, 3))


def plot_wrong_rows(
    got, expected, before, layout: str = "NHD", title: str = "which pool rows are wrong", slot_mapping=None
):
    """The pool after a write, K rows and V rows side by side, each row coloured by
    :func:`row_status`: untouched, written right, wrong or missing, changed though it
    should be untouched. With ``slot_mapping`` each row a token should be written to is
    labelled with that token's index. Returns the figure."""
    status = row_status(got, expected, before, layout)
    pages, page_size = status.shape[0], status.shape[2]
    text = None
    if slot_mapping is not None:
        text = [["" for _ in range(page_size)] for _ in range(pages)]
        for t, slot in enumerate(torch.as_tensor(slot_mapping).tolist()):
            if slot >= 0:
                text[slot // page_size][slot % page_size] = f"t{t}"
    fig, axes = plt.subplots(1, 2, figsize=(min(2.0 + 0.8 * pages, 11.0), 1.1 + 0.32 * page_size))
    for kv, ax in enumerate(axes):
        colours = [[_ROW_STATUS[int(s)][1] for s in page] for page in status[:, kv]]
        _pool_grid(ax, colours, text, f"{'KV'[kv]} rows")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c) for _, c in _ROW_STATUS.values()]
    names = [n for n, _ in _ROW_STATUS.values()] + (["tN: the row of token N"] if text else [])
    if text:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="white"))
    axes[1].legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def source_code(obj):
    """``obj``'s source as an ``IPython.display.Code`` (syntax-highlighted in a notebook,
    plain text elsewhere). Works on Triton kernels too (``@triton.jit`` objects keep the
    Python function as ``.fn``), so a notebook shows a module's code, never a copy."""
    import inspect

    from IPython.display import Code

    return Code(inspect.getsource(getattr(obj, "fn", obj)), language="python")


__all__ += ["plot_access_pattern", "row_status", "plot_wrong_rows", "source_code"]

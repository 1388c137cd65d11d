"""Plot helpers for the notebooks: the one home of every figure the suite draws.

Every function returns a matplotlib ``Figure`` (and draws nothing else), so a
notebook cell can assert on the data and end with ``plt.show()``.

One style for all of them (:func:`use_style`): text of 11-12 px at 100 dpi, legible in a
1400 px browser window; the Okabe-Ito palette (:data:`PALETTE`), which stays distinct
under the common colour-vision deficiencies; discrete colours with a legend for
categories and booleans, a colour bar only for continuous quantities; integer ticks on
integer axes. A sequence keeps its colour in every view that is given the same
``order`` (:func:`sequence_colors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from .compare import bits
from .pool import cache_dims, cache_strides

__all__ = [
    "PALETTE",
    "use_style",
    "sequence_colors",
    "line_plot",
    "bar_plot",
    "occupancy",
    "plot_occupancy",
    "plot_occupancy_steps",
    "plot_block_table",
    "plot_address_map",
    "plot_ring_slots",
    "plot_heatmap",
    "plot_categories",
    "plot_exact_match",
    "plot_histogram",
    "conformance_margins",
    "plot_conformance",
]

# Okabe & Ito's colour-blind-safe palette, most distinct first.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442", "#000000")
_HATCHES = (None, "//", "..", "xx")  # a second, third... round of the palette gets a hatch
FREE, SHARED, OK_GREEN, FAIL_RED = "0.92", "0.45", "#009E73", "#D55E00"


def use_style() -> None:
    """The suite's figure style: 100 dpi, 8 x 4 in (800 x 400 px), 11-12 px text,
    the Okabe-Ito colour cycle (about 40-90 kB per PNG)."""
    plt.rcParams.update(
        {
            "figure.figsize": (8.0, 4.0),
            "figure.dpi": 100,
            "savefig.dpi": 100,
            "font.size": 11,
            "axes.titlesize": 12,
            "axes.labelsize": 11,
            "xtick.labelsize": 10,
            "ytick.labelsize": 10,
            "legend.fontsize": 10,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.prop_cycle": plt.cycler(color=PALETTE),
            "image.cmap": "viridis",
        }
    )


def sequence_colors(order: Sequence) -> dict:
    """Colour (and hatch) per sequence id: the same ``order`` gives every view the same
    colours. Past 8 sequences the palette repeats with a hatch."""
    return {s: (PALETTE[i % len(PALETTE)], _HATCHES[(i // len(PALETTE)) % len(_HATCHES)]) for i, s in enumerate(order)}


def _is_integer(values) -> bool:
    arr = np.asarray(values)
    return arr.size > 0 and (np.issubdtype(arr.dtype, np.integer) or bool(np.all(np.mod(arr, 1) == 0)))


def _integer_ticks(ax, x=None, y=None) -> None:
    """Integer tick locators on linear axes whose data are integers."""
    if x is not None and ax.get_xscale() == "linear" and _is_integer(x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y is not None and ax.get_yscale() == "linear" and _is_integer(y):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


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
    """One line per entry of ``series`` (label -> y values) over ``x``. Series with
    identical values share one line and one legend entry (``"a = b"``), so no line hides
    another; integer axes get integer ticks."""
    merged: dict[tuple, list[str]] = {}
    for label, y in series.items():
        merged.setdefault(tuple(float(v) for v in y), []).append(label)
    fig, ax = plt.subplots()
    all_y = []
    for y, labels in merged.items():
        ax.plot(x, y, marker=marker, markersize=4, label=" = ".join(labels))
        all_y.extend(y)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    _integer_ticks(ax, x, all_y)
    if len(merged) > 3:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        ax.legend()
    fig.tight_layout()
    return fig


def bar_plot(
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    ylabel: str,
    annotate: str = "{:.1f}",
    colors: Sequence[str] | None = None,
):
    """Bars with their values written on top; ``colors`` one per bar (default one colour)."""
    fig, ax = plt.subplots()
    bars = ax.bar(labels, values, color=list(colors) if colors is not None else PALETTE[0])
    for bar, value in zip(bars, values):
        ax.annotate(
            annotate.format(value),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=10,
        )
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="x", visible=False)
    if max((len(str(s)) for s in labels), default=0) * len(labels) > 60:
        ax.tick_params(axis="x", labelrotation=30)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    _integer_ticks(ax, y=values)
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
    (right); each page box takes its owner's colour, so a glance pairs both sides."""
    colors = sequence_colors(list(tables) if order is None else order)
    rows = sum(len(t) for t in tables.values()) + 0.5 * (len(tables) - 1)
    height = max(rows, num_pages)
    fig, ax = plt.subplots(figsize=(7.0, 0.9 + 0.42 * height))
    owner = {}
    y = 0.0
    for name, table in tables.items():
        color, hatch = colors[name]
        for j, page in enumerate(table):
            owner[page] = name
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
    for page in range(num_pages):
        face, hatch = colors[owner[page]] if page in owner else (FREE, None)
        ax.add_patch(Rectangle((3.4, page - 0.38), 1.6, 0.76, facecolor=face, hatch=hatch, edgecolor="0.25"))
        ax.text(
            4.2, page, f"page {page}", ha="center", va="center", fontsize=11, color="white" if page in owner else "k"
        )
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


def _as_array(values) -> np.ndarray:
    return np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=float)


def plot_heatmap(
    values,
    title: str,
    xlabel: str,
    ylabel: str,
    cmap: str = "viridis",
    label: str = "",
    annotate: bool = False,
    integer: bool | None = None,
    yticklabels: Sequence[str] | None = None,
):
    """A labelled heatmap of a 2-D array of a continuous or integer quantity (an error, a
    refcount). Integer values (``integer=None`` detects them) get one discrete colour per
    value and integer ticks. For categories or booleans use :func:`plot_categories`; for
    a difference that is exactly zero, :func:`plot_exact_match`."""
    values = _as_array(values)
    finite = values[np.isfinite(values)]
    if integer is None:
        integer = _is_integer(finite)
    fig, ax = plt.subplots()
    norm = None
    if integer and finite.size and finite.max() - finite.min() <= 16:
        lo, hi = int(finite.min()), int(finite.max())
        base = plt.get_cmap(cmap)
        cmap = ListedColormap([base(i / max(hi - lo, 1)) for i in range(hi - lo + 1)])
        norm = BoundaryNorm(np.arange(lo - 0.5, hi + 1.5), cmap.N)
    im = ax.imshow(values, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    if annotate and finite.size:
        for (r, c), v in np.ndenumerate(values):
            if np.isfinite(v):
                rgba = im.cmap(im.norm(v))
                dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.5
                ax.text(c, r, f"{v:g}", ha="center", va="center", fontsize=10, color="w" if dark else "k")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if yticklabels is not None:
        ax.set_yticks(range(len(yticklabels)), yticklabels)
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    cbar = fig.colorbar(im, ax=ax, label=label)
    if norm is not None:
        cbar.set_ticks(range(int(finite.min()), int(finite.max()) + 1))
    fig.tight_layout()
    return fig


def plot_categories(
    codes,
    categories: Mapping[int, str],
    title: str,
    xlabel: str,
    ylabel: str,
    colors: Sequence[str] | None = None,
):
    """A grid of categories (booleans included: ``{0: "no", 1: "yes"}``) with one
    discrete colour and a legend entry per category, never a colour bar.
    ``codes``: 2-D integers, each a key of ``categories``."""
    codes = _as_array(codes).astype(int)
    keys = sorted(categories)
    unknown = set(np.unique(codes)) - set(keys)
    if unknown:
        raise ValueError(f"codes {sorted(unknown)} have no category (categories: {categories})")
    colors = list(colors) if colors is not None else [FREE, *PALETTE][: len(keys)]
    cmap = ListedColormap(colors)
    norm = BoundaryNorm(np.arange(len(keys) + 1) - 0.5, len(keys))
    index = np.vectorize(keys.index)(codes) if codes.size else codes
    fig, ax = plt.subplots()
    ax.imshow(index, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    handles = [Patch(facecolor=colors[i], edgecolor="0.4", label=categories[k]) for i, k in enumerate(keys)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_exact_match(got, want, before=None, title: str = "kernel vs reference"):
    """Instead of a heatmap of an all-zero difference: state the exact equality in the
    title and show *what was compared*, per token row of an NHD pool
    ``[pages, 2, page_size, heads, head_dim]``: rows this step wrote, rows left
    untouched (when ``before`` is given), rows that differ. NaN equals NaN here."""
    got, want = (_as_array(x) for x in (got, want))
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs {want.shape}")

    def rows_equal(a, b):
        return ((a == b) | (np.isnan(a) & np.isnan(b))).reshape(*a.shape[:3], -1).all(-1)  # [pages, 2, rows]

    same = rows_equal(got, want)
    codes = np.where(same, 1, 2)
    if before is not None:
        codes = np.where(same & rows_equal(want, _as_array(before)), 0, codes)
    codes = codes.reshape(codes.shape[0], -1)  # [pages, K rows then V rows]
    n_same = int(((got == want) | (np.isnan(got) & np.isnan(want))).sum())
    verdict = (
        f"identical in all {got.size:,} elements" if n_same == got.size else f"{got.size - n_same:,} elements differ"
    )
    names = {0: "untouched (equal)", 1: "written this step (equal)", 2: "differs"}
    palette = {0: FREE, 1: OK_GREEN, 2: FAIL_RED}
    present = sorted(set(np.unique(codes).tolist()) | {1})
    return plot_categories(
        codes.T,
        {k: names[k] for k in present},
        f"{title}: {verdict}",
        "page",
        f"row: K rows 0-{got.shape[2] - 1}, then V rows",
        colors=[palette[k] for k in present],
    )


def plot_histogram(samples: Mapping[str, Sequence[float]], title: str, xlabel: str, bins: int = 40, logx=True):
    """Overlaid histograms (e.g. absolute errors per dtype), log-spaced bins by default;
    exact zeros (which a log axis cannot show) are counted in the legend."""
    fig, ax = plt.subplots()
    for label, values in samples.items():
        v = np.asarray(values, dtype=float).ravel()
        zeros = int((v == 0).sum()) if logx else 0
        v = v[v > 0] if logx else v
        name = f"{label} ({zeros} exact zeros)" if zeros else label
        if v.size == 0:
            ax.plot([], [], label=name)
            continue
        edges = np.logspace(np.log10(v.min()), np.log10(v.max()) + 1e-9, bins) if logx else bins
        ax.hist(v, bins=edges, alpha=0.6, label=name)
    if logx:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel="count")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.tight_layout()
    return fig


def conformance_margins(results) -> tuple[list[str], list[float], list[bool]]:
    """``(labels, ratios, passed)`` of the checked results of a conformance report, where
    ``ratio`` is the pass rule itself: ``max |err| / (atol + rtol |ref|)``, at most 1 exactly
    when the case passed. Uses each result's ``tol_ratio`` where it recorded one; for a
    check whose rule has no ``rtol`` term, ``max_abs / atol``; exact checks (``atol``
    0): 0 when equal. A result that failed another rule within tolerance (a decode that
    wrote the pool, a write into a guard region) is drawn as failed (``inf``). A result
    whose recorded numbers cannot give its margin by the rule (it passed, yet
    ``max_abs / atol > 1``) gets ``nan``: plotted as "not recorded"."""
    labels, ratios, passed = [], [], []
    for r in results:
        if r.passed is None:
            continue
        if r.tol_ratio is not None:
            ratio = r.tol_ratio
            if not r.passed and ratio <= 1:  # failed another rule (the pool was written, a guard hit)
                ratio = math.inf
        elif r.atol == 0:
            ratio = 0.0 if r.passed else math.inf
        else:
            ratio = r.max_abs / r.atol
            if (ratio <= 1) != bool(r.passed):
                ratio = math.nan
        labels.append(r.check)
        ratios.append(float(ratio))
        passed.append(bool(r.passed))
    return labels, ratios, passed


def plot_conformance(
    labels: Sequence[str],
    ratios: Sequence[float],
    passed: Sequence[bool],
    title: str = "conformance: margin by the pass rule",
    floor: float = 1e-4,
):
    """One bar per case of ``ratio = max |err| / (atol + rtol |ref|)``, the pass rule
    itself: a case passes exactly when its bar stays at or below the line at 1. Exact
    matches (ratio 0) sit on the floor; ``nan`` ratios are marked "not recorded".
    Raises ``ValueError`` if a ratio contradicts its verdict (a plot that would mislead)."""
    ratios = [float(r) for r in ratios]
    for label, ratio, ok in zip(labels, ratios, passed):
        if not math.isnan(ratio) and (ratio <= 1) != bool(ok):
            raise ValueError(f"{label}: ratio {ratio:.3g} contradicts {'pass' if ok else 'fail'}: not the pass rule")
    shown = [floor if r == 0 else (1e3 if math.isinf(r) else r) for r in ratios]
    colors = [OK_GREEN if ok else FAIL_RED for ok in passed]
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    xs = range(len(ratios))
    ax.bar(xs, [floor if math.isnan(r) else max(r, floor) for r in shown], color=colors, bottom=0)
    for x, r in zip(xs, ratios):
        if math.isnan(r):
            ax.text(x, floor * 1.5, "not\nrecorded", ha="center", va="bottom", fontsize=8, rotation=90)
        elif r == 0:
            ax.text(x, floor * 1.5, "exact", ha="center", va="bottom", fontsize=8, rotation=90)
    ax.axhline(1.0, color="k", lw=1.0, ls="--")
    ax.text(len(ratios) - 0.5, 1.15, "pass rule: ratio <= 1", ha="right", va="bottom", fontsize=10)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max(100.0, max((r for r in shown if math.isfinite(r)), default=1) * 3))
    ax.set_xticks(list(xs), list(labels), rotation=60, ha="right", rotation_mode="anchor", fontsize=9)
    ax.grid(axis="x", visible=False)
    ax.set(title=title, ylabel="max |err| / (atol + rtol |ref|)")
    ax.legend(
        handles=[
            Patch(color=OK_GREEN, label=f"pass ({sum(passed)})"),
            Patch(color=FAIL_RED, label=f"fail ({len(passed) - sum(passed)})"),
        ],
        loc="upper left",
        frameon=False,
    )
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

    def rows(t):
        t = t.detach().cpu()
        if layout == "HND":
            t = t.transpose(2, 3)
        return bits(t).flatten(3)  # [pages, 2, page_size, heads * dim]

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

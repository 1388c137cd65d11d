"""Generic charts in the suite's style: lines, bars (single and grouped), histograms,
heatmaps of a continuous or integer quantity, grids of categories."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pagedkv_lab.viz.style import FREE, PALETTE, as_array, integer_ticks, is_integer


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
    integer_ticks(ax, x, all_y)
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
    xlabel: str = "",
):
    """Bars with their values written on top; ``colors`` one per bar (default one colour);
    ``xlabel`` names what the bars are (none by default)."""
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
    ax.set(title=title, ylabel=ylabel, xlabel=xlabel)
    ax.grid(axis="x", visible=False)
    if max((len(str(s)) for s in labels), default=0) * len(labels) > 60:
        ax.tick_params(axis="x", labelrotation=30)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    integer_ticks(ax, y=values)
    fig.tight_layout()
    return fig


BAR_LABEL_PT = 9
"""Size of the values written on bars (points); learners read them at 100 dpi."""


def plot_grouped_bars(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    ylabel: str,
    logy: bool = False,
    annotate: str | None = "{:.3g}",
):
    """Bars grouped by ``labels``, one colour per entry of ``series`` (name -> one value
    per label), values written on top in :data:`BAR_LABEL_PT` points, the legend outside
    the data (right)."""
    fig, ax = plt.subplots(figsize=(9.0, 4.0))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
        if annotate:
            for bar, value in zip(bars, values):
                ax.annotate(annotate.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            xytext=(0, 1), textcoords="offset points", ha="center", va="bottom",
                            fontsize=BAR_LABEL_PT)  # fmt: skip
    ax.set_xticks(x, labels)
    ax.tick_params(axis="x", labelrotation=20)
    if logy:
        ax.set_yscale("log")
    ax.margins(y=0.1)  # room for the values above the tallest bar
    ax.set(title=title, ylabel=ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=10)
    fig.tight_layout()
    return fig


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
    values = as_array(values)
    finite = values[np.isfinite(values)]
    if integer is None:
        integer = is_integer(finite)
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
    labels=None,
    figsize: tuple[float, float] | None = None,
):
    """A grid of categories (booleans included: ``{0: "no", 1: "yes"}``) with one
    discrete colour and a legend entry per category, never a colour bar.
    ``codes``: 2-D integers, each a key of ``categories``. ``labels``: optional 2-D
    strings of ``codes``' shape, written in each cell ("" for none), e.g. which token
    wrote a row. ``figsize`` in inches (default: the style's)."""
    codes = as_array(codes).astype(int)
    keys = sorted(categories)
    unknown = set(np.unique(codes)) - set(keys)
    if unknown:
        raise ValueError(f"codes {sorted(unknown)} have no category (categories: {categories})")
    if labels is not None and np.shape(labels) != codes.shape:
        raise ValueError(f"labels has shape {np.shape(labels)}, codes {codes.shape}")
    colors = list(colors) if colors is not None else [FREE, *PALETTE][: len(keys)]
    cmap = ListedColormap(colors)
    norm = BoundaryNorm(np.arange(len(keys) + 1) - 0.5, len(keys))
    index = np.vectorize(keys.index)(codes) if codes.size else codes
    fig, ax = plt.subplots(figsize=figsize)
    ax.imshow(index, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    if labels is not None:
        for (i, j), text in np.ndenumerate(np.asarray(labels, dtype=object)):
            if text:
                ax.text(j, i, str(text), ha="center", va="center", fontsize=10)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    handles = [Patch(facecolor=colors[i], edgecolor="0.4", label=categories[k]) for i, k in enumerate(keys)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig

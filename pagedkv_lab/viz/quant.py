"""Pictures of quantized KV (notebook 09, :mod:`pagedkv_lib.quant`): the E2M1 grid and
where its ties round, error histograms per format, error bars with readable labels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import NullFormatter

from pagedkv_lab.viz.style import PALETTE
from pagedkv_lib.quant import E2M1_VALUES, e2m1_decode, e2m1_encode

_LABEL_PT = 9  # the smallest text any of these figures draws


def plot_e2m1_grid(samples: Mapping[str, float] | None = None, title: str = "E2M1: the 8 magnitudes and where ties go"):
    """The E2M1 magnitudes (dots, each with its index) on a number line from 0 to 6, the
    rounding threshold between each pair (dotted; a value exactly on it, a tie, goes to
    the neighbour with the even index, marked by the short bar on that side), and one row
    per entry of ``samples`` (name -> value in block units): an arrow from the value to
    the magnitude it rounds to, named on the y axis. Values past 6 are drawn at 6.5 (they
    saturate to 6). Text is at least 9 pt."""
    samples = samples or {}
    fig, ax = plt.subplots(figsize=(8.0, 2.4 + 0.4 * len(samples)))
    grid = np.array(E2M1_VALUES)
    ax.scatter(grid, np.zeros_like(grid), s=50, color=PALETTE[0], zorder=3)
    for i, g in enumerate(grid):
        ax.annotate(f"{g:g}\nidx {i}", (g, 0), xytext=(0, 8), textcoords="offset points", ha="center",
                    va="bottom", fontsize=_LABEL_PT)  # fmt: skip
    for i in range(1, len(grid)):
        mid = (grid[i - 1] + grid[i]) / 2
        even = grid[i] if i % 2 == 0 else grid[i - 1]
        ax.plot([mid, mid], [-0.35, 0.35], color="0.5", lw=0.9, ls=":")
        ax.plot([mid, mid + 0.12 * np.sign(even - mid)], [-0.35, -0.35], color="0.3", lw=2.0)
    ys = [-1.0 - 0.6 * j for j in range(len(samples))]
    for y, value in zip(ys, samples.values()):
        rounded = float(e2m1_decode(e2m1_encode(torch.tensor([value])))[0])
        start = min(abs(value), 6.5)
        ax.annotate("", xy=(abs(rounded), y), xytext=(start, y),
                    arrowprops={"arrowstyle": "->", "color": PALETTE[3], "lw": 1.4})  # fmt: skip
        ax.plot([start], [y], "o", color=PALETTE[3], ms=4)
        ax.text(start, y + 0.12, f"{value:.3g} -> {rounded:g}", ha="center", va="bottom", fontsize=_LABEL_PT,
                color=PALETTE[3])  # fmt: skip
    ax.set_yticks([0.0, *ys], ["grid", *samples], fontsize=_LABEL_PT + 1)
    ax.set(title=title, xlabel="magnitude (units of block scale x global scale)", xlim=(-0.3, 6.8))
    ax.set_ylim(min(ys, default=-0.6) - 0.45, 0.95)
    ax.grid(False)
    fig.text(0.01, 0.01, "dotted: the threshold between two magnitudes; bar: the side a tie goes to (even index)",
             fontsize=_LABEL_PT, color="0.3")  # fmt: skip
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _write_exact_zeros(ax, counts: Mapping[str, tuple[str, int]], total: int) -> None:
    """List, in the panel's top-left corner, how many of ``total`` errors of each format
    (name -> (colour, count)) are exactly 0, in words: a log axis cannot draw them."""
    shown = {name: cz for name, cz in counts.items() if cz[1]}
    if not shown:
        return
    ax.text(0.02, 0.97, f"exactly 0 (off the log axis), of {total:,}:", transform=ax.transAxes, va="top",
            fontsize=_LABEL_PT, color="0.25")  # fmt: skip
    for i, (name, (colour, zeros)) in enumerate(shown.items(), start=1):
        ax.text(0.04, 0.97 - 0.085 * i, f"{name}: {zeros:,}", transform=ax.transAxes, va="top",
                fontsize=_LABEL_PT, color=colour)  # fmt: skip


def plot_error_histograms(errors: Mapping[str, Mapping[str, torch.Tensor]], title: str, bins: int = 40):
    """Side-by-side panels (one per entry of ``errors``: panel name -> {format name ->
    absolute errors}), each format's histogram drawn as a step outline in its own colour
    over log-spaced bins shared by all panels, legend (format names) outside the data.
    Exact zeros, which a log axis cannot show, are counted per panel in its top-left
    corner ("exactly 0 (off the log axis), of N:", then "format: count" in the format's
    colour)."""
    values = {p: {f: np.asarray(e, dtype=float).ravel() for f, e in fmts.items()} for p, fmts in errors.items()}
    positive = np.concatenate([v[v > 0] for fmts in values.values() for v in fmts.values()])
    edges = np.logspace(np.log10(positive.min()), np.log10(positive.max()) + 1e-9, bins)
    fig, axes = plt.subplots(1, len(values), figsize=(8.0, 3.8), sharey=True, squeeze=False)
    for ax, (panel, fmts) in zip(axes[0], values.items()):
        zeros = {}
        for colour, (name, v) in zip(PALETTE, fmts.items()):
            zeros[name] = (colour, int((v == 0).sum()))
            ax.hist(v[v > 0], bins=edges, histtype="step", lw=1.6, color=colour, label=name)
        ax.set(xscale="log", title=panel, xlabel="absolute error")
        ax.margins(y=0.35)  # headroom for the exact-zero counts above the histograms
        _write_exact_zeros(ax, zeros, max(v.size for v in fmts.values()))
    axes[0][0].set_ylabel("values per bin")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.02), ncol=len(labels), frameon=False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_error_bars(
    labels: Sequence[str], series: Mapping[str, Sequence[float]], title: str, ylabel: str, logy: bool = True
):
    """Grouped bars (``series``: name -> one value per label, one colour per name), each
    bar's value written above it in 9 pt (upright; turned 90 degrees when more than two
    bars share a group, so neighbours never overlap), the legend outside the data (right)."""
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, vals) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name, color=PALETTE[i])
        for bar, value in zip(bars, vals):
            ax.annotate(f"{value:.2g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=_LABEL_PT,
                        rotation=90 if len(series) > 2 else 0)  # fmt: skip
    ax.set_xticks(x, labels)
    ax.set(title=title, ylabel=ylabel)
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())  # decade labels only, no "6 x 10^-1" clutter
    ax.margins(y=0.25)
    if len(series) > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig

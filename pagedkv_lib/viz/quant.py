"""Pictures of quantized KV (notebook 09, :mod:`pagedkv_lib.quant`): the E2M1 grid and
where its ties round."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import torch

from ..quant import E2M1_VALUES, e2m1_decode, e2m1_encode


def plot_e2m1_grid(samples: Mapping[str, float] | None = None, title: str = "E2M1: the 8 magnitudes and where ties go"):
    """The E2M1 magnitudes on a number line, the rounding threshold between each pair (a
    tie goes to the neighbour with the even index, drawn as an arrow), and optional
    labelled ``samples`` (name -> value in block units) with the value each rounds to."""
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
    return fig

"""The suite's one figure style: palette, sizes, colours per sequence, integer ticks."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator

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


def is_integer(values) -> bool:
    arr = np.asarray(values)
    return arr.size > 0 and (np.issubdtype(arr.dtype, np.integer) or bool(np.all(np.mod(arr, 1) == 0)))


def integer_ticks(ax, x=None, y=None) -> None:
    """Integer tick locators on linear axes whose data are integers."""
    if x is not None and ax.get_xscale() == "linear" and is_integer(x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y is not None and ax.get_yscale() == "linear" and is_integer(y):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def as_array(values) -> np.ndarray:
    return np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=float)

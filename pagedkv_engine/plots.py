"""Figures of an engine run (notebook 12): the pool over time, single steps of it, the
memory comparison and the agreement with transformers.

Every function returns a matplotlib ``Figure`` and draws nothing else; sizes follow
:func:`pagedkv_lab.viz.use_style`. Requests keep one colour in every figure (tab10,
in order of arrival); a page named by several block tables is dark grey and hatched.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

__all__ = ["request_colours", "plot_pool_timeline", "plot_pool_steps", "plot_memory", "plot_agreement"]

_FREE, _SHARED = -1, -2
_SHARED_COLOUR = "0.3"


def request_colours(engine) -> dict[str, tuple]:
    """Colour of every request id, in order of arrival."""
    cmap = plt.get_cmap("tab10")
    return {r: cmap(i % 10) for i, r in enumerate(engine.request_ids_in_order())}


def _pages(record, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Per page at one step: how many block tables name it, and the first request naming it
    (``""`` if none)."""
    count = np.zeros(num_pages, dtype=int)
    request = np.full(num_pages, "", dtype=object)
    for seq_id, table in record.tables.items():
        for page in table:
            count[page] += 1
            request[page] = request[page] or seq_id.split(".")[0]
    return count, request


def plot_pool_timeline(engine, title: str = "pool pages over the run, coloured by request"):
    """Pages (rows) over engine steps (columns), coloured by the request whose table names
    them; white is free, hatched grey is shared by several sequences. Preemptions are
    marked on the top axis, page copies (copy-on-write) with a black outline."""
    colours = request_colours(engine)
    index = {r: i for i, r in enumerate(colours)}
    num_pages, steps = engine.manager.num_blocks, len(engine.history)
    grid = np.full((num_pages, steps), _FREE)
    for col, record in enumerate(engine.history):
        count, request = _pages(record, num_pages)
        grid[:, col] = [_SHARED if c > 1 else index[r] if c else _FREE for c, r in zip(count, request)]
    palette = [_SHARED_COLOUR, "white"] + [colours[r] for r in colours]  # index = grid + 2
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    ax.imshow(
        grid + 2,
        cmap=ListedColormap(palette),
        vmin=0,
        vmax=len(palette) - 1,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
    )
    for col, record in enumerate(engine.history):
        for _src, dst, _rows in record.copies:
            ax.add_patch(Rectangle((col - 0.5, dst - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.2))
        for seq_id in record.preempted:
            ax.annotate(
                "P",
                (col, num_pages - 0.5),
                ha="center",
                va="bottom",
                fontsize=10,
                fontweight="bold",
                color=colours[seq_id.split(".")[0]],
                annotation_clip=False,
            )
    ax.set(xlabel="engine step", ylabel="page id")
    # page ids and steps are integers: no tick at 2.5
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, pad=14)
    ax.grid(False)
    handles = [Patch(color=colours[r], label=r) for r in colours] + [Patch(color=_SHARED_COLOUR, label="shared")]
    ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _draw_snapshot(ax, engine, record, title: str, columns: int) -> None:
    colours = request_colours(engine)
    ps, n = engine.page_size, engine.manager.num_blocks
    count, request = _pages(record, n)
    rows = np.zeros(n, dtype=int)
    for seq_id, table in record.tables.items():
        for j, page in enumerate(table):
            rows[page] = max(rows[page], min(ps, record.computed[seq_id] - j * ps))
    copied = {dst for _src, dst, _rows in record.copies}
    hits = {p for seq_id, cached in record.admitted.items() for p in record.tables.get(seq_id, [])[: cached // ps]}
    nrows = -(-n // columns)
    for page in range(n):
        r, c = divmod(page, columns)
        y = nrows - 1 - r
        ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor="0.95", edgecolor="0.75"))
        if count[page]:
            shared = count[page] > 1
            colour = _SHARED_COLOUR if shared else colours[request[page]]
            # Reserved rows not yet written (a prompt still being prefilled) are pale.
            ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor=colour, alpha=0.25, edgecolor="0.5"))
            ax.add_patch(
                Rectangle(
                    (c, y),
                    0.92,
                    0.92 * rows[page] / ps,
                    facecolor=colour,
                    hatch="//" if shared else None,
                    edgecolor="0.3",
                )
            )
        if page in copied:
            ax.add_patch(Rectangle((c, y), 0.92, 0.92, fill=False, edgecolor="black", linewidth=2))
        if page in hits:
            ax.add_patch(Rectangle((c, y), 0.92, 0.92, fill=False, edgecolor="black", linewidth=1.5, linestyle="--"))
        ax.text(c + 0.46, y + 0.46, str(page), ha="center", va="center", fontsize=9)
    ax.set(xlim=(0, columns), ylim=(0, nrows))
    ax.set_title(title, fontsize=10)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_pool_steps(engine, steps: list[int], titles: list[str], columns: int = 10):
    """The pool at several steps, side by side: each page filled to the share of its rows
    holding K/V (pale: reserved, not yet written), coloured by request; shared pages
    hatched grey; outlined in black: pages written by a copy-on-write copy in that step
    (solid) or found in the prefix cache by an admission in that step (dashed). Panels
    are drawn in step order, whatever order ``steps`` (and their ``titles``) come in.
    ValueError if ``titles`` is not one per step."""
    if len(titles) != len(steps):
        raise ValueError(f"titles has {len(titles)} entries for {len(steps)} steps")
    steps, titles = zip(*sorted(zip(steps, titles), key=lambda pair: pair[0])) if steps else ((), ())
    colours = request_colours(engine)
    nrows = -(-engine.manager.num_blocks // columns)
    fig, axes = plt.subplots(1, len(steps), figsize=(2.9 * len(steps) + 0.9, 0.5 * nrows + 0.9), squeeze=False)
    for ax, step, title in zip(axes[0], steps, titles):
        _draw_snapshot(ax, engine, engine.history[step], title, columns)
    handles = [Patch(color=colours[r], label=r) for r in colours] + [Patch(color=_SHARED_COLOUR, label="shared")]
    axes[0, -1].legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_memory(series: dict, pool_bytes: int | None = None, title: str = "KV memory of the same requests"):
    """Reserved bytes per step for each strategy (solid) and the bytes in use (dashed), MiB."""
    fig, ax = plt.subplots()
    mib = 2**20
    colours = {"cat": "tab:orange", "contiguous": "tab:red", "paged": "tab:blue"}
    for name, s in series.items():
        steps = np.arange(len(s.reserved))
        ax.plot(steps, np.array(s.reserved) / mib, color=colours.get(name), label=f"{name}: reserved")
        ax.plot(
            steps, np.array(s.used) / mib, color=colours.get(name), linestyle="--", linewidth=1, label=f"{name}: used"
        )
    if pool_bytes is not None:
        ax.axhline(pool_bytes / mib, color="tab:blue", linestyle=":", linewidth=1, label="paged pool (all pages)")
    ax.set(title=title, xlabel="engine step", ylabel="MiB (fp32 K+V, 30 layers)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_agreement(report, title: str = "engine vs transformers, per generated token"):
    """Two histograms: max |logit difference| per token, and transformers' top-2 logit
    gap per token, with the tolerance drawn on both (log scale)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(7.2, 2.8))
    diffs = np.maximum(np.array(report.diffs), 1e-9)
    gaps = np.maximum(np.array(report.gaps), 1e-9)
    a.hist(diffs, bins=np.logspace(-7, 1, 33), color="tab:blue")
    b.hist(gaps, bins=np.logspace(-4, 2, 31), color="tab:green")
    for ax, label in ((a, "max |logit difference|"), (b, "top-1 minus top-2 logit")):
        ax.axvline(report.tol, color="tab:red", linestyle="--", label=f"tol {report.tol:g}")
        ax.set_xscale("log")
        ax.set(xlabel=label, ylabel="tokens")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig

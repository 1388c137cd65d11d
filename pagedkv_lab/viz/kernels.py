"""Pictures of what kernels do (notebooks 06, 07, 10 and the exercise checker,
:mod:`pagedkv_lab.exercises`): a written pool against the reference, which pool rows one
program touches and which a wrong kernel got wrong (both draw the pool as a grid, one
column per page and one cell per token row), a prefill chunk's masks, and a kernel's
source."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap, to_rgb
from matplotlib.patches import Patch

from pagedkv_lab.viz.charts import plot_categories
from pagedkv_lab.viz.style import FAIL_RED, FREE, OK_GREEN, as_array
from pagedkv_lib.compare import bits


def plot_exact_match(got, want, before=None, title: str = "kernel vs reference"):
    """Instead of a heatmap of an all-zero difference: state the exact equality in the
    title and show *what was compared*, per token row of an NHD pool
    ``[pages, 2, page_size, heads, head_dim]``: rows this step wrote, rows left
    untouched (when ``before`` is given), rows that differ. NaN equals NaN here."""
    got, want = (as_array(x) for x in (got, want))
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs {want.shape}")

    def rows_equal(a, b):
        return ((a == b) | (np.isnan(a) & np.isnan(b))).reshape(*a.shape[:3], -1).all(-1)  # [pages, 2, rows]

    same = rows_equal(got, want)
    codes = np.where(same, 1, 2)
    if before is not None:
        codes = np.where(same & rows_equal(want, as_array(before)), 0, codes)
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


_ROW_STATUS = {
    0: ("untouched, as it should be", "0.93"),
    1: ("written, right", "tab:green"),
    2: ("should be written: wrong or missing", "tab:red"),
    3: ("should be untouched: changed", "tab:orange"),
}


def _pool_grid(ax, colours, text, title: str, pages: Sequence[int] | None = None, hatched=None) -> None:
    """Draw ``colours [num_pages, page_size]`` (matplotlib colours) as one column per page,
    row 0 at the top; ``text`` (same shape, str or None) is written in the cells."""
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
    return fig


def _source(obj) -> tuple[list[str], int]:
    """``obj``'s source lines and the file line number of the first (a module, a function
    or a ``@triton.jit`` kernel)."""
    import inspect

    lines, start = inspect.getsourcelines(getattr(obj, "fn", obj))
    return lines, max(start, 1)


def find_lines(obj, needle: str) -> list[int]:
    """File line numbers (1-based) of the lines of ``obj``'s source (a module, function or
    ``@triton.jit`` kernel) that contain ``needle``; empty when none does. A notebook
    asserts where a lesson line sits (e.g. inside the tile loop) with these."""
    lines, start = _source(obj)
    return [start + i for i, line in enumerate(lines) if needle in line]


def plot_margins(labels: Sequence[str], ratios: Sequence[float], title: str, limit_label: str = "pass rule"):
    """Horizontal bars of ``ratios`` (error / tolerance, log scale), one per label, green
    when <= 1 (passes) and red otherwise, the pass limit 1 drawn as a dashed line;
    labels read horizontally, values written at each bar's end in 9 pt."""
    values = np.maximum(np.asarray(ratios, dtype=float), 1e-12)
    fig, ax = plt.subplots(figsize=(8.0, 1.3 + 0.45 * len(values)))
    y = np.arange(len(values))[::-1]
    ax.barh(y, values, color=[OK_GREEN if r <= 1 else FAIL_RED for r in values], height=0.6)
    for yi, r in zip(y, values):
        ax.annotate(f"{r:.2g}", (r, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=9)
    ax.axvline(1.0, color="k", ls="--", lw=1.0, label=f"{limit_label} (error = tolerance)")
    ax.set_yticks(y, labels)
    ax.set_xscale("log")
    ax.set_xlim(values.min() / 10, max(values.max(), 1.0) * 30)
    ax.set(title=title, xlabel="max |error| / tolerance (log; <= 1 passes)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    fig.tight_layout()
    return fig

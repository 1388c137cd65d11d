"""Pictures of a conformance report (:mod:`pagedkv_lab.verify`): each checked case's
margin by the pass rule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pagedkv_lab.viz.style import FAIL_RED, OK_GREEN


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

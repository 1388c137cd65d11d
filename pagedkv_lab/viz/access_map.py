"""A picture of the learner's own kernel: which pool pages and rows each program read
or wrote, drawn from the loads and stores the kernel made in Triton's interpreter
(recorded by :func:`pagedkv_lab.poisoning.accesses_recorded`).

:func:`access_map` turns the recorded accesses into per-program sets of pool slots
(``page * page_size + row``; a slot holds a K row and a V row of every head): rows read,
rows written, the pool rows masked lanes pointed at (they read and wrote nothing: drawn
apart, pale), and the bytes each program wrote outside the pool and every other tensor
of the launch (red, before or after the pool). :func:`plot_access_map` draws it as a
grid, one row per program and one column per slot, at a readable size whatever the
launch (at least 800 x 400 px)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from pagedkv_lab.viz.style import FAIL_RED, FREE, OK_GREEN, PALETTE
from pagedkv_lib.pool import cache_dims, cache_strides

__all__ = ["AccessMap", "access_map", "plot_access_map", "MIN_FIGSIZE"]

MIN_FIGSIZE = (8.0, 4.0)
"""The smallest access map, in inches (at 100 dpi: 800 x 400 px)."""
_MAX_PROGRAMS = 48  # rows drawn; more are counted in the title
_CODES = (  # (legend, colour) per cell code
    ("nothing", FREE),
    ("masked lanes only (no memory touched)", "0.72"),
    ("read", PALETTE[0]),
    ("written", OK_GREEN),
    ("read and written", PALETTE[5]),
    ("written outside the pool", FAIL_RED),
)


@dataclass
class AccessMap:
    """What each program of a launch touched in one paged pool.

    ``programs`` are the program ids ``(x, y, z)`` that made an access, in order; the
    arrays have one row per program and one column per pool slot (``num_pages *
    page_size``): ``read``, ``written`` (lanes the mask let through), ``masked`` (masked
    lanes whose address was in the pool). ``outside`` is ``int64 [programs, 2]``: the
    bytes each program wrote before and after the pool, outside every tensor named."""

    programs: list[tuple[int, int, int]]
    num_pages: int
    page_size: int
    read: np.ndarray
    written: np.ndarray
    masked: np.ndarray
    outside: np.ndarray

    def slots(self, program: tuple[int, int, int], kind: str) -> set[int]:
        """The slots ``program`` read (``kind="read"``), wrote (``"written"``) or pointed
        masked lanes at (``"masked"``)."""
        row = self.programs.index(tuple(program))
        return {int(s) for s in np.flatnonzero(getattr(self, kind)[row])}


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of the tensors (their whole strided span)."""
    out = []
    for t in tensors:
        span = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0
        out.append((t.data_ptr(), t.data_ptr() + span * t.element_size()))
    return out


def _pool_slots(offsets: np.ndarray, cache: torch.Tensor, layout: str) -> np.ndarray:
    """Slot of each element offset into ``cache`` (its dims taken greatest stride first)."""
    dims = cache_dims(cache, layout)
    sizes = (dims.num_pages, 2, dims.page_size, dims.num_kv_heads, dims.head_dim)
    index, rest = {}, offsets.astype(np.int64)
    for axis in sorted(range(5), key=lambda a: -cache_strides(cache, layout)[a]):
        stride = cache_strides(cache, layout)[axis]
        index[axis] = np.minimum(rest // stride, sizes[axis] - 1)
        rest = rest - index[axis] * stride
    return index[0] * dims.page_size + index[2]


def access_map(accesses: Sequence, cache: torch.Tensor, layout: str = "NHD", tensors=()) -> AccessMap:
    """The :class:`AccessMap` of the recorded ``accesses``
    (:class:`pagedkv_kernels.interpreter.access.Access`) in the pool ``cache`` (raw 5-D,
    ``layout`` ``"NHD"`` or ``"HND"``); ``tensors`` are the launch's other tensors (a
    write into one of them is not outside). Addresses are placed by ``data_ptr()``: the
    tensors must be the ones the kernel saw (CPU tensors under the interpreter)."""
    dims = cache_dims(cache, layout)
    programs = sorted({a.program for a in accesses})
    row_of = {p: i for i, p in enumerate(programs)}
    shape = (len(programs), dims.num_pages * dims.page_size)
    read, written, masked = (np.zeros(shape, dtype=bool) for _ in range(3))
    outside = np.zeros((len(programs), 2), dtype=np.int64)
    (start, end), others = _ranges([cache])[0], _ranges(tensors)
    size = cache.element_size()
    for a in accesses:
        row, addr = row_of[a.program], a.addresses.astype(np.int64)
        inside = (addr >= start) & (addr < end)
        slots = _pool_slots((addr[inside] - start) // size, cache, layout)
        lanes = a.mask[inside]
        (read if a.kind == "load" else written)[row, slots[lanes]] = True
        masked[row, slots[~lanes]] = True
        if a.kind == "store":
            stray = a.mask & ~inside
            for lo, hi in others:
                stray &= ~((addr >= lo) & (addr < hi))
            outside[row, 0] += int((stray & (addr < start)).sum()) * a.itemsize
            outside[row, 1] += int((stray & (addr >= end)).sum()) * a.itemsize
    masked &= ~(read | written)
    return AccessMap(programs, dims.num_pages, dims.page_size, read, written, masked, outside)


def _codes(m: AccessMap) -> np.ndarray:
    """Cell codes (indices into ``_CODES``): ``[programs, page_size + slots + page_size]``,
    the first and last page-wide band the bytes written before and after the pool."""
    body = np.where(m.read & m.written, 4, np.where(m.written, 3, np.where(m.read, 2, np.where(m.masked, 1, 0))))
    edges = np.repeat(np.where(m.outside > 0, 5, 0), m.page_size, axis=1)
    return np.concatenate([edges[:, : m.page_size], body, edges[:, m.page_size :]], axis=1)


def _program_label(p: tuple[int, int, int], axes: int) -> str:
    return str(p[0]) if axes == 1 else "(" + ", ".join(str(i) for i in p[:axes]) + ")"


def _summary(m: AccessMap, axes: int) -> str:
    n = len(m.programs)
    words = [f"{n} program{'s' if n != 1 else ''}"]
    stray = []
    for i in (i for i in range(n) if m.outside[i].any()):
        sides = [f"{int(b)} bytes {side}" for b, side in zip(m.outside[i], ("before it", "after it")) if b]
        stray.append(f"{_program_label(m.programs[i], axes)} ({' and '.join(sides)})")
    if stray:
        more = f" and {len(stray) - 3} more" if len(stray) > 3 else ""
        words.append(f"wrote outside the pool: program {', '.join(stray[:3])}{more}")
    if m.masked.any():
        words.append("pale: rows only masked lanes pointed at")
    return "; ".join(words)


def plot_access_map(m: AccessMap, title: str, expected: np.ndarray | None = None, program_axes: str = ""):
    """Draw ``m``: one row per program (at most 48 shown), one column per pool slot
    (grouped by page), a band before and after the pool for the bytes written outside
    it (red). ``expected`` (``bool [programs, slots]``, optional) marks with a
    dot the rows each program should touch. ``program_axes`` names the grid axes for
    the y label (e.g. ``"(b, h)"``). Returns the figure, at least :data:`MIN_FIGSIZE`."""
    if not m.programs:
        raise ValueError("m: no program made a load or store (was the kernel launched inside accesses_recorded()?)")
    axes = (
        program_axes.count(",") + 1
        if program_axes
        else max([i + 1 for p in m.programs for i in range(3) if p[i]], default=1)
    )
    shown = min(len(m.programs), _MAX_PROGRAMS)
    codes = _codes(m)[:shown]
    slots = m.num_pages * m.page_size
    edge = m.page_size  # the bands before and after the pool: a page wide each
    width = min(11.0, max(MIN_FIGSIZE[0], 3.5 + 0.09 * (slots + 2 * edge)))
    more = f" (first {shown} of {len(m.programs)} shown)" if shown < len(m.programs) else ""
    chars = int(width * 100 / 10)  # 12 pt text at 100 dpi: under 10 px a character
    heading = textwrap.wrap(f"{title}{more}", chars) + textwrap.wrap(_summary(m, axes), chars)
    height = min(10.0, max(MIN_FIGSIZE[1], 2.2 + 0.2 * shown) + 0.2 * max(0, len(heading) - 2))
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    ax.imshow(codes, cmap=ListedColormap([c for _, c in _CODES]), vmin=0, vmax=len(_CODES) - 1, aspect="auto")
    ax.grid(False)
    for page in range(m.num_pages + 1):
        ax.axvline(edge + page * m.page_size - 0.5, color="0.35", linewidth=1.6 if page in (0, m.num_pages) else 0.6)
    for i in range(1, shown):  # a line between programs of different first ids (sequences)
        if axes > 1 and m.programs[i][0] != m.programs[i - 1][0]:
            ax.axhline(i - 0.5, color="0.35", linewidth=0.8)
    step = max(1, -(-m.num_pages // 24))
    pages = list(range(0, m.num_pages, step))
    centre = (m.page_size - 1) / 2
    ax.set_xticks([centre, *(edge + p * m.page_size + centre for p in pages), edge + slots + centre])
    ax.set_xticklabels(["before", *(str(p) for p in pages), "after"])
    ystep = max(1, -(-shown // 24))
    ax.set_yticks(range(0, shown, ystep))
    ax.set_yticklabels([_program_label(m.programs[i], axes) for i in range(0, shown, ystep)])
    ax.set_xlabel(f"pool page ({m.page_size} rows each; a row holds K and V of every head)")
    ax.set_ylabel(f"program {program_axes}".strip())
    if expected is not None:
        ys, xs = np.nonzero(np.asarray(expected, dtype=bool)[:shown])
        ax.scatter(xs + edge, ys, s=9, color="black", marker="o", label="a row it should touch")
    ax.set_title("\n".join(heading), loc="left")
    used = sorted(set(np.unique(codes).tolist()) | {2, 3})
    handles = [Patch(facecolor=_CODES[c][1], edgecolor="0.4", label=_CODES[c][0]) for c in used]
    if expected is not None:
        handles.append(ax.collections[-1])
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig

"""What the checks of exercises 06-08 share: the learner's Triton append kernel
(:mod:`.check_append`), split-KV merge (:mod:`.check_merge`) and paged decode kernel
(:mod:`.check_decode`), each behind the launcher the exercise gives.

Each check runs a few small teaching cases first, whose failures are easy to read, then
cases of the conformance harness (:func:`pagedkv_lab.verify.append_case` and
:func:`~pagedkv_lab.verify.decode_case` on the harness's grid). Expectations are the
float64 references; a copy must match bit for bit, attention within
:data:`pagedkv_lib.compare.TOLERANCES`. In Triton's interpreter the learner's kernel runs
with masked lanes poisoned (``poison_masked=True``, the default: a masked ``tl.load``
without ``other=`` reads NaN, as undefined as on a GPU, instead of 0). This module never
imports triton: the learner's kernel brings it.

Here: the folder of the pictures of failed checks, the poisoning wrapper around a
learner's launcher (which also keeps the interpreter's numpy warnings, such as
``inf - inf`` in an online softmax's first tile, out of the learner's output: a GPU
raises none), the access map of an addressing failure (:func:`access_picture`), the
hint that names the masked loads that read poison, and the pool seen in NHD whatever
its layout.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from pagedkv_lab.exercises.result import code_place
from pagedkv_lab.poisoning import masked_lanes_poisoned

__all__ = [
    "picture_dir",
    "save_picture",
    "access_picture",
    "poisoning",
    "nhd",
    "DECODE_POISON_FIX",
    "MERGE_POISON_FIX",
    "poisoned_hint",
]

_PICTURES: Path | None = None


def picture_dir() -> Path:
    """A folder of this process for the pictures of failed checks (created on first use)."""
    global _PICTURES
    if _PICTURES is None:
        _PICTURES = Path(tempfile.mkdtemp(prefix="pagedkv-exercises-"))
    return _PICTURES


def save_picture(fig, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = picture_dir() / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)  # shown by the result itself, not again by the notebook's inline backend
    return path


def access_picture(
    amap,
    title: str,
    should_touch: Callable[[tuple[int, int, int]], set[int]] | None = None,
    program_axes: str = "",
) -> Path | None:
    """The saved picture (:func:`pagedkv_lab.viz.plot_access_map`) of ``amap``, the
    :class:`~pagedkv_lab.viz.AccessMap` of the learner's launch; ``should_touch(program)``
    the pool slots a program should touch (drawn as dots). None when no program made an
    access (nothing recorded: a compiled kernel, or one run in another process)."""
    from pagedkv_lab.viz import plot_access_map, use_style

    if amap is None or not amap.programs:
        return None
    expected = None
    if should_touch is not None:
        expected = np.zeros_like(amap.read)
        for i, program in enumerate(amap.programs):
            expected[i, sorted(should_touch(program))] = True
    use_style()
    return save_picture(plot_access_map(amap, title, expected, program_axes), "access_map")


def poisoning(fn, on: bool, seen: list | None = None):
    """``fn`` (the learner's launcher) run with masked lanes poisoned (``on``) or reading 0;
    each :class:`~pagedkv_kernels.interpreter.poison.PoisonedLoad` it poisons is added to ``seen``.
    A stand-in for a function that runs in another process (the grader's
    :class:`~pagedkv_lab.grading.remote.RemoteFunction`) is asked to poison there."""
    if hasattr(fn, "with_poison"):
        return fn.with_poison(on, seen)

    def poisoned(*args, **kwargs):
        # numpy's floating-point warnings are the interpreter's, not the kernel's: a GPU
        # computes inf - inf = NaN without a word, and a correct online softmax does so
        with np.errstate(all="ignore"), masked_lanes_poisoned(on) as loads:
            try:
                return fn(*args, **kwargs)
            finally:
                if seen is not None:
                    seen.extend(load for load in loads if load not in seen)

    return poisoned


def nhd(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The pool as ``[pages, 2, page_size, heads, dim]`` whatever its layout."""
    return cache if layout == "NHD" else cache.transpose(2, 3)


DECODE_POISON_FIX = "load masked K/V lanes with other=0.0, and give masked tokens score -inf; 0 * NaN is NaN."
MERGE_POISON_FIX = (
    'load the masked lse lanes with other=float("-inf") (they then weigh exactly 0) and the masked '
    "partial lanes with other=0.0."
)


def poisoned_hint(loads: list, fix: str = DECODE_POISON_FIX) -> str:
    where = "; ".join(f"`{load.source}` ({code_place(load.filename, load.lineno)})" for load in loads)
    return (
        f"NaN came from the masked lanes of a tl.load without other=: {where}. A masked lane reads no "
        "memory; on a GPU it is undefined, whatever its register held (this check fills it with NaN; "
        f"Triton's interpreter alone gives 0): {fix}"
    )

"""The first cell of every notebook, as one call: :func:`setup`.

Every notebook opens with the same five lines (``tests/test_install_hint.py`` keeps them
identical): import :func:`setup` (a Python without the suite stops there with one
sentence on how to install it; that sentence cannot live in the suite it is about), then
call it. What the notebook itself needs it imports in its next cell.
"""

from __future__ import annotations

import torch

from pagedkv_lib import runtime

from .viz import use_style

__all__ = ["setup"]


def setup(kernels: bool = False, threads: int | None = None, seed: int = 0) -> torch.device:
    """Set a notebook up and say so; return the torch device kernel inputs live on.

    In order: with ``kernels`` stop with one sentence where Triton is missing
    (:func:`pagedkv_lib.runtime.require_triton`; notebooks 01-05 never need it), import
    :mod:`pagedkv_kernels` (after the backend is chosen, so the backend line names the
    interpreter patches it applies); fix torch's seed (printed values are compared by
    nbval), use the suite's plot style (:func:`pagedkv_lab.viz.use_style`), and with
    ``threads`` set torch's intra-op threads (1 for the notebooks that run a model on small
    matrices: on a busy 2-core machine two threads ran 20x slower). Prints the backend
    line and one sentence of what it did.
    """
    if kernels:
        runtime.require_triton()
        import pagedkv_kernels  # noqa: F401  (chooses nothing: pagedkv_lib.runtime did; applies its patches)
    torch.manual_seed(seed)
    use_style()
    done = [f"torch seed {seed}", "the suite's plot style"]
    if threads is not None:
        torch.set_num_threads(threads)
        done.append(f"{threads} torch thread{'s' if threads != 1 else ''}")
    if kernels:
        done.append(f"kernels' tensors on {runtime.device()}")
    print(runtime.backend_line())
    print("Set up: " + ", ".join(done) + ".")
    return runtime.device()

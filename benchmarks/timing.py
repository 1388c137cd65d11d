"""The benchmarks' one timer: median seconds of a call, by CUDA events on a GPU and by
the wall clock in Triton's interpreter.

``python benchmarks/bench_x.py`` puts this folder first on ``sys.path``, so every
script imports it as ``timing``. On a GPU :func:`median_seconds` is
``triton.testing.do_bench``'s median (25 ms warm-up, 100 ms of runs, CUDA events, the
L2 cache flushed between runs); in the interpreter the median of ``repeats``
``time.perf_counter`` runs after ``warmup`` untimed ones: interpreter timings, which
show that everything runs, not GPU performance.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pagedkv_lib import runtime

__all__ = ["median_seconds", "timer", "timed"]


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (see the module docstring for how, per backend);
    ``repeats`` and ``warmup`` count calls and apply in the interpreter only."""
    if not runtime.BACKEND.interpreted:
        import triton.testing  # compiled Triton only: the interpreter run never imports it here

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timer(repeats: int, warmup: int = 1) -> Callable[[Callable[[], object]], float]:
    """``time_it(fn) -> seconds``: :func:`median_seconds` with ``repeats`` and ``warmup`` bound."""
    return lambda fn: median_seconds(fn, repeats, warmup)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``(fn(), seconds)``: one call and its wall-clock time, for runs too long to repeat
    (an engine serving a batch)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start

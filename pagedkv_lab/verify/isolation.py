"""Running a check in a child process, so that a kernel that crashes or hangs fails its
case instead of ending the run.

Each case runs in a fresh child (``fork`` on the CPU: the child inherits the callables,
lambdas included, and the inputs are rebuilt there from the case's seed). The child
sends its :class:`~pagedkv_lab.verify.report.CaseResult` back through a pipe. A child
killed by a signal (SIGSEGV, SIGABRT from a corrupted heap), one that exits without
an answer, or one that does not answer within ``timeout_s`` becomes a failed result
naming what happened. On a CUDA machine a forked child cannot use the GPU, so there
the case runs in-process (guard regions still catch writes next to a tensor).
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal
from collections.abc import Callable

from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import runtime

__all__ = ["run_isolated", "can_isolate"]


def can_isolate() -> bool:
    """Whether checks can run in forked children here: the interpreter backend (CPU) on
    a platform with ``fork``."""
    return runtime.BACKEND.interpreted and "fork" in multiprocessing.get_all_start_methods()


def _child(job: Callable[[], CaseResult], conn) -> None:
    import torch

    torch.set_num_threads(1)  # a forked OpenMP pool is not to be trusted; one thread is
    try:
        result = job()
    except BaseException as err:  # noqa: BLE001  (reported, not raised, in the child)
        result = CaseResult("?", {}, False, math.inf, detail=raised(err))
    conn.send(result)
    conn.close()
    os._exit(0)  # no atexit handlers, no flushing of inherited streams


@functools.cache
def _warm_parent() -> None:
    """Do once, in the parent, what torch does lazily on first use, so that every child
    inherits it: ``torch.unravel_index`` (the harness locates errors with it) imports
    sympy through torch.fx the first time, about 0.5 s that each child would pay again."""
    import torch

    torch.unravel_index(torch.tensor(0), (1,))


def run_isolated(job: Callable[[], CaseResult], check: str, case: dict, timeout_s: float) -> CaseResult:
    """Run ``job`` (a check of ``case``) in a forked child and return its result, or a
    failed result saying how the child ended."""
    _warm_parent()
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(job, send), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            try:
                return receive.recv()
            except EOFError:
                pass  # the child died before answering
        else:
            child.kill()
            child.join()
            return CaseResult(check, case, False, math.inf, detail=f"no answer within {timeout_s:g} s (a hang?)")
    finally:
        receive.close()
    child.join()
    code = child.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        what = f"the kernel crashed the process ({name})"
    else:
        what = f"the process exited with status {code} before answering"
    return CaseResult(check, case, False, math.inf, detail=what)

"""Running a check in a child process, so that a kernel that crashes or hangs fails its
case instead of ending the run.

Each case runs in a fresh child (``fork`` on the CPU: the child inherits the callables,
lambdas included, and the inputs are rebuilt there from the case's seed). The child
sends its :class:`~pagedkv_lab.verify.report.CaseResult` back through a pipe. A child
killed by a signal (SIGSEGV, SIGABRT from a corrupted heap), one that exits without
an answer, or one that does not answer within ``timeout_s`` becomes a failed result
naming what happened. On a CUDA machine a forked child cannot use the GPU, so there
the case runs in-process (guard regions still catch writes next to a tensor).

The child never outlives its parent: an exception in the parent while it waits (a
``KeyboardInterrupt`` from the notebook's stop button) kills it before propagating, and
on Linux the kernel kills it when the parent process ends (``PR_SET_PDEATHSIG``), so a
hanging kernel cannot keep a core busy after the notebook that started it is gone.
"""

from __future__ import annotations

import ctypes
import functools
import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable

from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import runtime

__all__ = ["run_isolated", "can_isolate"]


def can_isolate() -> bool:
    """Whether checks can run in forked children here: the interpreter backend (CPU) on
    a platform with ``fork``."""
    return runtime.BACKEND.interpreted and "fork" in multiprocessing.get_all_start_methods()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent ends; if the parent has already
    ended (before the request took effect), end now."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: the parent's kill on interrupt still holds
            pass
    if os.getppid() != parent:
        os._exit(1)


def _child(job: Callable[[], CaseResult], conn, parent: int) -> None:
    _die_with_parent(parent)
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


def _answered(receive, timeout_s: float, progress) -> bool:
    """Wait for the child's answer: True once it can be read (or the child has died),
    False when ``timeout_s`` passed without one, counted from the child's last step
    (each change of ``progress.value``) when ``progress`` is given, else from now."""
    if progress is None:
        return receive.poll(timeout_s)
    step, since = progress.value, time.monotonic()
    while not receive.poll(min(0.5, max(since + timeout_s - time.monotonic(), 0.0))):
        if progress.value != step:
            step, since = progress.value, time.monotonic()
        elif time.monotonic() - since >= timeout_s:
            return False
    return True


def run_isolated(job: Callable[[], CaseResult], check: str, case: dict, timeout_s: float, progress=None) -> CaseResult:
    """Run ``job`` (a check of ``case``) in a forked child and return its result, or a
    failed result saying how the child ended. The child gets ``timeout_s`` seconds, or
    that long for each of its steps when ``progress`` (a shared
    ``multiprocessing.Value`` the child sets as it goes) is given. An exception while
    waiting (``KeyboardInterrupt``) kills the child, then propagates."""
    _warm_parent()
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(job, send, os.getpid()), daemon=True)
    child.start()
    send.close()
    try:
        if _answered(receive, timeout_s, progress):
            try:
                return receive.recv()
            except EOFError:
                pass  # the child died before answering
        else:
            child.kill()
            child.join()
            return CaseResult(check, case, False, math.inf, detail=f"no answer within {timeout_s:g} s (a hang?)")
    except BaseException:
        child.kill()  # never leave a hanging kernel running at 100 % CPU behind an interrupt
        child.join()
        raise
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

"""The checker's side: a learner's functions as stand-ins that call into the learner
process (:mod:`.learner`), so that an exercise's check runs here, in the grader, on
nothing but the values those functions return.

:class:`LearnerProcess` starts the learner process in the sandbox (:mod:`.sandbox`),
runs the notebook's cells there and hands out :class:`RemoteFunction` stand-ins. Calling
one sends its arguments (:mod:`.wire`) and gets back the return value and the arguments
as the learner's function left them, which are written back into the checker's own
objects (a list filled in place, a pool a kernel wrote into, an allocator's refcounts),
as if the function had run here; a returned tensor that views an argument (GQA's
broadcast read) comes back as the same view of the checker's argument, so that a view is
told from a copy by its storage pointer here as in the learner's notebook. An exception
the learner's code raised is raised here as a :class:`LearnerException` of the same name
(a subclass of the built-in exception it was, where it was one), carrying where in the
learner's cells it happened.

Every reply must arrive by one deadline, the learner's time budget: a process that hangs,
dies, or answers something that is not a reply fails the call with a
:class:`LearnerProcessEnded` saying so, and the process (with every process it started)
is killed.
"""

from __future__ import annotations

import os
import select
import signal
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import torch

from pagedkv_lab.grading import sandbox
from pagedkv_lab.grading.launch import SANDBOX_FAILED, launch
from pagedkv_lab.grading.wire import HEAD, MAX_FRAME_BYTES, OBJECT_CLASSES, WireError, pack, unpack

OUTPUT_LIMIT = 20_000  # characters of a cell's output kept for the feedback

__all__ = [
    "OUTPUT_LIMIT",
    "LearnerProcess",
    "RemoteFunction",
    "LearnerException",
    "LearnerProcessEnded",
    "RemoteLoad",
    "CellRun",
]


class LearnerException(Exception):
    """An exception raised by the learner's code in the learner process. ``learner_where``
    is ``file, line N: code`` of its innermost frame in the learner's cells ("" if none);
    ``learner_hint`` a hint of the grader's own ("" if none)."""

    learner_where = ""
    learner_hint = ""
    message = ""

    def __str__(self) -> str:
        return self.message


class LearnerProcessEnded(LearnerException):
    """The learner process ended, hung past its deadline, or answered nonsense."""


@dataclass(frozen=True)
class RemoteLoad:
    """A masked ``tl.load`` without ``other=`` that read poison in the learner process."""

    filename: str
    lineno: int
    source: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}, line {self.lineno}: {self.source}"


@dataclass
class CellRun:
    """What one cell did in the learner process: its ``output`` (stdout and stderr) and,
    if it raised, ``error`` (``ename``, ``evalue``, ``traceback`` lines)."""

    id: str
    output: str
    error: dict | None


_CLASSES: dict[tuple[str, str], type] = {}


def _exception_class(name: str, bases: list) -> type:
    """A :class:`LearnerException` subclass named ``name``, also a subclass of the first
    built-in exception in ``bases`` (so ``isinstance(err, IndexError)`` still holds)."""
    import builtins

    name = name if isinstance(name, str) and name.isidentifier() else "Exception"
    base = next((getattr(builtins, b) for b in bases if isinstance(b, str) and hasattr(builtins, b)), Exception)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        base = Exception
    key = (name, base.__name__)
    if key not in _CLASSES:
        try:
            _CLASSES[key] = type(name, (LearnerException, base), {"__str__": LearnerException.__str__})
        except TypeError:  # a built-in whose layout does not mix
            _CLASSES[key] = type(name, (LearnerException,), {})
    return _CLASSES[key]


def remote_exception(info) -> LearnerException:
    """The :class:`LearnerException` of an ``error`` the learner process sent."""
    if not isinstance(info, dict):
        return LearnerProcessEnded("the learner process answered an error that is not one")
    cls = _exception_class(info.get("type"), info.get("bases") or [])
    err = BaseException.__new__(cls)
    err.message = str(info.get("message", ""))[:2000]
    err.args = (err.message,)
    err.learner_where = str(info.get("where", ""))[:500]
    return err


_MUTABLE = (torch.Tensor, list, dict, set, deque, tuple)


def _restore(mine, theirs, done: dict) -> None:
    """Write ``theirs`` (an argument as the learner's function left it) into ``mine`` (the
    checker's object it was sent from). ``done`` maps the storage pointer of each argument
    tensor as it came back to the checker's storage it was written into. Raises
    :class:`WireError` where they differ in kind."""
    if isinstance(mine, torch.Tensor):
        if not isinstance(theirs, torch.Tensor) or (mine.dtype, mine.shape, mine.stride()) != (
            theirs.dtype,
            theirs.shape,
            theirs.stride(),
        ):
            raise WireError("a tensor came back with another dtype, shape or stride")
        storage, came_back = mine.untyped_storage(), theirs.untyped_storage()
        if came_back.data_ptr() not in done:
            if came_back.nbytes() != storage.nbytes():
                raise WireError("a tensor's storage came back with another size")
            storage.copy_(came_back)
            if came_back.nbytes():  # empty storages share no bytes to be told apart by
                done[came_back.data_ptr()] = storage
    elif type(mine) in (list, dict, set, deque):
        if type(theirs) is not type(mine):
            raise WireError(f"a {type(mine).__name__} came back as a {type(theirs).__name__}")
        if isinstance(mine, list) and len(mine) == len(theirs):
            for i, (m, t) in enumerate(zip(mine, theirs)):
                if isinstance(m, _MUTABLE) and type(t) is type(m):
                    _restore(m, t, done)  # the checker may hold this element too
                else:
                    mine[i] = t
        elif isinstance(mine, list):
            mine[:] = theirs
        else:
            mine.clear()
            mine.update(theirs) if not isinstance(mine, deque) else mine.extend(theirs)
    elif isinstance(mine, tuple):
        if not isinstance(theirs, tuple) or len(theirs) != len(mine):
            raise WireError("a tuple came back with another length")
        for m, t in zip(mine, theirs):
            _restore(m, t, done)
    elif f"{type(mine).__module__}.{type(mine).__qualname__}" in OBJECT_CLASSES:
        if type(theirs) is not type(mine):
            raise WireError(f"a {type(mine).__name__} came back as a {type(theirs).__name__}")
        kept = {k: v for k, v in vars(mine).items() if k not in theirs.__getstate__()}  # its lock stays its own
        mine.__dict__.clear()
        mine.__dict__.update(theirs.__getstate__(), **kept)


def _reseat(value, storages: dict):
    """``value`` (a return value) with every tensor that views an argument's storage as it
    came back (``storages``: :func:`_restore`'s map) set on the checker's storage of that
    argument, at the same offset, shape and strides; tuples and lists are walked."""
    if isinstance(value, torch.Tensor):
        mine = storages.get(value.untyped_storage().data_ptr()) if value.untyped_storage().nbytes() else None
        if mine is None:
            return value
        return torch.empty(0, dtype=value.dtype, device=mine.device).set_(
            mine, value.storage_offset(), value.shape, value.stride()
        )
    if type(value) in (list, tuple):
        return type(value)(_reseat(v, storages) for v in value)
    return value


class RemoteFunction:
    """Stands for the learner's function ``name`` in the checker: calling it runs the
    learner's function in the learner process (see the module docstring)."""

    def __init__(self, process: LearnerProcess, name: str, poison: bool | None = None, seen: list | None = None):
        self.process, self.__name__, self._poison, self._seen = process, name, poison, seen

    def with_poison(self, on: bool, seen: list | None = None) -> RemoteFunction:
        """This function, run with masked lanes poisoned (``on``) or read as 0; each masked
        load that read poison is added to ``seen`` (as :func:`pagedkv_lab.exercises.kernel_checks.poisoning`)."""
        return RemoteFunction(self.process, self.__name__, on, seen)

    def __call__(self, *args, **kwargs):
        reply = self.process.request(
            {"op": "call", "name": self.__name__, "args": list(args), "kwargs": kwargs, "poison": self._poison}
        )
        try:
            if not isinstance(reply, dict) or not isinstance(reply.get("args"), list):
                raise WireError("a reply without the arguments")
            done: dict = {}
            if len(reply["args"]) != len(args):
                raise WireError("a reply with another number of arguments")
            for mine, theirs in zip(args, reply["args"]):
                _restore(mine, theirs, done)
            theirs = reply.get("kwargs")
            if not isinstance(theirs, dict) or theirs.keys() != kwargs.keys():
                raise WireError("a reply without the keyword arguments")
            for key, value in kwargs.items():
                _restore(value, theirs[key], done)
            if self._seen is not None:
                for load in reply.get("loads") or []:
                    site = RemoteLoad(str(load["filename"]), int(load["lineno"]), str(load["source"]))
                    if site not in self._seen:
                        self._seen.append(site)
        except (WireError, KeyError, TypeError, ValueError) as err:
            raise self.process.ended(f"it answered something that is not a reply ({err})") from None
        if "error" in reply:
            raise remote_exception(reply["error"])
        return _reseat(reply.get("value"), done)


class LearnerProcess:
    """A learner's notebook running in the sandbox, for ``timeout_s`` seconds at most in
    all (its cells, then every call). Use as a context manager; :meth:`run_cells` first,
    then :meth:`function`. ``preload``: modules to import before the learner's process
    starts (once per grading process, see :mod:`.zygote`)."""

    def __init__(self, timeout_s: float, isolation: sandbox.Isolation | None = None, preload: tuple = ()) -> None:
        self.isolation = isolation or sandbox.probe()
        self.timeout_s = timeout_s
        self._ended: LearnerProcessEnded | None = None
        self._printed_to = 0
        self._output = tempfile.TemporaryFile()  # the learner's stdout and stderr: it outlives the learner
        self._launched = launch(self.isolation, timeout_s + 5, self._output.fileno(), preload)
        self.deadline = time.monotonic() + timeout_s  # from now: a zygote's first start is not the learner's time
        self._in, self._out = self._launched.answers_fd, self._launched.requests_fd
        os.set_blocking(self._out, False)
        self.where = "starting"  # what the learner process is doing, for messages

    # ---------------------------------------------------------------- the conversation

    def ended(self, why: str) -> LearnerProcessEnded:
        """Kill the learner process and return the exception every later call raises."""
        if self._ended is None:
            self.kill()
            err = LearnerProcessEnded.__new__(LearnerProcessEnded)
            err.message = f"the process running your notebook {why}, while {self.where}"
            err.args = (err.message,)
            err.learner_hint = _TIMEOUT_HINT if "within" in why else _GARBLED_HINT if "reply" in why else _ENDED_HINT
            self._ended = err
        return self._ended

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _send(self, data: bytes) -> None:
        if self._ended is not None:
            raise self._ended
        view = memoryview(data)
        while view:
            if self._left() <= 0:
                raise self.ended(f"did not finish within {self.timeout_s:g} s")
            _, ready, _ = select.select([], [self._out], [], min(self._left(), 1.0))
            if ready:
                try:
                    view = view[os.write(self._out, view) :]
                except BlockingIOError:
                    pass
                except BrokenPipeError:
                    raise self.ended(self._how_it_ended()) from None

    def _receive(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            if self._left() <= 0:
                raise self.ended(f"did not finish within {self.timeout_s:g} s")
            ready, _, _ = select.select([self._in], [], [], min(self._left(), 1.0))
            if ready:
                chunk = os.read(self._in, min(left, 1 << 20))
                if not chunk:
                    raise self.ended(self._how_it_ended())
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    def request(self, message: dict):
        """Send ``message``; return the learner process's reply (its message)."""
        if self._ended is not None:
            raise self._ended
        self._send(pack(message))
        return self._reply()

    def _reply(self):
        (n,) = HEAD.unpack(self._receive(HEAD.size))
        if n > MAX_FRAME_BYTES:
            raise self.ended(f"answered something that is not a reply (a frame of {n} bytes announced)")
        try:
            return unpack(self._receive(n))
        except WireError as err:
            raise self.ended(f"answered something that is not a reply ({err})") from None

    def _how_it_ended(self) -> str:
        code = self._launched.exit_code(5)
        if code == SANDBOX_FAILED:  # the grader's problem, not the learner's
            raise RuntimeError(f"the learner's sandbox failed: {self._launched.problem()}")
        if code is not None and 128 < code < 128 + 65:
            return f"was killed by {signal.Signals(code - 128).name}"
        return "ended" if code in (0, 1, None) else f"ended with status {code}"

    # ---------------------------------------------------------------- what the checker uses

    def run_cells(self, cells: list[tuple[str, str]]) -> list[CellRun]:
        """Run ``cells`` (``(id, source)`` pairs, in order) in the learner process; returns
        what each did. If the process ends (or hangs) in a cell, that cell gets what it
        printed and the end as its error, the cells after it nothing, and every later
        call raises the same :class:`LearnerProcessEnded`."""
        self.where = "running your notebook's cells"
        runs: list[CellRun] = []
        try:
            self._send(pack({"op": "cells", "cells": [{"id": i, "source": s} for i, s in cells]}))
            for cell_id, _ in cells:
                done = self._reply()
                if not isinstance(done, dict) or done.get("id") != cell_id:
                    raise self.ended("answered something that is not a reply")
                error = done.get("error") if isinstance(done.get("error"), dict) else None
                runs.append(CellRun(cell_id, self._printed(done.get("start"), done.get("end")), error))
            if self._reply() != {"done": True}:
                raise self.ended("answered something that is not a reply")
        except LearnerProcessEnded as err:
            if len(runs) < len(cells):
                error = {"ename": "LearnerProcessEnded", "evalue": str(err), "traceback": [str(err)]}
                runs.append(CellRun(cells[len(runs)][0], self._printed(self._printed_to, None), error))
            return runs + [CellRun(i, "", None) for i, _ in cells[len(runs) :]]
        self.where = "running the check"
        return runs

    def _printed(self, start, end) -> str:
        """The learner's output between the offsets ``start`` and ``end`` (None: the end of
        what it wrote), at most :data:`OUTPUT_LIMIT` characters."""
        size = os.fstat(self._output.fileno()).st_size
        start = min(max(start, 0), size) if isinstance(start, int) else size
        end = size if not isinstance(end, int) else min(max(end, start), size)
        self._printed_to = end
        text = os.pread(self._output.fileno(), min(end - start, 4 * OUTPUT_LIMIT), start).decode(errors="replace")
        return text if len(text) <= OUTPUT_LIMIT else text[:OUTPUT_LIMIT] + "\n[... output cut]"

    def function(self, name: str) -> RemoteFunction:
        """The stand-in for the learner's function ``name``."""
        return RemoteFunction(self, name)

    # ---------------------------------------------------------------- the end

    def kill(self) -> None:
        """End the learner process and every process it started."""
        self._launched.kill()

    def close(self) -> None:
        if self._ended is None:
            try:
                self._send(pack({"op": "bye"}))
                self._launched.exit_code(2)
            except LearnerProcessEnded:
                pass
        self._launched.close()
        self._output.close()

    def __enter__(self) -> LearnerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_TIMEOUT_HINT = (
    "your code did not return: look for a loop that never ends (a while loop whose condition never "
    "changes, a page or slot that is never reached)."
)
_GARBLED_HINT = (
    "your code wrote into the grader's channel (a file descriptor it did not open itself), or returned something "
    "that cannot be sent back: print what you want to see, and return plain values (numbers, lists, tensors)."
)
_ENDED_HINT = (
    "your code ended its own process (os._exit, a signal, a crash in a kernel): the grader runs each "
    "learner's notebook in a process of its own, so only your grade is affected."
)

"""What a check returns, and how a failure is told to the learner.

A :class:`CheckResult` prints as plain words: which case failed (what it is about), its
inputs, what was expected, what came back, the first difference, a hint, and for the
kernel exercises the path of a picture of the pool rows that were wrong. In a notebook
it also shows that picture inline. Exceptions raised by the learner's code become a
:class:`Failure` too (:class:`LearnerError`), never a traceback.
"""

from __future__ import annotations

import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Failure", "CheckResult", "LearnerError", "call", "where_in_learner_code", "show", "code_place"]

_WIDTH = 100
_LIBRARY_PARTS = ("site-packages", "dist-packages", "/pagedkv_lib/", "/pagedkv_lab/", "/pagedkv_kernels/", "<frozen")


def show(value, limit: int = 400) -> str:
    """A short, readable rendering of an input or output value (tensors as lists)."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            if value.numel() > 64:
                return f"tensor of shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}"
            value = value.tolist()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


class LearnerError(Exception):
    """The learner's function raised: carries the original exception and the call."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"{name} raised {type(error).__name__}: {error}")
        self.name = name
        self.error = error


def call(name: str, fn, *args, **kwargs):
    """Call the learner's ``fn``; an exception from it becomes :class:`LearnerError`."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # anything the learner's code raises is a result to explain
        raise LearnerError(name, err) from err


def _notebook_cell(filename: str) -> int | None:
    """The execution count of the notebook cell whose code IPython compiled as
    ``filename`` (ipykernel names a cell's code after a hash of its source), or None."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with the lab's extras
        return None
    shell = get_ipython()
    if shell is None:
        return None
    history, name = shell.history_manager.input_hist_raw, Path(filename).name
    for number in range(len(history) - 1, 0, -1):  # the latest run of that source first
        # the history keeps a cell without its trailing newlines; the name hashes it whole.
        # Names only: ipykernel's folder holds the process id, and a check's child has its own
        for source in (history[number] + "\n" * k for k in range(4)):
            try:
                if Path(shell.compile.get_code_name(source, source, number)).name == name:
                    return number
            except Exception:  # a compiler of another shape: name the file instead
                return None
    return None


def code_place(filename: str, lineno: int) -> str:
    """Where a line of the learner's code is, in words: ``cell [7], line 29`` for a cell
    of the running notebook (as JupyterLab numbers it), else ``file.py, line 29``."""
    cell = _notebook_cell(filename)
    return f"cell [{cell}], line {lineno}" if cell is not None else f"{Path(filename).name}, line {lineno}"


def where_in_learner_code(error: BaseException) -> str:
    """``file:line: code`` of the innermost frame outside the library and site-packages
    (the learner's cell or kernel), following chained exceptions ("" if none). An
    exception that came from another process (the grader's learner process) says it
    itself, as ``learner_where``."""
    if getattr(error, "learner_where", ""):
        return error.learner_where
    seen, found = set(), None
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            if not any(part in frame.filename for part in _LIBRARY_PARTS):
                found = frame
        error = error.__cause__ or error.__context__
    return "" if found is None else f"{code_place(found.filename, found.lineno)}: {(found.line or '').strip()}"


@dataclass
class Failure:
    """The first failing case of a check, in plain words.

    ``case`` is the 1-based case number out of ``total``; ``label`` says what the case
    is about. ``inputs`` are ``(name, rendering)`` pairs. ``picture`` is the path of a
    saved PNG (kernel exercises), or None.
    """

    case: int
    total: int
    label: str
    inputs: list[tuple[str, str]] = field(default_factory=list)
    expected: str = ""
    got: str = ""
    detail: str = ""
    hint: str = ""
    picture: Path | None = None
    detail_head: str = "first wrong"

    def lines(self) -> list[str]:
        out = [f"case {self.case} of {self.total}: {self.label}"]
        if self.inputs:
            width = max(len(name) for name, _ in self.inputs)
            out.append("  inputs:")
            out += [f"    {name:<{width}} = {value}" for name, value in self.inputs]
        for head, text in (("expected", self.expected), ("got", self.got), (self.detail_head, self.detail)):
            if text:
                out.append(_wrap(f"  {head}: ", text))
        if self.hint:
            out.append(_wrap("  hint: ", self.hint))
        if self.picture is not None:
            what = (
                "access map of your kernel" if Path(self.picture).stem == "access_map" else "picture of the pool rows"
            )
            out.append(f"  {what}: {self.picture}")
        return out


def _wrap(head: str, text: str) -> str:
    lines = []
    for paragraph in str(text).split("\n"):
        lines += textwrap.wrap(paragraph, _WIDTH - len(head)) or [""]
    pad = " " * len(head)
    return head + ("\n" + pad).join(lines)


@dataclass
class CheckResult:
    """Outcome of :func:`pagedkv_lab.exercises.check`: ``passed``, how many cases ran, the
    wall time in seconds, the first :class:`Failure` (None when passed) and ``summary``
    (what passing covered). ``str()`` is the message a learner reads."""

    exercise: str
    passed: bool
    cases: int
    seconds: float
    failure: Failure | None = None
    summary: str = ""

    @property
    def message(self) -> str:
        if self.passed:
            return f"PASS {self.exercise}: {self.summary} ({self.seconds:.1f} s)"
        head = f"FAIL {self.exercise}, " + "\n".join(self.failure.lines())
        return head

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"CheckResult(exercise={self.exercise!r}, passed={self.passed})"

    def _ipython_display_(self) -> None:  # pragma: no cover - exercised in JupyterLab
        from IPython.display import Image, display

        print(self.message)
        if self.failure is not None and self.failure.picture is not None:
            display(Image(filename=str(self.failure.picture)))

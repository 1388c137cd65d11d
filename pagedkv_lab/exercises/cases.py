"""The case runner every exercise check uses: cases in order, stop at the first failure,
turn an exception from the learner's code into a message.

The kernel exercises run their cases in a forked child process
(:func:`pagedkv_lab.verify.isolation.run_isolated`, the harness's isolation): a learner's
kernel that writes far outside its tensors (a heap corruption, ``free(): invalid
size``) or hangs ends the child, not the learner's Jupyter kernel, and comes back as a
message naming the case that was running. The child is forked, so it inherits the
process's whole state: the learner's functions, the backend, every setting. A case that
runs longer than :data:`CASE_TIMEOUT_S` is a hang: the child is killed and the message
says so, that many seconds after the case began; the child also dies with the check
(a stop button, the notebook's kernel ending).
"""

from __future__ import annotations

import multiprocessing
import re
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv_lab.exercises.result import CheckResult, Failure, LearnerError, show, where_in_learner_code
from pagedkv_lab.verify.isolation import can_isolate, run_isolated

__all__ = ["Case", "Mismatch", "run_cases", "first_wrong_index", "as_ints", "CASE_TIMEOUT_S"]

# Each case of an isolated check: the slowest case of a solution (a decode grid case, or
# the first case, which pays the interpreter's warm-up) took 10 s on 2 loaded cores.
CASE_TIMEOUT_S = 60.0


@dataclass
class Mismatch:
    """How one case went wrong: renderings of the expected and returned values, the
    first difference in words, a diagnosis (``hint``) and an optional picture."""

    expected: str
    got: str
    detail: str = ""
    hint: str = ""
    picture: Path | None = None
    detail_head: str = "first wrong"


@dataclass
class Case:
    """One case: ``run()`` returns None when the learner's code is right, else a
    :class:`Mismatch`. ``hint`` says what the case tests; it is shown when the mismatch
    has no sharper diagnosis of its own (and after it when it has)."""

    label: str
    run: Callable[[], Mismatch | None]
    inputs: list[tuple[str, str]] = field(default_factory=list)
    hint: str = ""


def _error_hint(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if getattr(error, "learner_hint", ""):  # the grader's own words (a hang, a process that ended)
        return error.learner_hint
    if isinstance(error, NotImplementedError):
        return "the stub is not filled in yet: replace the `raise NotImplementedError(...)` line with your code."
    if "mask has unsupported dtype" in text:
        return (
            "Triton's interpreter refuses a mask built as `scalar_condition & tile`. Fold the scalar test "
            "into a bound instead, e.g. `heads < tl.where(slot >= 0, num_heads, 0)`, or compare a tile."
        )
    if "arange" in text and ("power of 2" in text or "constexpr" in text):
        return (
            "tl.arange takes a compile-time power of two: use the BLOCK_ size you are given (a tl.constexpr) "
            "and mask the lanes past the end."
        )
    if isinstance(error, IndexError):
        return "an index ran past the end of a list: check the padding value -1 and the last (partly filled) page."
    return ""


def _from_error(err: LearnerError) -> Mismatch:
    e = err.error
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    where = where_in_learner_code(e)
    return Mismatch(
        expected="a return value",
        got=f"{err.name} raised {type(e).__name__}" + (f": {message[:300]}" if message else ""),
        detail=where,
        hint=_error_hint(e),
        detail_head="raised at",
    )


def run_cases(
    exercise: str, cases: Iterable[Case], summary: str, isolate: bool = False, timeout_s: float | None = None
) -> CheckResult:
    """Run ``cases`` in order and stop at the first failure. An exception raised by the
    learner's code (wrapped by :func:`~pagedkv_lab.exercises.result.call`) fails its
    case with the exception's text and where it was raised; any other exception is a
    bug in the checker and propagates (from a child too, as a RuntimeError holding
    its traceback).

    ``isolate``: run the cases in one forked child (where the backend allows it: the
    interpreter on a platform with ``fork``; compiled on a GPU they run here, as the
    harness's do). A child that crashes, exits, or spends more than ``timeout_s``
    seconds (default :data:`CASE_TIMEOUT_S`) on one case fails the case it was
    running, with how it ended."""
    cases = list(cases)
    if not (isolate and can_isolate()):
        return _run_here(exercise, cases, summary)
    timeout_s = CASE_TIMEOUT_S if timeout_s is None else timeout_s
    progress = multiprocessing.get_context("fork").Value("i", 0)  # shared with the child: the case it runs
    start = time.perf_counter()

    def job():
        try:
            return _run_here(exercise, cases, summary, progress)
        except Exception:  # a bug of the checker: carried back, raised in the parent
            return traceback.format_exc()

    outcome = run_isolated(job, exercise, {}, timeout_s, progress)
    if isinstance(outcome, str):
        raise RuntimeError(f"the check of {exercise} raised in its child process:\n{outcome}")
    if isinstance(outcome, CheckResult):
        return outcome
    i = max(progress.value, 1)  # the child ended without answering: outcome.detail says how
    case = cases[i - 1]
    hung = outcome.detail.startswith("no answer within")
    expected = f"your code to return within {timeout_s:g} s" if hung else "your code to return"
    failure = Failure(
        i, len(cases), case.label, case.inputs, expected, outcome.detail, "", _ended_hint(hung, case.hint), None
    )
    return CheckResult(exercise, False, i, time.perf_counter() - start, failure)


def _ended_hint(hung: bool, case_hint: str) -> str:
    """The hint for a child that ended without answering: it hung, or it died."""
    if hung:
        what = (
            "your code did not finish this case (the check stopped it; your notebook lives on): look for a "
            "while loop whose counter never reaches its bound (a tile index not advanced, a bound read as "
            "garbage or -1), or a loop over far more tiles than the sequence has. "
        )
    else:
        what = (
            "your kernel wrote (or read) so far outside its tensors that the process died; the check ran in a "
            "child process, so your notebook lives on. Look for an unmasked lane, a -1 slot or page used as an "
            "index, or a wrong stride. "
        )
    return (what + case_hint).strip()


def _run_here(exercise: str, cases: list[Case], summary: str, progress=None) -> CheckResult:
    """The cases in this process; ``progress.value`` (a shared int) is set to each case's
    number before it runs."""
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        if progress is not None:
            progress.value = i
        try:
            mismatch = case.run()
        except LearnerError as err:
            mismatch = _from_error(err)
        if mismatch is not None:
            hint = combine_hints(mismatch.hint, case.hint)
            failure = Failure(
                i,
                len(cases),
                case.label,
                case.inputs,
                mismatch.expected,
                mismatch.got,
                mismatch.detail,
                hint,
                mismatch.picture,
                mismatch.detail_head,
            )
            return CheckResult(exercise, False, i, time.perf_counter() - start, failure)
    return CheckResult(exercise, True, len(cases), time.perf_counter() - start, None, summary)


def combine_hints(diagnosis: str, case_hint: str) -> str:
    """The diagnosis, then what the case tests, without saying a thing twice: a sentence of
    ``case_hint`` the diagnosis holds (in any letter case) is dropped; one whose statement
    (after its ``": "``) the diagnosis already makes (the same words, or every formula
    right of an ``=``) is cut to its lead-in."""
    kept = []
    for sentence in (s.strip() for s in re.split(r"(?<=\.)\s+", case_hint) if s.strip()):
        head, sep, tail = sentence.partition(": ")
        if sentence.rstrip(".").lower() in diagnosis.lower():
            continue
        # the statement's formulas (right of each "=") all in the diagnosis: said already
        formulas = [part.split(" = ", 1)[-1].strip(" .") for part in tail.split(", ")]
        if sep and (tail.rstrip(".") in diagnosis or all(f and f in diagnosis for f in formulas)):
            sentence = head + "."
        kept.append(sentence)
    return " ".join(h for h in (diagnosis, *kept) if h)


def first_wrong_index(got: list, expected: list) -> int | None:
    """Index of the first element where two equal-length lists differ, else None."""
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            return i
    return None


def listing(values) -> str:
    """Render a returned sequence for a message."""
    return show(list(values) if isinstance(values, tuple) else values)


def as_ints(name: str, value) -> list[int] | Mismatch:
    """``value`` as a list of Python ints, or a Mismatch saying what came back instead."""
    try:
        values = value.tolist() if hasattr(value, "tolist") else list(value)
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return Mismatch("a list of ints", f"{name} returned {show(value)} ({type(value).__name__})")

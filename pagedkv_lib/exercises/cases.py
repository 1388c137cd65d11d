"""The case runner every exercise check uses: cases in order, stop at the first failure,
turn an exception from the learner's code into a message."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .result import CheckResult, Failure, LearnerError, show, where_in_learner_code

__all__ = ["Case", "Mismatch", "run_cases", "first_wrong_index"]


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


def run_cases(exercise: str, cases: Iterable[Case], summary: str) -> CheckResult:
    """Run ``cases`` in order and stop at the first failure. An exception raised by the
    learner's code (wrapped by :func:`~pagedkv_lib.exercises.result.call`) fails its
    case with the exception's text and where it was raised; any other exception is a
    bug in the checker and propagates."""
    cases = list(cases)
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        try:
            mismatch = case.run()
        except LearnerError as err:
            mismatch = _from_error(err)
        if mismatch is not None:
            hint = " ".join(h for h in (mismatch.hint, case.hint) if h)
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


def first_wrong_index(got: list, expected: list) -> int | None:
    """Index of the first element where two equal-length lists differ, else None."""
    for i, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            return i
    return None


def listing(values) -> str:
    """Render a returned sequence for a message."""
    return show(list(values) if isinstance(values, tuple) else values)

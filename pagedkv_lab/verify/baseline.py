"""Baselines: what changed between a saved report and this run.

With standing failures (a kernel outside the suite that fails a few known cases), a
new bug hides among them. Give :func:`pagedkv_lab.verify.run` (or the command line's
``--baseline PATH``) a report saved with ``--json`` (or :meth:`Report.to_json`), and the
report lists only the changes: **new failures** (a case that failed now and did not
fail then: passed, was outside the contract, or was not in the baseline), **new
causes** (a case that failed then and fails now for a reason it did not fail for then:
a second bug in an already failing case), **fixed** cases (failed then, pass now),
**fewer causes** (still failing, for fewer reasons) and **changed margins** (a case that
passes in both, whose ``err / tol`` moved by more than a factor of 2 above 0.01). The
run fails on new failures and new causes. Cases are matched by check and case dict; a
hypothesis summary (whose worst case moves with every draw) by its check alone.

A failure's **cause** (:func:`failure_cause`) is what kind of wrong it is, without the
numbers and places that move with any change: non-finite outputs, a finite output where
NaN was due, a mismatch beyond tolerance, a write before or past a named tensor, a
modified input, an exception (its type and the ``@triton.jit`` function it came from),
a crash or a hang, and the NaN attribution (which unused rows the kernel reads, or that
it fails with finite stale values too). A missing softmax rescale planted in a kernel
that already read NaN tails keeps the cases failing, but their attribution changes
from "reads the tail" to "fails with finite stale values too": new causes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BaselineDiff", "load_baseline", "diff_against", "case_key", "failure_cause"]

# What a part of a failure's detail (split at "; ") says went wrong: (pattern, cause),
# the first match wins; a cause with {} takes the pattern's first group. None: a part
# that is a location or a note, not a cause.
_CAUSES = (
    (r"finite outputs where the reference is NaN", "a NaN hidden"),
    (r"rows not kept NaN or -inf", "a NaN or empty row not kept"),
    (r"non-finite outputs", "non-finite outputs"),
    (r"^the worst:", None),
    (r"beyond tolerance", "beyond tolerance"),
    (r"^shape \(", "wrong shape"),
    (r"returned (\w+), not a tensor", "returned a {}"),
    (r"wrote into the pool", "wrote into the pool"),
    (r"modified its input (\w+)", "modified its input {}"),
    (r"wrote before (\w+)", "wrote before {}"),
    (r"wrote after the end of (\w+)", "wrote past {}"),
    (r"crashed the process \((\w+)\)", "crashed ({})"),
    (r"no answer within", "no answer (a hang)"),
    (r"exited with status", "exited without an answer"),
    (r"nothing checked", "nothing checked"),
    (r"missing write", "a missing write"),
    (r"wrong value", "a wrong value"),
    (r"a write outside the addressed slots", "a write outside the addressed slots"),
    (r"^NaN attribution:", None),
    (r"takes no \w+: ran with its own", None),
)
_NUMBER = re.compile(r"-?\d[\d.]*(?:e[+-]?\d+)?")

MARGIN_FACTOR = 2.0  # a margin that moved by more than this factor is reported
MARGIN_FLOOR = 0.01  # margins below this (near bit-exact) are noise


def case_key(check: str, case: dict) -> str:
    """The key that matches a result with its baseline entry: check and case as JSON
    (tuples and lists alike); a hypothesis summary by its check alone."""
    if "generated" in case:
        return check
    return check + " " + json.dumps(json.loads(json.dumps(case, default=str)), sort_keys=True)


def _part_cause(part: str) -> str | None:
    for pattern, cause in _CAUSES:
        m = re.search(pattern, part)
        if m:
            return cause.format(*m.groups()) if cause and m.groups() else cause
    head = _NUMBER.sub("N", part.split(":")[0]).strip()  # a detail no rule knows: its words
    return head[:80] or None


def _raised_cause(detail: str) -> str:
    """``raised <Type>`` (for Triton's InterpreterError, the original type too) and the
    ``@triton.jit`` function it came from."""
    kind = re.match(r"raised (\w+)(?:: (\w+):)?", detail)
    cause = "raised " + (kind.group(1) if kind else "?")
    if kind and kind.group(1) == "InterpreterError" and kind.group(2):
        cause += f" ({kind.group(2)})"
    jit = re.search(r"@triton\.jit function (\w+)", detail)
    return cause + (f" in {jit.group(1)}" if jit else "")


def _attribution_causes(attribution: str) -> list[str]:
    if "still fails" in attribution:
        return ["fails with finite stale values too"]
    if "passes with finite stale values" not in attribution:
        return []
    read = [f"reads unused rows: {what}" for what in ("the tail", "pages no sequence") if what in attribution]
    return read or ["reads unused rows: only NaN in both kinds together"]


def failure_cause(detail: str, attribution: str = "", status: str = "FAIL") -> tuple[str, ...]:
    """What kind of wrong a failure is (see the module docstring), as sorted words
    without numbers or places; ``()`` for a result that did not fail. Parts of the
    detail prefixed ``lse: `` (the log-sum-exp check) keep the prefix."""
    if status != "FAIL":
        return ()
    detail = detail or ""
    if detail.startswith("raised "):  # the exception's own message may hold anything
        causes = [_raised_cause(detail)]
    else:
        causes = []
        for part in detail.split("; "):
            prefix = "lse " if part.startswith("lse: ") else ""
            cause = _part_cause(part.removeprefix("lse: "))
            if cause:
                causes.append(prefix + cause)
    causes += _attribution_causes(attribution or "")
    return tuple(sorted(set(causes)))


@dataclass
class BaselineDiff:
    """The changes against a baseline: ``new_failures`` and ``fixed`` as lists of
    results (this run's); ``new_causes`` and ``fewer_causes`` as ``(result, then,
    now)`` triples of still failing cases whose causes (:func:`failure_cause`) gained
    one or only lost some; ``margins`` as ``(result, then, now)`` triples."""

    new_failures: list = field(default_factory=list)
    fixed: list = field(default_factory=list)
    margins: list = field(default_factory=list)
    new_causes: list = field(default_factory=list)
    fewer_causes: list = field(default_factory=list)
    still_failing: int = 0
    source: str = ""

    @property
    def failed(self) -> bool:
        """Whether the run is worse than the baseline: a new failure or a new cause."""
        return bool(self.new_failures or self.new_causes)

    def summary(self) -> str:
        return (f"against the baseline {self.source}: {len(self.new_failures)} new failures, "
                f"{len(self.new_causes)} failing for a new cause, {len(self.fixed)} fixed, "
                f"{len(self.fewer_causes)} failing for fewer causes, {len(self.margins)} margins changed, "
                f"{self.still_failing} still failing as before")  # fmt: skip

    def to_json(self) -> dict:
        def causes(triples):
            return [{"case": case_key(r.check, r.case), "then": list(a), "now": list(b)} for r, a, b in triples]

        return {
            "source": self.source,
            "new_failures": [case_key(r.check, r.case) for r in self.new_failures],
            "new_causes": causes(self.new_causes),
            "fixed": [case_key(r.check, r.case) for r in self.fixed],
            "fewer_causes": causes(self.fewer_causes),
            "margins": [{"case": case_key(r.check, r.case), "then": a, "now": b} for r, a, b in self.margins],
            "still_failing": self.still_failing,
        }


def load_baseline(baseline) -> tuple[dict, str]:
    """``({case_key: entry}, source)`` from a path to a saved JSON report, its data
    (a dict as :meth:`Report.to_json` returns) or a :class:`Report`. ValueError names
    a file that is missing or not a report."""
    source = "given"
    if hasattr(baseline, "to_json"):
        baseline = baseline.to_json()
    elif isinstance(baseline, (str, Path)):
        source = str(baseline)
        try:
            baseline = json.loads(Path(baseline).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"baseline={source!r} is not a readable JSON report: {err}") from None
    if not isinstance(baseline, dict) or not isinstance(baseline.get("results"), list):
        raise ValueError(f"baseline {source} has no 'results' list: save one with --json or Report.to_json()")
    return {case_key(e["check"], e["case"]): e for e in baseline["results"]}, source


def _entry_cause(entry: dict) -> tuple[str, ...]:
    """A saved result's cause: saved with it, or (a report saved before causes were)
    derived from its detail and attribution."""
    if entry.get("cause") is not None:
        return tuple(entry["cause"])
    return failure_cause(entry.get("detail") or "", entry.get("attribution") or "", entry.get("status", "FAIL"))


def diff_against(results, baseline) -> BaselineDiff:
    """The :class:`BaselineDiff` of ``results`` (this run's) against ``baseline``."""
    entries, source = load_baseline(baseline)
    diff = BaselineDiff(source=source)
    for r in results:
        then = entries.get(case_key(r.check, r.case))
        was = then["status"] if then else None
        if r.status == "FAIL":
            if was != "FAIL":
                diff.new_failures.append(r)
                continue
            before, now = _entry_cause(then), failure_cause(r.detail, r.attribution)
            if set(now) - set(before):
                diff.new_causes.append((r, before, now))
            elif set(before) - set(now):
                diff.fewer_causes.append((r, before, now))
            else:
                diff.still_failing += 1
        elif r.status == "pass" and was == "FAIL":
            diff.fixed.append(r)
        elif r.status == "pass" and was == "pass":
            a, b = then.get("tol_ratio"), r.tol_ratio
            if a is not None and b is not None and max(a, b) >= MARGIN_FLOOR:
                if max(a, b) > MARGIN_FACTOR * max(min(a, b), MARGIN_FLOOR / MARGIN_FACTOR):
                    diff.margins.append((r, a, b))
    return diff

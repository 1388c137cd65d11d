"""Baselines: what changed between a saved report and this run.

With standing failures (a kernel outside the suite that fails a few known cases), a
new bug hides among them. Give :func:`pagedkv_lab.verify.run` (or the command line's
``--baseline PATH``) a report saved with ``--json`` (or :meth:`Report.to_json`), and the
report lists only the changes: **new failures** (a case that failed now and did not
fail then: passed, was outside the contract, or was not in the baseline), **fixed**
cases (failed then, pass now) and **changed margins** (a case that passes in both,
whose ``err / tol`` moved by more than a factor of 2 above 0.01). The run fails only
on new failures. Cases are matched by check and case dict; a hypothesis summary (whose
worst case moves with every draw) by its check alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BaselineDiff", "load_baseline", "diff_against", "case_key"]

MARGIN_FACTOR = 2.0  # a margin that moved by more than this factor is reported
MARGIN_FLOOR = 0.01  # margins below this (near bit-exact) are noise


def case_key(check: str, case: dict) -> str:
    """The key that matches a result with its baseline entry: check and case as JSON
    (tuples and lists alike); a hypothesis summary by its check alone."""
    if "generated" in case:
        return check
    return check + " " + json.dumps(json.loads(json.dumps(case, default=str)), sort_keys=True)


@dataclass
class BaselineDiff:
    """The changes against a baseline: ``new_failures`` and ``fixed`` as lists of
    results (this run's), ``margins`` as ``(result, then, now)`` triples."""

    new_failures: list = field(default_factory=list)
    fixed: list = field(default_factory=list)
    margins: list = field(default_factory=list)
    still_failing: int = 0
    source: str = ""

    def summary(self) -> str:
        return (f"against the baseline {self.source}: {len(self.new_failures)} new failures, {len(self.fixed)} fixed, "
                f"{len(self.margins)} margins changed, {self.still_failing} still failing")  # fmt: skip

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "new_failures": [case_key(r.check, r.case) for r in self.new_failures],
            "fixed": [case_key(r.check, r.case) for r in self.fixed],
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


def diff_against(results, baseline) -> BaselineDiff:
    """The :class:`BaselineDiff` of ``results`` (this run's) against ``baseline``."""
    entries, source = load_baseline(baseline)
    diff = BaselineDiff(source=source)
    for r in results:
        then = entries.get(case_key(r.check, r.case))
        was = then["status"] if then else None
        if r.status == "FAIL":
            if was == "FAIL":
                diff.still_failing += 1
            else:
                diff.new_failures.append(r)
        elif r.status == "pass" and was == "FAIL":
            diff.fixed.append(r)
        elif r.status == "pass" and was == "pass":
            a, b = then.get("tol_ratio"), r.tol_ratio
            if a is not None and b is not None and max(a, b) >= MARGIN_FLOOR:
                if max(a, b) > MARGIN_FACTOR * max(min(a, b), MARGIN_FLOOR / MARGIN_FACTOR):
                    diff.margins.append((r, a, b))
    return diff

"""What the harness returns: one :class:`CaseResult` per check and case, gathered in a
:class:`Report` that prints as a table with a repro line for every failure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedkv_lab.verify.baseline import BaselineDiff, failure_cause

__all__ = ["CaseResult", "Report", "located"]

_STATUSES = ("pass", "FAIL", "skip", "outside")


@dataclass
class CaseResult:
    """One check on one case.

    ``passed`` is None when the check did not run: skipped (``detail`` says why), or
    ``outside`` the kernel's declared contract (the reason). ``max_abs`` / ``max_rel`` are the
    errors against the reference and ``atol`` the absolute tolerance; ``tol_ratio`` is
    the largest ``|err| / (atol + rtol |ref|)`` by the pass rule (>= 1 fails; 0 for a
    bit-exact check that passed). ``fns`` maps the callables this check ran
    (``append_fn``, ``decode_fn``, ...) to their import paths (``"module:function"``),
    None for one without. ``kind``: ``"kernel"`` (the check called a callable under
    test), ``"self-check"`` (a check of the suite's own arithmetic, such as
    ``int64_offsets``: it never counts as the kernel's pass) or ``"nothing"`` (a family
    or run in which nothing of the kernel was checked: a failure). ``attribution``: why
    a case that failed on non-finite outputs did, from re-runs with finite stale values
    (:mod:`.stale`).
    """

    check: str
    case: dict
    passed: bool | None
    max_abs: float = 0.0
    max_rel: float = 0.0
    atol: float = 0.0
    detail: str = ""
    tol_ratio: float | None = None
    faults: tuple[str, ...] = ()
    fns: dict[str, str | None] = field(default_factory=dict)
    outside: str | None = None
    kind: str = "kernel"
    attribution: str = ""

    @property
    def cause(self) -> tuple[str, ...]:
        """What kind of wrong this failure is, without numbers or places
        (:func:`.baseline.failure_cause`); ``()`` unless it failed."""
        return failure_cause(self.detail, self.attribution, self.status)

    @property
    def status(self) -> str:
        """``"pass"``, ``"FAIL"``, ``"skip"`` or ``"outside"`` (the declared contract)."""
        if self.passed is None:
            return "outside" if self.outside else "skip"
        return "pass" if self.passed else "FAIL"

    @property
    def repro(self) -> str:
        """A line that re-runs this case when pasted: the callables it ran by import
        path; one without (a lambda, a closure, a wrapped callable) by its argument name,
        with a comment saying to bind that name to it first. "" for a "nothing checked"
        result."""
        if self.kind == "nothing":
            return ""
        args = [repr(self.check.split("[")[0]), repr(self.case)]
        local = []
        for arg, path in sorted(self.fns.items()):
            args.append(f"{arg}={path!r}" if path else f"{arg}={arg}")
            if not path:
                local.append(arg)
        if self.faults:
            args.append(f"faults={set(self.faults)!r}")
        line = f"from pagedkv_lab import verify; verify.run_case({', '.join(args)})"
        if local:
            names = ", ".join(local)
            line += f"  # first bind {names} to your callable (it has no import path 'module:function')"
        return line


@dataclass
class Report:
    """The results of a run. ``baseline``: the changes against a saved report when the
    run was given one (:mod:`.baseline`); the report then prints only those, and passes
    unless there is a new failure or a failure with a new cause."""

    results: list[CaseResult] = field(default_factory=list)
    baseline: BaselineDiff | None = None

    @property
    def passed(self) -> bool:
        """No new failure and no new cause of a standing failure against the baseline
        when there is one; else no failure at all (a run that checked nothing of the
        kernel carries a "nothing" failure)."""
        if self.baseline is not None:
            return not self.baseline.failed
        return all(r.passed is not False for r in self.results)

    @property
    def self_checks(self) -> list[CaseResult]:
        """Checks of the suite's own arithmetic that never call the kernel."""
        return [r for r in self.results if r.kind == "self-check"]

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.passed is False]

    @property
    def outside_contract(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == "outside"]

    def rows(self) -> list[dict]:
        """One dict per result: check, case, status, max_abs, max_rel, atol, tol_ratio, detail."""
        return [
            {
                "check": r.check,
                "case": _short(r.case),
                "status": r.status,
                "max_abs": r.max_abs,
                "max_rel": r.max_rel,
                "atol": r.atol,
                "tol_ratio": r.tol_ratio,
                "detail": r.outside or r.detail,
            }
            for r in self.results
        ]

    def to_json(self) -> dict:
        """The report as JSON-ready data (for other projects' CI): a summary, then one
        entry per result with its case as a dict, its status, errors, detail and repro
        line (failures only)."""

        def number(x):
            return None if x is None or x != x or x in (float("inf"), float("-inf")) else x

        counts = {s: sum(r.status == s for r in self.results) for s in _STATUSES}
        return {
            "passed": self.passed,
            "counts": counts,
            "baseline": None if self.baseline is None else self.baseline.to_json(),
            "results": [
                {
                    "check": r.check,
                    "case": r.case,
                    "status": r.status,
                    "max_abs": number(r.max_abs),
                    "max_rel": number(r.max_rel),
                    "atol": r.atol,
                    "tol_ratio": number(r.tol_ratio),
                    "detail": r.outside or r.detail,
                    "faults": list(r.faults),
                    "kind": r.kind,
                    "attribution": r.attribution or None,
                    "cause": list(r.cause) or None,
                    "repro": r.repro if r.passed is False else None,
                }
                for r in self.results
            ],
        }

    def to_frame(self):
        """The rows as a pandas DataFrame (pandas is optional)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> str:
        """Counts of the kernel's checks; the suite's self-checks apart."""
        kernel = [r for r in self.results if r.kind != "self-check"]
        counts = {s: sum(r.status == s for r in kernel) for s in _STATUSES}
        text = f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"
        text += f", {counts['outside']} outside the declared contract" if counts["outside"] else ""
        selfs = self.self_checks
        if selfs:
            ok, bad = sum(r.passed is True for r in selfs), sum(r.passed is False for r in selfs)
            text += f"; suite self-checks (they call no kernel, and count as no pass of it): {ok} passed, {bad} failed"
        return text

    def _baseline_text(self) -> str:
        diff = self.baseline
        lines = [diff.summary()]
        for label, results in (("new failure", diff.new_failures), ("fixed", diff.fixed)):
            lines += [f"  {label:<12} {r.check:<16} {_short(r.case)}  {r.detail}" for r in results]
        for label, triples in (("new cause", diff.new_causes), ("fewer causes", diff.fewer_causes)):
            lines += [f"  {label:<12} {r.check:<16} {_short(r.case)}  cause {', '.join(a)} -> {', '.join(b)}; "
                      f"{r.detail}" for r, a, b in triples]  # fmt: skip
        lines += [f"  {'margin':<12} {r.check:<16} {_short(r.case)}  err/tol {a:.2g} -> {b:.2g}"
                  for r, a, b in diff.margins]  # fmt: skip
        lines += [f"reproduce: {r.repro}" for r in [*diff.new_failures, *(t[0] for t in diff.new_causes)]]
        return "\n".join(lines)

    def __str__(self) -> str:
        if self.baseline is not None:
            return self._baseline_text()
        lines = [f"{'check':<18} {'status':<6} {'max_abs':>9} {'err/tol':>8}  case / detail"]
        for row in self.rows():
            if row["status"] == "outside":
                continue
            ratio = "" if row["tol_ratio"] is None else f"{row['tol_ratio']:.2g}"
            lines.append(
                f"{row['check']:<18} {row['status']:<6} {row['max_abs']:>9.2e} {ratio:>8}  "
                f"{row['case']}{'  ' + row['detail'] if row['detail'] else ''}"
            )
        outside = self.outside_contract
        if outside:
            lines.append(f"outside the declared contract ({len(outside)}, neither passed nor failed):")
            lines += [f"  {r.check:<16} {_short(r.case)}  ({r.outside})" for r in outside]
        lines.append(self.summary())
        for r in self.failures:
            if r.repro:
                lines.append(f"reproduce: {r.repro}")
        return "\n".join(lines)

    def plot(self, title: str = "conformance: margin by the pass rule"):
        """One bar per checked case of ``max |err| / (atol + rtol |ref|)``, the pass rule
        itself (:func:`pagedkv_lab.viz.plot_conformance`): a case fails at or above 1."""
        from pagedkv_lab import viz

        return viz.plot_conformance(*viz.conformance_margins(self.results), title)


def located(result, where: Callable[[tuple], str], out=None, expected=None) -> str:
    """The detail of a failed :func:`pagedkv_lib.compare.compare` ``result``, located:
    non-finite outputs (``result.detail``) with ``where`` of the first one; a finite
    mismatch as ``first beyond tolerance: <where(first)>: <got> instead of <ref>, then
    the worst: <where(worst)> (<x> x the tolerance)`` (values when ``out`` and
    ``expected`` are given). ``where`` turns an index tuple into words (request, head,
    feature ...). "" for a passing result or one that could not be located."""
    if result.passed or result.worst is None:
        return result.detail
    first = result.first or result.worst
    if result.detail:  # non-finite outputs, or a NaN hidden: where the first one is
        return f"{result.detail}, the first at {where(first)}"

    def value(idx):
        if out is None or expected is None:
            return ""
        got = float(torch.as_tensor(out).detach().cpu()[idx])
        return f": {got:.6g} instead of {float(expected[idx]):.6g}"

    text = f"first beyond tolerance: {where(first)}{value(first)}"
    if first != result.worst:
        text += f"; the worst: {where(result.worst)}{value(result.worst)}"
    return text + f" ({result.tol_ratio:.3g} x the tolerance at the worst)"


def _short(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")

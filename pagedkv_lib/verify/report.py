"""What the harness returns: one :class:`CaseResult` per check and case, gathered in a
:class:`Report` that prints as a table with a repro line for every failure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["CaseResult", "Report"]

_STATUS = {True: "pass", False: "FAIL", None: "skip"}


@dataclass
class CaseResult:
    """One check on one case.

    ``passed`` is None when the check was skipped. ``max_abs`` / ``max_rel`` are the
    errors against the reference and ``atol`` the absolute tolerance; ``tol_ratio`` is
    the largest ``|err| / (atol + rtol |ref|)`` by the pass rule (>= 1 fails; 0 for a
    bit-exact check that passed). ``fns`` maps ``append_fn`` / ``decode_fn`` to the
    import path (``"module:function"``) of the callable that ran, when it has one.
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

    @property
    def repro(self) -> str:
        """A line that re-runs this case when pasted. Callables without an import path
        (lambdas, closures) appear as a name in capitals to replace with your own."""
        args = [repr(self.check.split("[")[0]), repr(self.case)]
        for arg, path in sorted(self.fns.items()):
            args.append(f"{arg}={path!r}" if path else f"{arg}={arg.upper()}")
        if self.faults:
            args.append(f"faults={set(self.faults)!r}")
        return f"from pagedkv_lib import verify; verify.run_case({', '.join(args)})"


@dataclass
class Report:
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.passed is False]

    def rows(self) -> list[dict]:
        """One dict per result: check, case, status, max_abs, max_rel, atol, tol_ratio, detail."""
        return [
            {
                "check": r.check,
                "case": _short(r.case),
                "status": _STATUS[r.passed],
                "max_abs": r.max_abs,
                "max_rel": r.max_rel,
                "atol": r.atol,
                "tol_ratio": r.tol_ratio,
                "detail": r.detail,
            }
            for r in self.results
        ]

    def to_frame(self):
        """The rows as a pandas DataFrame (pandas is optional)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> str:
        counts = {s: sum(r.passed is p for r in self.results) for p, s in _STATUS.items()}
        return f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"

    def __str__(self) -> str:
        lines = [f"{'check':<18} {'status':<6} {'max_abs':>9} {'err/tol':>8}  case / detail"]
        for row in self.rows():
            ratio = "" if row["tol_ratio"] is None else f"{row['tol_ratio']:.2g}"
            lines.append(
                f"{row['check']:<18} {row['status']:<6} {row['max_abs']:>9.2e} {ratio:>8}  "
                f"{row['case']}{'  ' + row['detail'] if row['detail'] else ''}"
            )
        lines.append(self.summary())
        for r in self.failures:
            lines.append(f"reproduce: {r.repro}")
        return "\n".join(lines)

    def plot(self, title: str = "conformance: error / tolerance per case"):
        """Bar per checked case of its error over the tolerance by the pass rule (log
        scale; a case fails at or above 1, drawn red). Bit-exact checks that pass are
        drawn at 1e-8."""
        import matplotlib.pyplot as plt

        ratios, colors = [], []
        for r in self.results:
            if r.passed is None:
                continue
            ratio = r.tol_ratio if r.tol_ratio is not None else (0.0 if r.passed else math.inf)
            ratio = 1e3 if not math.isfinite(ratio) else ratio
            ratios.append(max(ratio, 1e-8) if r.passed else max(ratio, 1.0))
            colors.append("tab:green" if r.passed else "tab:red")
        fig, ax = plt.subplots()
        ax.bar(range(len(ratios)), ratios, color=colors)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set(title=title, xlabel="case", ylabel="max |err| / (atol + rtol |ref|)")
        fig.tight_layout()
        return fig


def _short(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")

"""Generated cases: hypothesis draws append and decode cases beyond the fixed grid and,
on a failure, shrinks it to a minimal case that is reported with its repro line."""

from __future__ import annotations

from .append_checks import append_case
from .decode_checks import decode_case
from .grid import accepts
from .report import CaseResult

__all__ = ["generated_cases"]


def generated_cases(kind: str, fn, examples: int) -> list[CaseResult]:
    """Run ``examples`` generated ``kind`` (``"append"`` or ``"decode"``) cases through
    ``fn``. All pass: one summary result naming the worst case. One fails: hypothesis
    shrinks it, and the shrunk case is the single result returned."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    common = {
        "layout": st.sampled_from(["NHD", "HND"]),
        "dtype": st.sampled_from(["fp32", "fp16", "bf16"]),
        "head_dim": st.sampled_from([16, 64, 80]),
        "page_size": st.sampled_from([1, 3, 5, 16]),
        "num_kv_heads": st.sampled_from([1, 2]),
        "seed": st.integers(0, 2**16),
    }
    if kind == "decode":
        fields = {
            **common,
            "group": st.sampled_from([1, 2, 3, 5]),
            "seq_lens": st.lists(st.integers(0, 40), min_size=1, max_size=3),
            "poison": st.booleans(),
        }
        if accepts(fn, "num_splits"):
            fields["num_splits"] = st.sampled_from([None, 1, 2, 3])
        strategy = st.fixed_dictionaries(fields)
        run_one = lambda c: decode_case(fn, c)  # noqa: E731
    else:
        strategy = st.fixed_dictionaries(
            {**common, "num_tokens": st.integers(0, 40), "padding": st.integers(0, 3), "noncontiguous": st.booleans()}
        )
        run_one = lambda c: append_case(fn, {**c, "padding": min(c["padding"], c["num_tokens"])})  # noqa: E731
    results: list[CaseResult] = []

    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def prop(case):
        result = run_one(case)
        result.check = f"{kind}[hypothesis]"
        results.append(result)
        assert result.passed, result.detail

    try:
        prop()
    except AssertionError:  # hypothesis re-raises the failure after shrinking and replaying it
        shrunk = results[-1]  # the last run is the shrunk case
        shrunk.detail = f"shrunk from {len(results)} generated cases; {shrunk.detail}"
        return [shrunk]
    worst = max(results, key=lambda r: r.tol_ratio or 0.0)
    summary = {"generated": len(results), "worst": worst.case}
    return [
        CaseResult(f"{kind}[hypothesis]", summary, True, worst.max_abs, worst.max_rel, worst.atol, "", worst.tol_ratio)
    ]

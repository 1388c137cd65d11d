"""Generated cases: hypothesis draws append and decode cases beyond the fixed grid, only
inside the kernel's declared contract.

Every generated case runs (a failure does not stop the run: all failures are
reported); then the first failure is shrunk by hypothesis to a minimal case, reported
last with its repro line.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedkv_lab.verify.append_checks import append_case
from pagedkv_lab.verify.contract import Contract, admits
from pagedkv_lab.verify.decode_checks import decode_case
from pagedkv_lab.verify.grid import accepts
from pagedkv_lab.verify.report import CaseResult

__all__ = ["generated_cases"]


def _strategy(kind: str, fn, contract: Contract):
    from hypothesis import strategies as st

    def pick(values, domain=None, allowed=None):
        keep = [v for v in values if (allowed is None or v in allowed) and admits(domain, v)]
        return st.sampled_from(keep or values[:1])

    common = {
        "layout": pick(["NHD", "HND"], allowed=contract.layouts),
        "dtype": pick(["fp32", "fp16", "bf16"], allowed=contract.dtypes),
        "head_dim": pick([16, 64, 80], contract.head_dims),
        "page_size": pick([1, 3, 5, 16], contract.page_sizes),
        "num_kv_heads": st.sampled_from([1, 2]),
        "seed": st.integers(0, 2**16),
    }
    if kind == "decode":
        fields = {
            **common,
            "group": pick([1, 2, 3, 5], contract.gqa_groups),
            "seq_lens": st.lists(
                st.integers(contract.min_seq_len, max(40, contract.min_seq_len)), min_size=1, max_size=3
            ),
            "poison": st.booleans(),
        }
        if accepts(fn, "num_splits"):
            fields["num_splits"] = st.sampled_from([None, 1, 2, 3])
        return st.fixed_dictionaries(fields)
    padding = st.integers(0, 3) if contract.padding else st.just(0)
    noncontiguous = st.booleans() if contract.strided_kv else st.just(False)
    return st.fixed_dictionaries(
        {**common, "num_tokens": st.integers(0, 40), "padding": padding, "noncontiguous": noncontiguous}
    ).map(lambda c: {**c, "padding": min(c["padding"], c["num_tokens"])})


def generated_cases(
    kind: str, fn, examples: int, contract: Contract | None = None, runner: Callable | None = None
) -> list[CaseResult]:
    """Run ``examples`` generated ``kind`` (``"append"`` or ``"decode"``) cases through
    ``fn`` (each through ``runner(check, case)`` when given, e.g. in a child process).
    All pass: one summary result naming the worst case. Some fail: every failure, then
    the first one shrunk to a minimal case."""
    from hypothesis import HealthCheck, given, settings

    from pagedkv_lab.verify.contract import contract_of

    contract = contract or contract_of(fn)
    case_fn = append_case if kind == "append" else decode_case
    run_one = runner or (lambda check, case: case_fn(fn, case, contract))
    strategy = _strategy(kind, fn, contract)
    config = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    results: list[CaseResult] = []
    shrunk: list[CaseResult] = []
    state = {"shrinking": False, "drawn": 0, "first_failure": None}

    # One property for both passes, so that the derandomized draws come in the same
    # order: the first pass runs every case; the second stops at the first failure
    # and lets hypothesis shrink it.
    def prop(case):
        state["drawn"] += 1
        if contract.outside(case) is not None:
            return
        result = run_one(kind, case)
        if not state["shrinking"]:
            results.append(result)
            if result.passed is False and state["first_failure"] is None:
                state["first_failure"] = state["drawn"]
            return
        shrunk.append(result)
        assert result.passed is not False, result.detail

    settings(max_examples=examples, **config)(given(strategy)(prop))()
    for r in results:
        r.check = f"{kind}[hypothesis]"
    failures = [r for r in results if r.passed is False]
    if not failures:
        if not results:
            return [CaseResult(f"{kind}[hypothesis]", {}, None, detail="no generated case inside the contract")]
        worst = max(results, key=lambda r: r.tol_ratio or 0.0)
        summary = {"generated": len(results), "worst": worst.case}
        return [
            CaseResult(
                f"{kind}[hypothesis]", summary, True, worst.max_abs, worst.max_rel, worst.atol, "", worst.tol_ratio
            )
        ]
    state["shrinking"] = True
    try:
        settings(max_examples=state["first_failure"], **config)(given(strategy)(prop))()
    except AssertionError:  # hypothesis re-raises the failure after shrinking and replaying it
        last = shrunk[-1]
        last.check = f"{kind}[hypothesis, shrunk]"
        last.detail = f"shrunk from {len(shrunk)} runs; {last.detail}"
        return failures + [last]
    return failures

"""The harness fails wrong kernels: mutation testing of the suite's own kernels.

Each mutant in :mod:`mutants` is the real kernel source with one small edit (a bug
that real paged kernels have shipped with). The harness must fail every one of them,
on the checks that exist to catch it, while the unmutated kernels pass (see
``test_verify.py``). A mutant is judged on the grid and scenarios in order and
stops at its first failing case, which is what ``verify.run`` would report first.
"""

import pytest

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import reference

# isort: split
import mutants

import pagedkv_kernels as kernels


def first_failure(append_fn=None, decode_fn=None):
    """The first failing result of the decode grid, the append grid and the scenarios
    (in that order; with the reference for a side not given), or None."""
    if decode_fn is not None:
        for case in verify.decode_grid():
            result = verify.decode_case(decode_fn, case)
            if not result.passed:
                return result
    if append_fn is not None:
        for case in verify.append_grid():
            result = verify.append_case(append_fn, case)
            if not result.passed:
                return result
    writer, reader = append_fn or reference.append_paged_kv, decode_fn or reference.paged_decode_attention
    for scenario in verify.SCENARIOS.values():
        result = scenario(writer, reader, frozenset())
        if result.passed is False:
            return result
    return None


# Where each mutant must be caught first: the check name and a phrase of its detail
# or case (a long, multi-split case for the numerics bugs; the pool check for a write).
EXPECTED = {
    "no_rescale": ("decode", "num_splits"),
    "equal_split_weights": ("decode", "num_splits"),
    "reads_prefix": ("decode", "num_splits"),
    "writes_pool": ("decode", "decode wrote into the pool"),
    "drops_last_token": ("decode", "first beyond tolerance"),
    "ignores_window": ("decode", "window"),
    "gqa_off_by_one": ("decode", "first beyond tolerance"),
    "append_drops_last_token": ("append", "elements differ"),
    "append_v_over_k": ("append", "elements differ"),
}


@pytest.mark.parametrize("mutant", mutants.DECODE_MUTANTS + mutants.APPEND_MUTANTS, ids=lambda m: m.name)
def test_harness_fails_the_mutant(mutant):
    fn = mutants.build(mutant)
    is_decode = mutant in mutants.DECODE_MUTANTS
    failure = first_failure(decode_fn=fn) if is_decode else first_failure(append_fn=fn)
    assert failure is not None, f"the harness passes a kernel whose bug is: {mutant.bug}"
    check, phrase = EXPECTED[mutant.name]
    assert failure.check == check
    assert phrase in failure.detail or phrase in str(failure.case), (failure.detail, failure.case)


def test_numerics_mutants_pass_every_short_case():
    """Why the long cases exist: the online-softmax, split-merge and prefix bugs are
    invisible on sequences that fit one KV tile, which is all the grid held before."""
    short = [c for c in verify.decode_grid() if max(c["seq_lens"]) <= 80]
    for name in ("no_rescale", "equal_split_weights", "reads_prefix"):
        fn = mutants.build(next(m for m in mutants.DECODE_MUTANTS if m.name == name))
        assert all(verify.decode_case(fn, c).passed for c in short), name


def test_full_run_reports_a_mutant_with_a_replayable_line():
    """End to end: ``verify.run`` fails the mutant, and the printed repro line names a
    callable that ``run_case`` can import (the suite's kernel, which passes it)."""
    fn = mutants.build(mutants.DECODE_MUTANTS[0])
    report = verify.run(decode_fn=fn, checks=("decode",))
    assert not report.passed and report.failures
    failure = report.failures[0]
    assert "decode_fn='kernels_mutant_no_rescale.decode:paged_decode_attention'" in failure.repro
    assert verify.run_case("decode", failure.case, decode_fn=fn).passed is False
    assert verify.run_case("decode", failure.case, decode_fn=kernels.paged_decode_attention).passed is True


def test_a_patch_that_no_longer_applies_is_an_error_not_a_pass():
    stale = mutants.Mutant(
        "stale", "nothing", {"decode": (("this text is not in the kernel", ""),)}, "paged_decode_attention"
    )
    with pytest.raises(AssertionError, match="occurs 0 times"):
        mutants.build(stale)

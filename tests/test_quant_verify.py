"""The harness's quantized family: it passes on correct code, and each quantized fault
is caught by the check built for it."""

import pytest

import pagedkv_kernels as kernels
from pagedkv_lab import faults, verify
from pagedkv_lib import quant_reference

QUANT_CAUGHT_BY = {"nvfp4_unrounded_scale": "quant_append", "shared_kv_scale": "quant_scales"}
IMPLEMENTATIONS = {
    "reference": (quant_reference.append_paged_kv_quant, quant_reference.paged_decode_attention_quant),
    "kernels": (kernels.append_paged_kv_quant_pool, kernels.paged_decode_attention_quant_pool),
}


def run(impl, **kwargs):
    append_fn, decode_fn = IMPLEMENTATIONS[impl]
    kwargs.setdefault("checks", verify.QUANT_CHECKS)
    return verify.run(quant_append_fn=append_fn, quant_decode_fn=decode_fn, **kwargs)


def test_the_quantized_faults_are_in_the_one_table_of_faults():
    assert set(QUANT_CAUGHT_BY) <= set(faults.FAULTS)
    assert faults.check_faults({"shared_kv_scale", "past_len_zero"}) == {"shared_kv_scale", "past_len_zero"}


def test_quantized_family_passes_on_the_suites_kernels():
    # (The references pass by construction: they are what the grid compares with.)
    report = run("kernels")
    assert report.passed, str(report)
    assert {r.check for r in report.results if r.passed} == set(verify.QUANT_CHECKS)
    assert sum(r.check == "quant_append" for r in report.results) >= 9


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fault", sorted(QUANT_CAUGHT_BY))
def test_quantized_fault_is_caught_by_its_check(impl, fault):
    check = QUANT_CAUGHT_BY[fault]
    report = run(impl, faults={fault}, checks=(check,))
    assert report.failures and {r.check for r in report.failures} == {check}, str(report)


def test_quantized_family_runs_only_when_a_quantized_callable_is_given():
    report = verify.run(checks=("quant_append", "quant_scales"))
    assert [r.kind for r in report.results] == ["nothing"]  # no callable: nothing ran, and that fails


def test_failing_quantized_case_repro_line_replays_the_failure():
    report = run("kernels", faults={"nvfp4_unrounded_scale"}, checks=("quant_append",))
    failure = report.failures[0]
    assert (
        "verify.run_case('quant_append'" in failure.repro
        and "pagedkv_kernels.adapters.quant_pool_entry:append_paged_kv_quant_pool" in failure.repro
    )
    again = verify.run_case(
        failure.check,
        failure.case,
        quant_append_fn="pagedkv_kernels.adapters.quant_pool_entry:append_paged_kv_quant_pool",
        faults=failure.faults,
    )
    assert again.passed is False
    assert verify.run_case(failure.check, failure.case, quant_append_fn=kernels.append_paged_kv_quant_pool).passed


def test_run_case_names_the_missing_quantized_callable():
    with pytest.raises(ValueError, match="quant_decode_fn"):
        verify.run_case("quant_decode", verify.quant_decode_grid()[0])

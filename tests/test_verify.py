"""The conformance harness: it passes on correct code, and every fault breaks a check."""

import subprocess
import sys

import pytest

import kernels
from pagedkv_lib import faults, reference, verify

# The check each fault is built to break (the harness may catch it elsewhere too).
CAUGHT_BY = {
    "past_len_zero": "chunked_prefill",
    "window_write_only": "ring_window",
    "v_tail_not_zeroed": "v_tail",
    "no_copy_on_write": "fork_cow",
    "minus_one_as_index": "append",
    "stale_block_table": "reused_page",
    "int32_offset": "int64_offsets",
    "chunk_local_mask": "prefill",
}
IMPLEMENTATIONS = {  # (append_fn, decode_fn, prefill_fn)
    "reference": (reference.append_paged_kv, reference.paged_decode_attention, reference.paged_prefill_attention),
    "kernels": (kernels.append_paged_kv, kernels.paged_decode_attention, kernels.paged_prefill_attention),
}


def test_every_fault_has_a_check():
    assert set(CAUGHT_BY) == set(faults.FAULTS)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_harness_passes_on_correct_code(impl):
    report = verify.run(*IMPLEMENTATIONS[impl], hypothesis_examples=3)
    assert report.passed, str(report)
    checks = {r.check for r in report.results if r.passed}
    assert {"append", "decode", "prefill", "append[hypothesis]", "decode[hypothesis]", *CAUGHT_BY.values()} <= checks


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fault", sorted(CAUGHT_BY))
def test_fault_is_caught_by_its_check(impl, fault):
    check = CAUGHT_BY[fault]
    report = verify.run(*IMPLEMENTATIONS[impl], faults={fault}, checks=(check,))
    assert [r.check for r in report.failures] and {r.check for r in report.failures} == {check}, str(report)


def test_unknown_fault_and_check_are_refused_by_name():
    with pytest.raises(ValueError, match="nonsense"):
        verify.run(reference.append_paged_kv, faults={"nonsense"})
    with pytest.raises(ValueError, match="bogus"):
        verify.run(reference.append_paged_kv, checks=("bogus",))


def test_failing_case_repro_line_replays_the_failure():
    broken = faults.minus_one_as_index(reference.append_paged_kv)
    report = verify.run(broken, checks=("append",))
    failure = report.failures[0]
    assert "verify.run_case('append'" in failure.repro
    assert verify.run_case(failure.check, failure.case, append_fn=broken).passed is False
    assert verify.run_case(failure.check, failure.case, append_fn=reference.append_paged_kv).passed is True
    compile(failure.repro, "<repro>", "exec")


def test_hypothesis_shrinks_a_failure_to_one_reported_case():
    broken = faults.minus_one_as_index(reference.append_paged_kv)
    results = verify.generated_cases("append", broken, 30)
    assert len(results) == 1 and results[0].passed is False
    assert results[0].case["padding"] >= 1  # the shrunk case still has a padding slot
    assert "shrunk" in results[0].detail


def test_report_table_counts_and_plot():
    report = verify.run(reference.append_paged_kv, faults={"minus_one_as_index"}, checks=("append",))
    rows = report.rows()
    assert {r["status"] for r in rows} == {"pass", "FAIL"}
    assert report.summary().endswith("0 skipped") and "reproduce:" in str(report)
    assert len(report.plot().axes[0].patches) == len(rows)


def test_cli_exits_nonzero_only_when_a_check_fails():
    cmd = [sys.executable, "-m", "pagedkv_lib.verify", "--reference", "--hypothesis", "0"]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run([*cmd, "--fault", "past_len_zero"], capture_output=True, text=True)
    assert bad.returncode == 1 and "FAIL" in bad.stdout

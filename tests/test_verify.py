"""The conformance harness: it passes on correct code, and every fault breaks a check."""

import json
import subprocess
import sys

import pytest

import pagedkv_kernels as kernels
from pagedkv_kernels.tools import verify as suite_tool
from pagedkv_lab import faults, verify
from pagedkv_lib import reference

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
    "tree_mask_ignored": "prefill",
    "rotary_at_cache_position": "rotary_append",
}
IMPLEMENTATIONS = {  # (append_fn, decode_fn, prefill_fn)
    "reference": (reference.append_paged_kv, reference.paged_decode_attention, reference.paged_prefill_attention),
    "kernels": (kernels.append_paged_kv, kernels.paged_decode_attention, kernels.paged_prefill_attention),
}
ROTARY_APPEND = {"reference": reference.append_paged_kv_csr, "kernels": kernels.append_paged_kv_csr}


def test_every_fault_has_a_check():
    from test_quant_verify import QUANT_CAUGHT_BY

    assert set(CAUGHT_BY) | set(QUANT_CAUGHT_BY) == set(faults.FAULTS)


@pytest.fixture(scope="module")
def suite_report():
    """The harness on the suite's kernels, every family (merge, quantized, MLA, prefix hits,
    LSEs), with the contracts their command line declares: run once for the tests below
    (~15 s on 2 cores), in-process."""
    defaults, contracts = suite_tool.suite_defaults()
    return verify.run(**defaults, contracts=contracts, hypothesis_examples=3)


def test_harness_passes_on_the_reference():
    impl = "reference"
    report = verify.run(*IMPLEMENTATIONS[impl], rotary_append_fn=ROTARY_APPEND[impl], hypothesis_examples=3)
    assert report.passed, str(report)
    checks = {r.check for r in report.results if r.passed}
    assert {"append", "decode", "prefill", "append[hypothesis]", "decode[hypothesis]", *CAUGHT_BY.values()} <= checks


def test_harness_passes_on_the_suites_kernels_every_family(suite_report):
    assert suite_report.passed, str(suite_report)
    checks = {r.check for r in suite_report.results if r.passed}
    families = {"append", "decode", "prefill", "merge", "quant_decode", "mla_decode", "prefix_hit"}
    assert families | {"append[hypothesis]", "decode[hypothesis]", *CAUGHT_BY.values()} <= checks


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("fault", sorted(CAUGHT_BY))
def test_fault_is_caught_by_its_check(impl, fault):
    check = CAUGHT_BY[fault]
    report = verify.run(*IMPLEMENTATIONS[impl], rotary_append_fn=ROTARY_APPEND[impl], faults={fault}, checks=(check,))
    caught = {r.check for r in report.failures if r.kind != "nothing"}  # a self-check alone also "checks nothing"
    assert caught == {check}, str(report)


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


def test_hypothesis_reports_every_failure_then_the_first_one_shrunk():
    """A failure does not stop the generated cases: all of them run, every failure is
    reported, and the first is shrunk to a minimal case with its repro line."""
    broken = faults.minus_one_as_index(reference.append_paged_kv)
    results = verify.generated_cases("append", broken, 30)
    failures = [r for r in results if r.check == "append[hypothesis]"]
    assert len(failures) > 1 and all(r.passed is False for r in failures)
    assert all(r.case["padding"] >= 1 for r in failures)  # only cases with a padding slot fail
    shrunk = results[-1]
    assert shrunk.check == "append[hypothesis, shrunk]" and shrunk.passed is False
    assert "shrunk" in shrunk.detail and shrunk.case["padding"] == 1 and shrunk.case["num_tokens"] == 1


def test_hypothesis_draws_only_inside_the_declared_contract():
    narrow = verify.Contract(dtypes=("fp16",), layouts=("HND",), head_dims="pow2", page_sizes=(16,))
    seen = []

    def record(check, case):
        seen.append(case)
        return verify.append_case(reference.append_paged_kv, case)

    verify.generated_cases("append", reference.append_paged_kv, 12, contract=narrow, runner=record)
    assert seen and all(narrow.outside(c) is None for c in seen)
    assert {c["head_dim"] for c in seen} <= {16, 64}


def test_report_table_counts_and_plot():
    report = verify.run(reference.append_paged_kv, faults={"minus_one_as_index"}, checks=("append",))
    rows = report.rows()
    assert {r["status"] for r in rows} == {"pass", "FAIL"}
    assert report.summary().endswith("0 skipped") and "reproduce:" in str(report)
    assert len(report.plot().axes[0].patches) == len(rows)


def test_cli_exits_nonzero_only_when_a_check_fails():
    cmd = [sys.executable, "-m", "pagedkv_lab.verify", "--reference", "--hypothesis", "0"]
    cmd += ["--checks", "chunked_prefill"]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0 and "0 failed" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([*cmd, "--fault", "past_len_zero"], capture_output=True, text=True)
    assert bad.returncode == 1 and "FAIL" in bad.stdout


def test_cli_on_the_suites_kernels_lives_on_the_kernels_side(tmp_path):
    """``python -m pagedkv_kernels.tools.verify`` runs the suite's kernels (here only the
    merge and decode checks: the full grid runs in-process above); the library's own
    command line asks for the kernels to check instead of importing them."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pagedkv_kernels.tools.verify", "--hypothesis", "0", "--no-isolate"]
    out = subprocess.run([*cmd, "--checks", "merge,decode", "--json", str(report)], capture_output=True, text=True)
    assert out.returncode == 0 and "0 failed" in out.stdout, out.stdout + out.stderr
    checks = {r["check"] for r in json.loads(report.read_text())["results"] if r["status"] == "pass"}
    assert checks == {"merge", "decode"}, checks
    bare = subprocess.run([sys.executable, "-m", "pagedkv_lab.verify"], capture_output=True, text=True)
    assert bare.returncode == 2 and "python -m pagedkv_kernels.tools.verify" in bare.stderr


def test_cli_refuses_an_unknown_check_by_name():
    cmd = [sys.executable, "-m", "pagedkv_lab.verify", "--reference", "--checks", "decode,bogus"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2 and "bogus" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["-5", "many"])
def test_cli_refuses_a_bad_hypothesis_count_as_a_usage_error(value):
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv_lab.verify", "--reference", "--hypothesis", value],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "argument --hypothesis" in out.stderr and "Traceback" not in out.stderr


def test_cli_names_kernels_by_import_path_and_refuses_one_that_does_not_import():
    ref = ["--append-fn", "pagedkv_lib.reference:append_paged_kv", "--hypothesis", "0"]
    ok = subprocess.run([sys.executable, "-m", "pagedkv_lab.verify", *ref], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = ["--decode-fn", "pagedkv_lib.reference:no_such_kernel"]
    out = subprocess.run([sys.executable, "-m", "pagedkv_lab.verify", *bad], capture_output=True, text=True)
    assert out.returncode == 2 and "cannot import 'pagedkv_lib.reference:no_such_kernel'" in out.stderr


def _raising_decode(q, cache, block_tables, seq_lens, **kwargs):
    raise RuntimeError("illegal memory access")


def test_a_kernel_that_raises_inside_a_scenario_fails_that_check_and_the_run_goes_on():
    report = verify.run(decode_fn=_raising_decode, checks=("chunked_prefill", "fork_cow", "int64_offsets"))
    by_check = {r.check: r for r in report.results}
    assert by_check["chunked_prefill"].passed is False
    assert "raised RuntimeError: illegal memory access" in by_check["chunked_prefill"].detail
    assert by_check["fork_cow"].passed is False
    assert by_check["int64_offsets"].passed is True  # the run went on
    repro = by_check["fork_cow"].repro
    assert "verify.run_case('fork_cow', {}, decode_fn='test_verify:_raising_decode')" in repro


def test_repro_lines_name_the_callable_by_import_path_or_ask_for_it():
    report = verify.run(kernels.append_paged_kv, faults={"minus_one_as_index"}, checks=("append",))
    assert "append_fn='pagedkv_kernels.write:append_paged_kv'" in report.failures[0].repro
    local = verify.run(lambda *a, **k: None, checks=("append",))  # writes nothing: fails
    assert "append_fn=append_fn)  # first bind append_fn to your callable" in local.failures[0].repro
    with pytest.raises(ValueError, match="needs decode_fn"):
        verify.run_case("decode", verify.decode_grid()[0])


def test_decode_that_modifies_its_query_fails_even_with_a_right_output():
    def decode_then_scribble(q, cache, block_tables, seq_lens, **kwargs):
        out = kernels.paged_decode_attention(q, cache, block_tables, seq_lens, **kwargs)
        q.zero_()
        return out

    result = verify.decode_case(decode_then_scribble, verify.decode_grid()[0])
    assert result.passed is False and "decode modified its input q" in result.detail


def test_the_library_and_the_harness_import_neither_the_kernels_nor_triton():
    # The peer kernels (correct and faulty copies written to other engines' conventions)
    # are Triton kernels; the fault registry loads them by name only when a fault asks.
    code = (
        "import sys, pkgutil, importlib, pagedkv_lib, pagedkv_lab; "
        "[importlib.import_module(m.name) for pkg in (pagedkv_lib, pagedkv_lab)"
        " for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')"
        " if not m.name.endswith(('__main__', '.peer_kernels'))]; "
        "assert not {'pagedkv_kernels', 'triton', 'pagedkv_engine'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")

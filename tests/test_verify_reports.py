"""What a report says is what happened: baselines keyed on the failure's cause, no pass
for a scenario that never called the kernel, a kernel's own file and line when it
fails inside Triton's interpreter, and the first element beyond tolerance (and,
apart, the worst).

Python callables (the references with one thing changed) and one tiny Triton kernel:
the whole file runs in about 25 s on 2 cores.
"""

import inspect
import json
import math

import pytest
import torch
import triton
import triton.language as tl

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import faults as F
from pagedkv_lab import verify
from pagedkv_lab.verify.baseline import failure_cause
from pagedkv_lib import reference
from pagedkv_lib.compare import compare

SCENARIOS = tuple(verify.runner.SCENARIO_SIDES)


# ----------------------------------------------------------------------------- no pass without a call


def _raises(*args, **kwargs):
    raise RuntimeError("always")


@pytest.mark.parametrize("arg", ["append_fn", "decode_fn", "prefill_fn"])
def test_a_callable_that_always_raises_gets_no_kernel_pass_from_any_scenario(arg):
    """``v_tail`` reads with the suite's own whole-page decode, so with a raising
    ``decode_fn`` it used to report ``pass kind=kernel`` without calling it. ~3 s each."""
    report = verify.run(**{arg: _raises}, checks=SCENARIOS, isolate=False)
    passes = [r for r in report.results if r.passed and r.kind == "kernel"]
    assert not passes, [(r.check, r.detail) for r in passes]
    assert not report.passed
    not_called = [r for r in report.results if "called none of the callables under test" in r.detail]
    assert all(r.kind == "self-check" for r in not_called)
    if arg == "decode_fn":  # the v_tail read is the suite's: a check of its own code, said so
        (v_tail,) = [r for r in report.results if r.check == "v_tail"]
        assert v_tail.kind == "self-check" and "called none of the callables under test (decode_fn)" in v_tail.detail


# ----------------------------------------------------------------------------- baselines keyed on the cause


def _whole_page_decode(q, cache, block_tables, seq_lens, layout="NHD"):
    """Reads every row of the pages a sequence names (the standing bug: NaN tails)."""
    return F.whole_page_decode(q, cache, block_tables, seq_lens, layout)


def _whole_page_decode_unscaled(q, cache, block_tables, seq_lens, layout="NHD"):
    """The standing bug plus a planted one: scores twice too large (finite, everywhere)."""
    return F.whole_page_decode(q * 2, cache, block_tables, seq_lens, layout)


SHORT = [c for c in verify.decode_grid() if max(c["seq_lens"]) <= 80 and c["layout"] == "NHD"]


def test_a_baseline_run_shows_a_new_cause_in_an_already_failing_case(tmp_path):
    """The planted bug changes nothing in the status of the cases the NaN-tail read
    already fails; their cause changes (finite stale values no longer save them), and
    the baseline run fails on it. The saved report is read back from JSON, and from JSON
    saved without causes (derived from detail and attribution). ~20 s (the NaN
    attribution re-runs each failing case three times)."""
    saved = tmp_path / "report.json"
    before = verify.Report([verify.run_case("decode", c, decode_fn=_whole_page_decode, isolate=False) for c in SHORT])
    standing = [r for r in before.results if r.status == "FAIL"]
    assert standing and all("reads unused rows: the tail" in " ".join(r.cause) for r in standing)
    saved.write_text(json.dumps(before.to_json()))
    after = [verify.run_case("decode", c, decode_fn=_whole_page_decode_unscaled, isolate=False) for c in SHORT]
    diff = verify.baseline.diff_against(after, saved)
    changed = {json.dumps(r.case, sort_keys=True) for r, _, _ in diff.new_causes}
    assert changed == {json.dumps(r.case, sort_keys=True) for r in standing}, diff.summary()
    assert all("fails with finite stale values too" in now for _, _, now in diff.new_causes)
    assert diff.still_failing == 0 and diff.failed
    report = verify.Report(after, baseline=diff)
    assert not report.passed and "new cause" in str(report) and "reproduce:" in str(report)
    old = json.loads(saved.read_text())
    for entry in old["results"]:
        entry.pop("cause")
    again = verify.baseline.diff_against(after, old)
    assert [r.case for r, _, _ in again.new_causes] == [r.case for r, _, _ in diff.new_causes]
    same = verify.baseline.diff_against(before.results, saved)  # the same run: nothing changed
    assert not same.failed and same.still_failing == len(standing) and not same.fewer_causes


def test_failure_causes_leave_out_numbers_and_places():
    a = "3 non-finite outputs, the first at sequence 0 (length 20), query head 1, feature 7"
    b = "128 non-finite outputs, the first at sequence 2 (length 70), query head 0, feature 0"
    assert failure_cause(a) == failure_cause(b) == ("non-finite outputs",)
    raised = "raised InterpreterError: ValueError: bad in the @triton.jit function k at /x.py:3: `y`"
    assert failure_cause(raised) == ("raised InterpreterError (ValueError) in k",)
    wrote = (
        "first beyond tolerance: row 1; kernel wrote after the end of out (8 bytes): 4 bytes changed, the first at 9"
    )
    assert failure_cause(wrote) == ("beyond tolerance", "wrote past out")
    assert failure_cause("lse: first beyond tolerance: row 0, head 0 (declared base2)") == ("lse beyond tolerance",)
    assert failure_cause("anything", status="pass") == ()


# ----------------------------------------------------------------------------- the kernel's file and line


@triton.jit
def _non_power_of_two_reshape(x_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    y = tl.reshape(x, (3, 5))  # the line the report must name
    tl.store(x_ptr + tl.arange(0, N), x + tl.sum(y))


def _decode_with_a_broken_kernel(q, cache, block_tables, seq_lens, layout="NHD"):
    _non_power_of_two_reshape[(1,)](torch.zeros(16, device=q.device), N=16)
    return reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout)


def test_a_kernel_that_fails_inside_the_interpreter_is_reported_with_its_file_and_line():
    """The interpreter's InterpreterError carried only the repr of the inner error. ~1 s."""
    result = verify.run_case("decode", verify.decode_grid()[0], decode_fn=_decode_with_a_broken_kernel, isolate=False)
    source, first = inspect.getsourcelines(_non_power_of_two_reshape.fn)
    line = first + next(i for i, text in enumerate(source) if "tl.reshape" in text)
    assert result.passed is False
    assert f"@triton.jit function _non_power_of_two_reshape at {__file__}:{line}" in result.detail, result.detail
    assert "tl.reshape(x, (3, 5))" in result.detail and "ValueError" in result.detail


# ----------------------------------------------------------------------------- first beyond tolerance, and the worst


def _decode_off_twice(q, cache, block_tables, seq_lens, layout="NHD"):
    """The reference, just beyond tolerance at (0, 0, 3) and far off at (1, 2, 5)."""
    out = reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout, precision="fp64")
    out[0, 0, 3] += 3e-5
    out[1, 2, 5] += 1.0
    return out


def test_a_finite_mismatch_names_the_first_element_beyond_tolerance_and_the_worst():
    case = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 4, "group": 2, "num_kv_heads": 2,
            "seq_lens": [9, 5], "poison": False}  # fmt: skip
    result = verify.run_case("decode", case, decode_fn=_decode_off_twice, isolate=False)
    assert result.passed is False
    first, worst = result.detail.split("; the worst: ")
    assert first.startswith("first beyond tolerance: sequence 0 (length 9), query head 0, feature 3:"), result.detail
    assert worst.startswith("sequence 1 (length 5), query head 2, feature 5:"), result.detail
    c = compare(torch.tensor([[0.0, 2.0, 9.0]]), torch.zeros(1, 3, dtype=torch.float64), 1.0)
    assert c.first == (0, 1) and c.worst == (0, 2) and not math.isnan(c.tol_ratio)


# ----------------------------------------------------------------------------- NaN attribution in scenarios


VLLM_PAGES = dict(cache_layout="kv_tuple", layouts=("NHD",), page_sizes=(16, 32), min_seq_len=1, windows=False,
                  kv_strides="shared")  # fmt: skip


@verify.contract(**VLLM_PAGES)
def _whole_page_prefill(q, cache, qo_indptr, block_tables, seq_lens):
    """vLLM-style prefill whose loads are masked by head_dim only (the registry's
    ``whole_page_loads`` kernel, launched over prefill rows)."""
    from pagedkv_lab import peer_kernels as peer
    from pagedkv_lab.faults import peer_kernels as faulty

    rows = peer.prefill_rows(q, qo_indptr, seq_lens)
    return peer.launch_tuple_attention(faulty.decode_tuple_kernel_whole_page_loads, q, *cache, block_tables, *rows)


def test_scenarios_attribute_a_nan_tail_read_as_the_grid_does():
    """A prefill scenario used to say "the chunk sees the wrong keys" of a NaN-tail read.
    Scenario pools start NaN, as the grid's do (the decode scenarios' too), and a
    non-finite failure is re-run with finite stale values. ~12 s."""
    report = verify.run(prefill_fn=_whole_page_prefill, checks=("prefill_chunks",), isolate=False)
    assert [r.check for r in report.results] == ["prefill_chunks"]
    for r in report.results:
        assert r.passed is False and "non-finite outputs" in r.detail, (r.check, r.detail)
        assert "reads unused pool rows" in r.attribution and "the tail of a partly filled last page" in r.attribution
        assert "reads unused rows: the tail" in r.cause

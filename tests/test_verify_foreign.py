"""Bringing a kernel not written for this suite: contracts, other engines' cache layouts,
crash isolation, guard regions and reports that locate the bug.

The kernels under test are :mod:`pagedkv_lab.peer_kernels` (and their planted bugs, faulty copies in
:mod:`pagedkv_lab.faults.peer_kernels`): a flat-slot store with
nano-vllm's interface and a separate-K/V decode with vLLM's flash layout, wrapped here
in the adapters an engineer would write (a few lines each, with a contract), with and
without their planted bugs. Every bug must come back as a report that names the
element it got wrong; none may end the run.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import reference
from pagedkv_lib.cache_layouts import native_shapes, to_native, to_paged
from pagedkv_lib.formats import PAD
from pagedkv_lib.indexing import split_slot

# isort: split
from pagedkv_lab import peer_kernels as peer_conventions
from pagedkv_lab.faults import peer_kernels

ROOT = Path(__file__).resolve().parents[1]
# The peer store needs contiguous caches, and the peer decode reads V with K's strides:
# both declare K and V sharing strides (the harness gives V its own otherwise).
FLAT = dict(cache_layout="flat", strided_kv=False, kv_strides="shared")
TUPLE = dict(cache_layout="kv_tuple", layouts=("NHD",), page_sizes="pow2", min_seq_len=1, windows=False,
             kv_strides="shared")  # fmt: skip


# ----------------------------------------------------------------------------- the adapters


@verify.contract(**FLAT)
def flat_store(k, v, cache, slot_mapping):
    peer_conventions.store_kvcache_flat(k, v, *cache, slot_mapping)


@verify.contract(**FLAT)
def flat_store_without_minus_one_guard(k, v, cache, slot_mapping):
    peer_kernels.store_kvcache_flat_no_minus_one_guard(k, v, *cache, slot_mapping)


@verify.contract(**FLAT)
def flat_store_with_unguarded_v_store(k, v, cache, slot_mapping):
    peer_kernels.store_kvcache_flat_unguarded_v_store(k, v, *cache, slot_mapping)


@verify.contract(**FLAT)
def flat_store_far_out_of_bounds(k, v, cache, slot_mapping):
    """A slot computed wildly wrong: the write lands far outside any guard (a crash)."""
    peer_conventions.store_kvcache_flat(k, v, *cache, torch.where(slot_mapping >= 0, slot_mapping + 2**40, -1))


@verify.contract(**TUPLE)
def tuple_decode(q, cache, block_tables, seq_lens):
    return peer_conventions.decode_kv_tuple(q, *cache, block_tables, seq_lens)


@verify.contract(**TUPLE)
def tuple_decode_off_by_one_block(q, cache, block_tables, seq_lens):
    return peer_kernels.decode_kv_tuple_off_by_one_block(q, *cache, block_tables, seq_lens)


@verify.contract(cache_layout="vllm_x", head_dims=(64, 128))
def vllm_x_store(k, v, cache, slot_mapping):
    """A plain torch store into vLLM's x-packed key layout, written from its documented
    shape alone: if the harness built or read that layout wrongly, this would fail."""
    key_cache, value_cache = cache
    x = key_cache.shape[-1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot == PAD:
            continue
        block, row = split_slot(slot, key_cache.shape[3])
        key_cache[block, :, :, row, :] = k[i].reshape(k.shape[1], -1, x)
        value_cache[block, :, :, row] = v[i]


def _first(report, check):
    return next(r for r in report.results if r.check == check and r.passed is False)


# ----------------------------------------------------------------------------- contracts and layouts


def test_a_foreign_store_passes_what_it_declares_and_the_rest_is_listed_outside():
    report = verify.run(append_fn=flat_store, checks=("append", "chunked_prefill", "fork_cow", "v_tail"))
    assert report.passed, str(report)
    assert {r.status for r in report.results if r.check == "append"} == {"pass"}
    # Cases with strided K/V are checked with contiguous K/V instead (the rest of the
    # case still counts); none is left outside this contract.
    assert all(r.case["noncontiguous"] is False for r in report.results if r.check == "append")
    # The scenarios run the store on flat pools and the reference decode reads them back.
    assert {r.check: r.status for r in report.results if r.check != "append"} == {
        "chunked_prefill": "pass",
        "fork_cow": "pass",
        "v_tail": "skip",  # the store takes no zero_v_tail
    }


def test_a_foreign_decode_passes_inside_its_contract():
    cases = [c for c in verify.decode_grid() if max(c["seq_lens"]) <= 100]  # the long cases cost a minute here
    session = verify.runner._Session({"decode_fn": tuple_decode}, (), None, None, 300.0)
    results = [session.case("decode", c) for c in cases]
    assert not [r for r in results if r.passed is False], [r.detail for r in results if r.passed is False]
    assert all(r.status == "pass" for r in results)  # every case moved inside the contract
    generated = session.generated("decode", 6)  # drawn inside the contract only
    assert [r.status for r in generated] == ["pass"] and generated[0].case["generated"] == 6
    moved = " ".join(r.case.get("substituted", "") for r in results)
    assert "page_size 5->" in moved and "seq_lens [0, 1, 37]->[1, 37]" in moved and "layout HND->NHD" in moved


def test_a_window_scenario_is_outside_a_contract_without_windows_and_a_failed_check_without_a_contract():
    declared = verify.run(decode_fn=tuple_decode, checks=("ring_window",))
    assert declared.results[0].status == "outside" and "a ring window" in declared.results[0].outside
    undeclared = verify.run(decode_fn=tuple_decode, checks=("ring_window",), contracts={"decode_fn": verify.Contract()})
    assert undeclared.results[0].passed is False  # no exception escapes run()
    assert "raised TypeError" in undeclared.results[0].detail and "window" in undeclared.results[0].detail


@pytest.mark.parametrize("cache_layout", ["paged", "kv_tuple", "vllm_x", "flat"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_layout_conversions_are_exact_and_place_each_element(cache_layout, layout):
    pool = torch.randn((5, 2, 4, 3, 16) if layout == "NHD" else (5, 2, 3, 4, 16)).half()
    native = to_native(pool, cache_layout, layout)
    shapes = native_shapes(cache_layout, 5, 4, 3, 16, layout, pool.dtype)
    got = (native.shape,) if isinstance(native, torch.Tensor) else tuple(t.shape for t in native)
    assert got == ((shapes,) if cache_layout == "paged" else shapes)
    assert torch.equal(to_paged(native, cache_layout, layout, 5, 4, 3, 16).view(torch.int16), pool.view(torch.int16))
    if cache_layout == "vllm_x":  # K of page 2, row 1, head 0, feature 9: 8 halves per 16-byte group
        k_elem = pool[2, 0, 1, 0, 9] if layout == "NHD" else pool[2, 0, 0, 1, 9]
        assert native[0][2, 0, 9 // 8, 1, 9 % 8] == k_elem


def test_vllm_x_key_layout_runs_through_the_harness():
    report = verify.run(append_fn=vllm_x_store, checks=("append",), isolate=False)
    assert report.passed, str(report)
    assert sum(r.status == "pass" for r in report.results) >= 2


# ----------------------------------------------------------------------------- planted bugs


def test_a_missing_minus_one_guard_is_reported_with_the_tensor_and_offset_and_the_run_goes_on():
    report = verify.run(append_fn=flat_store_without_minus_one_guard, checks=("append",))
    failure = _first(report, "append")
    assert failure.case["padding"] > 0
    assert "kernel wrote before k_cache" in failure.detail and "the first at offset -" in failure.detail
    assert "kernel wrote before v_cache" in failure.detail
    assert any(r.passed for r in report.results)  # the cases without padding still ran, and pass
    assert "append_fn='test_verify_foreign:flat_store_without_minus_one_guard'" in failure.repro


def test_an_unguarded_v_store_is_located_by_element():
    report = verify.run(append_fn=flat_store_with_unguarded_v_store, checks=("append",))
    failure = _first(report, "append")
    detail = failure.detail
    # head_dim 80 x heads is not a power of two: the unmasked V store spills past the row.
    assert "V" in detail and ("write outside the addressed slots" in detail or "after the end of v_cache" in detail)
    assert "page " in detail and "row " in detail and "feature " in detail


def test_an_off_by_one_block_index_is_located_by_sequence_and_head():
    case = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 2, "num_kv_heads": 2}
    case["seq_lens"] = [40, 17, 1]
    result = verify.run_case("decode", case, decode_fn=tuple_decode_off_by_one_block)
    assert result.passed is False
    # Reading the next table entry walks into pages and rows this sequence never wrote:
    # the report names the first sequence and head it got wrong.
    assert "sequence " in result.detail and "query head " in result.detail
    assert verify.run_case("decode", case, decode_fn=tuple_decode).passed is True


def test_a_kernel_that_crashes_the_process_fails_its_case_and_the_run_goes_on():
    report = verify.run(append_fn=flat_store_far_out_of_bounds, checks=("append",))
    crashed = [r for r in report.results if r.passed is False]
    assert crashed and all("the kernel crashed the process (SIG" in r.detail for r in crashed)
    assert {r.status for r in report.results} >= {"FAIL"}
    assert len(report.results) == len(verify.append_grid())  # every case was reported


def _sleepy_decode(q, cache, block_tables, seq_lens, layout="NHD"):
    time.sleep(30)
    return reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout)


def test_a_kernel_that_hangs_fails_its_case_after_the_timeout():
    case = verify.decode_grid()[0]
    start = time.perf_counter()
    session = verify.runner._Session({"decode_fn": _sleepy_decode}, (), None, None, 2.0)
    result = session.case("decode", case)
    assert result.passed is False and "no answer within 2 s" in result.detail
    assert time.perf_counter() - start < 20


def test_json_report_from_the_command_line(tmp_path):
    out = tmp_path / "report.json"
    fn = "test_verify_foreign:flat_store_without_minus_one_guard"
    cmd = [sys.executable, "-m", "pagedkv_lab.verify", "--append-fn", fn, "--hypothesis", "0", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["passed"] is False and data["counts"]["FAIL"] >= 1 and "outside" in data["counts"]
    failed = [r for r in data["results"] if r["status"] == "FAIL"]
    assert all(r["repro"] and "kernel wrote before k_cache" in r["detail"] for r in failed if r["check"] == "append")

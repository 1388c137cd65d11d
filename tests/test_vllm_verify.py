"""The harness meets a production kernel's contract: a kernel written to vLLM's paged
layout (separate ``[num_blocks, block_size, num_kv_heads, head_size]`` K and V caches,
pages of 16 or more, no empty sequences, no windows) gets a full grid and every
scenario; runs that check nothing fail; NaN in unused rows is attributed; baselines
report only what changed; repro lines run as printed.

The kernels are :mod:`pagedkv_lab.peer_kernels` (store, decode and prefill in vLLM's
convention), through the adapters an engineer would write.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import mla, quant_reference, reference

# isort: split
import mutants

from pagedkv_lab import peer_kernels as peer_conventions
from pagedkv_lab.faults import peer_kernels

ROOT = Path(__file__).resolve().parents[1]
# An honest contract for a kernel whose tile is one page (tl.dot needs >= 16 rows), which
# reads V with K's strides (and whose store needs contiguous caches).
VLLM = dict(cache_layout="kv_tuple", layouts=("NHD",), page_sizes=(16, 32, 64, 128, 256), min_seq_len=1, windows=False,
            kv_strides="shared")  # fmt: skip


@verify.contract(**VLLM, strided_kv=False)
def vllm_store(k, v, cache, slot_mapping):
    peer_conventions.store_kv_tuple(k, v, *cache, slot_mapping)


@verify.contract(**VLLM)
def vllm_decode(q, cache, block_tables, seq_lens):
    return peer_conventions.decode_kv_tuple(q, *cache, block_tables, seq_lens)


@verify.contract(**VLLM)
def vllm_prefill(q, cache, qo_indptr, block_tables, seq_lens):
    return peer_conventions.prefill_kv_tuple(q, *cache, qo_indptr, block_tables, seq_lens)


@verify.contract(**VLLM)
def vllm_decode_whole_pages(q, cache, block_tables, seq_lens):
    return peer_kernels.decode_kv_tuple_whole_page_loads(q, *cache, block_tables, seq_lens)


def tuple_reference_decode(q, cache, block_tables, seq_lens):
    """The reference decode behind a kv_tuple adapter (exact conversion, then the reference)."""
    k, v = cache
    pool = torch.stack([k, v], dim=1)
    return reference.paged_decode_attention(q.cpu(), pool.cpu(), block_tables.cpu(), seq_lens.cpu())


def _inside(session, check):
    cases = verify.runner._grid(session, check, False)
    return [c for c in cases if session.contracts[FN[check]].outside(c) is None]


FN = {"append": "append_fn", "decode": "decode_fn", "prefill": "prefill_fn"}
# A case of each family to run for real (the whole grid costs minutes in the interpreter).
SMALL = {"layout": "NHD", "dtype": "fp16", "head_dim": 64, "page_size": 16, "group": 1, "num_kv_heads": 1}
SHORT = {
    "append": {**SMALL, "num_tokens": 45, "padding": 3},
    "decode": {**SMALL, "seq_lens": [0, 16, 33]},
    "prefill": {**SMALL, "requests": ((37, 5), (0, 0), (20, 1))},
}


# ----------------------------------------------------------------------------- grids inside the contract


def test_a_vllm_layout_kernel_gets_over_twenty_grid_cases_inside_its_contract_and_every_scenario():
    fns = {"append_fn": vllm_store, "decode_fn": vllm_decode, "prefill_fn": vllm_prefill}
    session = verify.runner._Session(fns, (), None, False, 300.0)
    for check in FN:
        inside = _inside(session, check)
        assert len(inside) >= 12 and all(c["page_size"] >= 16 for c in inside), (check, len(inside))
        assert all(min(c.get("seq_lens", [1])) >= 1 for c in inside)
    total = sum(len(_inside(session, check)) for check in FN)
    assert total >= 20
    # Empty sequences are dropped from their batch, not the batch from the grid.
    decode = _inside(session, "decode")
    assert any("seq_lens [0, 1, 37]->[1, 37]" in c.get("substituted", "") for c in decode)
    # One case of each family, run for real through the kernels (the rest cost minutes here).
    for check, case in SHORT.items():
        result = session.case(check, case)
        assert result.passed is True, (check, result.detail)
    report = verify.run(vllm_store, vllm_decode, vllm_prefill, isolate=False,
                        checks=tuple(n for n in verify.runner.SCENARIO_SIDES if n != "quant_scales"))  # fmt: skip
    status = {r.check: r.status for r in report.results}
    assert report.passed, str(report)
    # Every scenario the contract admits runs, in pages of 16: the prefill ones through the prefill kernel.
    for name in ("chunked_prefill", "fork_cow", "reused_page", "prefill_chunks", "prefix_hit"):
        assert status[name] == "pass", (name, str(report))
    assert status["ring_window"] == "outside" and status["v_tail"] == "skip"  # windows=False; no zero_v_tail
    assert all(r.case.get("page_size") == 16 for r in report.results if r.check in ("fork_cow", "prefix_hit"))


def test_a_contract_that_excludes_everything_fails_as_nothing_checked():
    zeros = verify.contract(page_sizes=(3000,))(lambda q, cache, block_tables, seq_lens, **kw: torch.zeros_like(q))
    report = verify.run(decode_fn=zeros, checks=("decode",), isolate=False)
    assert not report.passed
    nothing = [r for r in report.results if r.kind == "nothing"]
    assert nothing and "nothing checked" in nothing[0].detail and nothing[0].check == "decode"
    assert not any(r.passed for r in report.results)


def test_a_self_check_never_counts_as_the_kernels_pass():
    report = verify.run(decode_fn=reference.paged_decode_attention, checks=("int64_offsets",), isolate=False)
    offsets = next(r for r in report.results if r.check == "int64_offsets")
    assert offsets.passed is True and offsets.kind == "self-check"
    assert not report.passed and "nothing checked" in report.failures[0].detail
    assert "suite self-checks" in report.summary() and report.summary().startswith("0 passed")


# ----------------------------------------------------------------------------- declared layouts


@pytest.mark.parametrize("family", ["quant_append_fn", "quant_decode_fn", "mla_append_fn", "mla_decode_fn"])
def test_a_family_with_its_own_pool_refuses_a_foreign_layout_naming_those_that_build_it(family):
    with pytest.raises(ValueError, match="the families that build it: append, decode, prefill"):
        verify.run(**{family: reference.append_paged_kv}, contracts={family: verify.Contract(cache_layout="kv_tuple")})


def test_scenarios_honour_a_layout_given_through_contracts():
    contracts = {"decode_fn": verify.Contract(cache_layout="kv_tuple")}
    report = verify.run(decode_fn=tuple_reference_decode, contracts=contracts, checks=("fork_cow", "reused_page"))
    assert report.passed, str(report)


def test_prefill_receives_its_declared_layout_and_is_guarded():
    seen = []

    @verify.contract(cache_layout="kv_tuple")
    def tuple_prefill(q, cache, qo_indptr, block_tables, seq_lens, layout="NHD", window=None):
        k, v = cache  # a kernel asserting the tuple it declared
        seen.append(k.shape)
        pool = torch.stack([k, v], dim=1)
        out = reference.paged_prefill_attention(
            q, pool, qo_indptr, block_tables, seq_lens, layout=layout, window=window
        )
        return out

    case = verify.prefill_grid()[0]
    assert verify.run_case("prefill", case, prefill_fn=tuple_prefill, isolate=False).passed
    assert len(seen) == 1

    @verify.contract(cache_layout="kv_tuple", kv_strides="shared")  # its V contiguous: numel + 1 is past its end
    def prefill_writing_past_v(q, cache, qo_indptr, block_tables, seq_lens, layout="NHD", window=None):
        out = tuple_prefill(q, cache, qo_indptr, block_tables, seq_lens, layout=layout, window=window)
        v = cache[1]
        torch.as_strided(v, (v.numel() + 1,), (1,))[-1] = 0.0  # one element past the end of v_cache
        return out

    broken = verify.run_case("prefill", case, prefill_fn=prefill_writing_past_v, isolate=False)
    assert broken.passed is False and "kernel wrote after the end of v_cache" in broken.detail


# ----------------------------------------------------------------------------- mutants


@pytest.mark.parametrize(
    ("family", "fn"),
    [
        ("append", mutants.append_one_row_past_its_page),
        ("quant_append", mutants.quant_append_one_row_past_its_page),
        ("mla_append", mutants.mla_append_one_row_past_its_page),
    ],
)
def test_a_writer_one_row_past_its_page_fails_the_default_grid(family, fn):
    arg = verify.runner.FAMILIES[family].fn_arg
    report = verify.run(**{arg: fn}, checks=(family,), isolate=False)
    failed = [r for r in report.results if r.passed is False]
    assert failed and not report.passed, str(report)
    assert all(r.check == family for r in failed)


def test_a_writer_one_row_past_its_page_fails_the_grid_of_a_pages_of_16_contract():
    contracts = {"append_fn": verify.Contract(**{**VLLM, "cache_layout": "paged"})}
    report = verify.run(mutants.append_one_row_past_its_page, checks=("append",), contracts=contracts, isolate=False)
    assert not report.passed and sum(r.passed is False for r in report.results) >= 3


# ----------------------------------------------------------------------------- NaN attribution


def test_a_kernel_that_reads_the_unwritten_tail_of_a_last_page_is_told_so():
    case = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 2, "num_kv_heads": 2,
            "seq_lens": [40, 17, 1]}  # fmt: skip
    result = verify.run_case("decode", case, decode_fn=vllm_decode_whole_pages, isolate=False)
    assert result.passed is False and "non-finite" in result.detail
    assert (
        "reads unused pool rows" in result.attribution and "the tail of a partly filled last page" in result.attribution
    )
    assert "pages no sequence's table names" not in result.attribution
    # A finite wrong answer gets no attribution: it is not about unused rows.
    assert verify.run_case("decode", {**case, "poison": "none"}, decode_fn=vllm_decode_whole_pages).passed


# ----------------------------------------------------------------------------- baselines


def _standing(k, v, cache, slot_mapping, layout="NHD"):
    """The reference append, which writes nothing for head_dim 128: the standing failures."""
    if k.shape[2] != 128:
        reference.append_paged_kv(k, v, cache, slot_mapping, layout)


def _planted(k, v, cache, slot_mapping, layout="NHD"):
    """The standing failures, plus a planted bug: nothing written in bf16 either."""
    if k.dtype != torch.bfloat16:
        _standing(k, v, cache, slot_mapping, layout)


def _writes(case, when) -> bool:
    return when(case) and case["num_tokens"] > case["padding"]  # an append of nothing cannot fail


def test_a_baseline_run_reports_exactly_the_planted_bugs_new_failures(tmp_path):
    saved = tmp_path / "report.json"
    before = verify.run(_standing, checks=("append",), isolate=False)
    saved.write_text(json.dumps(before.to_json()))
    assert not before.passed
    after = verify.run(_planted, checks=("append",), isolate=False, baseline=saved)
    # Computed from the cases alone: bf16 cases that write something, not at head_dim 128.
    grid = verify.append_grid()
    planted = [c for c in grid if _writes(c, lambda c: c["dtype"] == "bf16" and c["head_dim"] != 128)]
    expected = {json.dumps(c, sort_keys=True) for c in planted}
    got = {json.dumps(r.case, sort_keys=True) for r in after.baseline.new_failures}
    assert got == expected and expected and not after.passed
    assert after.baseline.still_failing == sum(_writes(c, lambda c: c["head_dim"] == 128) for c in grid)
    assert "new failures" in str(after) and "reproduce:" in str(after)
    fixed = verify.run(reference.append_paged_kv, checks=("append",), isolate=False, baseline=saved)
    assert fixed.passed and len(fixed.baseline.fixed) == before.to_json()["counts"]["FAIL"]


def test_the_command_line_exits_nonzero_only_on_new_failures(tmp_path):
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(verify.run(_standing, checks=("append",), isolate=False).to_json()))
    cmd = [sys.executable, "-m", "pagedkv_lab.verify", "--hypothesis", "0", "--no-isolate", "--baseline", str(saved)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    # The standing failures alone: exit 0 (a new failure exits 1, as any failed run does).
    done = subprocess.run([*cmd, "--append-fn", "test_vllm_verify:_standing"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "0 new failures" in done.stdout and "still failing" in done.stdout, done.stdout


# ----------------------------------------------------------------------------- located failures, repro lines


def _unscaled_decode(q, cache, block_tables, seq_lens, layout="NHD", **kwargs):
    """A decode without the softmax scale: a finite wrong answer everywhere."""
    return reference.paged_decode_attention(q, cache, block_tables, seq_lens, scale=1.0, layout=layout, **kwargs)


def test_scenario_failures_name_request_step_pages_and_element_and_a_missing_scale_is_not_page_reuse():
    report = verify.run(decode_fn=_unscaled_decode, checks=("chunked_prefill", "fork_cow", "reused_page"))
    by = {r.check: r for r in report.results}
    for name in ("chunked_prefill", "fork_cow", "reused_page"):
        detail = by[name].detail
        assert by[name].passed is False and "first beyond tolerance: " in detail, (name, detail)
        assert "head " in detail and "feature " in detail and ("pages " in detail or "table " in detail)
    assert "decode after 4 chunk steps" in by["chunked_prefill"].detail
    assert "not a page-reuse bug" in by["reused_page"].detail and "stale block table" not in by["reused_page"].detail
    stale = verify.run(reference.append_paged_kv, reference.paged_decode_attention, faults={"stale_block_table"},
                       checks=("reused_page",))  # fmt: skip
    assert "a stale block table" in stale.results[0].detail


def test_a_repro_line_runs_as_printed_and_names_only_the_familys_callable():
    report = verify.run(decode_fn="test_vllm_verify:_unscaled_decode", prefill_fn=reference.paged_prefill_attention,
                        checks=("decode",), isolate=False)  # fmt: skip
    line = report.failures[0].repro
    assert "decode_fn='test_vllm_verify:_unscaled_decode'" in line and "prefill_fn" not in line
    scope = {}
    exec(line.replace("verify.run_case(", "result = verify.run_case("), scope)
    assert scope["result"].passed is False
    local = verify.run(decode_fn=lambda *a, **k: _unscaled_decode(*a, **k), checks=("decode",), isolate=False)
    assert "decode_fn=decode_fn)  # first bind decode_fn to your callable" in local.failures[0].repro


def _poke_past(t):
    torch.as_strided(t, (t.numel() + 1,), (1,))[-1] = 7  # one element past the end


def _mla_append_past_kpe(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, rope=None, positions=None):
    mla.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)
    _poke_past(kpe_cache if kpe_cache.is_contiguous() else ckv_cache)


def _quant_append_past_data(k, v, pool, slot_mapping):
    quant_reference.append_paged_kv_quant(k, v, pool, slot_mapping)
    _poke_past(pool.data)


@pytest.mark.parametrize(
    ("family", "fn", "tensor"),
    [("mla_append", _mla_append_past_kpe, "kpe_cache"), ("quant_append", _quant_append_past_data, "data")],
)
def test_every_family_guards_the_tensors_it_hands_the_kernel(family, fn, tensor):
    arg = verify.runner.FAMILIES[family].fn_arg
    case = verify.runner.FAMILIES[family].grid(False)[0]
    result = verify.run_case(family, case, isolate=False, **{arg: fn})
    assert result.passed is False and f"kernel wrote after the end of {tensor}" in result.detail, result.detail

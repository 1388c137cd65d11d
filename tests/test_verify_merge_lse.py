"""The merge family and the LSE checks: merges of attention states in the base-2 and
natural-log conventions, empty states, NaN states, and a log-sum-exp judged wherever a
kernel returns one, so that a wrong base fails.

The oracle is the float64 merge :func:`pagedkv_lib.merge_state.merge_states`. The tests
expect NaN to survive every merge and LSE (issue 36, item
1), which the kernels and the float64 merge do once NaN propagation lands. The file
runs in about 40 s on 2 cores.
"""

import math

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import merge_state, reference

# isort: split
import pagedkv_kernels as kernels

LN2 = math.log(2.0)
SMALL = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 4, "group": 2, "num_kv_heads": 2}
NAN_QUERY = {"decode": next(c for c in verify.decode_grid() if c.get("nan_query")),
             "prefill": next(c for c in verify.prefill_grid() if c.get("nan_query"))}  # fmt: skip


def _merge(merge_fn, contract=None, case_filter=lambda c: True):
    cases = [c for c in verify.merge_grid() if case_filter(c)]
    contracts = None if contract is None else {"merge_fn": contract}
    return [verify.run_case("merge", c, merge_fn=merge_fn, contracts=contracts, isolate=False) for c in cases]


# ----------------------------------------------------------------------------- merges in both conventions


def test_the_merge_family_passes_on_the_suites_merges_of_n_states_and_of_a_pair():
    """~12 s (the pair form on the first four cases)."""
    report = verify.run(merge_fn=kernels.merge_states, isolate=False)
    assert report.passed and {r.check for r in report.results} == {"merge"}, str(report)
    assert len(report.results) == len(verify.merge_grid()) == 10
    first = verify.merge_grid()[:4]
    pair = _merge(kernels.merge_state, verify.Contract(merge_inputs="pair"), lambda c: c in first)
    assert len(pair) == 4 and all(r.passed for r in pair) and {r.case["num_states"] for r in pair} == {2}


def vllm_merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None):
    """vLLM's ``merge_attn_states`` convention, in torch: natural-log LSEs laid out
    ``[num_heads, num_tokens]``, the result written into ``output``."""
    p, s = prefix_lse.float(), suffix_lse.float()
    m = torch.maximum(p, s)
    m_safe = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    wp, ws = torch.exp(p - m_safe), torch.exp(s - m_safe)
    wp_v = torch.where(wp > 0, wp, 0.0).T[..., None]
    ws_v = torch.where(ws > 0, ws, 0.0).T[..., None]
    den = (wp + ws).T[..., None]
    pv = torch.where(wp_v > 0, prefix_output.float(), 0.0)
    sv = torch.where(ws_v > 0, suffix_output.float(), 0.0)
    output.copy_(torch.where(den > 0, (wp_v * pv + ws_v * sv) / torch.where(den > 0, den, 1.0), 0.0))
    if output_lse is not None:
        output_lse.copy_(torch.where(wp + ws > 0, m_safe + torch.log(wp + ws), float("-inf")))


def vllm_merge(v_a, s_a, v_b, s_b, out=None):
    """The harness's pair form around vLLM's convention (its LSE transposed)."""
    out_lse = torch.empty(s_a.shape[::-1], dtype=torch.float32)
    vllm_merge_attn_states(out, v_a, s_a.T, v_b, s_b.T, out_lse)
    return None, out_lse.T


def test_a_natural_log_merge_passes_declared_natural_and_fails_declared_base_2():
    """vLLM's ``merge_attn_states`` uses the natural log, FlashInfer's ``merge_state``
    base 2: the harness hands each its LSEs in the declared base. ~3 s."""
    no_nan = lambda c: "nan" not in c  # noqa: E731  (the NaN cases have tests of their own below)
    natural = _merge(vllm_merge, verify.Contract(lse="natural", merge_inputs="pair"), no_nan)
    assert all(r.passed for r in natural), [r.detail for r in natural if not r.passed]
    base2 = _merge(vllm_merge, verify.Contract(merge_inputs="pair"), no_nan)
    assert any(not r.passed and "lse:" in r.detail for r in base2)
    # Every case fails but the one whose LSEs lie 300 apart: one state takes all the
    # weight in either base, and the merged LSE is its own.
    assert [r.passed for r in base2] == ["spread" in r.case for r in base2]


# ----------------------------------------------------------------------------- mutants of a merge


def _states_merge(v, s, exp2=torch.exp2, subtract_max=True, weigh_empty_v=False, nan_as_empty=False):
    """A float32 torch merge of ``v [n, k, h, d]``, ``s [n, k, h]`` (base 2), with knobs for
    its classic bugs."""
    s = s.float()
    if nan_as_empty:
        s = torch.where(torch.isnan(s), float("-inf"), s)
    m = s.max(dim=1).values if subtract_max else torch.zeros_like(s[:, 0])
    m = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    w = exp2(s - m[:, None])
    vv = v.float() if weigh_empty_v else torch.where(w[..., None] > 0, v.float(), 0.0)
    den = w.sum(1)
    out = torch.where(den[..., None] > 0, (w[..., None] * vv).sum(1) / torch.where(den > 0, den, 1.0)[..., None], 0.0)
    lse = torch.where(den > 0, m + torch.log2(torch.where(den > 0, den, 1.0)), float("-inf"))
    return out.to(v.dtype), lse


@pytest.mark.parametrize(
    ("bug", "knob", "caught_by"),
    [
        ("no maximum subtracted", {"subtract_max": False}, "spread"),
        ("empty states' v multiplied by 0", {"weigh_empty_v": True}, "empty"),
        ("natural exp for base-2 LSEs", {"exp2": torch.exp}, "num_states"),
        ("a NaN LSE taken for an empty state", {"nan_as_empty": True}, "nan"),
    ],
)
def test_a_merge_with_a_classic_bug_fails_the_cases_made_for_it(bug, knob, caught_by):
    """~2 s each."""

    def merge(v, s):
        return _states_merge(v, s, **knob)

    results = _merge(merge)
    assert any(not r.passed and caught_by in r.case for r in results), (bug, [r.detail for r in results])
    assert all(r.passed for r in _merge(_states_merge, case_filter=lambda c: "nan" not in c))  # the bugless twin


def _merge_past_out(v, s, out=None):
    got, lse = kernels.merge_states(v, s)
    out.copy_(got)
    torch.as_strided(out, (out.numel() + 1,), (1,))[-1] = 0.0
    return out, lse


def test_a_merge_that_writes_past_its_out_buffer_fails():
    result = verify.run_case("merge", verify.merge_grid()[0], merge_fn=_merge_past_out, isolate=False)
    assert result.passed is False and "kernel wrote after the end of out" in result.detail


# ----------------------------------------------------------------------------- LSE checks in decode and prefill


def _natural_lse_decode(q, cache, block_tables, seq_lens, layout="NHD", return_lse=False):
    out, lse = reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout, return_lse=True)
    return (out, (lse * LN2).float()) if return_lse else out


@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_the_suites_lse_passes_in_base_2_and_fails_declared_natural(family):
    """A wrong-base LSE passes every output check; the LSE check fails it. ~4 s each."""
    fn = {"decode": kernels.paged_decode_attention, "prefill": kernels.paged_prefill_attention}[family]
    case = {**SMALL, "seq_lens": [9, 0, 5]} if family == "decode" else {**SMALL, "requests": ((9, 4), (0, 0), (5, 1))}
    arg = f"{family}_fn"

    def run(lse):
        return verify.run_case(family, case, contracts={arg: verify.Contract(lse=lse)}, isolate=False, **{arg: fn})

    assert run("base2").passed is True
    wrong = run("natural")
    assert wrong.passed is False and wrong.detail.startswith("lse: first beyond tolerance"), wrong.detail
    assert "(declared natural)" in wrong.detail and run(None).passed is True  # the output alone cannot tell


def test_a_natural_log_lse_passes_declared_natural_and_a_missing_lse_fails():
    case = {**SMALL, "seq_lens": [9, 0, 5]}
    natural = verify.Contract(lse="natural")
    assert verify.run_case("decode", case, decode_fn=_natural_lse_decode, contracts={"decode_fn": natural}).passed
    missing = verify.run_case(
        "decode",
        case,
        decode_fn=reference.paged_decode_attention,
        contracts={"decode_fn": verify.Contract(lse="base2")},
    )
    assert missing.passed is True  # the reference takes return_lse: it returns (out, lse)
    plain = verify.run_case("decode", case, decode_fn=lambda *a, **k: reference.paged_decode_attention(*a),
                            contracts={"decode_fn": natural})  # fmt: skip
    assert plain.passed is False and "not (out, lse)" in plain.detail


# ----------------------------------------------------------------------------- NaN survives (with NaN propagation)


def test_the_float64_merge_keeps_a_nan_or_inf_lse_from_looking_empty():
    v, s = verify.merge_inputs(next(c for c in verify.merge_grid() if c.get("nan") == "lse"))
    out, lse = merge_state.merge_states(v, s)
    assert out[0, 0].isnan().all() and lse[0, 0].isnan()
    v, s = verify.merge_inputs(next(c for c in verify.merge_grid() if c.get("nan") == "inf_lse"))
    assert merge_state.merge_states(v, s)[1][0, 0] != float("-inf")


def test_the_suites_merge_keeps_a_nan_lse_nan():
    v, s = verify.merge_inputs(next(c for c in verify.merge_grid() if c.get("nan") == "lse"))
    out, lse = kernels.merge_states(v, s)
    assert out[0, 0].isnan().all() and lse[0, 0].isnan()


@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_a_nan_row_keeps_a_nan_lse_in_the_suites_decode_and_prefill(family):
    fn = {"decode": kernels.paged_decode_attention, "prefill": kernels.paged_prefill_attention}[family]
    arg = f"{family}_fn"
    contracts = {arg: verify.Contract(lse="base2")}
    result = verify.run_case(family, NAN_QUERY[family], contracts=contracts, isolate=False, **{arg: fn})
    assert result.passed is True, result.detail

"""The references are honest oracles: they accept every input the kernels accept and let
NaN through where the kernels do.

* Junk in block-table entries a sequence does not use (which the checks allow and the
  kernels never read) used to raise IndexError in the vectorised references, which
  gathered every entry up to the longest sequence for every row.
* ``softmax(...).nan_to_num(0)`` turned a row whose query or a visible key holds NaN
  into zeros while the kernels return NaN; only a row with no visible key is zero now,
  and the harness fails a kernel that hides NaN.
"""

import math

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import mla, quant_reference, reference
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
import pagedkv_kernels as kernels

JUNK = 10**6  # a page id far outside every pool below, in entries no sequence uses


def paged_pool(num_pages=6, page_size=4, heads=2, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, page_size, heads, head_dim, generator=gen, dtype=torch.float64)


def junk_table():
    """Sequence 0 (length 9) uses pages 3, 0, 5; sequence 1 (length 2) only page 1: its
    two later entries hold junk."""
    return torch.tensor([[3, 0, 5], [1, JUNK, -7]]), torch.tensor([9, 2])


def test_decode_reference_accepts_junk_in_unused_table_entries():
    cache, (table, lens) = paged_pool(), junk_table()
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    got = reference.paged_decode_attention(q, cache, table, lens, precision="fp64")
    want = reference.paged_decode_attention_loop(q, cache, table, lens, precision="fp64")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mla_references_accept_junk_in_unused_table_entries():
    gen = torch.Generator().manual_seed(1)
    ckv, kpe = torch.randn(6, 4, 16, generator=gen), torch.randn(6, 4, 8, generator=gen)
    q_nope, q_pe = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 3, 8, generator=gen)
    w_uk, w_uv = torch.randn(3, 12, 16, generator=gen), torch.randn(3, 10, 16, generator=gen)
    table, lens = junk_table()
    args = (q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv)
    want = mla.mla_decode_naive_loop(*args)
    torch.testing.assert_close(mla.mla_decode_naive(*args), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mla.mla_decode_absorbed(*args), want, rtol=1e-10, atol=1e-12)


def test_quantized_decode_reference_accepts_junk_in_unused_table_entries():
    pool = QuantizedKVPool(6, 4, 2, 32, "fp8", "NHD", "cpu", scale_mode="token", k_scale=0.01, v_scale=0.02)
    gen = torch.Generator().manual_seed(2)
    slots = torch.arange(24)
    k, v = torch.randn(24, 2, 32, generator=gen), torch.randn(24, 2, 32, generator=gen)
    quant_reference.append_paged_kv_quant(k, v, pool, slots)
    table, lens = junk_table()
    q = torch.randn(2, 2, 32, generator=gen)
    got = quant_reference.paged_decode_attention_quant(q, pool, table, lens, precision="fp64")
    want = reference.paged_decode_attention_loop(q, pool.dequantize(), table, lens, precision="fp64")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_decode_and_prefill_references_return_nan_for_a_nan_query_and_zeros_for_an_empty_row():
    cache = paged_pool()
    table, lens = torch.tensor([[3, 0, 5], [1, 2, 4]]), torch.tensor([9, 0])
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    q[:, 1, 0] = math.nan  # head 1 of both: sequence 0 sees 9 keys, sequence 1 none
    out = reference.paged_decode_attention(q, cache, table, lens, precision="fp64")
    assert out[0, 1].isnan().all(), "a NaN query must come back NaN"
    assert out[0, [0, 2, 3]].isfinite().all() and out[1].eq(0).all()
    indptr = torch.tensor([0, 2, 2])  # the last 2 tokens of sequence 0; sequence 1 has no queries
    out = reference.paged_prefill_attention(q, cache, indptr, table, lens, precision="fp64")
    assert out[:, 1].isnan().all() and out[:, [0, 2, 3]].isfinite().all()


def test_decode_reference_returns_nan_for_a_nan_visible_key_and_ignores_nan_past_the_end():
    cache = paged_pool()
    table, lens = torch.tensor([[3, 0, 5], [1, 2, 4]]), torch.tensor([9, 3])
    cache[3, 0, 1, 0, 0] = math.nan  # sequence 0, position 1, KV head 0's key
    cache[1, :, 3] = math.nan  # sequence 1's page past its 3 tokens
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    out = reference.paged_decode_attention(q, cache, table, lens, precision="fp64")
    assert out[0, :2].isnan().all() and out[0, 2:].isfinite().all()  # query heads 0, 1 read KV head 0
    assert out[1].isfinite().all()


def test_mla_references_return_nan_for_a_nan_query_and_zeros_for_an_empty_row():
    gen = torch.Generator().manual_seed(3)
    ckv, kpe = torch.randn(6, 4, 16, generator=gen), torch.randn(6, 4, 8, generator=gen)
    q_nope, q_pe = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 3, 8, generator=gen)
    w_uk, w_uv = torch.randn(3, 12, 16, generator=gen), torch.randn(3, 10, 16, generator=gen)
    q_pe[:, 2, 0] = math.nan
    args = (q_nope, q_pe, ckv, kpe, torch.tensor([[3, 0, 5], [1, 2, 4]]), torch.tensor([9, 0]), w_uk, w_uv)
    for out in (mla.mla_decode_naive(*args), mla.mla_decode_absorbed(*args)):
        assert out[0, 2].isnan().all() and out[0, :2].isfinite().all() and out[1].eq(0).all()


# ----------------------------------------------------------------------------- the harness

# One fp32 NHD shape, so that only a few decode and prefill cases (the NaN-query ones
# among them) run: what matters here is the NaN rows, not the grid.
NARROW = dict(dtypes=("fp32",), layouts=("NHD",), head_dims=(64,), page_sizes=(8,), gqa_groups=(2,), windows=False)


@verify.contract(**NARROW)
def decode(q, cache, block_tables, seq_lens, layout="NHD"):
    return kernels.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout)


@verify.contract(**NARROW)
def decode_hiding_nan(q, cache, block_tables, seq_lens, layout="NHD"):
    return kernels.paged_decode_attention(q, cache, block_tables, seq_lens, layout=layout).nan_to_num(0.0)


@verify.contract(**NARROW)
def prefill(q, cache, qo_indptr, block_tables, seq_lens, layout="NHD"):
    return kernels.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout=layout)


@verify.contract(**NARROW)
def prefill_hiding_nan(q, cache, qo_indptr, block_tables, seq_lens, layout="NHD"):
    return kernels.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout=layout).nan_to_num(0.0)


def _nan_results(report):
    return [r for r in report.results if r.case.get("nan_query")]


@pytest.mark.parametrize("family", ["decode", "prefill"])
def test_the_harness_fails_a_kernel_that_zeroes_nan_rows_and_passes_the_suites(family):
    honest, hiding = {"decode": (decode, decode_hiding_nan), "prefill": (prefill, prefill_hiding_nan)}[family]
    report = verify.run(**{f"{family}_fn": honest}, checks=(family,), isolate=False)
    assert _nan_results(report) and all(r.passed for r in _nan_results(report)), report
    report = verify.run(**{f"{family}_fn": hiding}, checks=(family,), isolate=False)
    failed = [r for r in _nan_results(report) if r.passed is False]
    assert failed and "a NaN input was hidden" in failed[0].detail, report


def test_score_modifiers_in_the_references_match_the_formula_row_by_row():
    """Soft cap, ALiBi and sinks (:mod:`pagedkv_lib.score_mods`) in the decode and prefill
    references against the formula written out for one row at a time: ``s = c tanh(s /
    c) + slope (j - p)``, ``p_j = e^{s_j} / (e^{sink} + sum_k e^{s_k})``; the LSE over the
    keys alone. A zero-length row stays 0 with a sink. Milliseconds."""
    from pagedkv_lib.score_mods import alibi_slopes_for

    cache, (table, lens) = paged_pool(), (torch.tensor([[3, 0, 5], [1, 2, 4]]), torch.tensor([9, 0]))
    q = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mods = dict(logits_soft_cap=1.5, alibi_slopes=alibi_slopes_for(4), sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    out, lse = reference.paged_decode_attention(q, cache, table, lens, precision="fp64", return_lse=True, **mods)
    k, v = reference.gather_paged_kv(cache, table[0], 9)
    for h in range(4):
        s = (k[:, h // 2] @ q[0, h]) / math.sqrt(8)
        s = 1.5 * torch.tanh(s / 1.5) + float(mods["alibi_slopes"][h]) * (torch.arange(9) - 8)
        weights = torch.exp(s) / (torch.exp(s).sum() + math.exp(float(mods["sinks"][h])))
        torch.testing.assert_close(out[0, h], weights @ v[:, h // 2], rtol=1e-12, atol=1e-12)
        assert abs(float(lse[0, h]) - float(torch.logsumexp(s, 0)) / math.log(2)) < 1e-12
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()
    prefill = reference.paged_prefill_attention(q[:1], cache, torch.tensor([0, 1, 1]), table, lens, precision="fp64",
                                                **mods)  # fmt: skip
    torch.testing.assert_close(prefill[0], out[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"sinks must be a float32 tensor \[num_q_heads\] = \[4\]"):
        reference.paged_decode_attention(q, cache, table, lens, sinks=torch.zeros(3))

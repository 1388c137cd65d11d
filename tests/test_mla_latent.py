"""MLA attention in FlashInfer's convention (pagedkv_kernels.mla_latent): the absorbed query in,
the latent output and base-2 LSE out, padded or CSR tables, several causal or
non-causal queries per request; against the float64 references of pagedkv_lib.mla."""

from __future__ import annotations

import math

import mutants
import pytest
import torch

import pagedkv_kernels as kernels
from pagedkv_lib import mla
from pagedkv_lib.compare import TOLERANCES, compare

PAGE, PAGES, RANK, ROPE, HEADS = 4, 40, 32, 16, 3
SCALE = 1 / math.sqrt(48)


def _pool(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ckv = torch.randn((PAGES, PAGE, RANK), generator=gen).to(dtype)
    kpe = torch.randn((PAGES, PAGE, ROPE), generator=gen).to(dtype)
    return ckv, kpe


def _csr_batch(kv_len, q_lens, dtype=torch.float32, seed=1):
    """FlashInfer's arguments for requests of ``kv_len`` keys and ``q_lens`` queries, each
    request on scattered pages of the pool."""
    gen = torch.Generator().manual_seed(seed)
    kv_len, q_lens = torch.tensor(kv_len), torch.tensor(q_lens)
    pages = (kv_len + PAGE - 1) // PAGE
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)])
    kv_indices = torch.randperm(PAGES, generator=gen)[: int(kv_indptr[-1])]
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    rows = int(qo_indptr[-1])
    q_nope = torch.randn((rows, HEADS, RANK), generator=gen).to(dtype)
    q_pe = torch.randn((rows, HEADS, ROPE), generator=gen).to(dtype)
    return q_nope, q_pe, qo_indptr, kv_indptr, kv_indices, kv_len


# Three tiles and more at the interpreter's 16-key tiles; a request without queries or keys.
KV_LEN, Q_LENS = [37, 1, 50, 0, 9], [3, 1, 5, 0, 9]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_several_queries_per_request_match_the_float64_reference_with_lse(causal, num_splits):
    ckv, kpe = _pool()
    q_nope, q_pe, qo, indptr, indices, kv_len = _csr_batch(KV_LEN, Q_LENS)
    o, lse = kernels.mla_latent_attention_csr(
        q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE, causal, num_splits, return_lse=True
    )
    ref_o, ref_lse = mla.mla_latent_attention_ref(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE, causal)
    check = compare(o, ref_o, *TOLERANCES[torch.float32])
    assert check.passed, f"latent output off by {check.max_abs:.2e} at {check.worst}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "rows without keys must have lse -inf, the others a finite lse"
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-5), "lse must be base-2 logsumexp"


def test_the_causal_limit_is_each_querys_own():
    """Query i of q_len sees kv_len - q_len + i + 1 keys: the last query of request 2
    sees all 50 keys, its first only 46, so their outputs differ from the non-causal
    ones exactly where the limits differ."""
    ckv, kpe = _pool()
    args = _csr_batch(KV_LEN, Q_LENS)
    causal = kernels.mla_latent_attention_csr(*_pool_first(args, ckv, kpe), SCALE, True)
    full = kernels.mla_latent_attention_csr(*_pool_first(args, ckv, kpe), SCALE, False)
    qo = args[2]
    last_rows = qo[1:][torch.tensor(Q_LENS) > 0] - 1
    assert torch.equal(causal[last_rows], full[last_rows]), "a request's last query sees every key either way"
    first_of_2 = int(qo[2])
    assert not torch.allclose(causal[first_of_2], full[first_of_2]), "the first of 5 queries must not see keys 46-49"


def _pool_first(args, ckv, kpe):
    q_nope, q_pe, qo, indptr, indices, kv_len = args
    return q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_queries_and_pool(dtype):
    ckv, kpe = _pool(dtype)
    args = _csr_batch(KV_LEN, Q_LENS, dtype)
    o = kernels.mla_latent_attention_csr(*_pool_first(args, ckv, kpe), SCALE)
    ref, _ = mla.mla_latent_attention_ref(*_pool_first(args, ckv, kpe), SCALE)
    assert o.dtype == dtype
    check = compare(o, ref, *TOLERANCES[dtype])
    assert check.passed, f"{dtype} latent output off by {check.max_abs:.2e} at {check.worst}"


def test_absorbed_decode_equals_the_naive_mla_through_w_uv():
    """FlashInfer's form on q_nope @ w_uk, then w_uv @ o, equals the naive MLA decode
    (every c_kv projected up to K and V) in float64: the two conventions agree."""
    gen = torch.Generator().manual_seed(3)
    ckv, kpe = _pool()
    nope, v_dim, batch = 24, 20, 3
    w_uk = torch.randn((HEADS, nope, RANK), generator=gen) / math.sqrt(RANK)
    w_uv = torch.randn((HEADS, v_dim, RANK), generator=gen) / math.sqrt(RANK)
    q_nope = torch.randn((batch, HEADS, nope), generator=gen)
    q_pe = torch.randn((batch, HEADS, ROPE), generator=gen)
    table = torch.randperm(PAGES, generator=gen)[: batch * 13].view(batch, 13)
    lens = torch.tensor([50, 0, 17])
    scale = mla.default_scale(nope, ROPE)
    q_abs = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    o = kernels.mla_latent_attention(q_abs, q_pe, ckv, kpe, table, lens, scale, num_splits=2)
    out = torch.einsum("hvr,bhr->bhv", w_uv.double(), o.double())
    naive = mla.mla_decode_naive(q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv, scale)
    check = compare(out, naive, 1e-5, 1e-6)
    assert check.passed, f"w_uv @ o differs from the naive decode by {check.max_abs:.2e} at {check.worst}"
    assert not o[1].any(), "a sequence of length 0 returns zeros"


def test_the_padded_and_csr_forms_agree_for_one_query_per_request():
    ckv, kpe = _pool()
    q_nope, q_pe, qo, indptr, indices, kv_len = _csr_batch([13, 40, 1], [1, 1, 1])
    o_csr = kernels.mla_latent_attention_csr(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE)
    table = torch.full((3, 10), -1)
    for b in range(3):
        pages = indices[indptr[b] : indptr[b + 1]]
        table[b, : pages.numel()] = pages
    o_pad = kernels.mla_latent_attention(q_nope, q_pe, ckv, kpe, table, kv_len, SCALE)
    assert torch.equal(o_csr, o_pad), "the same decode through CSR and padded tables must give the same bits"


def test_a_nan_in_a_visible_latent_row_reaches_the_output_and_the_reference():
    ckv, kpe = _pool()
    q_nope, q_pe, qo, indptr, indices, kv_len = _csr_batch([9], [2])
    ckv[int(indices[0]), 0, 0] = float("nan")
    o = kernels.mla_latent_attention_csr(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE)
    ref, _ = mla.mla_latent_attention_ref(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE)
    assert torch.isnan(ref).any() and torch.isnan(o).any(), "a NaN the queries see must not be hidden"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q_nope=a["q_nope"][..., :24]), "absorbed"),
        (lambda a: a.update(scale=None), "scale is required"),
        (lambda a: a.update(kv_len=torch.tensor([37, 1, 50, 0, 13])), r"kv_len\[4\]=13"),
        (lambda a: a.update(kv_len=torch.tensor([37, 0, 50, 0, 9])), r"kv_len\[1\]=0"),
        (lambda a: a.update(qo_indptr=torch.tensor([0, 3, 4, 9, 9, 17])), r"qo_indptr\[-1\]=17"),
        (lambda a: a.update(causal=1), "causal=1 must be a bool"),
    ],
    ids=["q_nope_not_absorbed", "no_scale", "kv_len_past_pages", "kv_len_short_of_pages", "qo_indptr", "causal"],
)
def test_bad_arguments_are_refused_by_name_before_launch(change, message):
    ckv, kpe = _pool()
    q_nope, q_pe, qo, indptr, indices, kv_len = _csr_batch(KV_LEN, Q_LENS)
    args = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, qo_indptr=qo, kv_indptr=indptr)
    args |= dict(kv_indices=indices, kv_len=kv_len, scale=SCALE, causal=True)
    change(args)
    with pytest.raises(ValueError, match=message):
        kernels.mla_latent_attention_csr(**args)


def test_more_queries_than_keys_is_refused_when_causal_only():
    ckv, kpe = _pool()
    q_nope, q_pe, qo, indptr, indices, kv_len = _csr_batch([3], [5])
    with pytest.raises(ValueError, match=r"request 0 has 5 queries but kv_len\[0\]=3"):
        kernels.mla_latent_attention_csr(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE)
    o = kernels.mla_latent_attention_csr(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE, causal=False)
    ref, _ = mla.mla_latent_attention_ref(q_nope, q_pe, ckv, kpe, qo, indptr, indices, kv_len, SCALE, causal=False)
    assert compare(o, ref, *TOLERANCES[torch.float32]).passed, "non-causal: every query sees all 3 keys"


_ROW_LIMIT = "        seq_len = tl.minimum(seq_len, tl.load(row_len_ptr + b))\n"
IGNORES_CAUSAL_LIMIT = mutants.Mutant(
    "latent_ignores_causal_limit",
    "every query of a request sees all its keys (the per-query causal limit is dropped)",
    {"mla_decode": ((_ROW_LIMIT, "        seq_len = seq_len\n"),)},
    "mla_latent_attention_csr",
)


def test_a_kernel_without_the_per_query_limit_fails_the_causal_check():
    ckv, kpe = _pool()
    args = _pool_first(_csr_batch(KV_LEN, Q_LENS), ckv, kpe)
    wrong = mutants.build(IGNORES_CAUSAL_LIMIT)(*args, SCALE, True)
    ref, _ = mla.mla_latent_attention_ref(*args, SCALE, True)
    check = compare(wrong, ref, *TOLERANCES[torch.float32])
    assert not check.passed, "the mutant must be caught: its early queries see future keys"

"""``return_lse=True`` of the decode and prefill entry points, the attention-state merge
(:func:`pagedkv_kernels.cascade.merge_state` / :func:`pagedkv_kernels.cascade.merge_states`) and cascade
attention, against float64 references.

The log-sum-exp is FlashInfer's, in base 2: ``lse = log2(sum_j 2**(scale * log2(e) *
q.k_j))``, ``-inf`` for a row without keys. Tolerances: outputs by the harness's
(:data:`pagedkv_lab.verify.compare.TOLERANCES`); fp32 lse within ``LSE_ATOL = 1e-4``
(an fp32 sum of at most a few hundred terms, values of order 10: about 1e-6 measured).
Mutants (a merge without the max shift, an lse without the log of the sum, a cascade
without the prefix) must fail the same checks.
"""

import math

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab.verify.compare import TOLERANCES, compare
from pagedkv_lab.verify.prefill_checks import prefill_inputs
from pagedkv_lib import merge_state as ref_states
from pagedkv_lib import reference, runtime
from pagedkv_lib.formats import block_table_to_csr

# isort: split
from pagedkv_kernels.cascade import cascade_attention, merge_state, merge_states
from pagedkv_kernels.decode import paged_decode_attention, paged_decode_attention_csr
from pagedkv_kernels.prefill import paged_prefill_attention, paged_prefill_attention_csr

DEV = runtime.device()
LSE_ATOL = 1e-4


def on_dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def lse_close(lse, ref) -> bool:
    """Same ``-inf`` rows, finite rows within ``LSE_ATOL``."""
    lse, ref = lse.cpu().double(), ref.cpu().double()
    inf = torch.isinf(ref)
    return torch.equal(torch.isinf(lse), inf) and bool(((lse - ref).abs()[~inf] <= LSE_ATOL).all())


def out_close(out, ref, dtype) -> bool:
    return compare(out.cpu(), ref, *TOLERANCES[dtype]).passed


def case(requests, dtype="fp32", layout="NHD", page_size=4):
    c = {"layout": layout, "dtype": dtype, "head_dim": 16, "page_size": page_size, "group": 2,
         "num_kv_heads": 2, "requests": requests}  # fmt: skip
    q, cache, qo, tables, lens, _ = prefill_inputs(c)
    return q, cache, qo, tables, lens


# ----------------------------------------------------------------------------- return_lse


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_lse_is_the_base2_logsumexp_of_the_visible_scores(causal):
    q, cache, qo, tables, lens = case(((21, 6), (0, 0), (9, 9), (13, 1)))
    ref, ref_lse = reference.paged_prefill_attention(
        q, cache, qo, tables, lens, precision="fp64", causal=causal, return_lse=True
    )
    out, lse = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert out_close(out, ref, torch.float32) and lse_close(lse, ref_lse)
    # the reference's lse is log2 of the softmax denominator, written out for row 0, head 0
    k, _ = reference.gather_paged_kv(cache, tables[0], 21)
    scores = (q[0, 0].double() @ k[:, 0].double().T) / math.sqrt(16)
    visible = scores[: 21 - 6 + 1] if causal else scores
    assert math.isclose(float(ref_lse[0, 0]), math.log2(float(torch.exp(visible).sum())), rel_tol=1e-12)
    csr = block_table_to_csr(tables, lens, 4)
    out_c, lse_c = paged_prefill_attention_csr(*on_dev(q, cache, qo, *csr), causal=causal, return_lse=True)
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)


def test_prefill_lse_of_a_row_without_keys_is_minus_inf():
    q, cache, qo, tables, lens = case(((0, 3), (5, 2)))
    out, lse = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), causal=False, return_lse=True)
    assert torch.isneginf(lse[:3]).all() and torch.isfinite(lse[3:]).all() and (out[:3] == 0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_lse_merges_the_splits_into_the_total(num_splits):
    q, cache, _, tables, lens = case(((200, 1), (0, 0), (37, 1)))
    q = torch.randn((3, *q.shape[1:]), generator=torch.Generator().manual_seed(2))  # one query per request
    ref, ref_lse = reference.paged_decode_attention(q, cache, tables, lens, precision="fp64", return_lse=True)
    out, lse = paged_decode_attention(*on_dev(q, cache, tables, lens), num_splits=num_splits, return_lse=True)
    assert out_close(out, ref, torch.float32) and lse_close(lse, ref_lse)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    plain = paged_decode_attention(*on_dev(q, cache, tables, lens), num_splits=num_splits)
    assert torch.equal(plain, out)  # asking for the lse changes no output bit
    csr = block_table_to_csr(tables, lens, 4)
    out_c, lse_c = paged_decode_attention_csr(*on_dev(q, cache, *csr), num_splits=num_splits, return_lse=True)
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_return_lse_must_be_a_bool(bad):
    q, cache, qo, tables, lens = case(((5, 2),))
    with pytest.raises(ValueError, match="return_lse"):
        paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), return_lse=bad)
    with pytest.raises(ValueError, match="return_lse"):
        paged_decode_attention(*on_dev(q[:1], cache, tables, lens), return_lse=bad)


# ----------------------------------------------------------------------------- merge_state(s)


def states(seq_len=5, num_states=4, heads=3, dim=24, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn((seq_len, num_states, heads, dim), generator=gen).to(dtype)
    s = torch.randn((seq_len, num_states, heads), generator=gen) * 8
    s[0, :, 0] = float("-inf")  # a row whose states are all empty
    s[1, 2, :] = float("-inf")  # one empty state, its v NaN: must not leak
    v[1, 2] = float("nan")
    return v, s


def drops_max_shift(v, s):
    """Mutant: weights 2**s without subtracting the max (overflows at s >= 128)."""
    w = torch.exp2(s.double())
    return (w[..., None] * torch.nan_to_num(v.double())).sum(1) / w.sum(1)[..., None], torch.log2(w.sum(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_states_matches_float64_reference_with_empty_states(dtype):
    v, s = states(dtype=dtype)
    ref_v, ref_s = ref_states.merge_states(v, s)
    out, lse = merge_states(*on_dev(v, s))
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (5, 3, 24)
    assert out_close(out, ref_v, dtype) and lse_close(lse, ref_s)
    assert (out[0, 0] == 0).all() and torch.isneginf(lse[0, 0]) and torch.isfinite(out).all()


def test_merged_state_is_the_state_of_the_union_of_key_sets():
    """The reference's own promise, from scores: merging the states of two key halves gives
    the softmax over all keys and its log-sum-exp (not computed by the code under test)."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn((4, 2, 10), generator=gen, dtype=torch.float64) * 3  # [rows, heads, keys], base 2
    values = torch.randn((10, 8), generator=gen, dtype=torch.float64)

    def state(sl):
        p = torch.softmax(scores[..., sl] * math.log(2), -1)
        return p @ values[sl], torch.logsumexp(scores[..., sl] * math.log(2), -1) / math.log(2)

    (va, sa), (vb, sb), (vall, sall) = state(slice(0, 3)), state(slice(3, 10)), state(slice(0, 10))
    v, s = ref_states.merge_state(va.float(), sa.float(), vb.float(), sb.float())
    assert torch.allclose(v, vall, atol=1e-6) and torch.allclose(s, sall, atol=1e-5)
    kv, ks = merge_state(*on_dev(va.float(), sa.float(), vb.float(), sb.float()))
    assert torch.allclose(kv.cpu().double(), vall, atol=1e-5) and torch.allclose(ks.cpu().double(), sall, atol=1e-4)


def test_large_lse_needs_the_max_shift_and_the_mutant_without_it_fails():
    v, s = states()
    s = s + 200.0  # 2**200 overflows fp32 and, summed, nothing in float64 either at 2**1100
    s[1, 2, :] = float("-inf")
    s[0, :, 0] = float("-inf")
    ref_v, ref_s = ref_states.merge_states(v, s)
    out, lse = merge_states(*on_dev(v, s))
    assert out_close(out, ref_v, torch.float32) and lse_close(lse, ref_s)
    bad_v, bad_s = drops_max_shift(v, s + 900.0)
    assert not (torch.isfinite(bad_v[2:]).all() and torch.isfinite(bad_s[2:]).all())


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda v, s: (v[..., 0], s), "v must be a 4-D"),
        (lambda v, s: (v, s.double()), "s must be a 3-D float32"),
        (lambda v, s: (v, s[:, :2]), "s has shape"),
        (lambda v, s: (v[:, :0], s[:, :0]), "0 states"),
    ],
)
def test_merge_states_bad_inputs_name_the_argument(change, match):
    v, s = states()
    with pytest.raises(ValueError, match=match):
        merge_states(*on_dev(*change(v, s)))
    with pytest.raises(ValueError, match=match):
        ref_states.merge_states(*change(v, s))


def test_merge_state_bad_inputs_name_the_argument():
    v, s = states()
    va, sa, vb, sb = v[:, 0], s[:, 0], v[:, 1], s[:, 1]
    with pytest.raises(ValueError, match="s_b must be float32"):
        merge_state(va, sa, vb, sb[:, :1])
    with pytest.raises(ValueError, match="v_b .* must match v_a"):
        merge_state(va, sa, vb.half(), sb)


# ----------------------------------------------------------------------------- cascade


def test_cascade_attention_equals_attention_over_prefix_and_suffix():
    """Shared prefix of 10 tokens (not page-aligned: page 4) in pages 0-2, suffixes of 7, 3
    and 12 tokens with 3, 3 and 5 new queries; the oracle is torch's SDPA in float64 over
    the gathered prefix + suffix (``reference.contiguous_attention``). Tolerance: fp32's."""
    gen = torch.Generator().manual_seed(3)
    ps, hk, group, d, shared = 4, 2, 2, 16, 10
    cache = torch.randn((16, 2, ps, hk, d), generator=gen)
    shared_pages = torch.tensor([0, 1, 2])
    suffix_tables = torch.tensor([[3, 4, -1], [5, -1, -1], [6, 7, 8]])
    suffix_lens = torch.tensor([7, 3, 12])
    q_lens = [3, 3, 5]
    qo = torch.tensor([0, 3, 6, 11], dtype=torch.int32)
    q = torch.randn((11, hk * group, d), generator=gen)
    out = cascade_attention(*on_dev(q, cache, qo, shared_pages), shared, *on_dev(suffix_tables, suffix_lens))
    kp, vp = reference.gather_paged_kv(cache, shared_pages, shared)
    no_prefix = torch.zeros_like(kp[:0])
    for b in range(3):
        ks, vs = reference.gather_paged_kv(cache, suffix_tables[b], int(suffix_lens[b]))
        n = shared + int(suffix_lens[b])
        pos = torch.arange(n - q_lens[b], n)
        rows = slice(int(qo[b]), int(qo[b + 1]))
        ref = reference.contiguous_attention(q[rows], torch.cat([kp, ks]), torch.cat([vp, vs]), pos)
        assert out_close(out[rows], ref, torch.float32), b
        # mutant: the suffix pass alone (the prefix dropped) is far from it
        alone = reference.contiguous_attention(
            q[rows], torch.cat([no_prefix, ks]), torch.cat([no_prefix, vs]), pos - shared
        )
        assert not compare(alone.float(), ref, *TOLERANCES[torch.float32]).passed


def test_cascade_shared_len_must_be_a_non_negative_int():
    q = torch.zeros((1, 2, 16))
    with pytest.raises(ValueError, match="shared_len"):
        cascade_attention(q, torch.zeros((2, 2, 4, 1, 16)), torch.tensor([0, 1]), torch.tensor([0]), -1,
                          torch.tensor([[1]]), torch.tensor([1]))  # fmt: skip

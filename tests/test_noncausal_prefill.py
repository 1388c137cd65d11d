"""``causal=False`` of the prefill kernel (every query sees all its request's keys) against
the float64 reference, and the option's bad inputs.

Pass rule: the harness's tolerances (:data:`pagedkv_lab.verify.compare.TOLERANCES`,
``|err| <= atol + rtol |ref|``). A mutant that drops ``causal=False`` (the causal kernel
under the non-causal name) must fail the same comparison, so the cases can tell the two
masks apart.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab.verify.compare import DTYPES, TOLERANCES, compare
from pagedkv_lab.verify.prefill_checks import noncausal_prefill_cases, prefill_case, prefill_inputs
from pagedkv_lib import RingWindow, reference, runtime

# isort: split
from pagedkv_kernels.prefill import paged_prefill_attention, paged_prefill_attention_csr, plan_prefill
from pagedkv_lib.formats import block_table_to_csr

DEV = runtime.device()

# (seq_len, q_len): a chunk in the middle of a sequence, more queries than keys (allowed
# without the causal alignment), a request without queries, one without keys.
REQUESTS = ((21, 6), (5, 9), (12, 0), (0, 2))


def inputs(dtype="fp32", layout="NHD", page_size=4, group=2):
    case = {"layout": layout, "dtype": dtype, "head_dim": 16, "page_size": page_size, "group": group,
            "num_kv_heads": 2, "requests": REQUESTS}  # fmt: skip
    q, cache, qo, tables, lens, _ = prefill_inputs(case)
    return q, cache, qo, tables, lens


def on_dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def passes(out, ref, dtype) -> bool:
    return compare(out.cpu(), ref, *TOLERANCES[DTYPES[dtype]]).passed


def ignores_causal(*args, causal=True, **kw):
    """Mutant: a kernel that ignores ``causal=False``."""
    return paged_prefill_attention(*args, **kw)


@pytest.mark.parametrize("dtype, layout", [("fp32", "NHD"), ("fp16", "HND")])
def test_non_causal_prefill_matches_float64_reference_and_the_causal_mutant_fails(dtype, layout):
    q, cache, qo, tables, lens = inputs(dtype, layout)
    ref = reference.paged_prefill_attention(q, cache, qo, tables, lens, layout=layout, precision="fp64", causal=False)
    out = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), layout, causal=False)
    assert out.dtype == q.dtype and passes(out, ref, dtype)
    # the request without keys attends to nothing: zeros
    assert (out.cpu()[int(qo[3]) :] == 0).all()
    # The causal kernel refuses q_len > seq_len; on the request it takes, it must fail.
    keep = torch.tensor([0, 6, 6, 6, 6], dtype=torch.int32)  # request 0's 6 queries only
    q0 = q[:6]
    ref0 = reference.paged_prefill_attention(
        q0, cache, keep, tables, lens, layout=layout, precision="fp64", causal=False
    )
    wrong = ignores_causal(*on_dev(q0, cache, keep, tables, lens), layout, causal=False)
    assert not passes(wrong, ref0, dtype)
    right = paged_prefill_attention(*on_dev(q0, cache, keep, tables, lens), layout, causal=False)
    assert passes(right, ref0, dtype)


def test_non_causal_csr_equals_the_padded_entry_bit_for_bit():
    q, cache, qo, tables, lens = inputs()
    indptr, indices, last = block_table_to_csr(tables, lens, 4)
    padded = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), causal=False)
    csr = paged_prefill_attention_csr(*on_dev(q, cache, qo, indptr, indices, last), causal=False)
    assert torch.equal(padded, csr)


def test_causal_default_is_todays_kernel_and_plan():
    q, cache, qo, tables, lens = inputs()
    keep = torch.tensor([0, 6, 11, 11, 11], dtype=torch.int32)
    args = on_dev(q[:11], cache, keep, tables, lens)
    assert torch.equal(paged_prefill_attention(*args), paged_prefill_attention(*args, causal=True))
    assert plan_prefill(*args).causal is True


def test_non_causal_plan_visits_every_key_of_every_tile():
    q, cache, qo, tables, lens = inputs(group=1)
    plan = plan_prefill(*on_dev(q, cache, qo, tables, lens), causal=False)
    # each (query row, key) pair of every request: 6*21 + 9*5 + 0 + 2*0, times 2 KV heads
    assert plan.visited_pairs == (6 * 21 + 9 * 5) * 2


@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_causal_must_be_a_bool(bad):
    q, cache, qo, tables, lens = inputs()
    with pytest.raises(ValueError, match="causal"):
        paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), causal=bad)
    with pytest.raises(ValueError, match="causal"):
        reference.paged_prefill_attention(q, cache, qo, tables, lens, causal=bad)


def test_non_causal_through_a_ring_window_is_refused_naming_causal_and_why():
    q, cache, qo, tables, lens = inputs()
    window = RingWindow(max_attention_window=8, sink_tokens=0, tokens_per_block=4)
    with pytest.raises(ValueError, match="causal=False with a ring window.*overwritten"):
        paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), window=window, causal=False)


def test_causal_prefill_still_refuses_more_queries_than_keys():
    q, cache, qo, tables, lens = inputs()
    with pytest.raises(ValueError, match="request 1 has 9 queries but seq_lens"):
        paged_prefill_attention(*on_dev(q, cache, qo, tables, lens))


@pytest.mark.parametrize("case", noncausal_prefill_cases(), ids=lambda c: f"{c['layout']}-{c['dtype']}")
def test_harness_noncausal_cases_pass_the_kernel_and_fail_the_mutant(case):
    assert prefill_case(paged_prefill_attention, case).passed is True
    wrong = prefill_case(ignores_causal, case)
    assert wrong.passed is False
    if all(m <= n for n, m in case["requests"]):  # the causal kernel takes the case: its mask is what fails
        assert not wrong.detail.startswith("raised") and wrong.max_abs > 0.01
    assert prefill_case(lambda q, c, qo, t, sl, layout="NHD": q, case).passed is None  # no causal option: outside

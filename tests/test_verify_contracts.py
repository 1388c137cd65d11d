"""Contracts state what real kernels need, and the harness builds the cases that tell
whether they need it: each field below is exercised by a kernel that depends on it
(:mod:`pagedkv_lab.peer_kernels`, Triton kernels in other engines' conventions), which
passes with the field and fails without it.

* ``kv_strides="shared"``: the peer ``decode_kv_tuple`` addresses V with K's strides;
* ``fp32_dots="tf32"``: the unified-attention peer with tf32 factors;
* ``min_q_len=1`` and ``new_tokens="both"``: vLLM's ``chunked_prefill_paged_decode``;
* ``score_mods``: the unified-attention peer's sinks, ALiBi and soft cap (the float64
  references implement all three);
* the flat layout's page size: a LightLLM-style slot-table decode;
* guarded ``out=`` buffers.

Short cases only (Triton's interpreter): the file runs in about 90 s on 2 cores.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import reference
from pagedkv_lib.cache_layouts import FlatCache, to_native

# isort: split
from pagedkv_lab import peer_kernels as peer

TUPLE = dict(cache_layout="kv_tuple", layouts=("NHD",))
SMALL = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 4, "group": 2, "num_kv_heads": 2}


def _run(fn, check, contract, case):
    """One case of ``check`` through ``fn`` under ``contract``, as ``verify.run`` runs it."""
    arg = verify.runner.FAMILIES[check].fn_arg
    return verify.run_case(check, case, contracts={arg: contract}, isolate=False, **{arg: fn})


# ----------------------------------------------------------------------------- K and V strides


def tuple_decode(q, cache, block_tables, seq_lens):
    return peer.decode_kv_tuple(q, *cache, block_tables, seq_lens)


def unified_decode(q, cache, block_tables, seq_lens):
    return peer.decode_paged(q, *cache, block_tables, seq_lens)


def store_v_with_ks_strides(k, v, cache, slot_mapping):
    """A kv_tuple store (NHD) that addresses V with K's strides, as a kernel given one set does."""
    key_cache, value_cache = cache
    v_as_k = torch.as_strided(value_cache, value_cache.shape, key_cache.stride())
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // key_cache.shape[1], slot % key_cache.shape[1]] = k[i]
            v_as_k[slot // key_cache.shape[1], slot % key_cache.shape[1]] = v[i]


def test_a_store_that_writes_v_with_ks_strides_fails_unless_it_declares_them_shared():
    """Milliseconds."""
    case = next(c for c in verify.append_grid() if c["layout"] == "NHD" and c["num_tokens"] > 8)
    result = _run(store_v_with_ks_strides, "append", verify.Contract(**TUPLE), case)
    assert result.passed is False and "V" in result.detail, result.detail
    assert _run(store_v_with_ks_strides, "append", verify.Contract(**TUPLE, kv_strides="shared"), case).passed


def test_a_kernel_that_reads_v_with_ks_strides_needs_kv_strides_shared():
    """~4 s."""
    case = {**SMALL, "seq_lens": [9, 5], "poison": False}  # finite stale values: no NaN attribution re-runs
    tuple_contract = verify.Contract(**TUPLE, min_seq_len=1, page_sizes="pow2")
    assert _run(tuple_decode, "decode", tuple_contract, case).passed is False
    shared = verify.Contract(**TUPLE, min_seq_len=1, page_sizes="pow2", kv_strides="shared")
    assert _run(tuple_decode, "decode", shared, case).passed is True
    assert _run(unified_decode, "decode", verify.Contract(**TUPLE), case).passed is True  # its own V strides


# ----------------------------------------------------------------------------- tf32 dots


def tf32_decode(q, cache, block_tables, seq_lens):
    return peer.decode_paged(q, *cache, block_tables, seq_lens, tf32=True)


def tf32_decode_unscaled(q, cache, block_tables, seq_lens):
    return peer.decode_paged(q, *cache, block_tables, seq_lens, tf32=True, scale=0.5)


def test_a_tf32_kernel_fails_fp32_cases_unless_it_declares_tf32_dots_and_a_bug_still_fails():
    """~3 s."""
    case = {**SMALL, "seq_lens": [37, 1]}
    result = _run(tf32_decode, "decode", verify.Contract(**TUPLE), case)
    assert result.passed is False and "first beyond tolerance" in result.detail
    assert _run(tf32_decode, "decode", verify.Contract(**TUPLE, fp32_dots="tf32"), case).passed is True
    assert _run(tf32_decode_unscaled, "decode", verify.Contract(**TUPLE, fp32_dots="tf32"), case).passed is False
    assert verify.Contract(fp32_dots="tf32").tolerance("fp32") == verify.TOLERANCES[torch.float16]


# ----------------------------------------------------------------------------- vLLM's chunked prefill + paged decode


def chunked_prefill_paged_decode(q, cache, qo_indptr, block_tables, seq_lens, k_new, v_new):
    return peer.chunked_prefill_paged_decode(q, *cache, k_new, v_new, qo_indptr, block_tables, seq_lens)


ZERO_QUERY = [c for c in verify.prefill_grid() if any(m == 0 for _, m in c["requests"])]
VLLM_CPPD = dict(**TUPLE, new_tokens="both", min_q_len=1)


def test_seven_of_the_default_prefill_cases_hold_a_request_without_queries():
    assert len(verify.prefill_grid()) == 18 and len(ZERO_QUERY) == 7


@pytest.mark.parametrize(
    ("contract", "failure"),
    [
        (dict(**TUPLE, new_tokens="both"), "first beyond tolerance"),  # its decode lands on the next request's row
        (dict(**TUPLE, new_tokens="separate", min_q_len=1), "non-finite outputs"),  # its decode reads the pool
        (dict(**TUPLE, min_q_len=1), "missing 2 required positional arguments"),  # no k_new, v_new
    ],
)
def test_vllms_chunked_prefill_paged_decode_needs_a_query_per_request_and_its_new_tokens_twice(contract, failure):
    """Each field left out fails a case holding a request without queries; with both
    declared, the request is dropped from its batch and the rest passes. ~6 s each."""
    case = next(c for c in ZERO_QUERY if c["dtype"] == "fp32" and c["layout"] == "NHD")
    result = _run(chunked_prefill_paged_decode, "prefill", verify.Contract(**contract), case)
    assert result.passed is False and failure in result.detail, result.detail
    passed = _run(chunked_prefill_paged_decode, "prefill", verify.Contract(**VLLM_CPPD), case)
    assert passed.passed is True and "queries" not in (passed.outside or "")
    assert "requests" in passed.case["substituted"]  # the request without queries was dropped


def test_a_request_without_queries_is_outside_a_min_q_len_contract_and_dropped_by_projection():
    contract = verify.Contract(min_q_len=1)
    assert "a request with 0 queries" in contract.outside({"requests": ((5, 0), (3, 1))})
    assert contract.project({"requests": ((5, 0), (3, 1)), "tree": (None, (-1,))}) == {
        "requests": ((3, 1),), "tree": ((-1,),), "substituted": "requests [(5, 0), (3, 1)]->[(3, 1)]"
    }  # fmt: skip


# ----------------------------------------------------------------------------- score modifiers


def mods_decode(q, cache, block_tables, seq_lens, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    return peer.decode_paged(q, *cache, block_tables, seq_lens, softcap=logits_soft_cap,
                             alibi_slopes=alibi_slopes, sinks=sinks)  # fmt: skip


def mods_prefill(q, cache, qo_indptr, block_tables, seq_lens, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    return peer.prefill_paged(q, *cache, qo_indptr, block_tables, seq_lens, softcap=logits_soft_cap,
                              alibi_slopes=alibi_slopes, sinks=sinks)  # fmt: skip


MODS = verify.Contract(**TUPLE, score_mods=("softcap", "alibi", "sinks"))


def _ignoring(mod):
    """``mods_decode`` that drops one modifier (a kernel that takes the argument and ignores it)."""
    name = {"softcap": "logits_soft_cap", "alibi": "alibi_slopes", "sinks": "sinks"}[mod]

    def decode(q, cache, block_tables, seq_lens, **kwargs):
        kwargs.pop(name)
        return mods_decode(q, cache, block_tables, seq_lens, **kwargs)

    return decode


def test_a_kernel_with_sinks_alibi_and_softcap_passes_their_cases_and_ignoring_one_fails():
    """The modifier cases join the grid only for a kernel declaring them; each is one
    modifier (the last all three, over 300 keys: not run here, ~20 s). ~15 s."""
    session = verify.runner._Session({"decode_fn": mods_decode}, (), {"decode_fn": MODS}, False, 300.0)
    cases = [c for c in verify.runner._grid(session, "decode", False) if any(c.get(m) for m in MODS.score_mods)]
    assert len(cases) == 4 and all(cases[3].get(m) for m in MODS.score_mods)
    results = [session.case("decode", c) for c in cases[:3]]
    assert all(r.passed for r in results), [r.detail for r in results]
    plain = verify.runner._Session({"decode_fn": mods_decode}, (), None, False, 300.0)
    assert not [c for c in verify.runner._grid(plain, "decode", False) if c.get("sinks") or c.get("alibi")]
    for case, mod in zip(cases[:3], ("softcap", "alibi", "sinks")):
        assert case.get(mod)
        assert _run(_ignoring(mod), "decode", MODS, case).passed is False, mod
    prefill = verify.prefill_checks.score_mod_prefill_cases()[2]  # sinks, next to a request without queries
    assert _run(mods_prefill, "prefill", MODS, prefill).passed is True


def test_a_contract_refuses_a_score_modifier_the_references_do_not_implement():
    with pytest.raises(ValueError, match=r"score_mods=\('dropout',\) must be a tuple of \('softcap', 'alibi'"):
        verify.Contract(score_mods=("dropout",))
    assert "score modifiers sinks" in verify.Contract().outside({"sinks": True})


# ----------------------------------------------------------------------------- the flat layout's page size


def flat_decode(q, cache, block_tables, seq_lens):
    return peer.decode_flat(q, cache, block_tables, seq_lens)


def flat_decode_pages_of_16(q, cache, block_tables, seq_lens):
    """A slot-table decode that cannot know the page size and assumes 16."""
    return peer.decode_flat(q, FlatCache(*cache, 16), block_tables, seq_lens)


@pytest.mark.parametrize("page_size", [5, 16])
def test_a_flat_cache_carries_its_page_size_for_a_slot_table_decode(page_size):
    """105 slots are 21 pages of 5 or 35 of 3: the cache object says which. ~2 s each."""
    flat = verify.Contract(cache_layout="flat")
    case = {**SMALL, "page_size": page_size, "seq_lens": [33, 7]}
    assert _run(flat_decode, "decode", flat, case).passed is True
    assert _run(flat_decode_pages_of_16, "decode", flat, case).passed is (page_size == 16)
    native = to_native(torch.zeros(21, 2, 5, 1, 4), "flat")
    assert isinstance(native, FlatCache) and native.page_size == 5 and native[0].shape == (105, 4)
    k_cache, v_cache = native  # still unpacks as the pair
    with pytest.raises(ValueError, match="not a whole number of pages of 3"):
        FlatCache(torch.zeros(106, 4), torch.zeros(106, 4), 3)


# ----------------------------------------------------------------------------- guarded outputs


def _decode_into(q, cache, block_tables, seq_lens, out=None, layout="NHD"):
    out.copy_(reference.paged_decode_attention(q.cpu(), cache.cpu(), block_tables.cpu(), seq_lens.cpu(), layout=layout))


def _decode_past_out(q, cache, block_tables, seq_lens, out=None, layout="NHD"):
    _decode_into(q, cache, block_tables, seq_lens, out, layout)
    torch.as_strided(out, (out.numel() + 1,), (1,))[-1] = 0.0  # one element past the end


def _decode_skipping_row_0(q, cache, block_tables, seq_lens, out=None, layout="NHD"):
    saved = out[0].clone()
    _decode_into(q, cache, block_tables, seq_lens, out, layout)
    out[0] = saved  # row 0 never written


def test_a_kernel_writing_into_out_is_guarded_and_must_write_every_row():
    """~1 s."""
    case = {**SMALL, "seq_lens": [9, 0, 5], "poison": False}
    assert verify.run_case("decode", case, decode_fn=_decode_into, isolate=False).passed is True
    past = verify.run_case("decode", case, decode_fn=_decode_past_out, isolate=False)
    assert past.passed is False and "kernel wrote after the end of out" in past.detail
    skipped = verify.run_case("decode", case, decode_fn=_decode_skipping_row_0, isolate=False)
    assert skipped.passed is False and "non-finite outputs, the first at sequence 0" in skipped.detail

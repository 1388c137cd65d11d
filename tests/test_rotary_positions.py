"""Rotary positions apart from cache positions: TensorRT-LLM's three sources.

The builder (:mod:`pagedkv_lib.rotary_positions`) is checked against the formula of
TensorRT-LLM's write kernel written out by hand, then the CSR write kernels (MHA,
quantized, MLA) against the references and against their own slot form, the inactive
Helix rank against a NaN-poisoned pool, and the harness against a kernel that rotates
by the cache position instead.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import faults, verify
from pagedkv_lib import formats, mla, quant_reference, reference, runtime
from pagedkv_lib.quant_pool import QuantizedKVPool
from pagedkv_lib.rotary_positions import as_padding, draft_tree_offsets, inactive_tokens, rotary_positions

import pagedkv_kernels as kernels  # isort: skip
import mutants  # isort: skip

DEV = runtime.device()


def trtllm_rotary_position(b, i, past, helix=None, spec=None, mrope=None, global_idx=0):
    """The expression of TensorRT-LLM's ``applyBiasRopeUpdateKVCache``, one token at a time."""
    base = helix[global_idx] if helix is not None else (spec[b][i] + past[b] if spec is not None else past[b] + i)
    return base + (mrope[b] if mrope is not None else 0)


def _by_hand(indptr, past, **sources):
    out = []
    for b in range(len(past)):
        for i in range(indptr[b + 1] - indptr[b]):
            out.append(trtllm_rotary_position(b, i, past, global_idx=indptr[b] + i, **sources))
    return torch.tensor(out, dtype=torch.int64)


# --------------------------------------------------------------------------- the builder


def test_without_a_source_the_rotary_position_is_the_cache_position():
    assert rotary_positions([0, 3, 5], [4, 0]).tolist() == [4, 5, 6, 0, 1]


def test_a_draft_tree_is_verified_at_each_nodes_depth():
    # root; two drafts for the next position; two after the first, one after the second
    assert draft_tree_offsets([-1, 0, 0, 1, 1, 2]).tolist() == [0, 1, 1, 2, 2, 2]
    assert draft_tree_offsets([-1, 0, 1, 2]).tolist() == [0, 1, 2, 3]  # a chain
    with pytest.raises(ValueError, match=r"parents\[2\] = 5"):
        draft_tree_offsets([-1, 0, 5])
    with pytest.raises(ValueError, match=r"parents\[0\]"):
        draft_tree_offsets([0, 0])


def test_spec_decoding_offsets_are_added_to_past_len_in_trtllms_batch_by_max_len_layout():
    offsets = [[0, 1, 1, 9], [0, 7, 7, 7]]  # columns past a request's drafts are ignored
    got = rotary_positions([0, 3, 4], [10, 2], spec_decoding_position_offsets=offsets)
    assert got.tolist() == [10, 11, 11, 2]
    assert torch.equal(got, _by_hand([0, 3, 4], [10, 2], spec=offsets))


def test_mrope_delta_shifts_every_token_of_its_request():
    got = rotary_positions([0, 2, 5], [6, 1], mrope_position_deltas=torch.tensor([[-3], [5]]))  # [batch, 1] too
    assert got.tolist() == [3, 4, 6, 7, 8]
    assert torch.equal(got, _by_hand([0, 2, 5], [6, 1], mrope=[-3, 5]))


def test_helix_table_overrides_the_spec_offsets_and_the_mrope_delta_still_adds():
    helix, spec, mrope = [41, 45, 49, 3, 7], [[0, 1, 2], [0, 1, 0]], [2, -1]
    got = rotary_positions(
        [0, 3, 5], [10, 0], helix_position_offsets=helix, spec_decoding_position_offsets=spec,
        mrope_position_deltas=mrope,
    )  # fmt: skip
    assert got.tolist() == [43, 47, 51, 2, 6]
    assert torch.equal(got, _by_hand([0, 3, 5], [10, 0], helix=helix, spec=spec, mrope=mrope))


def test_random_sources_equal_trtllms_expression_token_by_token():
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        counts = torch.randint(0, 5, (4,), generator=gen)
        indptr = [0, *counts.cumsum(0).tolist()]
        past = torch.randint(20, 60, (4,), generator=gen).tolist()
        spec = torch.randint(0, 4, (4, 5), generator=gen).tolist()
        mrope = torch.randint(-15, 15, (4,), generator=gen).tolist()
        helix = torch.randint(20, 500, (indptr[-1],), generator=gen).tolist()
        for sources in (
            {"spec": spec},
            {"mrope": mrope},
            {"helix": helix, "mrope": mrope},
            {"spec": spec, "mrope": mrope},
        ):
            names = {"spec": "spec_decoding_position_offsets", "mrope": "mrope_position_deltas",
                     "helix": "helix_position_offsets"}  # fmt: skip
            got = rotary_positions(indptr, past, **{names[k]: v for k, v in sources.items()})
            assert torch.equal(got, _by_hand(indptr, past, **sources)), sources


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"spec_decoding_position_offsets": [[0, 1]]}, "spec_decoding_position_offsets has shape"),
        ({"spec_decoding_position_offsets": [[0], [0]]}, "max_input_seq_len >= 3"),
        ({"mrope_position_deltas": [1, 2, 3]}, "mrope_position_deltas has 3 entries for 2 requests"),
        ({"helix_position_offsets": [0, 1]}, "helix_position_offsets has 2 entries for 4"),
        ({"helix_position_offsets": torch.zeros(4)}, "helix_position_offsets must hold integers"),
        ({"mrope_position_deltas": [-20, 0]}, "rotary position -17 < 0"),
    ],
)
def test_bad_sources_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rotary_positions([0, 3, 4], [3, 0], **kwargs)
    with pytest.raises(ValueError, match="append_indptr needs 3 entries"):
        rotary_positions([0, 3], [3, 0])
    with pytest.raises(ValueError, match="append_indptr must be non-decreasing"):
        rotary_positions([0, 3, 2], [3, 0])
    with pytest.raises(ValueError, match=r"past_lens\[1\] = -1"):
        rotary_positions([0, 3, 4], [3, -1])


def test_an_inactive_ranks_tokens_become_padding():
    inactive = inactive_tokens([0, 2, 5, 6], torch.tensor([False, True, False]))
    assert inactive.tolist() == [False, False, True, True, True, False]
    slots = torch.tensor([9, 10, 3, 4, 5, 0])
    assert as_padding(slots, inactive).tolist() == [9, 10, -1, -1, -1, 0]
    with pytest.raises(ValueError, match="helix_is_inactive_rank must be a bool tensor"):
        inactive_tokens([0, 2], torch.tensor([0]))


# --------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("case", verify.rotary_append_grid(full=True), ids=lambda c: f"{c['source']}-{c['dtype']}")
def test_csr_append_rotates_at_rope_positions_like_the_reference(case):
    result = verify.rotary_append_case(kernels.append_paged_kv_csr, case)
    assert result.passed, result.detail


def _helix_inputs(dtype=torch.float32, seed=0):
    """A Helix case (request 1 inactive) with 4-row pages, as the harness builds it."""
    case = {"source": "helix", "dtype": {torch.float32: "fp32", torch.float16: "fp16"}[dtype], "layout": "NHD",
            "rope": "neox", "page_size": 4, "num_kv_heads": 2, "num_q_heads": 2, "head_dim": 32,
            "seed": seed}  # fmt: skip
    return case, verify.rotary_append_inputs(case)


def test_inactive_rank_writes_nothing_to_a_nan_pool_and_still_rotates_its_q():
    case, t = _helix_inputs()
    inactive = t["positions"] < 0
    assert inactive.any() and (~inactive).any()
    cache = torch.full_like(t["cache"], float("nan")).to(DEV)
    q = t["q"].clone().to(DEV)
    args = (t[n].to(DEV) for n in ("batch_indices", "positions", "kv_indices", "kv_indptr"))
    kernels.append_paged_kv_csr(
        t["k"].to(DEV), t["v"].to(DEV), cache, *args, rope="neox", q=q, rope_positions=t["rope_positions"].to(DEV)
    )
    # The pool keeps its NaN bits everywhere but the rows of the active requests' tokens.
    slots = formats.csr_slot_mapping(t["batch_indices"], t["positions"], t["kv_indices"], t["kv_indptr"], 4)
    written = torch.zeros(cache.shape[0] * 4, dtype=torch.bool)
    written[slots[~inactive]] = True
    rows = cache.cpu().permute(0, 2, 1, 3, 4).reshape(written.numel(), -1)  # [slot, K and V of every head]
    nan_bits = torch.tensor(float("nan")).view(torch.int32)
    untouched = (rows.view(torch.int32) == nan_bits).all(-1)  # bit for bit, payload included
    assert torch.equal(untouched, ~written)
    # ... while every token's Q, the inactive ones' too, is rotated at its Helix position.
    want = reference.rope_reference(t["q"], t["rope_positions"], style="neox")
    assert torch.allclose(q.cpu().double(), want, atol=1e-5)


def test_rope_positions_equal_to_the_cache_positions_change_nothing():
    """The ROPE_POS branch and the launch without it agree bit for bit on the pool, and on
    every written token's Q."""
    _, t = _helix_inputs(torch.float16, seed=4)
    outs = []
    for own in (False, True):
        cache, q = t["cache"].clone().to(DEV), t["q"].clone().to(DEV)
        args = [t[n].to(DEV) for n in ("batch_indices", "positions", "kv_indices", "kv_indptr")]
        extra = {"rope_positions": t["positions"].to(DEV)} if own else {}
        kernels.append_paged_kv_csr(t["k"].to(DEV), t["v"].to(DEV), cache, *args, rope="gptj", q=q, **extra)
        outs.append((cache.cpu(), q.cpu()))
    assert torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
    assert torch.equal(outs[0][1].view(torch.int16), outs[1][1].view(torch.int16))


def test_slot_form_takes_the_built_positions_directly_and_skips_padding_q():
    case, t = _helix_inputs(seed=2)
    slots = formats.csr_slot_mapping(t["batch_indices"], t["positions"], t["kv_indices"], t["kv_indptr"], 4)
    by_slot, by_csr = t["cache"].clone().to(DEV), t["cache"].clone().to(DEV)
    q_slot, q_csr = t["q"].clone().to(DEV), t["q"].clone().to(DEV)
    pos = t["rope_positions"].to(DEV)
    kernels.append_paged_kv(
        t["k"].to(DEV), t["v"].to(DEV), by_slot, slots.to(DEV), rope="neox", positions=pos, q=q_slot
    )
    args = (t[n].to(DEV) for n in ("batch_indices", "positions", "kv_indices", "kv_indptr"))
    kernels.append_paged_kv_csr(t["k"].to(DEV), t["v"].to(DEV), by_csr, *args, rope="neox", q=q_csr, rope_positions=pos)
    assert torch.equal(by_slot.cpu().view(torch.int32), by_csr.cpu().view(torch.int32))
    written = slots >= 0
    assert torch.equal(q_slot.cpu()[written], q_csr.cpu()[written])
    assert torch.equal(q_slot.cpu()[~written], t["q"][~written])  # slot form: padding's q left as it was


def _quant_pool(num_pages: int):
    return QuantizedKVPool(num_pages, 4, 2, 32, "nvfp4", "NHD", DEV).poison_()


def test_quantized_csr_append_with_rope_positions_equals_its_slot_form_and_writes_nothing_inactive():
    _, t = _helix_inputs(seed=5)
    slots = formats.csr_slot_mapping(t["batch_indices"], t["positions"], t["kv_indices"], t["kv_indptr"], 4)
    k, v, pos = t["k"].to(DEV), t["v"].to(DEV), t["rope_positions"].to(DEV)
    by_csr, by_slot, before = (_quant_pool(t["cache"].shape[0]) for _ in range(3))
    q = t["q"].clone().to(DEV)
    args = (t[n].to(DEV) for n in ("batch_indices", "positions", "kv_indices", "kv_indptr"))
    kernels.append_paged_kv_quant_csr_pool(k, v, by_csr, *args, rope="gptj", q=q, rope_positions=pos)
    kernels.append_paged_kv_quant_pool(k, v, by_slot, slots.to(DEV), rope="gptj", positions=pos)
    for name in ("data", "scales"):
        assert torch.equal(
            getattr(by_csr, name).cpu().view(torch.uint8), getattr(by_slot, name).cpu().view(torch.uint8)
        )
    # the inactive request's pages are untouched (their codes still read NaN)
    pages = t["kv_indices"][t["kv_indptr"][1] : t["kv_indptr"][2]]
    assert torch.equal(by_csr.data.cpu()[pages], before.data.cpu()[pages])
    q_ref = t["q"].clone()
    want = by_csr.to("cpu").clone()
    quant_reference.append_paged_kv_quant_csr(
        t["k"], t["v"], want, t["batch_indices"], t["positions"], t["kv_indices"], t["kv_indptr"], rope="gptj",
        q=q_ref, rope_positions=t["rope_positions"],
    )  # fmt: skip
    assert torch.allclose(q.cpu(), q_ref, atol=1e-5)  # Q rotated for every token, the inactive ones' too


def test_mla_csr_append_with_rope_positions_equals_its_slot_form_and_the_reference():
    _, t = _helix_inputs(seed=6)
    slots = formats.csr_slot_mapping(t["batch_indices"], t["positions"], t["kv_indices"], t["kv_indptr"], 4)
    gen = torch.Generator().manual_seed(6)
    n = slots.numel()
    ckv, kpe = torch.randn(n, 48, generator=gen), torch.randn(n, 16, generator=gen)
    pages = t["cache"].shape[0]
    pools = [(torch.full((pages, 4, 48), float("nan")), torch.full((pages, 4, 16), float("nan"))) for _ in range(3)]
    index = [t[x] for x in ("batch_indices", "positions", "kv_indices", "kv_indptr")]
    dev_pools = [tuple(p.to(DEV) for p in pool) for pool in pools[:2]]
    kernels.append_paged_mla_kv_csr(
        ckv.to(DEV), kpe.to(DEV), *dev_pools[0], *(x.to(DEV) for x in index), rope="gptj",
        rope_positions=t["rope_positions"].to(DEV),
    )  # fmt: skip
    kernels.append_paged_mla_kv(
        ckv.to(DEV), kpe.to(DEV), *dev_pools[1], slots.to(DEV), rope="gptj", positions=t["rope_positions"].to(DEV)
    )
    for a, b in zip(*dev_pools):
        assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))
    mla.append_paged_mla_kv_csr(ckv, kpe, *pools[2], *index, rope="gptj", rope_positions=t["rope_positions"])
    assert torch.allclose(dev_pools[0][1].cpu(), pools[2][1], atol=1e-5, equal_nan=True)
    assert int(dev_pools[0][0].cpu().isnan().all(-1).sum()) == pages * 4 - int((slots >= 0).sum())


def test_rope_positions_are_checked_by_name():
    _, t = _helix_inputs()
    args = [t[n] for n in ("k", "v", "cache", "batch_indices", "positions", "kv_indices", "kv_indptr")]
    for fn in (kernels.append_paged_kv_csr, reference.append_paged_kv_csr):
        with pytest.raises(ValueError, match="rope_positions is given but rope is None"):
            fn(*args, rope_positions=t["rope_positions"])
        with pytest.raises(ValueError, match="rope_positions has 3 entries for 15 tokens"):
            fn(*args, rope="neox", rope_positions=t["rope_positions"][:3])
        bad = t["rope_positions"].clone()
        bad[0] = -4
        with pytest.raises(ValueError, match=r"rope_positions\[0\]=-4 must be >= 0 for a token that is written"):
            fn(*args, rope="neox", rope_positions=bad)


# --------------------------------------------------------------------------- what catches the bug


def test_harness_fails_every_rotary_case_of_the_fault_rotary_at_cache_position():
    report = verify.run(
        rotary_append_fn=kernels.append_paged_kv_csr, faults={"rotary_at_cache_position"}, checks=("rotary_append",)
    )
    failed = [r for r in report.results if r.check == "rotary_append" and r.passed is False]
    assert len(failed) == len(verify.rotary_append_grid()), str(report)
    assert all("beyond tolerance at rope_positions" in r.detail for r in failed)
    assert "rotary_at_cache_position" in faults.FAULTS


def test_harness_fails_a_write_kernel_that_rotates_at_the_cache_position():
    (mutant,) = [m for m in mutants.ROTARY_MUTANTS if m.name == "write_rope_at_cache_position"]
    report = verify.run(rotary_append_fn=mutants.build(mutant), checks=("rotary_append",))
    assert not report.passed
    assert {r.case["source"] for r in report.failures} == set(verify.ROTARY_SOURCES), str(report)


@pytest.mark.parametrize("name", ["quant_write_rope_at_cache_position", "mla_write_rope_at_cache_position"])
def test_quantized_and_mla_kernels_rotating_at_the_cache_position_differ_from_the_correct_ones(name):
    (mutant,) = [m for m in mutants.ROTARY_MUTANTS if m.name == name]
    broken = mutants.build(mutant)
    _, t = _helix_inputs(seed=7)
    index = [t[x].to(DEV) for x in ("batch_indices", "positions", "kv_indices", "kv_indptr")]
    pos = t["rope_positions"].to(DEV)
    if name.startswith("quant"):
        k, v = t["k"].to(DEV), t["v"].to(DEV)
        good, bad = _quant_pool(t["cache"].shape[0]), _quant_pool(t["cache"].shape[0])
        kernels.append_paged_kv_quant_csr_pool(k, v, good, *index, rope="neox", rope_positions=pos)
        broken(k, v, bad, *index, rope="neox", rope_positions=pos)
        assert not torch.equal(good.data.cpu(), bad.data.cpu())
    else:
        n = t["k"].shape[0]
        ckv, kpe = torch.randn(n, 16).to(DEV), torch.randn(n, 8).to(DEV)
        pages = t["cache"].shape[0]
        good, bad = [(torch.zeros(pages, 4, 16, device=DEV), torch.zeros(pages, 4, 8, device=DEV)) for _ in range(2)]
        kernels.append_paged_mla_kv_csr(ckv, kpe, *good, *index, rope="neox", rope_positions=pos)
        broken(ckv, kpe, *bad, *index, rope="neox", rope_positions=pos)
        assert (good[1].cpu() - bad[1].cpu()).abs().max() > 0.1

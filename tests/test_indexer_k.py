"""The indexer-K cache: host slot arithmetic, per-token FP8 quantization, the Triton
scatter on a segmented pool (bit for bit against the torch reference), its refusals, a
kernel that assumes a contiguous pool (caught), and the DSA top-k read."""

from __future__ import annotations

import math
import re

import pytest
import torch
import triton
import triton.language as tl

from pagedkv_kernels.indexer_k import indexer_k_cache_scatter, plan_indexer_k_scatter, run_indexer_k_scatter
from pagedkv_lab.verify.indexer_cases import indexer_scatter_case, indexer_scatter_grid, indexer_scatter_inputs
from pagedkv_lib import runtime
from pagedkv_lib.indexer_cache import (
    IndexerKPool,
    indexer_slots,
    indexer_topk,
    quantize_indexer_k,
    read_indexer_k,
    scatter_indexer_k,
)
from pagedkv_lib.quant import fp8_decode, fp8_encode_loop

DEV = runtime.device()


def _segmented_case(**overrides):
    case = {"num_layers": 3, "num_tokens": 13, "block_size": 4, "head_dim": 16, "layer": 1, "pad": 12, "padding": 2}
    return {**case, **overrides}


def test_pool_view_is_not_contiguous_and_each_block_is_its_own_segment():
    pool = IndexerKPool(5, 4, 16, num_layers=2, pad=8, fill=0)
    cache = pool.cache(1)
    assert cache.shape == (5, 4, 1, 20)
    assert cache.stride() == (2 * (4 * 20 + 8), 20, 20, 1)
    assert not cache.is_contiguous()
    cache[1].fill_(7)  # block 1 of layer 1: bytes 2*88 + 88 .. + 80 of the arena, nothing else
    flat = pool.arena.view(-1)
    assert torch.nonzero(flat).flatten().tolist() == list(range(3 * 88, 3 * 88 + 80))


def test_slots_follow_the_block_layout_codes_first_then_scales():
    # block_size 4, head_dim 16: a block is 4 * 20 = 80 bytes, codes 0..63, scales 64..79.
    table = torch.tensor([[2, 0]])
    batch = torch.tensor([0, 0, -1])
    positions = torch.tensor([1, 6, -1])  # page 2 row 1; page 0 row 2; padding
    fp8, scale = indexer_slots(table, batch, positions, 4, 16)
    assert fp8.tolist() == [2 * 80 + 16, 0 * 80 + 32, -1]
    assert scale.tolist() == [2 * 80 + 64 + 4, 0 * 80 + 64 + 8, -1]


def test_quantize_uses_one_scale_per_token_amax_over_448():
    k = torch.tensor([[1.0, -2.0, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [math.inf, 1.0, math.nan, -3.0]])
    codes, scales = quantize_indexer_k(k)
    assert scales.dtype == torch.float32 and scales.shape == (3,)
    assert scales.tolist() == [
        float(torch.tensor(4.0) / 448),
        0.0,
        float(torch.tensor(3.0) / 448),
    ], "amax / 448 over each row's finite values, 0 for a row without any nonzero"
    # The codes are the format's loop encoder applied to k / scale (a zero scale: k itself).
    divided = torch.where(scales[:, None] > 0, k / torch.where(scales > 0, scales, 1.0)[:, None], k)
    assert torch.equal(codes, fp8_encode_loop(divided))
    assert fp8_decode(codes[0]).tolist()[3] == 448.0, "the row's largest value maps to the largest code"


def test_scatter_matches_the_reference_bit_for_bit_on_a_segmented_pool():
    pool, codes, scales, fp8, sc, _ = indexer_scatter_inputs(_segmented_case())
    expected = pool.arena.clone()
    ref_pool = IndexerKPool(pool.num_blocks, 4, 16, 3, 12, fill=0)
    ref_pool.arena = expected
    scatter_indexer_k(ref_pool.cache(1), codes, scales, fp8, sc)
    pool.arena = pool.arena.to(DEV)
    indexer_k_cache_scatter(pool.cache(1), codes.to(DEV), scales.to(DEV), fp8.to(DEV), sc.to(DEV))
    assert torch.equal(pool.arena.cpu(), expected)
    real = fp8 >= 0
    got_codes, got_scales = read_indexer_k(pool.cache(1), fp8[real], sc[real], 16)
    assert torch.equal(got_codes, codes[real]) and torch.equal(
        got_scales.view(torch.int32), scales[real].view(torch.int32)
    )


def test_scatter_passes_the_default_harness_grid():
    results = [indexer_scatter_case(indexer_k_cache_scatter, c) for c in indexer_scatter_grid()]
    assert all(r.passed for r in results), [r.detail for r in results if not r.passed]
    assert any(c["num_layers"] > 1 and c["num_tokens"] > 0 for c in indexer_scatter_grid()), "no segmented case"


def test_padding_tokens_write_nothing():
    pool = IndexerKPool(3, 4, 16, num_layers=2, generator=torch.Generator().manual_seed(1))
    before = pool.arena.clone()
    codes = torch.full((3, 16), 0x11, dtype=torch.uint8)
    scales = torch.ones(3)
    minus = torch.full((3,), -1, dtype=torch.int64)
    pool.arena = pool.arena.to(DEV)
    indexer_k_cache_scatter(pool.cache(0), codes.to(DEV), scales.to(DEV), minus.to(DEV), minus.to(DEV))
    assert torch.equal(pool.arena.cpu(), before)


@triton.jit
def _contiguous_scatter_kernel(codes_ptr, scale_bytes_ptr, cache_ptr, slot_fp8_ptr, slot_scale_ptr, head_dim,
                               BLOCK_D: tl.constexpr):  # fmt: skip
    # The mutant: the flat index taken for the memory offset (true only of a contiguous pool).
    t = tl.program_id(0).to(tl.int64)
    base = tl.load(slot_fp8_ptr + t)
    base_scale = tl.load(slot_scale_ptr + t)
    real = (base >= 0) & (base_scale >= 0)
    d = tl.arange(0, BLOCK_D)
    m = d < tl.where(real, head_dim, 0)
    tl.store(cache_ptr + base + d, tl.load(codes_ptr + t * head_dim + d, mask=m), mask=m)
    b = tl.arange(0, 4)
    ms = b < tl.where(real, 4, 0)
    tl.store(cache_ptr + base_scale + b, tl.load(scale_bytes_ptr + t * 4 + b, mask=ms), mask=ms)


def contiguous_scatter(k_cache, codes, scales, slot_fp8, slot_scale):
    """A scatter that assumes a contiguous pool (validated like the real one)."""
    plan = plan_indexer_k_scatter(k_cache, codes, scales, slot_fp8, slot_scale)
    if plan.num_tokens:
        _contiguous_scatter_kernel[(plan.num_tokens,)](
            codes.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8), k_cache,
            plan.slot_fp8, plan.slot_scale, plan.head_dim, BLOCK_D=triton.next_power_of_2(plan.head_dim),
        )  # fmt: skip


def test_a_kernel_that_assumes_a_contiguous_pool_fails_on_the_segmented_one():
    one_layer = _segmented_case(num_layers=1, layer=0, pad=0)
    assert indexer_scatter_case(contiguous_scatter, one_layer).passed, "the mutant must be right where it assumes"
    result = indexer_scatter_case(contiguous_scatter, _segmented_case())
    assert result.passed is False
    assert "bytes differ" in result.detail
    grid = [indexer_scatter_case(contiguous_scatter, c) for c in indexer_scatter_grid()]
    assert any(r.passed is False for r in grid), "the default grid must catch it too"


def _valid():
    pool = IndexerKPool(2, 4, 16, num_layers=2, fill=0)
    codes = torch.zeros((2, 16), dtype=torch.uint8)
    scales = torch.ones(2)
    fp8, sc = indexer_slots(torch.tensor([[0, 1]]), torch.tensor([0, 0]), torch.tensor([0, 5]), 4, 16)
    return {"k_cache": pool.cache(1), "codes": codes, "scales": scales, "slot_fp8": fp8, "slot_scale": sc}


BAD = {
    "slot past the pool": ("slot_fp8", lambda a: a["slot_fp8"].clone().fill_(2 * 80 - 8), "slot_fp8"),
    "scale slot past the pool": ("slot_scale", lambda a: torch.tensor([64, 2 * 80 - 2]), "slot_scale"),
    "two tokens on one slot": ("slot_fp8", lambda a: a["slot_fp8"][:1].repeat(2), "write the same bytes"),
    "codes over a scale": ("slot_fp8", lambda a: torch.tensor([0, 64]), "write the same bytes"),
    "slot below -1": ("slot_fp8", lambda a: torch.tensor([-2, 16]), "slot_fp8[0]=-2"),
    # slot + size wrapped around int64 and passed the bound check; the kernel then segfaulted
    "slot near 2**63": ("slot_fp8", lambda a: torch.tensor([2**63 - 8, 16]), "slot_fp8[0]=9223372036854775800"),
    "scale slot near 2**63": ("slot_scale", lambda a: torch.tensor([2**63 - 2, 84]), "slot_scale[0]=922337203685477"),
    "padding in one mapping only": ("slot_scale", lambda a: torch.tensor([-1, 84]), "a padding token is -1 in both"),
    "float slots": ("slot_fp8", lambda a: a["slot_fp8"].float(), "slot_fp8 must be"),
    "slot count": ("slot_scale", lambda a: a["slot_scale"][:1], "slot_scale has 1 entries"),
    "pool dtype": ("k_cache", lambda a: torch.zeros((2, 4, 1, 20)), "k_cache must be uint8"),
    "pool rank": ("k_cache", lambda a: torch.zeros((2, 4, 20), dtype=torch.uint8), "k_cache must be uint8"),
    "codes dtype": ("codes", lambda a: a["codes"].float(), "codes must be"),
    "scales shape": ("scales", lambda a: torch.ones(2, 1), "scales must be float32 [2]"),
    "scales dtype": ("scales", lambda a: torch.ones(2, dtype=torch.float16), "scales must be float32"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_are_refused_by_name_before_anything_is_written(name):
    args = _valid()
    arg, bad, message = BAD[name]
    args[arg] = bad(args)
    arena = args["k_cache"]
    snapshot = arena.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        indexer_k_cache_scatter(**{k: v.to(DEV) for k, v in args.items()})
    assert torch.equal(arena, snapshot)


@pytest.mark.skipif(DEV.type != "cpu", reason="the device check needs a second device")
def test_inputs_off_the_kernels_device_are_refused():
    args = _valid()
    args["codes"] = args["codes"].to("meta")
    with pytest.raises(ValueError, match="codes is on meta"):
        indexer_k_cache_scatter(**args)


@pytest.mark.parametrize("name", ["slot_fp8", "slot_scale"])
def test_meta_slot_tensors_are_refused_by_name(name):
    """They gave torch's NotImplementedError: Cannot copy out of meta tensor."""
    args = {k: v.to(DEV) for k, v in _valid().items()}
    args[name] = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device and holds no values"):
        indexer_k_cache_scatter(**args)


def test_run_refuses_a_pool_or_inputs_other_than_planned():
    args = {k: v.to(DEV) for k, v in _valid().items()}
    plan = plan_indexer_k_scatter(**args)
    contiguous = torch.zeros((2, 4, 1, 20), dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="k_cache has shape"):
        run_indexer_k_scatter(plan, contiguous, args["codes"], args["scales"])
    with pytest.raises(ValueError, match="codes.dtype=torch.int8"):
        run_indexer_k_scatter(plan, args["k_cache"], args["codes"].view(torch.int8), args["scales"])


@pytest.mark.parametrize("seq_len", [-1, 2.0, True])
def test_topk_refuses_a_seq_len_that_is_not_a_count_by_name(seq_len):
    pool = IndexerKPool(3, 4, 8, num_layers=1)
    with pytest.raises(ValueError, match=re.escape(f"seq_len={seq_len!r} must be an int >= 0")):
        indexer_topk(torch.zeros((2, 8)), torch.ones(2), pool.cache(0), torch.tensor([0, 1]), seq_len, 8, top_k=1)


def test_topk_scores_relu_per_indexer_head_then_weights():
    # Head 0 looks along +e0, head 1 along -e0, weight 1 each: relu per head makes the
    # score |k0| (without relu the two heads would cancel to 0 for every token).
    head_dim, block_size = 8, 4
    k0 = [0.5, -5.0, 2.0, 1.0, 4.0, -0.25, 3.0]
    k = torch.zeros((len(k0), head_dim))
    k[:, 0] = torch.tensor(k0)
    k[:, 1] = 0.125  # a second feature the queries do not look at
    pool = IndexerKPool(3, block_size, head_dim, num_layers=2, generator=torch.Generator().manual_seed(2))
    table = torch.tensor([[2, 0]])
    pos = torch.arange(len(k0))
    fp8, sc = indexer_slots(table, torch.zeros_like(pos), pos, block_size, head_dim)
    codes, scales = quantize_indexer_k(k)
    pool.arena = pool.arena.to(DEV)
    indexer_k_cache_scatter(pool.cache(1), codes.to(DEV), scales.to(DEV), fp8.to(DEV), sc.to(DEV))
    q = torch.zeros((2, head_dim))
    q[0, 0], q[1, 0] = 1.0, -1.0
    top = indexer_topk(q, torch.tensor([1.0, 1.0]), pool.cache(1), table[0], len(k0), head_dim, top_k=3)
    assert top.tokens.tolist() == [1, 4, 6], "the largest |k0|: -5 (position 1), 4 (position 4), 3 (position 6)"
    assert top.blocks.tolist() == [0, 2], "positions 1 (block 2) and 4, 6 (block 0)"
    assert top.scores.tolist() == pytest.approx([abs(v) for v in k0], rel=2**-4)
    assert math.isclose(float(top.scores[1]), 5.0, rel_tol=1e-6), "the row maximum is exact in FP8 (448 * amax / 448)"

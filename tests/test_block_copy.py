"""The multi-layer block copy: bit for bit against torch copies (NaN payloads included),
partial copies that leave the rest of the destination alone, every layer in one launch,
copies into a second pool, refusals before launch, and mutants the harness catches."""

from __future__ import annotations

import re

import pytest
import torch

from pagedkv_kernels.block_copy import block_copy_kernel, copy_paged_blocks, plan_block_copy, run_block_copy
from pagedkv_lab.verify.compare import bits
from pagedkv_lab.verify.indexer_cases import block_copy_case, block_copy_grid, block_copy_inputs
from pagedkv_lib import runtime
from pagedkv_lib.block_copy import copy_blocks

DEV = runtime.device()
LAYOUTS = ("NHD", "HND")


def _random_bits_pool(shape, dtype, seed=0):
    """A pool of random bit patterns: NaNs with many payloads, infinities, signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * size,), generator=gen).to(torch.uint8)
    return raw.view(dtype).view(shape)


def _rows(cache, layout, page):
    """``[num_layers, 2, page_size, heads, head_dim]`` view of one block, rows first."""
    block = cache[:, page]
    return block if layout == "NHD" else block.transpose(2, 3)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_copy_is_bit_exact_against_torch_copies_nan_payloads_included(layout, dtype):
    shape = (3, 8, 2, 5, 2, 8) if layout == "NHD" else (3, 8, 2, 2, 5, 8)
    cache = _random_bits_pool(shape, dtype)
    if dtype.is_floating_point:
        assert torch.isnan(cache.float()).any(), "the pool must carry NaN payloads for this test to mean anything"
    src, dst, tokens = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7]), torch.tensor([0, -1, 3, 1])
    expected = cache.clone()
    copy_blocks(expected, src, dst, tokens, layout)
    got = cache.to(DEV)
    copy_paged_blocks(got, src.to(DEV), dst.to(DEV), tokens.to(DEV), layout)
    assert torch.equal(bits(got.cpu()), bits(expected))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_copy_copies_the_first_rows_of_every_layer_and_leaves_the_rest(layout):
    shape = (4, 3, 2, 6, 3, 4) if layout == "NHD" else (4, 3, 2, 3, 6, 4)
    cache = _random_bits_pool(shape, torch.float32, seed=1)
    before = cache.clone()
    got = cache.to(DEV)
    copy_paged_blocks(got, torch.tensor([2], device=DEV), torch.tensor([0], device=DEV), torch.tensor([4], device=DEV),
                      layout)  # fmt: skip
    got = got.cpu()
    new, old, src = _rows(got, layout, 0), _rows(before, layout, 0), _rows(before, layout, 2)
    assert torch.equal(bits(new[:, :, :4]), bits(src[:, :, :4])), "rows 0..3 of every layer, K and V, come from block 2"
    assert torch.equal(bits(new[:, :, 4:]), bits(old[:, :, 4:])), "rows 4, 5 keep their values"
    assert torch.equal(bits(got[:, 1:]), bits(before[:, 1:])), "no other block changes"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_into_a_second_pool_leaves_the_source_unchanged(layout):
    shape = (2, 4, 2, 4, 2, 8) if layout == "NHD" else (2, 4, 2, 2, 4, 8)
    cache = _random_bits_pool(shape, torch.bfloat16, seed=2)
    other = _random_bits_pool((2, 6, *shape[2:]), torch.bfloat16, seed=3)
    src, dst, tokens = torch.tensor([3, 0, 1]), torch.tensor([5, 0, 2]), torch.tensor([0, 2, -1])
    source_before, expected_dst = cache.clone(), other.clone()
    copy_blocks(cache.clone(), src, dst, tokens, layout, expected_dst)
    assert not torch.equal(bits(expected_dst), bits(other)), "the copy must change something"
    got_src, got_dst = cache.clone().to(DEV), other.clone().to(DEV)
    copy_paged_blocks(got_src, src.to(DEV), dst.to(DEV), tokens.to(DEV), layout, dst_cache=got_dst)
    assert torch.equal(bits(got_dst.cpu()), bits(expected_dst))
    assert torch.equal(bits(got_src.cpu()), bits(source_before))


def test_copy_passes_the_default_harness_grid():
    results = [block_copy_case(copy_paged_blocks, c) for c in block_copy_grid()]
    assert all(r.passed for r in results), [r.detail for r in results if not r.passed]


# Mutants: the production kernel launched with one argument wrong, as a buggy wrapper would.
def _launch_wrong(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache, *, layers=None, ignore_count=False):
    plan = plan_block_copy(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache)
    if not plan.num_pairs:
        return
    out = cache if dst_cache is None else dst_cache
    page_size, heads = (cache.shape[3], cache.shape[4]) if layout == "NHD" else (cache.shape[4], cache.shape[3])

    def strides(t):
        s = t.stride()
        return s if layout == "NHD" else (*s[:3], s[4], s[3], s[5])

    block_t, block_h, block_d = plan.tiles
    tokens = torch.zeros_like(plan.num_tokens) if ignore_count else plan.num_tokens
    block_copy_kernel[(plan.num_pairs, -(-page_size // block_t), -(-heads // block_h))](
        cache, out, plan.src_blocks, plan.dst_blocks, tokens,
        cache.shape[0] if layers is None else layers, page_size, heads, cache.shape[5],
        *strides(cache), *strides(out), BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d,
    )  # fmt: skip


def copy_layer_zero_only(cache, src_blocks, dst_blocks, num_tokens, layout="NHD", dst_cache=None):
    _launch_wrong(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache, layers=1)


def copy_ignoring_the_token_count(cache, src_blocks, dst_blocks, num_tokens, layout="NHD", dst_cache=None):
    _launch_wrong(cache, src_blocks, dst_blocks, num_tokens, layout, dst_cache, ignore_count=True)


@pytest.mark.parametrize("mutant", [copy_layer_zero_only, copy_ignoring_the_token_count])
def test_the_harness_catches_a_copy_that_skips_layers_or_ignores_the_count(mutant):
    results = [block_copy_case(mutant, c) for c in block_copy_grid()]
    failed = [r for r in results if r.passed is False]
    assert failed, f"{mutant.__name__} passed every case"
    assert "elements differ" in failed[0].detail


def _pool():
    return torch.zeros((2, 4, 2, 4, 2, 8), device=DEV)


BAD = {
    "source out of range": (dict(src_blocks=[4]), "src_blocks[0]=4 is outside the pool"),
    "negative destination": (dict(dst_blocks=[-1]), "dst_blocks[0]=-1 is outside the pool"),
    "count above the page": (dict(num_tokens=[5]), "num_tokens[0]=5 exceeds page_size=4"),
    "two pairs, one destination": (dict(src_blocks=[0, 1], dst_blocks=[2, 2], num_tokens=[0, 0]), "both write block 2"),
    "destination is a source": (dict(src_blocks=[0, 1], dst_blocks=[1, 2], num_tokens=[0, 0]), "block 1 is dst_blocks"),
    "lengths differ": (dict(num_tokens=[0, 0]), "num_tokens has 2 entries"),
    "float ids": (dict(src_blocks=torch.tensor([0.0])), "src_blocks must be a 1-D int32 or int64"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_pairs_are_refused_by_name_before_anything_is_copied(name):
    cache = _random_bits_pool((2, 4, 2, 4, 2, 8), torch.float32).to(DEV)
    snapshot = cache.clone()
    args = {"src_blocks": [0], "dst_blocks": [1], "num_tokens": [0]}
    overrides, message = BAD[name]
    args.update(overrides)
    tensors = {k: (v if isinstance(v, torch.Tensor) else torch.tensor(v)).to(DEV) for k, v in args.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        copy_paged_blocks(cache, **tensors)
    assert torch.equal(bits(cache), bits(snapshot))


def test_pools_that_overlap_or_do_not_match_are_refused():
    cache = _pool()
    one = {k: torch.tensor([0], device=DEV) for k in ("src_blocks", "dst_blocks", "num_tokens")}
    with pytest.raises(ValueError, match="dst_cache overlaps the memory of cache"):
        copy_paged_blocks(cache, **one, dst_cache=cache[:, 1:])
    with pytest.raises(ValueError, match="does not match cache"):
        copy_paged_blocks(cache, **one, dst_cache=torch.zeros((2, 4, 2, 4, 2, 4), device=DEV))
    with pytest.raises(ValueError, match="cache must be"):
        copy_paged_blocks(cache[0], **one)
    with pytest.raises(ValueError, match="cache.dtype"):
        copy_paged_blocks(cache.double(), **one)
    with pytest.raises(ValueError, match="layout="):
        copy_paged_blocks(cache, **one, layout="NDH")


@pytest.mark.parametrize("name", ["src_blocks", "dst_blocks", "num_tokens"])
@pytest.mark.parametrize("written", ["cache", "dst_cache"])
def test_index_tensors_inside_the_pool_the_copy_writes_are_refused(name, written):
    """An index tensor viewing the pool being written (int32 ids stored in its bytes) was
    accepted: the kernel read its pairs from memory it was overwriting. The indexer
    scatter already refused this."""
    source, target = _pool(), _pool()
    pool = source if written == "cache" else target
    ids = pool.view(torch.int32).flatten()
    ids[:3] = torch.tensor([0, 1, 0], dtype=torch.int32)  # valid pairs, stored in the pool's first bytes
    args = {"src_blocks": torch.tensor([0], device=DEV), "dst_blocks": torch.tensor([1], device=DEV),
            "num_tokens": torch.tensor([0], device=DEV)}  # fmt: skip
    args[name] = ids[("src_blocks", "dst_blocks", "num_tokens").index(name)].reshape(1)
    snapshot = pool.clone()
    with pytest.raises(ValueError, match=f"{name} overlaps the memory of {written}"):
        copy_paged_blocks(source, **args, dst_cache=None if written == "cache" else target)
    assert torch.equal(bits(pool), bits(snapshot))


@pytest.mark.parametrize("name", ["src_blocks", "dst_blocks", "num_tokens"])
def test_meta_index_tensors_are_refused_by_name(name):
    """They gave torch's NotImplementedError: Cannot copy out of meta tensor."""
    args = {k: torch.tensor([v], device=DEV) for k, v in (("src_blocks", 0), ("dst_blocks", 1), ("num_tokens", 0))}
    args[name] = torch.zeros(1, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device and holds no values"):
        copy_paged_blocks(_pool(), **args)


def test_run_refuses_pools_other_than_planned():
    cache = _pool()
    one = {k: torch.tensor([v], device=DEV) for k, v in (("src_blocks", 0), ("dst_blocks", 1), ("num_tokens", 0))}
    plan = plan_block_copy(cache, **one)
    with pytest.raises(ValueError, match="cache has shape"):
        run_block_copy(plan, cache.transpose(3, 4).contiguous().transpose(3, 4))
    with pytest.raises(ValueError, match="dst_cache must be given exactly"):
        run_block_copy(plan, cache, dst_cache=_pool())


def test_inputs_build_distinct_pairs_with_whole_and_partial_counts():
    case = {**block_copy_grid()[0], "num_pairs": 5}
    _, _, src, dst, tokens = block_copy_inputs(case)
    assert len(set(src.tolist()) | set(dst.tolist())) == 10, "sources and destinations are all distinct blocks"
    assert tokens.tolist() == [0, -1, 1, case["page_size"] - 1, 2]

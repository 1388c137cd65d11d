"""A plan owns the index tensors it validated (issue 36): changing the caller's tensors
after planning changes nothing a ``run_*`` does. Plans used to keep references to
int32/int64 contiguous device tensors (``.to(...).contiguous()`` copies nothing then),
so a table changed between plan and run made the kernel write (block copy, indexer
scatter, append) or read (decode) where no check had looked: past the pool with an id
out of range. Each test changes the tensors to other *valid* ids (an out-of-range one
would crash the interpreter's process on the old code) and checks that the run did what
was planned. Tiny shapes: well under 5 s in all.
"""

from __future__ import annotations

import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import reference, runtime
from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.indexer_cache import IndexerKPool, indexer_slots, quantize_indexer_k, scatter_indexer_k

# isort: split
import pagedkv_kernels as kernels

DEV = runtime.device()


def test_a_block_copy_plan_copies_the_pairs_it_validated():
    cache = torch.randn((2, 6, 2, 4, 1, 8), device=DEV)
    src, dst, n = (torch.tensor(x, dtype=torch.int32, device=DEV) for x in ([0, 1], [2, 3], [0, 2]))
    plan = kernels.plan_block_copy(cache, src, dst, n)
    want = cache.clone().cpu()
    copy_blocks(want, src.cpu(), dst.cpu(), n.cpu())
    src.copy_(torch.tensor([4, 5]))
    dst.copy_(torch.tensor([0, 1]))
    n.fill_(0)
    kernels.run_block_copy(plan, cache)
    assert torch.equal(cache.cpu(), want), "the run copied the pairs given after planning"


def test_an_indexer_scatter_plan_writes_the_slots_it_validated():
    pool = IndexerKPool(4, 4, 16, num_layers=1, fill=0)
    pool.arena = pool.arena.to(DEV)
    codes, scales = quantize_indexer_k(torch.randn((2, 16)))
    fp8, sc = indexer_slots(torch.tensor([[0, 1]]), torch.tensor([0, 0]), torch.tensor([0, 5]), 4, 16)
    fp8, sc = fp8.to(DEV), sc.to(DEV)
    plan = kernels.plan_indexer_k_scatter(pool.cache(0), codes.to(DEV), scales.to(DEV), fp8, sc)
    want = pool.cache(0).clone().cpu()
    scatter_indexer_k(want, codes, scales, fp8.cpu(), sc.cpu())
    other_fp8, other_sc = indexer_slots(torch.tensor([[2, 3]]), torch.tensor([0, 0]), torch.tensor([1, 6]), 4, 16)
    fp8.copy_(other_fp8)
    sc.copy_(other_sc)
    kernels.run_indexer_k_scatter(plan, pool.cache(0), codes.to(DEV), scales.to(DEV))
    assert torch.equal(pool.cache(0).cpu(), want), "the run wrote the slots given after planning"


def test_an_append_plan_writes_the_slots_it_validated():
    cache = torch.zeros((4, 2, 4, 1, 8), device=DEV)
    k, v = torch.randn((3, 1, 8), device=DEV), torch.randn((3, 1, 8), device=DEV)
    slots = torch.tensor([0, 5, 6], device=DEV)
    plan = kernels.plan_append(k, v, cache, slots)
    want = cache.clone().cpu()
    reference.append_paged_kv(k.cpu(), v.cpu(), want, slots.cpu())
    slots.copy_(torch.tensor([12, 13, 14]))
    kernels.run_append(plan, k, v, cache)
    assert torch.equal(cache.cpu(), want), "the run wrote the slots given after planning"


def test_a_decode_plan_reads_the_pages_it_validated():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn((6, 2, 4, 1, 8), generator=gen).to(DEV)
    q = torch.randn((1, 2, 8), generator=gen).to(DEV)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([10], dtype=torch.int32, device=DEV)
    plan = kernels.plan_decode(q, cache, table, lens)
    want = kernels.run_decode(plan, q, cache)
    table.copy_(torch.tensor([[3, 4, 5]]))
    lens.fill_(12)
    assert torch.equal(kernels.run_decode(plan, q, cache), want), "the run read the pages given after planning"

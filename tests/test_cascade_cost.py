"""The K/V-read model of cascade attention (pagedkv_lib.cascade_cost), by hand and against
the prefill kernel's own tile lists."""

from __future__ import annotations

import pytest
import torch

import pagedkv_kernels as kernels
from pagedkv_lib.cascade_cost import cascade_kv_reads


def test_reads_counted_by_hand():
    """Prefix 64; requests of 20 and 30 own tokens with 1 and 3 queries; group 2, tiles of
    4 (query, head) rows. Flat: 84 keys for request 0; 93 and 94 for request 1's two tiles
    (each up to its last query). Cascade: 2 prefix tiles x 64, then suffixes 20, 29, 30."""
    reads = cascade_kv_reads(64, [20, 30], [1, 3], group=2, block_m=4)
    assert (reads.flat_rows, reads.flat_tiles) == (84 + 93 + 94, 3)
    assert (reads.prefix_rows, reads.prefix_tiles) == (2 * 64, 2)
    assert (reads.suffix_rows, reads.suffix_tiles) == (20 + 29 + 30, 3)
    assert reads.cascade_rows == 128 + 79


def test_decodes_sharing_a_prefix_read_it_once_per_tile_of_requests():
    """32 one-query requests, group 4, tiles of 16 rows: flat reads the 1024-token prefix
    32 times, cascade 8 times (4 requests per tile)."""
    reads = cascade_kv_reads(1024, [8] * 32, [1] * 32, group=4, block_m=16)
    assert reads.flat_rows == 32 * (1024 + 8)
    assert reads.prefix_rows == 8 * 1024 and reads.suffix_rows == 32 * 8


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 2, 7]])
def test_tile_counts_match_the_prefill_plans(q_lens):
    """The model's tiles are the kernel's: a flat prefill plan, the prefix pass (one
    request of all queries, non-causal) and the suffix pass, each planned, not run."""
    page, heads_kv, group, dim, shared = 4, 2, 2, 16, 24
    suffix = [9, 6, 12]
    cache = torch.zeros((64, 2, page, heads_kv, dim))
    q = torch.zeros((sum(q_lens), heads_kv * group, dim))
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    flat_lens = torch.tensor([shared + s for s in suffix])
    table = torch.arange(3 * 16).view(3, 16)
    flat = kernels.plan_prefill(q, cache, qo, table, flat_lens)
    prefix = kernels.plan_prefill(
        q, cache, torch.tensor([0, sum(q_lens)]), table[:1], torch.tensor([shared]), causal=False
    )
    suffix_plan = kernels.plan_prefill(q, cache, qo, table, torch.tensor(suffix))
    assert flat.block_m == suffix_plan.block_m, "the flat and suffix passes have the same queries, so tiles"
    reads = cascade_kv_reads(shared, suffix, q_lens, group, flat.block_m, prefix.block_m)
    assert (reads.flat_tiles, reads.prefix_tiles, reads.suffix_tiles) == (
        flat.num_tiles,
        prefix.num_tiles,
        suffix_plan.num_tiles,
    ), "the model must count the programs the kernel launches"


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, [4, 2], [5, 1], 2, 4), r"q_lens\[0\]=5"),
        ((8, [4], [1, 1], 2, 4), "suffix_lens has 1 entries"),
        ((8, [4], [1], 2, 3), "block_m=3 must be a positive multiple of group=2"),
    ],
)
def test_bad_sizes_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        cascade_kv_reads(*args)

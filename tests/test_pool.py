"""PagedKVPool: layouts, strides, element offsets and block copies."""

import itertools

import numpy as np
import pytest
import torch

from pagedkv_lib import PagedKVPool, element_offset
from pagedkv_lib.pool import cache_dims, cache_strides, check_layout


def filled_pool(layout, pages=3, ps=4, heads=2, dim=8, dtype=torch.float32):
    """A pool whose every element holds a distinct value (its flat index)."""
    pool = PagedKVPool(pages, ps, heads, dim, dtype=dtype, layout=layout)
    pool.cache.copy_(torch.arange(pool.cache.numel(), dtype=dtype).view(pool.cache.shape))
    return pool


def test_nhd_pool_shape_and_strides():
    pool = PagedKVPool(3, 4, 2, 8, layout="NHD")
    assert pool.cache.shape == (3, 2, 4, 2, 8)
    assert pool.dtype == torch.float16 and pool.num_pages == 3 and pool.num_slots == 12
    assert torch.count_nonzero(pool.cache) == 0
    # (page, kv, row, head, feat): a page is 2*4*2*8 = 128 elements, K/V halves 64,
    # one token row 2*8 = 16, one head 8
    assert pool.strides == (128, 64, 16, 8, 1)
    assert cache_dims(pool.cache, "NHD") == (3, 4, 2, 8)


def test_hnd_pool_shape_and_strides():
    pool = PagedKVPool(3, 4, 2, 8, layout="HND")
    assert pool.cache.shape == (3, 2, 2, 4, 8)
    # one head's block is 4 rows * 8 = 32 elements; one row 8
    assert pool.strides == (128, 64, 8, 32, 1)
    assert cache_dims(pool.cache, "HND") == (3, 4, 2, 8)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("ps, heads, dim", [(4, 2, 8), (5, 3, 80), (1, 1, 4)])
def test_element_offset_matches_torch_indexing(layout, ps, heads, dim):
    pool = filled_pool(layout, pages=3, ps=ps, heads=heads, dim=dim)
    flat = pool.cache.flatten()
    for page, kv, head, row, feat in itertools.product(range(3), range(2), range(heads), range(ps), range(dim)):
        idx = (page, kv, row, head, feat) if layout == "NHD" else (page, kv, head, row, feat)
        assert flat[pool.element_offset(page, kv, head, row, feat)] == pool.cache[idx]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_element_offset_vectorized_over_all_indices(layout):
    pool = filled_pool(layout, pages=4, ps=5, heads=2, dim=6)
    g = torch.meshgrid(*(torch.arange(n) for n in (4, 2, 2, 5, 6)), indexing="ij")
    page, kv, head, row, feat = (x.flatten() for x in g)
    off = pool.element_offset(page, kv, head, row, feat)
    got = pool.cache.flatten()[off]
    want = pool.cache[page, kv, row, head, feat] if layout == "NHD" else pool.cache[page, kv, head, row, feat]
    assert torch.equal(got, want)
    # distinct values: the offsets are a permutation of the storage
    assert torch.equal(off.sort().values, torch.arange(pool.cache.numel()))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_element_offset_follows_the_strides_of_a_non_contiguous_view(layout):
    # A pool view carved out of a wider tensor (head_dim 6 of 10): strides, not shapes,
    # decide where an element lives.
    base = torch.arange(3 * 2 * 4 * 2 * 10, dtype=torch.float32).view(3, 2, 4, 2, 10)
    view = base[..., :6]
    assert not view.is_contiguous()
    strides = cache_strides(view, layout)
    for idx in itertools.product(range(3), range(2), range(4), range(2), range(6)):
        page, kv, a, b, feat = idx
        row, head = (a, b) if layout == "NHD" else (b, a)
        assert base.flatten()[element_offset(strides, page, kv, head, row, feat)] == view[idx]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rows_is_a_token_major_view_of_one_page(layout):
    pool = filled_pool(layout)
    r = pool.rows(1, 1)
    assert r.shape == (4, 2, 8)
    for row, head in itertools.product(range(4), range(2)):
        idx = (1, 1, row, head) if layout == "NHD" else (1, 1, head, row)
        assert torch.equal(r[row, head], pool.cache[idx])
    r[0, 0, 0] = -1.0  # a view: writes land in the pool
    assert pool.cache.flatten()[pool.element_offset(1, 1, 0, 0, 0)] == -1.0


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_blocks_copies_whole_pages_and_partial_rows(layout):
    pool = filled_pool(layout, pages=4)
    before = pool.cache.clone()
    pool.copy_blocks([(0, 2), (1, 3, 2)])
    assert torch.equal(pool.rows(2, 0), before[0, 0] if layout == "NHD" else before[0, 0].transpose(0, 1))
    assert torch.equal(pool.cache[2], before[0])
    # page 3: rows 0-1 of page 1 (K and V), rows 2-3 untouched
    for kv in range(2):
        src = before[1, kv] if layout == "NHD" else before[1, kv].transpose(0, 1)
        old = before[3, kv] if layout == "NHD" else before[3, kv].transpose(0, 1)
        assert torch.equal(pool.rows(3, kv)[:2], src[:2])
        assert torch.equal(pool.rows(3, kv)[2:], old[2:])
    assert torch.equal(pool.cache[:2], before[:2])  # sources untouched
    pool.copy_blocks([])
    pool.copy_blocks([(0, 1, 0)])  # zero rows: nothing
    assert torch.equal(pool.cache[1], before[1])


@pytest.mark.parametrize(
    "pairs, message",
    [
        ([(0, 1), (0, 4)], r"pairs\[1\].dst=4 is outside the pool \(4 pages\)"),
        ([(0, 1), (-1, 2)], r"pairs\[1\].src=-1 is outside the pool"),
        ([(0, 1), (2, 2)], r"pairs\[1\] copies page 2 onto itself"),
        ([(0, 1), (2, 3, 5)], r"pairs\[1\].num_rows=5 must be in \[0, 4\]"),
        ([(0, 1), (2, 3, -1)], r"pairs\[1\].num_rows=-1"),
        ([(0, 1), (2,)], r"pairs\[1\]=\(2,\) must be \(src, dst\)"),
        ([(0, 1), 2], r"pairs\[1\]=2 must be \(src, dst\)"),
        # Not ints: the first pair used to be copied before indexing with 3.5 failed, and
        # True (== 1) or 3.0 were taken as page ids.
        ([(0, 1), (2, 3.5)], r"pairs\[1\].dst=3.5 is not an int"),
        ([(0, 1), (2.0, 3)], r"pairs\[1\].src=2.0 is not an int"),
        ([(0, 1), (True, 2)], r"pairs\[1\].src=True is not an int"),
        ([(0, 1), (2, 3, 2.0)], r"pairs\[1\].num_rows=2.0 is not an int"),
        ([(0, 1), (2, 3, False)], r"pairs\[1\].num_rows=False is not an int"),
        ([(0, 1), (None, 3)], r"pairs\[1\].src=None is not an int"),
    ],
)
def test_copy_blocks_checks_every_pair_before_copying_any(pairs, message):
    pool = filled_pool("NHD", pages=4)
    before = pool.cache.clone()
    with pytest.raises(ValueError, match=message):
        pool.copy_blocks(pairs)
    assert torch.equal(pool.cache, before)  # not even the valid first pair was applied


def test_copy_blocks_takes_integer_like_ids_from_numpy_and_torch():
    pool = filled_pool("NHD", pages=4)
    before = pool.cache.clone()
    pool.copy_blocks([(np.int64(0), torch.tensor(2), np.int32(3))])
    assert torch.equal(pool.cache[2, :, :3], before[0, :, :3])
    assert torch.equal(pool.cache[2, :, 3:], before[2, :, 3:])


def test_pool_constructor_and_layout_errors():
    for name, args in (
        ("num_pages", (0, 4, 2, 8)),
        ("page_size", (2, -1, 2, 8)),
        ("num_kv_heads", (2, 4, 0, 8)),
        ("head_dim", (2, 4, 2, 0)),
    ):
        with pytest.raises(ValueError, match=f"PagedKVPool: {name}="):
            PagedKVPool(*args)
    with pytest.raises(ValueError, match="layout='NDH' must be one of"):
        PagedKVPool(2, 4, 2, 8, layout="NDH")
    with pytest.raises(ValueError, match="layout="):
        check_layout("nhd")
    with pytest.raises(ValueError, match=r"cache has shape \(2, 3, 4, 5\); a HND pool is \[num_pages, 2, num_kv_heads"):
        cache_dims(torch.zeros(2, 3, 4, 5), "HND")
    with pytest.raises(ValueError, match="cache has shape"):
        cache_dims(torch.zeros(2, 3, 4, 5, 6))  # dim 1 must be K/V = 2

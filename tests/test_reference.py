"""The Python references: append, gather, decode and prefill attention, RoPE.

Expected values come from independent computations: torch's own indexing for
storage, ``torch.nn.functional.scaled_dot_product_attention`` in float64 on the
contiguous K/V for attention, and hand-computed averages for the causal mask.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pagedkv_lib import PagedKVPool, get_batch_indices_positions, pad_block_tables, slot_mapping
from pagedkv_lib.formats import scatter_pages
from pagedkv_lib.reference import (
    append_paged_kv,
    append_paged_kv_loop,
    gather_paged_kv,
    gather_paged_kv_loop,
    paged_decode_attention,
    paged_decode_attention_loop,
    paged_prefill_attention,
    paged_prefill_attention_loop,
    rope_reference,
)

APPENDS = [append_paged_kv, append_paged_kv_loop]
GATHERS = [gather_paged_kv, gather_paged_kv_loop]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def put(pool, page, row, k, v):
    """Write one token through torch indexing of the pool's token-major view."""
    pool.rows(page, 0)[row] = k
    pool.rows(page, 1)[row] = v


def build_batch(layout, lens, ps, heads, dim, num_pages=None, seed=0, dtype=torch.float32):
    """Random contiguous K/V per sequence, stored in a pool under shuffled page tables.

    Returns (pool, tables [batch, max_blocks] with -1 padding, [(k, v) per sequence])."""
    g = gen(seed)
    need = [-(-n // ps) for n in lens]
    num_pages = num_pages or sum(need) + 2
    pool = PagedKVPool(num_pages, ps, heads, dim, dtype=dtype, layout=layout)
    pool.cache.copy_(torch.randn(pool.cache.shape, generator=g).to(dtype))  # garbage everywhere
    rows = scatter_pages(need, num_pages, g)
    tables = pad_block_tables(rows, max(need + [1]))
    kvs = []
    for b, n in enumerate(lens):
        pages = rows[b]
        k = torch.randn(n, heads, dim, generator=g).to(dtype)
        v = torch.randn(n, heads, dim, generator=g).to(dtype)
        for t in range(n):
            put(pool, pages[t // ps], t % ps, k[t], v[t])
        kvs.append((k, v))
    return pool, tables, kvs


def sdpa(q, k, v, causal):
    """Float64 SDPA of q [nq, Hq, D] over k, v [nk, Hk, D], GQA by repeat_interleave.
    With causal, the mask is the usual top-left one of a full sequence (nq == nk)."""
    group = q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).transpose(0, 1)


# ----------------------------------------------------------------------------- append


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("append", APPENDS)
def test_append_writes_each_token_to_its_slot(layout, append):
    # Pages of 4. Slots 13 (page 3 row 1), 2 (page 0 row 2), -1 (padding), 8 (page 2 row 0).
    pool = PagedKVPool(4, 4, 2, 8, dtype=torch.float32, layout=layout)
    k = torch.randn(4, 2, 8, generator=gen())
    v = torch.randn(4, 2, 8, generator=gen(1))
    append(k, v, pool.cache, [13, 2, -1, 8], layout)
    for i, (page, row) in {0: (3, 1), 1: (0, 2), 3: (2, 0)}.items():
        assert torch.equal(pool.rows(page, 0)[row], k[i])
        assert torch.equal(pool.rows(page, 1)[row], v[i])
    # nothing else was touched: exactly 3 rows of K and of V are non-zero
    assert int((pool.cache != 0).any(-1).sum()) == 3 * 2 * 2  # 3 tokens * K,V * 2 heads


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_append_loop_and_vectorized_are_bit_identical(layout, dtype):
    g = gen(3)
    pool_a = PagedKVPool(6, 5, 3, 80, dtype=dtype, layout=layout)
    pool_a.cache.copy_(torch.randn(pool_a.cache.shape, generator=g).to(dtype))
    pool_b = PagedKVPool(6, 5, 3, 80, dtype=dtype, layout=layout)
    pool_b.cache.copy_(pool_a.cache)
    slots = torch.randperm(30, generator=g)[:12]
    slots[[2, 7]] = -1
    k = torch.randn(12, 3, 80, generator=g).to(dtype)
    v = torch.randn(12, 3, 80, generator=g).to(dtype)
    append_paged_kv(k, v, pool_a.cache, slots, layout)
    append_paged_kv_loop(k, v, pool_b.cache, slots, layout)
    assert torch.equal(pool_a.cache, pool_b.cache)


@pytest.mark.parametrize("append", APPENDS)
@pytest.mark.parametrize(
    "slots, message",
    [
        ([0, 1, 16], r"slot_mapping\[2\] = 16 is outside the pool \(4 pages x 4 slots"),
        ([0, 1, -2], r"slot_mapping\[2\] = -2 is outside the pool"),
        ([5, 1, 5], "writes slot 5 more than once"),
        ([0, 1, 2, 3], "slot_mapping has 4 entries but k has only 3 rows"),
        ([0.0, 1.0, 2.0], "slot_mapping must hold integers"),
    ],
)
def test_bad_slot_raises_before_anything_is_written(append, slots, message):
    pool = PagedKVPool(4, 4, 2, 8, dtype=torch.float32)
    before = pool.cache.clone()
    k = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match=message):
        append(k, k, pool.cache, slots)
    assert torch.equal(pool.cache, before)


@pytest.mark.parametrize("append", APPENDS)
def test_append_rejects_mismatched_k_v(append):
    cache = PagedKVPool(4, 4, 2, 8, dtype=torch.float32).cache
    good = torch.ones(2, 2, 8)
    for k, v, message in (
        (torch.ones(2, 3, 8), good, "k has shape .* but the cache holds 2 KV heads of head_dim 8"),
        (good, torch.ones(2, 2, 4), "v has shape"),
        (good.half(), good, "k.dtype=torch.float16 differs from cache.dtype=torch.float32"),
        (good, torch.ones(3, 2, 8), "k has shape .* but v has"),
        (torch.ones(2, 16), good, r"k must be \[num_tokens, num_kv_heads, head_dim\]"),
    ):
        with pytest.raises(ValueError, match=message):
            append(k, v, cache, [0, 1])
    assert torch.count_nonzero(cache) == 0


# ----------------------------------------------------------------------------- gather


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("gather", GATHERS)
def test_gather_reads_back_the_sequence_in_order(layout, gather):
    pool, tables, kvs = build_batch(layout, [11, 4, 1], ps=4, heads=2, dim=8)
    for b, (k, v) in enumerate(kvs):
        gk, gv = gather(pool.cache, tables[b], k.shape[0], layout)
        assert torch.equal(gk, k) and torch.equal(gv, v)
        gk, gv = gather(pool.cache, tables[b], 0, layout)
        assert gk.shape == (0, 2, 8) and gv.shape == (0, 2, 8)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gather_loop_and_vectorized_are_bit_identical(layout):
    pool, tables, kvs = build_batch(layout, [23, 7], ps=5, heads=3, dim=80, dtype=torch.bfloat16)
    for b, (k, _) in enumerate(kvs):
        for n in (0, 1, 5, k.shape[0]):
            a = gather_paged_kv(pool.cache, tables[b], n, layout)
            lo = gather_paged_kv_loop(pool.cache, tables[b], n, layout)
            assert torch.equal(a[0], lo[0]) and torch.equal(a[1], lo[1])
            assert a[0].dtype == lo[0].dtype == torch.bfloat16


@pytest.mark.parametrize("gather", GATHERS)
def test_gather_rejects_rows_without_pages(gather):
    cache = PagedKVPool(4, 4, 1, 2).cache
    with pytest.raises(ValueError, match="num_tokens=9 needs 3 pages; block_table_row has 2"):
        gather(cache, [0, 1], 9)
    with pytest.raises(ValueError, match=r"block_table_row\[1\]=-1 is not a page of the pool"):
        gather(cache, [0, -1], 5)
    with pytest.raises(ValueError, match=r"block_table_row\[0\]=4 is not a page"):
        gather(cache, [4], 1)
    assert gather(cache, [0, -1], 4)[0].shape == (4, 1, 2)  # -1 past the sequence is fine


# ----------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads_q, heads_kv, dim, ps", [(4, 4, 16, 4), (8, 2, 80, 5), (6, 1, 32, 16)])
def test_decode_attention_matches_sdpa(layout, heads_q, heads_kv, dim, ps):
    lens = [1, 9, 17, 4]
    pool, tables, kvs = build_batch(layout, lens, ps, heads_kv, dim)
    q = torch.randn(len(lens), heads_q, dim, generator=gen(5))
    expected = torch.stack([sdpa(q[b : b + 1], k, v, causal=False)[0] for b, (k, v) in enumerate(kvs)])
    out64 = paged_decode_attention(q, pool.cache, tables, lens, layout=layout, precision="fp64")
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, expected, rtol=1e-12, atol=1e-12)
    out32 = paged_decode_attention(q, pool.cache, tables, lens, layout=layout)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)
    loop = paged_decode_attention_loop(q, pool.cache, tables, lens, layout=layout, precision="fp64")
    torch.testing.assert_close(loop, out64, rtol=1e-12, atol=1e-12)


def test_decode_attention_uses_scale_and_returns_zeros_for_empty_sequence():
    pool, tables, kvs = build_batch("NHD", [0, 6], ps=4, heads=2, dim=8)
    q = torch.randn(2, 2, 8, generator=gen(2))
    for fn in (paged_decode_attention, paged_decode_attention_loop):
        out = fn(q, pool.cache, tables, [0, 6], scale=0.3, precision="fp64")
        assert torch.equal(out[0], torch.zeros(2, 8, dtype=torch.float64))
        k, v = kvs[1]
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[1].double(), k.double()) * 0.3, dim=-1)
        torch.testing.assert_close(out[1], torch.einsum("ht,thd->hd", probs, v.double()), rtol=1e-12, atol=1e-12)


def test_decode_attention_in_half_precision_returns_q_dtype():
    pool, tables, kvs = build_batch("HND", [7], ps=4, heads=2, dim=16, dtype=torch.float16)
    q = torch.randn(1, 4, 16, generator=gen(1)).half()
    out = paged_decode_attention(q, pool.cache, tables, [7], layout="HND")
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), sdpa(q, *kvs[0], causal=False), rtol=2e-3, atol=2e-3)


def test_decode_argument_errors():
    pool, tables, _ = build_batch("NHD", [5], ps=4, heads=2, dim=8)
    q = torch.zeros(1, 4, 8)
    for args, message in (
        ((torch.zeros(1, 3, 8), pool.cache, tables, [5]), "q has 3 heads, not a multiple of the cache's 2"),
        ((torch.zeros(1, 4, 4), pool.cache, tables, [5]), "q has head_dim 4 but the cache has 8"),
        ((torch.zeros(2, 4, 8), pool.cache, tables, [5]), "q has 2 rows but seq_lens has 1"),
        ((torch.zeros(1, 4, 8, dtype=torch.int32), pool.cache, tables, [5]), "q.dtype=torch.int32"),
        ((q, pool.cache, tables, [9]), r"seq_lens\[0\]=9 needs 3 pages; block_tables has 2 columns"),
        ((q, pool.cache, torch.tensor([[0, -1]]), [5]), r"block_tables\[0, 1\]=-1 is not a page"),
        ((q, pool.cache, torch.tensor([[0, 99]]), [5]), r"block_tables\[0, 1\]=99 is not a page"),
        ((q, pool.cache, tables, [-1]), "seq_lens must be >= 0"),
    ):
        for fn in (paged_decode_attention, paged_decode_attention_loop):
            with pytest.raises(ValueError, match=message):
                fn(*args)
    with pytest.raises(ValueError, match="precision='fp16'"):
        paged_decode_attention(q, pool.cache, tables, [5], precision="fp16")


# ----------------------------------------------------------------------------- prefill attention


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads_q, heads_kv, dim, ps", [(4, 2, 16, 4), (3, 3, 80, 5)])
def test_prefill_attention_is_bottom_right_causal_like_the_tail_of_full_attention(layout, heads_q, heads_kv, dim, ps):
    # Request 0: a whole prompt (q_len == kv_len). Request 1: a chunk of 5 new tokens
    # after 9 cached ones. Request 2: one token (a decode, as a prefill). Request 3: idle.
    lens, q_lens = [7, 14, 6, 3], [7, 5, 1, 0]
    pool, tables, kvs = build_batch(layout, lens, ps, heads_kv, dim)
    g = gen(9)
    q_full = [torch.randn(n, heads_q, dim, generator=g) for n in lens]  # a query for every position
    q = torch.cat([qf[n - ql :] for qf, n, ql in zip(q_full, lens, q_lens)])
    indptr = [0, 7, 12, 13, 13]
    expected = torch.cat(
        [sdpa(qf, k, v, causal=True)[n - ql :] for qf, (k, v), n, ql in zip(q_full, kvs, lens, q_lens)]
    )
    out = paged_prefill_attention(q, pool.cache, indptr, tables, lens, layout=layout, precision="fp64")
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    loop = paged_prefill_attention_loop(q, pool.cache, indptr, tables, lens, layout=layout, precision="fp64")
    torch.testing.assert_close(loop, out, rtol=1e-12, atol=1e-12)
    out32 = paged_prefill_attention(q, pool.cache, indptr, tables, lens, layout=layout)
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)


def test_prefill_query_i_sees_keys_up_to_kv_len_minus_q_len_plus_i_by_hand():
    # With q = 0 every visible key scores the same, so the output is the plain mean of
    # the visible values. V[t] = t (every feature): a chunk of 3 queries over 8 keys
    # sees keys 0..5, 0..6, 0..7 -> means 2.5, 3.0, 3.5.
    ps = 4
    pool = PagedKVPool(2, ps, 1, 2, dtype=torch.float64)
    for t in range(8):
        put(pool, t // ps, t % ps, torch.zeros(1, 2, dtype=torch.float64), torch.full((1, 2), float(t)))
    q = torch.zeros(3, 1, 2, dtype=torch.float64)
    for fn in (paged_prefill_attention, paged_prefill_attention_loop):
        out = fn(q, pool.cache, [0, 3], [[0, 1]], [8], precision="fp64")
        assert out[:, 0, 0].tolist() == pytest.approx([2.5, 3.0, 3.5], abs=1e-12)


def test_prefill_argument_errors():
    pool, tables, _ = build_batch("NHD", [5], ps=4, heads=2, dim=8)
    q = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match=r"qo_indptr\[-1\]=2 but q has 3 rows"):
        paged_prefill_attention(q, pool.cache, [0, 2], tables, [5])
    with pytest.raises(ValueError, match=r"request 0 has 3 queries but seq_lens\[0\]=2"):
        paged_prefill_attention(q, pool.cache, [0, 3], tables, [2])
    with pytest.raises(ValueError, match="precision="):
        paged_prefill_attention(q, pool.cache, [0, 3], tables, [5], precision="bf16")


# ----------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("chunks", [[13], [5, 5, 3], [1] * 13, [4, 9]])
def test_chunked_prefill_write_gives_the_same_pool_and_outputs_as_one_shot(layout, chunks):
    # A 13-token prompt on pages [2, 0, 3, 1] (page size 4). Each chunk is written at
    # positions past_len .. cache_len - 1, with past_len = cache_len - chunk_len, via
    # get_batch_indices_positions + slot_mapping; the final pool must equal writing
    # all 13 at once, and the chunk's attention must equal the matching rows of the
    # one-shot prefill.
    g = gen(4)
    k = torch.randn(13, 2, 16, generator=g)
    v = torch.randn(13, 2, 16, generator=g)
    q = torch.randn(13, 4, 16, generator=g)
    table = torch.tensor([[2, 0, 3, 1]])

    def fresh():
        return PagedKVPool(5, 4, 2, 16, dtype=torch.float32, layout=layout)

    once = fresh()
    batch, pos = get_batch_indices_positions([0, 13], [13])
    assert pos.tolist() == list(range(13))
    append_paged_kv(k, v, once.cache, slot_mapping(table, batch, pos, 4), layout)
    full = paged_prefill_attention(q, once.cache, [0, 13], table, [13], layout=layout, precision="fp64")

    chunked, cache_len = fresh(), 0
    for n in chunks:
        past_len, cache_len = cache_len, cache_len + n
        batch, pos = get_batch_indices_positions([0, n], [cache_len])
        assert pos.tolist() == list(range(past_len, cache_len))
        append_paged_kv(
            k[past_len:cache_len], v[past_len:cache_len], chunked.cache, slot_mapping(table, batch, pos, 4), layout
        )
        out = paged_prefill_attention(
            q[past_len:cache_len], chunked.cache, [0, n], table, [cache_len], layout=layout, precision="fp64"
        )
        torch.testing.assert_close(out, full[past_len:cache_len], rtol=1e-12, atol=1e-12)
    assert torch.equal(chunked.cache, once.cache)


# ----------------------------------------------------------------------------- rope


def test_rope_at_position_zero_is_the_identity():
    x = torch.randn(3, 2, 8, generator=gen())
    for style in ("neox", "gptj"):
        assert torch.equal(rope_reference(x, [0, 0, 0], style=style), x.double())


def test_rope_pairs_features_by_style_by_hand():
    # head_dim 4, theta 100: pair 0 turns by pos * 1 rad, pair 1 by pos * 100**-0.5 = pos/10.
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    c1, s1, c2, s2 = math.cos(2), math.sin(2), math.cos(0.2), math.sin(0.2)
    # neox pairs (0, 2) and (1, 3)
    neox = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2]
    torch.testing.assert_close(rope_reference(x, [2], theta=100.0)[0, 0], torch.tensor(neox, dtype=torch.float64))
    # gptj pairs (0, 1) and (2, 3)
    gptj = [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2]
    torch.testing.assert_close(
        rope_reference(x, [2], theta=100.0, style="gptj")[0, 0], torch.tensor(gptj, dtype=torch.float64)
    )


def test_rope_scores_depend_only_on_relative_position():
    g = gen(7)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    for style in ("neox", "gptj"):

        def score(m, n, style=style):
            return float((rope_reference(q, [m], style=style) * rope_reference(k, [n], style=style)).sum())

        assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-9)
        assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-6)
        assert float(rope_reference(q, [5], style=style).norm()) == pytest.approx(float(q.double().norm()), abs=1e-12)


def test_rope_errors():
    with pytest.raises(ValueError, match="style='llama'"):
        rope_reference(torch.zeros(1, 1, 4), [0], style="llama")
    with pytest.raises(ValueError, match="head_dim=5 must be even"):
        rope_reference(torch.zeros(1, 1, 5), [0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_ignores_nan_in_rows_it_must_not_read(layout):
    # Poison every row of the pool with NaN, then write a short and a long sequence.
    # Decode of the short one must not pick up NaN from rows past its end (the
    # vectorized form reads the long sequence's positions for every request and masks
    # them), nor prefill from the unused tail of a last page.
    lens = [3, 11]
    pool, tables, kvs = build_batch(layout, lens, ps=4, heads=2, dim=8)
    pool.cache.fill_(float("nan"))
    for b, (k, v) in enumerate(kvs):
        for t in range(lens[b]):
            put(pool, int(tables[b, t // 4]), t % 4, k[t], v[t])
    q = torch.randn(2, 4, 8, generator=gen(8))
    expected = torch.stack([sdpa(q[b : b + 1], k, v, causal=False)[0] for b, (k, v) in enumerate(kvs)])
    for fn in (paged_decode_attention, paged_decode_attention_loop):
        out = fn(q, pool.cache, tables, lens, layout=layout, precision="fp64")
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    qp = torch.randn(14, 4, 8, generator=gen(9))
    for fn in (paged_prefill_attention, paged_prefill_attention_loop):
        out = fn(qp, pool.cache, [0, 3, 14], tables, lens, layout=layout, precision="fp64")
        assert not out.isnan().any()

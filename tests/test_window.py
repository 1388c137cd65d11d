"""Ring windows (sliding window + attention sinks), TensorRT-LLM KVBlockArray rules.

Worked example used throughout (from TensorRT-LLM): 64 tokens per block, a window
of 128 with 4 sink tokens. The sinks fill rows 0-3 of block 0; rows 4-63 are the
*bubble*; the other 128 - 4 = 124 tokens of the window cycle through rows 64..187.
"""

import math

import pytest
import torch

from pagedkv_lib import KVCacheManager, PagedKVPool, RingWindow
from pagedkv_lib.reference import (
    append_paged_kv,
    paged_decode_attention,
    paged_decode_attention_loop,
    paged_prefill_attention,
    paged_prefill_attention_loop,
)
from pagedkv_lib.window import window_mask

TRT = RingWindow(max_attention_window=128, sink_tokens=4, tokens_per_block=64)


# ----------------------------------------------------------------------------- scalar rules


def test_trt_llm_worked_example():
    assert TRT.bubble_len == 60
    assert TRT.cyclic_cache_len == 124
    assert TRT.kv_token_idx(0) == 0 and TRT.kv_token_idx(3) == 3  # sinks stay put
    assert TRT.kv_token_idx(4) == 64  # first non-sink token starts the ring after the bubble
    assert TRT.kv_token_idx(127) == 187  # last ring row
    assert TRT.kv_token_idx(128) == 64  # wraps onto token 4's row
    assert TRT.kv_token_idx(128 + 124) == 64
    assert TRT.max_cache_len == 4 + 60 + 124 == 188
    assert TRT.max_chunk_len() == 1  # a plain ring takes one token a step


def test_trt_llm_example_with_one_more_block():
    w = RingWindow(128, 4, 64, one_more_block=True)
    assert w.bubble_len == 60
    assert w.cyclic_cache_len == 124 + 64 == 188
    assert w.kv_token_idx(128) == 64 + 124 == 188  # no wrap yet
    assert w.kv_token_idx(4 + 188) == 64  # wraps after 188 ring tokens
    assert w.max_cache_len == 252 and w.num_blocks(10**6) == 4
    # a chunk may be as long as the extra block plus one token: 188 - 124 + 1
    assert w.max_chunk_len() == 65


def test_bubble_is_zero_when_sinks_fill_whole_blocks():
    assert RingWindow(100, 0, 16).bubble_len == 0
    assert RingWindow(100, 32, 16).bubble_len == 0
    assert RingWindow(100, 33, 16).bubble_len == 15
    # no sinks: the ring starts at row 0 and is exactly the window
    w = RingWindow(6, 0, 4)
    assert [w.kv_token_idx(t) for t in range(14)] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1]


@pytest.mark.parametrize(
    "seq_len, rows, blocks",
    [(0, 0, 0), (3, 3, 1), (4, 4, 1), (5, 65, 2), (68, 128, 2), (69, 129, 3), (128, 188, 3), (10**5, 188, 3)],
)
def test_cache_len_and_num_blocks_of_worked_example(seq_len, rows, blocks):
    # up to 4 tokens: only sinks; then sinks + bubble + ring tokens, capped at 188 rows
    assert TRT.cache_len(seq_len) == rows
    assert TRT.num_blocks(seq_len) == blocks


@pytest.mark.parametrize(
    "w",
    [TRT, RingWindow(128, 4, 64, True), RingWindow(8, 2, 4), RingWindow(7, 0, 5), RingWindow(9, 5, 5, True)],
)
def test_tensor_forms_equal_scalar_forms(w):
    t = torch.arange(0, 700)
    assert w.kv_token_idx(t).tolist() == [w.kv_token_idx(i) for i in range(700)]
    assert w.cache_len(t).tolist() == [w.cache_len(i) for i in range(700)]
    assert w.num_blocks(t).tolist() == [w.num_blocks(i) for i in range(700)]
    assert w.is_sink(t).tolist() == [w.is_sink(i) for i in range(700)]


@pytest.mark.parametrize(
    "w",
    [TRT, RingWindow(128, 4, 64, True), RingWindow(8, 2, 4), RingWindow(7, 0, 5), RingWindow(9, 5, 5, True)],
)
def test_ring_keeps_every_token_the_window_needs(w):
    # Simulate the cache row by row: write token t at kv_token_idx(t), then every key
    # the window lets token t see (the sinks and the last window - sinks tokens) must
    # still sit in its row, and the cache never grows past max_cache_len rows.
    rows = {}
    recent = w.max_attention_window - w.sink_tokens
    for t in range(600):
        r = w.kv_token_idx(t)
        assert 0 <= r < w.max_cache_len
        assert not w.sink_tokens <= r < w.sink_tokens + w.bubble_len  # never in the bubble
        rows[r] = t
        assert len(rows) + (w.bubble_len if t >= w.sink_tokens else 0) == w.cache_len(t + 1)
        for key in list(range(min(w.sink_tokens, t + 1))) + list(range(max(0, t - recent + 1), t + 1)):
            assert rows[w.kv_token_idx(key)] == key


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_attention_window=4, sink_tokens=4, tokens_per_block=4), "must exceed sink_tokens=4"),
        (dict(max_attention_window=4, sink_tokens=9, tokens_per_block=4), "must exceed sink_tokens=9"),
        (dict(max_attention_window=8, sink_tokens=-1, tokens_per_block=4), "sink_tokens=-1"),
        (dict(max_attention_window=0, sink_tokens=0, tokens_per_block=4), "max_attention_window=0"),
        (dict(max_attention_window=8, sink_tokens=0, tokens_per_block=0), "tokens_per_block=0"),
        (dict(max_attention_window=8.0, sink_tokens=0, tokens_per_block=4), "max_attention_window=8.0"),
        (dict(max_attention_window=8, sink_tokens=True, tokens_per_block=4), "sink_tokens=True"),
    ],
)
def test_invalid_windows_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RingWindow(**kwargs)


# ----------------------------------------------------------------------------- the mask


def test_window_mask_keeps_sinks_and_last_window_minus_sinks_positions():
    w = RingWindow(8, 2, 4)
    mask = window_mask(torch.arange(30), torch.arange(30), w)
    # query 20 sees sinks 0, 1 and the 6 positions 15..20
    assert torch.nonzero(mask[20]).flatten().tolist() == [0, 1, 15, 16, 17, 18, 19, 20]
    # early queries see everything before them (causal only)
    assert torch.nonzero(mask[3]).flatten().tolist() == [0, 1, 2, 3]
    assert torch.nonzero(mask[7]).flatten().tolist() == list(range(8))
    assert torch.nonzero(mask[8]).flatten().tolist() == [0, 1] + list(range(3, 9))
    assert int(mask.sum(-1).max()) == 8
    # without a window it is the plain causal mask
    assert torch.equal(window_mask(torch.arange(5), torch.arange(5)), torch.ones(5, 5, dtype=torch.bool).tril())


# ----------------------------------------------------------------------------- manager on a ring


def test_manager_ring_slots_wrap_and_table_stops_growing():
    # window 8, 2 sinks, pages of 4: rows 0-1 sinks (page 0), rows 2-3 bubble, ring
    # rows 4..9 = page 1 rows 0-3 and page 2 rows 0-1. Token 8 wraps to row 4.
    w = RingWindow(8, 2, 4)
    m = KVCacheManager(8, 4, window=w)
    m.add_sequence("s")
    slots = [m.append_tokens("s", 1)[0] for _ in range(14)]
    assert slots == [0, 1, 4, 5, 6, 7, 8, 9, 4, 5, 6, 7, 8, 9]
    assert m.block_table("s") == [0, 1, 2]
    assert m.seq_len("s") == 14 and m.num_free == 5
    m.check_integrity()
    with pytest.raises(ValueError, match="n=2 tokens at once would overwrite ring slots"):
        m.append_tokens("s", 2)
    m.free_sequence("s")
    assert m.num_free == 8


def test_manager_ring_with_one_more_block_accepts_chunks():
    # one more block: the ring has 6 + 4 = 10 rows (4..13), a chunk may be 10 - 6 + 1 = 5 tokens
    w = RingWindow(8, 2, 4, one_more_block=True)
    m = KVCacheManager(8, 4, window=w)
    m.add_sequence("s")
    assert m.append_tokens("s", 5) == [0, 1, 4, 5, 6]
    assert m.append_tokens("s", 5) == [7, 8, 9, 10, 11]
    assert m.append_tokens("s", 5) == [12, 13, 4, 5, 6]
    assert m.block_table("s") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="this window allows 5"):
        m.append_tokens("s", 6)


def test_fork_of_a_wrapped_ring_copies_the_page_the_child_overwrites():
    # After 12 tokens the ring (rows 4..9) has wrapped; token 12 goes to row
    # 4 + (12 - 2) % 6 = 8 = page 2 row 0. Page 2 holds 2 used rows (8, 9), so the
    # child copies those 2 rows into a fresh page 3 before writing.
    w = RingWindow(8, 2, 4)
    m = KVCacheManager(8, 4, window=w)
    m.add_sequence("a")
    for _ in range(12):
        m.append_tokens("a", 1)
    m.fork("a", "b")
    assert m.append_tokens("b", 1) == [12]
    assert m.pop_copies() == [(2, 3, 2)]
    assert m.block_table("b") == [0, 1, 3] and m.block_table("a") == [0, 1, 2]
    m.check_integrity()


# ----------------------------------------------------------------------------- attention through the ring


def naive_window_attention(q, k, v, t, w):
    """Float64 attention of q [Hq, D] at position t over contiguous k, v [>t, Hk, D]:
    a plain softmax over the positions the window makes visible."""
    visible = [j for j in range(t + 1) if j < w.sink_tokens or j > t - (w.max_attention_window - w.sink_tokens)]
    group = q.shape[0] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        keys = k[visible, h // group].double()
        vals = v[visible, h // group].double()
        s = keys @ q[h].double() / math.sqrt(q.shape[-1])
        p = torch.exp(s - s.max())
        out[h] = (p / p.sum()) @ vals
    return out


@pytest.mark.parametrize(
    "w, steps, layout, check_loop",
    [
        (RingWindow(8, 2, 4), 40, "NHD", True),
        (RingWindow(6, 0, 4), 30, "HND", True),
        (RingWindow(7, 3, 5, one_more_block=True), 40, "HND", True),
        (RingWindow(128, 4, 64), 300, "NHD", False),  # the worked example, wrapping twice
    ],
)
def test_decoding_through_the_ring_equals_full_cache_with_window_mask(w, steps, layout, check_loop):
    heads_q, heads_kv, dim = 4, 2, 16
    g = torch.Generator().manual_seed(11)
    k = torch.randn(steps, heads_kv, dim, generator=g)
    v = torch.randn(steps, heads_kv, dim, generator=g)
    q = torch.randn(steps, heads_q, dim, generator=g)
    ps = w.tokens_per_block
    pool = PagedKVPool(8, ps, heads_kv, dim, dtype=torch.float32, layout=layout)
    m = KVCacheManager(8, ps, window=w)
    m.add_sequence("s")
    for t in range(steps):
        slots = m.append_tokens("s", 1)
        append_paged_kv(k[t : t + 1], v[t : t + 1], pool.cache, slots, layout)
        table = torch.tensor([m.block_table("s")])
        out = paged_decode_attention(
            q[t : t + 1], pool.cache, table, [t + 1], layout=layout, window=w, precision="fp64"
        )
        torch.testing.assert_close(out[0], naive_window_attention(q[t], k, v, t, w), rtol=1e-12, atol=1e-12)
        if check_loop:
            loop = paged_decode_attention_loop(
                q[t : t + 1], pool.cache, table, [t + 1], layout=layout, window=w, precision="fp64"
            )
            torch.testing.assert_close(loop, out, rtol=1e-12, atol=1e-12)
    assert len(m.block_table("s")) == w.num_blocks(steps)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_chunked_prefill_through_a_ring_with_one_more_block(layout):
    # window 8, 2 sinks, pages of 4, one more block: chunks of up to 5 tokens. Every
    # query of every chunk must match the window-masked attention on contiguous K/V.
    w = RingWindow(8, 2, 4, one_more_block=True)
    chunks = [5, 3, 5, 1, 5, 4, 5]
    total = sum(chunks)
    g = torch.Generator().manual_seed(12)
    k = torch.randn(total, 1, 8, generator=g)
    v = torch.randn(total, 1, 8, generator=g)
    q = torch.randn(total, 2, 8, generator=g)
    pool = PagedKVPool(6, 4, 1, 8, dtype=torch.float32, layout=layout)
    m = KVCacheManager(6, 4, window=w)
    m.add_sequence("s")
    past = 0
    for n in chunks:
        slots = m.append_tokens("s", n)
        append_paged_kv(k[past : past + n], v[past : past + n], pool.cache, slots, layout)
        table = torch.tensor([m.block_table("s")])
        args = (q[past : past + n], pool.cache, [0, n], table, [past + n])
        out = paged_prefill_attention(*args, layout=layout, window=w, precision="fp64")
        loop = paged_prefill_attention_loop(*args, layout=layout, window=w, precision="fp64")
        torch.testing.assert_close(loop, out, rtol=1e-12, atol=1e-12)
        for i in range(n):
            want = naive_window_attention(q[past + i], k, v, past + i, w)
            torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        past += n


def test_prefill_refuses_chunks_that_overwrite_a_key_their_queries_see():
    w = RingWindow(8, 2, 4)  # plain ring: 2 sinks, 6 ring slots; max_chunk_len() 1
    pool = PagedKVPool(4, 4, 1, 8, dtype=torch.float32)
    # 5 tokens: the ring has not wrapped, so a chunk of 2 (positions 3, 4) overwrote nothing
    paged_prefill_attention(torch.zeros(2, 1, 8), pool.cache, [0, 2], [[0, 1]], [5], window=w)
    # 9 tokens: positions 8 overwrote position 2's slot, which the query at 7 still sees
    with pytest.raises(ValueError, match="a chunk of 2 tokens overwrites ring slots.*overwrote position 2"):
        paged_prefill_attention(torch.zeros(2, 1, 8), pool.cache, [0, 2], [[0, 1, 2]], [9], window=w)
    with pytest.raises(ValueError, match="window.tokens_per_block=4 != page_size=8"):
        paged_decode_attention(torch.zeros(1, 1, 8), PagedKVPool(4, 8, 1, 8).cache, [[0]], [1], window=w)


@pytest.mark.parametrize(
    "w", [RingWindow(8, 2, 4), RingWindow(8, 2, 4, True), RingWindow(6, 0, 3), RingWindow(10, 3, 4, True)]
)
def test_chunk_rule_refuses_exactly_the_chunks_that_lost_a_visible_key(w):
    """Simulate the ring: write positions 0..n-1 in order, then ask every query of the
    last chunk of m which of its visible keys still sit in their slot. ``lost_key`` names
    the oldest one lost, or -1, for every (n, m): both sides of the boundary, a ring that
    has not wrapped (any chunk), and chunks longer than ``max_chunk_len()`` that lose
    nothing because their early queries see only the sinks and keys still held."""
    longer_ok = 0
    for n in range(41):
        holder = {}
        for p in range(n):
            holder[w.kv_token_idx(p)] = p
        for m in range(n + 1):
            queries = torch.arange(n - m, n)
            visible = window_mask(queries, torch.arange(n), w).any(0)
            lost = [j for j in range(n) if visible[j] and holder[w.kv_token_idx(j)] != j]
            want = lost[0] if lost else -1
            assert w.lost_key(n, m) == want, (n, m)
            assert int(w.lost_key(torch.tensor([n]), torch.tensor([m]))[0]) == want, (n, m)
            longer_ok += want == -1 and m > w.max_chunk_len()
            if m <= w.max_chunk_len():
                assert want == -1, "max_chunk_len() is safe at any length"
    assert longer_ok > 0

"""The caches before paging (:mod:`pagedkv_lib.contiguous_cache`): the dictionary cache
copies its whole history at every append (counted by an independent meter wrapped
around ``torch.cat``), the preallocated pool writes rows by index and reads views, the packed
batch reads views and moves everything to grow, and attention through a cache equals
one causal attention over the whole sequence (torch's ``scaled_dot_product_attention``,
float64) for MHA, GQA and MQA, token by token and packed. Bad input is refused by name
before anything is written, and each sketch flaw of the exercise set (the ``caches``
faults of :mod:`pagedkv_lab.faults`) fails here. Cheap: tiny shapes, about 2 s in all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedkv_lib
from pagedkv_lab import faults
from pagedkv_lib.contiguous_cache import (
    MHAWithCache,
    PreallocKVCache,
    SimpleKVCache,
    VariableLengthKVCache,
    append_write,
    broadcast_kv_for_gqa,
    decode_write,
    full_causal_attention,
    prefill_write,
    varlen_attention,
)

F64 = torch.float64


def _rows(n: int, heads: int = 2, dim: int = 4, first: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``[n, heads, dim]`` whose every value names its token (``first + i``), head and dim."""
    t = torch.arange(first, first + n, dtype=dtype)[:, None, None] * 100
    return t + torch.arange(heads, dtype=dtype)[None, :, None] * 10 + torch.arange(dim, dtype=dtype)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class CatMeter:
    """Wraps ``torch.cat`` and counts the bytes of every input but the last (the history a
    growing cache copies again), independently of the cache's own counter."""

    def __init__(self, cat) -> None:
        self.cat, self.history_bytes, self.calls = cat, 0, 0

    def __call__(self, tensors, *args, **kwargs):
        self.calls += 1
        self.history_bytes += sum(t.nbytes for t in tensors[:-1])
        return self.cat(tensors, *args, **kwargs)


def test_the_four_caches_are_exported_from_pagedkv_lib():
    for name in ("SimpleKVCache", "PreallocKVCache", "VariableLengthKVCache", "MHAWithCache"):
        assert name in pagedkv_lib.__all__ and getattr(pagedkv_lib, name).__module__ == "pagedkv_lib.contiguous_cache"


# --------------------------------------------------------------------------- the dictionary cache


def test_the_dictionary_cache_copies_its_whole_history_at_every_append(monkeypatch):
    cache, n, row = SimpleKVCache(2, 2, 4), 40, 2 * 4 * 4  # a row: 2 heads x 4 values x 4 bytes
    meter = CatMeter(torch.cat)
    monkeypatch.setattr(torch, "cat", meter)
    for t in range(n):
        before = cache.get(1, "s")[0] if t else None
        k, v = cache.append(1, "s", _rows(1, first=t), -_rows(1, first=t))
        assert before is None or not _same_storage(before, k)  # a new tensor every time
    monkeypatch.undo()
    assert torch.equal(k, _rows(n)) and torch.equal(cache.get(1, "s", 3, 5)[1], -_rows(2, first=3))
    assert meter.calls == 2 * n and cache.bytes_copied == meter.history_bytes
    assert cache.bytes_copied == 2 * row * n * (n - 1) // 2  # K and V, 0 + 1 + ... + (n - 1) rows
    assert cache.seq_len("s", 1) == n and cache.seq_len("s", 0) == 0 and cache.nbytes == 2 * row * n


def test_the_dictionary_cache_refuses_bad_input_by_name():
    cache = SimpleKVCache(1, 2, 4)
    for args, name in [
        ((0, "s", _rows(1, dtype=F64), _rows(1, dtype=F64)), "k.dtype"),
        ((0, "s", _rows(1, heads=3), _rows(1, heads=3)), "k has shape"),
        ((1, "s", _rows(1), _rows(1)), "layer=1"),
    ]:
        with pytest.raises(ValueError, match=name):
            cache.append(*args)
    with pytest.raises(ValueError, match="seq_id='t' has no K/V"):
        cache.get(0, "t")
    assert cache.nbytes == 0 and cache.bytes_copied == 0
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        SimpleKVCache(1, 0, 4)


# --------------------------------------------------------------------------- the preallocated pool


def test_prefill_then_decode_write_rows_by_index_and_reads_are_views_of_the_pool():
    cache = PreallocKVCache(1, 3, 8, 2, 4)
    assert cache.k.shape == (1, 3, 8, 2, 4) and cache.nbytes == 2 * 3 * 8 * 2 * 4 * 4
    a, b = cache.add_sequence("a"), cache.add_sequence("b")
    cache.prefill(0, "a", _rows(5), -_rows(5))
    cache.prefill(0, "b", _rows(2, first=50), -_rows(2, first=50))
    cache.decode(0, ["b", "a"], torch.cat([_rows(1, first=52), _rows(1, first=5)]), -_rows(2, first=60))
    k, v = cache.get(0, "a")
    assert torch.equal(k, _rows(6)) and torch.equal(v[5], -_rows(1, first=61)[0])
    assert torch.equal(cache.k[0, b, :3], _rows(3, first=50)) and cache.seq_lens[0].tolist() == [6, 3, 0]
    assert _same_storage(k, cache.k) and k.data_ptr() == cache.k[0, a].data_ptr()  # a view: nothing copied
    assert cache.used_bytes() == 2 * (6 + 3) * 2 * 4 * 4


def test_append_grows_a_sequence_by_a_chunk_of_several_tokens():
    cache = PreallocKVCache(1, 2, 8, 2, 4)
    cache.add_sequence("s")
    cache.append(0, "s", _rows(3), _rows(3))
    k, _ = cache.append(0, "s", _rows(4, first=3), _rows(4, first=3))  # a chunk, or four drafts
    assert torch.equal(k, _rows(7)) and cache.seq_len("s") == 7


def test_each_layer_appends_at_its_own_first_free_row():
    cache = PreallocKVCache(2, 1, 8, 2, 4)
    cache.add_sequence("s")
    for layer in (0, 1):
        cache.prefill(layer, "s", _rows(4), _rows(4))
    for layer in (0, 1):  # one decode step through both layers
        cache.append(layer, "s", _rows(1, first=4), _rows(1, first=4))
    assert cache.seq_lens[:, 0].tolist() == [5, 5] and torch.equal(cache.get(1, "s")[0], _rows(5))


def test_a_freed_slot_goes_to_the_next_sequence_and_no_live_slot_is_shared():
    cache = PreallocKVCache(1, 3, 4, 1, 2)
    assert [cache.add_sequence(s) for s in "abc"] == [0, 1, 2]
    cache.free_sequence("a")
    assert cache.add_sequence("d") == 0 and sorted(cache.slot_of.values()) == [0, 1, 2]
    with pytest.raises(ValueError, match="no free slot for seq_id='e'"):
        cache.add_sequence("e")
    with pytest.raises(ValueError, match="seq_id='b' already holds slot 1"):
        cache.add_sequence("b")


def test_the_write_functions_refuse_before_writing_anything():
    k_cache, v_cache = torch.full((2, 4, 2, 4), float("nan")), torch.full((2, 4, 2, 4), float("nan"))
    seq_lens = torch.tensor([4, 1])
    before = (k_cache.clone(), seq_lens.clone())
    for call, name in [
        (lambda: decode_write(k_cache, v_cache, seq_lens, [1, 0], _rows(2), _rows(2)), "slot 0 is full"),
        (lambda: decode_write(k_cache, v_cache, seq_lens, [1, 1], _rows(2), _rows(2)), "names a slot twice"),
        (lambda: decode_write(k_cache, v_cache, seq_lens, [1], _rows(2), _rows(2)), "slots must name one slot"),
        (lambda: append_write(k_cache, v_cache, seq_lens, 1, _rows(4), _rows(4)), "4 more pass max_seq_len=4"),
        (lambda: prefill_write(k_cache, v_cache, seq_lens, 1, _rows(5), _rows(5)), "more than max_seq_len=4"),
        (lambda: prefill_write(k_cache, v_cache, seq_lens, 2, _rows(1), _rows(1)), "slot=2 is not a slot"),
        (lambda: prefill_write(k_cache, v_cache, seq_lens, 0, _rows(1, dtype=F64), _rows(1)), "k.dtype"),
        (lambda: prefill_write(k_cache, v_cache, seq_lens.int(), 0, _rows(1), _rows(1)), "seq_lens must be"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()
        assert torch.equal(k_cache.isnan(), before[0].isnan()) and torch.equal(seq_lens, before[1]), name


def test_decode_write_is_one_append_per_slot():
    pools = [(torch.zeros(3, 6, 2, 4), torch.zeros(3, 6, 2, 4), torch.tensor([2, 0, 5])) for _ in range(2)]
    k = _rows(3, first=7)
    decode_write(*pools[0], [2, 0, 1], k, -k)
    for i, slot in enumerate([2, 0, 1]):
        append_write(*pools[1], slot, k[i : i + 1], -k[i : i + 1])
    assert all(torch.equal(a, b) for a, b in zip(pools[0], pools[1]))


def test_a_meta_pool_gives_reserved_bytes_without_memory():
    cache = PreallocKVCache(32, 64, 2048, 8, 128, torch.float16, device="meta")
    assert cache.nbytes == 64 * 2048 * 128 * 1024 and cache.k.is_meta  # Llama-3-8B: 128 KiB/token


# --------------------------------------------------------------------------- attention through a cache


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("kind", ["prealloc", "simple"])
def test_prefill_chunks_then_decode_through_the_cache_equal_full_causal_attention(heads, kv_heads, kind):
    torch.manual_seed(0)
    if kind == "prealloc":
        cache = PreallocKVCache(1, 3, 16, kv_heads, 4, F64)
        for s in ("a", "b"):
            cache.add_sequence(s)
    else:
        cache = SimpleKVCache(1, kv_heads, 4, F64)
    m = MHAWithCache(4 * heads, heads, cache, num_kv_heads=kv_heads, dtype=F64)
    x = torch.randn(2, 11, 4 * heads, dtype=F64)
    steps = [(0, 4), (4, 7)] + [(t, t + 1) for t in range(7, 11)]  # two prompt chunks, then decode
    out = torch.cat([m(x[:, lo:hi], ["a", "b"]) for lo, hi in steps], dim=1)
    torch.testing.assert_close(out, full_causal_attention(m, x), rtol=0, atol=1e-12)
    assert cache.seq_len("b") == 11


def test_gqa_stores_only_the_kv_heads_and_reads_them_through_a_view():
    mha, gqa = PreallocKVCache(1, 2, 16, 8, 4), PreallocKVCache(1, 2, 16, 2, 4)
    assert mha.nbytes == 4 * gqa.nbytes
    gqa.add_sequence("s")
    k, _ = gqa.prefill(0, "s", _rows(5), _rows(5))
    b = broadcast_kv_for_gqa(k, 8)
    assert b.shape == (5, 2, 4, 4) and b.stride(2) == 0 and _same_storage(b, gqa.k)
    assert all(torch.equal(b[:, h // 4, h % 4], k[:, h // 4]) for h in range(8))
    hnd = torch.randn(3, 2, 9, 4)  # [slot, heads, tokens, dim]: a pool slice is not contiguous
    kv = hnd[1, :, :6].transpose(0, 1)
    assert not kv.is_contiguous() and _same_storage(broadcast_kv_for_gqa(kv, 6), hnd)
    with pytest.raises(ValueError, match="num_q_heads=6 is not a multiple of num_kv_heads=4"):
        broadcast_kv_for_gqa(torch.zeros(3, 4, 2), 6)


def test_mha_with_cache_refuses_bad_input_by_name():
    cache = PreallocKVCache(1, 1, 4, 2, 4)
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        MHAWithCache(24, 6, cache, num_kv_heads=4)
    m = MHAWithCache(16, 4, cache, num_kv_heads=2)
    with pytest.raises(ValueError, match="x must be"):
        m(torch.zeros(1, 2, 8), ["s"])
    with pytest.raises(ValueError, match="seq_ids names 2 sequences for a batch of 1"):
        m(torch.zeros(1, 2, 16), ["s", "t"])
    with pytest.raises(ValueError, match="seq_id='s' holds no slot"):
        m(torch.zeros(1, 2, 16), ["s"])


# --------------------------------------------------------------------------- the packed batch


def test_varlen_attention_of_a_packed_batch_equals_per_sequence_attention():
    torch.manual_seed(1)
    lens_k, lens_q = [5, 0, 9, 1], [2, 0, 9, 1]  # cached prefixes, an empty sequence, a full prompt
    cu_k, cu_q = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_k, lens_q))
    q, k, v = torch.randn(sum(lens_q), 6, 4, dtype=F64), *torch.randn(2, sum(lens_k), 2, 4, dtype=F64)
    out = varlen_attention(q, k, v, cu_q, cu_k)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        qs, ks, vs = (t[c[b] : c[b + 1]].transpose(0, 1) for t, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)  # the queries are the last nq tokens
        want = F.scaled_dot_product_attention(qs, ks.repeat_interleave(3, 0), vs.repeat_interleave(3, 0), mask)
        torch.testing.assert_close(out[cu_q[b] : cu_q[b + 1]], want.transpose(0, 1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cu_seqlens_k=.* must start at 0"):
        varlen_attention(q, k, v, cu_q, cu_k.flip(0))
    with pytest.raises(ValueError, match="cu_seqlens_k has 3 entries; a batch of 4 needs 5"):
        varlen_attention(q, k, v, cu_q, cu_k[:3])


def test_the_packed_cache_reads_views_and_moves_every_cached_row_to_grow():
    cache = VariableLengthKVCache(1, 3, 2, 4)
    cache.append(0, _rows(7), -_rows(7), torch.tensor([0, 3, 3, 7], dtype=torch.int32))
    assert cache.bytes_moved == 0 and cache.seq_lens().tolist() == [3, 0, 4]
    new = _rows(3, first=100)
    cache.append(0, new, -new, torch.tensor([0, 1, 2, 3]))  # one decode token each
    k, v, cu = cache.get(0)
    assert cu.tolist() == [0, 4, 5, 10] and cu.dtype == torch.int32
    assert torch.equal(cache.sequence(0, 2)[0], torch.cat([_rows(4, first=3), new[2:]]))
    assert _same_storage(cache.sequence(0, 0)[1], v) and cache.bytes_moved == 2 * 7 * 2 * 4 * 4
    with pytest.raises(ValueError, match="cu_seqlens_new has 3 entries; a batch of 3 needs 4"):
        cache.append(0, new, new, torch.tensor([0, 1, 3]))


# --------------------------------------------------------------------------- the sketches' flaws


def test_planted_slot_by_count_gives_a_live_sequences_slot_to_a_newcomer():
    for cls, shared in [(PreallocKVCache, False), (faults.faults_of("caches")["slot_by_count"].part("cache"), True)]:
        cache = cls(1, 3, 4, 1, 2)
        for s in "abc":
            cache.add_sequence(s)
            cache.prefill(0, s, _rows(2, 1, 2, first=ord(s)), _rows(2, 1, 2))
        cache.free_sequence("a")
        cache.add_sequence("d")
        cache.prefill(0, "d", _rows(1, 1, 2, first=999), _rows(1, 1, 2))
        c_kept = torch.equal(cache.get(0, "c")[0], _rows(2, 1, 2, first=ord("c")))
        assert (cache.slot_of["d"] == cache.slot_of["c"]) == shared and c_kept != shared, cls.__name__


def test_planted_shared_length_writes_layer_one_a_row_too_far():
    fault = faults.faults_of("caches")["shared_length"]
    cache = fault.part("cache")(2, 1, 8, 2, 4)
    cache.add_sequence("s")
    for layer in (0, 1):
        cache.prefill(layer, "s", _rows(4), _rows(4))
    for layer in (0, 1):  # one decode step: layer 0 moves the one length, layer 1 writes past it
        cache.append(layer, "s", _rows(1, first=4), _rows(1, first=4))
    assert torch.equal(cache.k[1, 0, 4], torch.zeros(2, 4)) and torch.equal(cache.k[1, 0, 5], _rows(1, first=4)[0])


def test_planted_one_row_append_cannot_take_a_chunk():
    one_row = faults.faults_of("caches")["one_row_append"].part("append")
    pool = (torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="size"):
        one_row(*pool, 0, _rows(3), _rows(3))
    append_write(*pool, 0, _rows(3), _rows(3))
    assert pool[2].tolist() == [5]


def test_planted_read_before_write_leaves_a_token_blind_to_itself():
    torch.manual_seed(2)
    blind = faults.faults_of("caches")["read_before_write"].part("attention")
    x = torch.randn(1, 6, 16, dtype=F64)
    outs = {}
    for cls in (MHAWithCache, blind):
        cache = PreallocKVCache(1, 1, 8, 2, 4, F64)
        cache.add_sequence("s")
        m = cls(16, 4, cache, num_kv_heads=2, dtype=F64)
        torch.manual_seed(3)
        m.load_state_dict(MHAWithCache(16, 4, cache, num_kv_heads=2, dtype=F64).state_dict())
        outs[cls] = torch.cat([m(x[:, :4], ["s"]), m(x[:, 4:5], ["s"]), m(x[:, 5:], ["s"])], dim=1)
    want = full_causal_attention(m, x)
    torch.testing.assert_close(outs[MHAWithCache], want, rtol=0, atol=1e-12)
    assert (outs[blind][0, 4] - want[0, 4]).abs().max() > 1e-3  # the decode token missed its own K/V


def test_planted_gqa_repeat_copy_copies_group_times_the_bytes():
    repeat = faults.faults_of("caches")["gqa_repeat_copy"].part("broadcast")
    k = _rows(5, heads=2)
    copied, view = repeat(k, 8), broadcast_kv_for_gqa(k, 8)
    assert torch.equal(copied, view) and _same_storage(view, k)
    assert not _same_storage(copied, k) and copied.untyped_storage().nbytes() == 4 * k.nbytes

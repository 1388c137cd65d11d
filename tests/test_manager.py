"""KVCacheManager bookkeeping: growth, copy-on-write forks, freeing and errors.

Each scenario is small enough to follow on paper; block ids are asserted exactly.
The allocator hands out the lowest free ids first (free list 0, 1, 2, ... and freed
ids go to the back), so the ids below follow from the order of the calls.
"""

import re

import numpy as np
import pytest
import torch

from pagedkv_lib import KVCacheManager, OutOfBlocksError, PagedKVPool, RingWindow
from pagedkv_lib.reference import append_paged_kv, gather_paged_kv
from pagedkv_lib.sharing import block_hash


def refcounts(m: KVCacheManager):
    return [m.refcount(b) for b in range(m.num_blocks)]


def snapshot(m: KVCacheManager):
    return (
        {s: (m.seq_len(s), m.block_table(s)) for s in m.sequences},
        refcounts(m),
        m.num_free,
    )


# ----------------------------------------------------------------------------- growth


def test_append_fills_pages_in_order_and_returns_flat_slots():
    # Pages of 4 rows. "a" gets 6 tokens: rows 0-3 in page 0, rows 4-5 in page 1.
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    assert m.append_tokens("a", 6) == [0, 1, 2, 3, 4, 5]
    assert m.block_table("a") == [0, 1]
    # Three more: positions 6, 7 finish page 1 (slots 6, 7); position 8 opens page 2 (slot 8).
    assert m.append_tokens("a", 3) == [6, 7, 8]
    assert m.block_table("a") == [0, 1, 2]
    assert m.seq_len("a") == 9
    # A second sequence starts on the next free page, 3: slots 12, 13.
    m.add_sequence("b")
    assert m.append_tokens("b", 2) == [12, 13]
    assert m.block_table("b") == [3]
    assert m.num_free == 4
    assert m.append_tokens("b", 0) == [] and m.block_table("b") == [3]
    m.check_integrity()


def test_empty_sequence_has_no_pages():
    m = KVCacheManager(2, 4)
    m.add_sequence(7)
    assert m.seq_len(7) == 0 and m.block_table(7) == [] and m.num_free == 2
    assert m.sequences == [7]


def test_block_table_is_a_copy():
    m = KVCacheManager(4, 2)
    m.add_sequence("a")
    m.append_tokens("a", 3)
    m.block_table("a").append(99)
    assert m.block_table("a") == [0, 1]


def test_page_size_five_is_supported():
    # Non-power-of-two pages: 12 tokens -> pages 0, 1, 2 with 5, 5, 2 rows.
    m = KVCacheManager(4, 5)
    m.add_sequence("a")
    assert m.append_tokens("a", 12) == list(range(12))
    assert m.block_table("a") == [0, 1, 2]
    assert m.append_tokens("a", 4) == [12, 13, 14, 15]  # 3 rows left in page 2, then page 3
    assert m.block_table("a") == [0, 1, 2, 3]


def test_freeing_returns_pages_and_they_are_reused_last():
    m = KVCacheManager(4, 2)
    m.add_sequence("a")
    m.append_tokens("a", 3)  # pages 0, 1
    m.add_sequence("b")
    m.append_tokens("b", 1)  # page 2
    m.free_sequence("a")
    assert m.num_free == 3 and refcounts(m) == [0, 0, 1, 0]
    # Free list is now [3, 1, 0] (a's pages were released tail first).
    m.add_sequence("c")
    m.append_tokens("c", 5)
    assert m.block_table("c") == [3, 1, 0]
    m.check_integrity()


# ----------------------------------------------------------------------------- fork / copy-on-write


def test_fork_shares_every_page_without_allocating():
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6)  # pages 0 (full), 1 (2 rows)
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1] and m.seq_len("b") == 6
    assert refcounts(m)[:3] == [2, 2, 0]
    assert m.num_free == 6
    assert m.pop_copies() == []
    m.check_integrity()


def test_fork_copies_partial_last_page_on_first_write_by_child():
    # "a" holds 6 tokens: page 0 full, page 1 with rows 0-1. "b" forks and appends one
    # token (position 6, row 2 of logical block 1). Page 1 is shared, so b moves to a
    # fresh page 2, and only the 2 filled rows must be copied: (src=1, dst=2, rows=2).
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6)
    m.fork("a", "b")
    assert m.append_tokens("b", 1) == [2 * 4 + 2]  # slot 10: page 2, row 2
    assert m.pop_copies() == [(1, 2, 2)]
    assert m.pop_copies() == []  # popping clears
    assert m.block_table("b") == [0, 2]
    assert m.block_table("a") == [0, 1]  # the parent keeps its page
    assert refcounts(m)[:3] == [2, 1, 1]
    # Page 1 is now a's alone: a's next token is written in place, nothing copied.
    assert m.append_tokens("a", 1) == [1 * 4 + 2]
    assert m.pop_copies() == []
    m.check_integrity()


def test_fork_copies_for_whichever_side_writes_first():
    # Same as above, but the parent writes first: the parent gets the private copy
    # and the child keeps the original page.
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6)
    m.fork("a", "b")
    assert m.append_tokens("a", 1) == [10]
    assert m.pop_copies() == [(1, 2, 2)]
    assert m.block_table("a") == [0, 2] and m.block_table("b") == [0, 1]
    assert m.append_tokens("b", 1) == [6]
    assert m.pop_copies() == []


def test_full_shared_page_is_never_copied():
    # "a" holds exactly 8 tokens: pages 0 and 1 are full. The child's next token opens
    # a new page; the shared full pages stay shared.
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 8)
    m.fork("a", "b")
    assert m.append_tokens("b", 5) == [8, 9, 10, 11, 12]  # pages 2 and 3
    assert m.pop_copies() == []
    assert m.block_table("b") == [0, 1, 2, 3]
    assert refcounts(m)[:4] == [2, 2, 1, 1]
    m.check_integrity()


def test_copy_and_growth_in_one_append():
    # "b" (fork of a 6-token "a") appends 3 tokens: positions 6, 7 land in shared page 1,
    # position 8 needs a new logical block. Two fresh pages are taken, [2, 3]; the copy
    # uses the last one (3) and the new block the other (2).
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6)
    m.fork("a", "b")
    assert m.append_tokens("b", 3) == [3 * 4 + 2, 3 * 4 + 3, 2 * 4 + 0]
    assert m.pop_copies() == [(1, 3, 2)]
    assert m.block_table("b") == [0, 3, 2]
    m.check_integrity()


def test_fork_of_fork_counts_three_owners_and_frees_at_zero():
    m = KVCacheManager(4, 4)
    m.add_sequence("a")
    m.append_tokens("a", 3)  # page 0, 3 rows
    m.fork("a", "b")
    m.fork("b", "c")
    assert refcounts(m) == [3, 0, 0, 0]
    m.free_sequence("a")
    assert refcounts(m) == [2, 0, 0, 0] and m.num_free == 3
    m.free_sequence("c")
    assert refcounts(m) == [1, 0, 0, 0] and m.num_free == 3
    m.free_sequence("b")
    assert refcounts(m) == [0, 0, 0, 0] and m.num_free == 4
    assert m.sequences == []
    m.check_integrity()


def test_fork_of_empty_sequence_shares_nothing():
    m = KVCacheManager(2, 4)
    m.add_sequence("a")
    m.fork("a", "b")
    assert m.block_table("b") == [] and m.append_tokens("b", 1) == [0]
    assert m.block_table("a") == [] and m.pop_copies() == []


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fork_and_appends_on_both_sides_leave_parent_kv_bit_identical(layout):
    # A real pool: the parent writes 6 tokens, forks, and then both sides keep writing,
    # applying the manager's copies before each write. The parent's first 6 tokens must
    # read back unchanged, both sides must read back exactly what they wrote, and
    # everything is freed at the end.
    gen = torch.Generator().manual_seed(0)
    heads, dim, ps = 2, 8, 4
    pool = PagedKVPool(16, ps, heads, dim, dtype=torch.float32, layout=layout)
    m = KVCacheManager(16, ps)
    written = {"a": [], "b": []}  # contiguous (k, v) per sequence, in order

    def write(seq, n):
        slots = m.append_tokens(seq, n)
        pool.copy_blocks(m.pop_copies())
        k = torch.randn(n, heads, dim, generator=gen)
        v = torch.randn(n, heads, dim, generator=gen)
        append_paged_kv(k, v, pool.cache, slots, layout)
        written[seq].append((k, v))

    def read(seq):
        return gather_paged_kv(pool.cache, m.block_table(seq), m.seq_len(seq), layout)

    m.add_sequence("a")
    write("a", 6)
    parent_before = read("a")
    m.fork("a", "b")
    written["b"] = list(written["a"])
    for seq, n in [("b", 1), ("a", 3), ("b", 5), ("a", 1), ("b", 2), ("a", 6)]:
        write(seq, n)
        k, v = read("a")
        assert torch.equal(k[:6], parent_before[0]) and torch.equal(v[:6], parent_before[1])
        m.check_integrity()
    for seq in ("a", "b"):
        k, v = read(seq)
        assert torch.equal(k, torch.cat([x for x, _ in written[seq]]))
        assert torch.equal(v, torch.cat([y for _, y in written[seq]]))
    m.free_sequence("a")
    m.free_sequence("b")
    assert m.num_free == m.num_blocks == 16


# ----------------------------------------------------------------------------- out of blocks


def test_out_of_blocks_on_growth_changes_nothing():
    # 3 pages of 4: "a" holds 8 tokens (pages 0, 1); 5 more need 2 pages, 1 is free.
    m = KVCacheManager(3, 4)
    m.add_sequence("a")
    m.append_tokens("a", 8)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks but only 1 are free"):
        m.append_tokens("a", 5)
    assert snapshot(m) == before and m.pop_copies() == []
    assert m.append_tokens("a", 4) == [8, 9, 10, 11]  # what fits still fits


def test_out_of_blocks_on_copy_on_write_changes_nothing():
    # Both pages are in use and shared by a fork: b's write needs a copy, no page is free.
    m = KVCacheManager(2, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6)
    m.fork("a", "b")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_tokens("b", 1)
    assert snapshot(m) == before and m.pop_copies() == []
    assert refcounts(m) == [2, 2]
    m.check_integrity()


# ----------------------------------------------------------------------------- bad ids and arguments


def test_unknown_sequence_ids_raise_key_error_naming_the_id():
    m = KVCacheManager(2, 4)
    for call in (
        lambda: m.seq_len("ghost"),
        lambda: m.committed_len("ghost"),
        lambda: m.commit("ghost"),
        lambda: m.block_table("ghost"),
        lambda: m.append_tokens("ghost", 1),
        lambda: m.free_sequence("ghost"),
        lambda: m.fork("ghost", "child"),
    ):
        with pytest.raises(KeyError, match="ghost"):
            call()
    assert m.sequences == [] and m.num_free == 2


def test_duplicate_ids_raise_value_error_naming_the_id():
    m = KVCacheManager(4, 4)
    m.add_sequence("a")
    m.append_tokens("a", 3)
    m.add_sequence("b")
    with pytest.raises(ValueError, match="'a'"):
        m.add_sequence("a")
    with pytest.raises(ValueError, match="'b'"):
        m.fork("a", "b")  # the child id is taken
    assert refcounts(m) == [1, 0, 0, 0]  # the failed fork took no references
    assert m.block_table("b") == []


def test_freed_id_can_be_reused():
    m = KVCacheManager(2, 4)
    m.add_sequence("a")
    m.append_tokens("a", 2)
    m.free_sequence("a")
    m.add_sequence("a")
    assert m.seq_len("a") == 0 and m.num_free == 2
    with pytest.raises(KeyError):
        m.free_sequence("b")


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_append_rejects_bad_token_counts(n):
    m = KVCacheManager(2, 4)
    m.add_sequence("a")
    with pytest.raises(ValueError, match="n="):
        m.append_tokens("a", n)
    assert m.seq_len("a") == 0


def test_append_rejects_token_ids_of_the_wrong_length():
    m = KVCacheManager(2, 4)
    m.add_sequence("a")
    with pytest.raises(ValueError, match="token_ids has 2 ids for n=3"):
        m.append_tokens("a", 3, [1, 2])
    assert m.seq_len("a") == 0 and m.num_free == 2


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("bad", [None, 2.0, "3", True, torch.tensor(True), torch.tensor(2.0)])
def test_append_tokens_with_a_non_int_id_raises_before_growing_and_on_every_retry(prefix_cache, bad):
    # Four ids fill one page of 4. The old code accepted any id without a prefix cache,
    # and with one it grew the sequence, then failed (None) or hashed the id through
    # int() (2.0, "3", True); every retry grew the sequence again.
    m = KVCacheManager(4, 4, prefix_cache=prefix_cache)
    m.add_sequence("a")
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(f"token_ids[2]={bad!r} is not an int")):
            m.append_tokens("a", 4, [1, 2, bad, 4])
        assert m.seq_len("a") == 0 and m.block_table("a") == [] and m.num_free == 4
        assert m.pop_copies() == []
    m.check_integrity()
    assert m.append_tokens("a", 4, [1, 2, 3, 4]) == [0, 1, 2, 3]  # good ids still go through


@pytest.mark.parametrize("token_ids, message", [(5, "token_ids=5 is not a sequence"), ("abcd", "is a string")])
def test_append_tokens_refuses_ids_that_are_not_a_sequence(token_ids, message):
    m = KVCacheManager(4, 4, prefix_cache=True)
    m.add_sequence("a")
    with pytest.raises(ValueError, match=message):
        m.append_tokens("a", 4, token_ids)
    assert m.seq_len("a") == 0 and m.num_free == 4


def test_append_tokens_takes_numpy_and_torch_integer_ids():
    m = KVCacheManager(4, 4, prefix_cache=True)
    m.add_sequence("a")
    assert m.append_tokens("a", 3, np.array([7, 8, 9])) == [0, 1, 2]
    assert m.append_tokens("a", 2, [torch.tensor(10), np.int32(11)]) == [3, 4]
    assert m.seq_len("a") == 5
    m.check_integrity()


def test_constructor_rejects_bad_configs():
    with pytest.raises(ValueError, match="page_size=0"):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError, match="num_blocks=0"):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError, match="tokens_per_block=8 != page_size=4"):
        KVCacheManager(4, 4, window=RingWindow(16, 0, 8))
    with pytest.raises(ValueError, match="prefix_cache cannot be combined"):
        KVCacheManager(4, 4, window=RingWindow(16, 0, 4), prefix_cache=True)


def test_check_integrity_catches_a_cached_page_that_is_still_being_filled():
    # Page 1 holds 2 of a's 4 rows. Were it cached, a's next append would write into a
    # page the cache hands to other requests.
    m = KVCacheManager(4, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m.prefix_cache.insert(block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]), [5, 6, 7, 8], 1)
    m.allocator.incref(1)  # the cache's reference, so only the new invariant can object
    with pytest.raises(AssertionError, match="cached page 1 is the partial block 1 of 'a'"):
        m.check_integrity()


def test_check_integrity_catches_a_commit_past_the_end():
    m = KVCacheManager(4, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m._seqs["a"].num_committed = 7  # corrupt on purpose: 7 committed of 6 tokens
    with pytest.raises(AssertionError, match="'a': 7 committed"):
        m.check_integrity()


def test_check_integrity_catches_a_leaked_reference():
    m = KVCacheManager(4, 4)
    m.add_sequence("a")
    m.append_tokens("a", 2)
    m.allocator.incref(0)  # a reference no table accounts for
    with pytest.raises(AssertionError, match="block 0"):
        m.check_integrity()

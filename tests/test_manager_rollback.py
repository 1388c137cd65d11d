"""KVCacheManager.rollback: speculative decoding's rejected drafts leave no trace.

A speculative step appends the last sampled token and its drafts, writes all of them,
and then drops the rejected drafts. Afterwards the manager must look exactly as if they
had never been appended: pages they alone filled released, the next write landing on
the first rejected slot, no prefix-cache entry for a block holding a rejected token,
refcounts right under copy-on-write. Each scenario is narrated; block ids follow from
the allocator's order (lowest free id first, freed ids to the back of the free list).
"""

import pytest
import torch

from pagedkv_lib import KVCacheManager, PagedKVPool, RingWindow
from pagedkv_lib.reference import append_paged_kv, gather_paged_kv


def refcounts(m: KVCacheManager):
    return [m.refcount(b) for b in range(m.num_blocks)]


def test_drafts_crossing_a_page_boundary_release_the_page_only_they_filled():
    # Pages of 4 rows. "a" holds 6 written tokens: page 0 full, page 1 rows 0-1.
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6, [10, 11, 12, 13, 14, 15])
    m.commit("a")
    # A speculative step: the last sampled token (position 6) and 4 drafts (7-10). The
    # drafts cross into page 2.
    assert m.append_tokens("a", 5, [16, 17, 18, 19, 20]) == [6, 7, 8, 9, 10]
    assert m.block_table("a") == [0, 1, 2]
    # The model agrees with the first draft only: positions 6, 7 stay, 8-10 roll back.
    # Page 2 held nothing but rejected drafts: it goes back to the free list.
    assert m.rollback("a", 3) == [2]
    assert m.block_table("a") == [0, 1] and m.seq_len("a") == 8 and refcounts(m)[:3] == [1, 1, 0]
    m.commit("a")
    m.check_integrity()
    # The next token (position 8) opens a page again: 3, since freed page 2 went to the back.
    assert m.append_tokens("a", 1, [21]) == [3 * 4]
    m.check_integrity()


def test_the_next_write_lands_on_the_first_rejected_slot_so_stale_kv_is_never_read():
    # A real pool. "a" writes 3 tokens, then a step with 4 drafts (positions 3-6) whose
    # drafts are all rejected; the corrected token is written at position 3 in the next
    # step. Reading the sequence back gives the accepted K/V only: the stale rows 4-6
    # of page 0 are past its length, and row 3 was overwritten.
    gen = torch.Generator().manual_seed(0)
    pool = PagedKVPool(4, 8, 2, 8, dtype=torch.float32)
    m = KVCacheManager(4, 8)

    def write(ids):
        slots = m.append_tokens("a", len(ids), ids)
        k, v = torch.randn(2, len(ids), 2, 8, generator=gen)
        append_paged_kv(k, v, pool.cache, slots, "NHD")
        return slots, k, v

    m.add_sequence("a")
    _, k0, v0 = write([1, 2, 3])
    m.commit("a")
    slots, k1, v1 = write([4, 5, 6, 7])  # the last sampled token and 3 drafts
    assert slots == [3, 4, 5, 6]
    assert m.rollback("a", 3) == []  # page 0 still holds 4 tokens: nothing to release
    assert m.seq_len("a") == 4 and m.block_table("a") == [0]
    m.commit("a")
    slots, k2, v2 = write([9])  # the model's own token after 4
    assert slots == [4], "the first rejected slot is handed out again"
    k, v = gather_paged_kv(pool.cache, m.block_table("a"), m.seq_len("a"), "NHD")
    assert torch.equal(k, torch.cat([k0, k1[:1], k2])) and torch.equal(v, torch.cat([v0, v1[:1], v2]))
    m.check_integrity()


def test_a_block_of_rejected_drafts_never_enters_the_prefix_cache():
    # "a" admits a 4-token prompt (one full page, written and committed: cached). A step
    # appends the token at position 4 and 4 drafts (5-8): page 1 fills up with them and
    # page 2 starts. Every draft is rejected, so the rollback happens before the commit:
    # page 1 is partial again and only block 0 is ever in the cache.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])
    m.commit("a")
    assert m.append_tokens("a", 5, [5, 6, 7, 8, 9]) == [4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"num_tokens=6 > 5, the uncommitted tokens of 'a'"):
        m.rollback("a", 6)  # the committed prompt cannot roll back
    assert m.rollback("a", 4) == [2]
    m.commit("a")
    assert len(m.prefix_cache) == 1 and 1 not in m.prefix_cache
    m.check_integrity()
    # A request whose prompt is exactly the rejected text hits block 0 only.
    assert m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]).num_cached_tokens == 4
    m.check_integrity()


def test_committing_before_the_rollback_is_refused_and_check_integrity_names_a_cached_draft_block():
    # The wrong order (commit, then roll back) would leave block 1 of rejected drafts in
    # the cache: rollback refuses, and check_integrity catches the corrupt state.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])
    m.append_tokens("a", 4, [5, 6, 7, 8])
    m.commit("a")
    assert 1 in m.prefix_cache
    with pytest.raises(ValueError, match="committed K/V may be shared already"):
        m.rollback("a", 3)
    m.check_integrity()  # refused before anything changed
    m._seqs["a"].num_committed = 5  # corrupt on purpose: block 1 cached, but not all committed
    m._seqs["a"].block_hashes.pop()
    with pytest.raises(AssertionError, match="cached page 1 is the uncommitted block 1 of 'a'"):
        m.check_integrity()


def test_a_forked_sample_rolls_back_its_private_copy_and_leaves_the_parent_untouched():
    # "a" holds 6 tokens (page 0 full, page 1 rows 0-1) and forks "b": both share pages
    # 0 and 1. b's speculative step writes positions 6-9: page 1 is shared, so b gets a
    # private copy (page 3, 2 rows copied) and a fresh page 2 for positions 8-9. All 3
    # drafts are rejected: page 2 is released, b keeps its copy, a still owns page 1.
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6, [1, 2, 3, 4, 5, 6])
    m.commit("a")
    m.fork("a", "b")
    assert m.append_tokens("b", 4, [7, 8, 9, 10]) == [3 * 4 + 2, 3 * 4 + 3, 2 * 4, 2 * 4 + 1]
    assert m.pop_copies() == [(1, 3, 2)]
    assert m.rollback("b", 3) == [2]
    assert m.block_table("b") == [0, 3] and m.block_table("a") == [0, 1]
    assert refcounts(m)[:4] == [2, 1, 0, 1] and m.seq_len("b") == 7 and m.seq_len("a") == 6
    m.commit("b")
    m.check_integrity()
    # a's own next token goes into page 1 in place: nobody else holds it.
    assert m.append_tokens("a", 1, [11]) == [1 * 4 + 2] and m.pop_copies() == []
    m.free_sequence("b")
    m.free_sequence("a")
    assert m.num_free == 8
    m.check_integrity()


def test_rolling_back_a_tail_appended_without_ids_resumes_prefix_tracking():
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m.commit("a")
    m.append_tokens("a", 2)  # no ids: a's later blocks can never be cached ...
    m.rollback("a", 2)  # ... unless that tail is gone
    m.append_tokens("a", 2, [7, 8])
    m.commit("a")
    assert len(m.prefix_cache) == 2
    m.check_integrity()


def test_rollback_refuses_bad_counts_and_ring_windows_before_changing_anything():
    m = KVCacheManager(8, 4)
    m.add_sequence("a")
    m.append_tokens("a", 5)
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            m.rollback("a", bad)
    with pytest.raises(KeyError, match="'zz'"):
        m.rollback("zz", 1)
    assert m.rollback("a", 0) == [] and m.seq_len("a") == 5 and m.block_table("a") == [0, 1]
    ring = KVCacheManager(8, 4, window=RingWindow(8, 0, 4))
    ring.add_sequence("r")
    for _ in range(3):
        ring.append_tokens("r", 1)  # a ring of 2 pages takes one token at a time
    with pytest.raises(ValueError, match="ring window"):
        ring.rollback("r", 1)
    assert ring.seq_len("r") == 3
    m.check_integrity()
    ring.check_integrity()


def test_blocks_needed_counts_new_and_copied_blocks_without_changing_anything():
    # A speculative step asks first whether its drafts fit beside the other decodes.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])  # pages 0 (full), 1 (2 rows)
    m.commit("a")
    assert m.num_allocatable == 6 and m.blocks_needed("a", 2) == 0 and m.blocks_needed("a", 3) == 1
    m.fork("a", "b")  # page 1 is shared now: b's first write copies it
    assert m.blocks_needed("b", 1) == 1 and m.blocks_needed("b", 6) == 2
    m.free_sequence("b")
    m.free_sequence("a")  # page 0 stays cached, evictable: still allocatable
    assert m.num_free == 7 and m.num_allocatable == 8
    m.check_integrity()


@pytest.mark.parametrize("copy_fn", [None, lambda kind, src, dst, n: None], ids=["pop_copies", "copy_fn"])
def test_rolling_back_into_a_page_the_fork_committed_keeps_it_cached_and_leaks_nothing(copy_fn):
    # Found by the thread stress test, single-threaded. Pages of 2 rows. "a" has 6 tokens,
    # 4 committed; it forks "b", which commits all 6: page 2 (tokens 4-5) is cached now.
    m = KVCacheManager(8, 2, prefix_cache=True, copy_fn=copy_fn)
    m.add_sequence("a")
    m.append_tokens("a", 6, [1, 2, 3, 4, 5, 6])
    m.commit("a", 4)
    m.fork("a", "b")
    m.commit("b")
    page = m.block_table("a")[2]
    assert m.prefix_cache.entry_of(page) is not None
    # "a" rejects its token 5: page 2 stays in its table, a prefix of the cached block.
    assert m.rollback("a", 1) == []
    m.check_integrity()
    # "b" goes first: the cache and "a" hold the page. The next append of "a" copies it
    # (never writes a cached page), and the page is then the cache's alone: evictable.
    m.free_sequence("b")
    m.append_tokens("a", 1, [9])
    assert m.block_table("a")[2] != page and m.refcount(page) == 1
    assert page in m.prefix_cache.evictable_blocks(), "the copied-from page is cached, unused and not evictable"
    m.check_integrity()
    m.free_sequence("a")
    m.check_integrity()
    assert m.evict(8) == 3 and m.num_free == 8

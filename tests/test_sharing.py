"""Prefix sharing: the block hash chain, KVCacheManager.admit and LRU eviction.

Scenarios use pages of 4 (or 2) tokens and prompts of small integers, so which
blocks are full, cached, shared or evicted can be followed by hand.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedkv_lib import KVCacheManager, OutOfBlocksError, PagedKVPool
from pagedkv_lib.manager import Admission
from pagedkv_lib.reference import append_paged_kv, paged_decode_attention, paged_prefill_attention
from pagedkv_lib.sharing import PrefixCache, as_token_ids, block_hash


def refcounts(m):
    return [m.refcount(b) for b in range(m.num_blocks)]


def cached_blocks(m):
    return sorted(b for b in range(m.num_blocks) if b in m.prefix_cache)


# ----------------------------------------------------------------------------- the hash chain


def test_block_hash_depends_on_parent_and_tokens():
    h0 = block_hash(None, [1, 2, 3, 4])
    assert h0 == block_hash(None, (1, 2, 3, 4)) == block_hash(None, torch.tensor([1, 2, 3, 4]))
    assert 0 <= h0 < 2**64
    assert block_hash(None, [1, 2, 3, 5]) != h0  # one token differs
    assert block_hash(None, [4, 3, 2, 1]) != h0  # order matters
    # The same block under two different parents is two different prefixes.
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(h0, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])
    # [1, 23] and [12, 3] must not collide through naive concatenation.
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])


def test_block_hash_refuses_float_ids_instead_of_aliasing_them_to_ints():
    # int(1.0) == 1 made [1.0, 2.0] hash (and hit) like [1, 2].
    with pytest.raises(ValueError, match=r"token_ids\[0\]=1.0 is not an int"):
        block_hash(None, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"token_ids\[1\]=True is not an int"):
        block_hash(None, [1, True])
    # Integer-like ids are the same token as the int.
    assert block_hash(None, [np.int64(1), torch.tensor(2)]) == block_hash(None, [1, 2])


def test_as_token_ids_accepts_integer_like_and_refuses_everything_else():
    ids = as_token_ids([1, np.int64(2), np.int32(3), torch.tensor(4)])
    assert ids == [1, 2, 3, 4] and all(type(t) is int for t in ids)
    assert as_token_ids(torch.tensor([5, 6])) == [5, 6] and as_token_ids(np.array([7])) == [7]
    assert as_token_ids((8, 9)) == [8, 9] and as_token_ids(range(2)) == [0, 1] and as_token_ids([]) == []
    not_ids = [2.0, np.float64(2.0), None, "7", True, np.True_]
    not_ids += [torch.tensor(True), torch.tensor(2.0), torch.tensor([3])]  # bool, float, not 0-d
    for bad in not_ids:
        with pytest.raises(ValueError, match=re.escape(f"ids[1]={bad!r} is not an int")):
            as_token_ids([0, bad], "ids")
    with pytest.raises(ValueError, match=r"ids\[0\]=1.0 is not an int"):
        as_token_ids(torch.tensor([1.0, 2.0]), "ids")  # a float tensor as a whole
    with pytest.raises(ValueError, match="ids=3 is not a sequence of token ids"):
        as_token_ids(3, "ids")
    with pytest.raises(ValueError, match="ids='12' is a string"):
        as_token_ids("12", "ids")


def test_block_hash_is_stable_across_processes():
    # Python's hash() of a str changes with PYTHONHASHSEED; stored expectations need a
    # digest that does not.
    code = "from pagedkv_lib.sharing import block_hash; print(block_hash(block_hash(None, [1, 2]), [3, 4]))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == block_hash(block_hash(None, [1, 2]), [3, 4])


def test_prefix_cache_lookup_checks_tokens_and_insert_refuses_duplicates():
    c = PrefixCache()
    h = block_hash(None, [1, 2])
    assert c.insert(h, [1, 2], 5)
    assert c.lookup(h, [1, 2]) == 5
    assert c.lookup(h, [9, 9]) is None  # same key, other tokens: never trusted
    assert not c.insert(h, [1, 2], 6)  # hash already cached
    assert not c.insert(block_hash(None, [3]), [3], 5)  # block already cached
    assert len(c) == 1 and 5 in c and 6 not in c and c.hash_of(5) == h
    with pytest.raises(ValueError, match=r"token_ids\[0\]=1.0 is not an int"):
        c.lookup(h, [1.0, 2.0])  # equal as a tuple to (1, 2), but not a token id
    with pytest.raises(ValueError, match=r"token_ids\[1\]=None"):
        c.insert(block_hash(None, [4]), [4, None], 7)
    assert len(c) == 1 and (c.queries, c.hits) == (2, 1)


# ----------------------------------------------------------------------------- admit, write, commit


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103], [104..107] full, [108, 109] partial


def test_admission_caches_nothing_until_commit_then_the_full_blocks_but_not_the_partial_one():
    m = KVCacheManager(8, 4, prefix_cache=True)
    adm = m.admit("a", PROMPT)
    assert adm.num_cached_tokens == 0
    assert adm.slots == list(range(10))
    assert m.block_table("a") == [0, 1, 2]
    # Slots are handed out, but nothing is written yet: nothing may be shared.
    assert cached_blocks(m) == [] and refcounts(m)[:3] == [1, 1, 1]
    assert m.committed_len("a") == 0
    m.check_integrity()
    m.commit("a")  # the caller has written the K/V of all 10 tokens
    assert m.committed_len("a") == 10
    assert cached_blocks(m) == [0, 1]  # page 2 holds only 2 of 4 rows
    # The cache holds its own reference on every block it maps.
    assert refcounts(m)[:3] == [2, 2, 1]
    m.check_integrity()


def test_request_freed_before_its_write_leaves_no_cache_hit():
    # The finding: "a" is admitted and freed before its K/V is written (cancelled,
    # preempted). Its pages hold nothing of a's; "b" must compute its prompt itself.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", list(range(9)))
    m.free_sequence("a")
    assert len(m.prefix_cache) == 0 and m.num_free == 8
    adm = m.admit("b", list(range(9)))
    assert adm.num_cached_tokens == 0 and adm.slots == list(range(12, 21))  # pages 3, 4, 5
    m.check_integrity()


def test_committed_request_freed_leaves_its_full_blocks_as_cache_hits():
    # The same story with the write and the commit in between: now b shares a's pages.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", list(range(9)))
    m.commit("a")
    m.free_sequence("a")
    adm = m.admit("b", list(range(9)))
    assert adm.num_cached_tokens == 8 and m.block_table("b") == [0, 1, 3]
    assert m.committed_len("b") == 8  # the hit blocks were written by a
    m.check_integrity()


def test_same_prompt_admitted_before_the_first_commits_shares_nothing():
    # "b" arrives right after "a", before a's K/V is written: a's pages cannot be
    # shared yet, so b gets pages of its own. Both commit; b's blocks are duplicates of
    # hashes a registered first and stay private. "c", after the commits, shares a's.
    m = KVCacheManager(12, 4, prefix_cache=True)
    m.admit("a", PROMPT)
    adm = m.admit("b", PROMPT)
    assert adm.num_cached_tokens == 0 and m.block_table("b") == [3, 4, 5]
    m.commit("a")
    m.commit("b")
    assert cached_blocks(m) == [0, 1]
    assert refcounts(m)[:6] == [2, 2, 1, 1, 1, 1]
    adm = m.admit("c", PROMPT)
    assert adm.num_cached_tokens == 8 and adm.slots == [6 * 4 + 0, 6 * 4 + 1]  # tokens 8, 9 into page 6
    assert m.block_table("c") == [0, 1, 6]
    assert refcounts(m)[:7] == [3, 3, 1, 1, 1, 1, 1]  # a + c + cache on the shared ones
    m.check_integrity()


def test_commit_caches_only_the_full_blocks_of_the_committed_tokens_and_never_goes_back():
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", PROMPT)
    m.commit("a", 5)  # tokens 0-4 written: block 0 is full, block 1 is not
    assert cached_blocks(m) == [0] and m.committed_len("a") == 5
    m.commit("a", 3)  # fewer than committed: a no-op, written K/V stays written
    assert cached_blocks(m) == [0] and m.committed_len("a") == 5
    m.commit("a", 8)
    assert cached_blocks(m) == [0, 1] and m.committed_len("a") == 8
    m.commit("a")
    m.commit("a")  # twice: nothing more to do
    assert cached_blocks(m) == [0, 1] and m.committed_len("a") == 10
    assert refcounts(m)[:3] == [2, 2, 1]
    m.check_integrity()


@pytest.mark.parametrize(
    "num_tokens, message",
    [
        (-1, r"num_tokens=-1 must be in \[0, 10\]"),
        (11, r"num_tokens=11 must be in \[0, 10\] \(the tokens of 'a'\)"),
        (8.0, r"num_tokens=8.0 is not an int"),
        (True, r"num_tokens=True is not an int"),
        ("8", r"num_tokens='8' is not an int"),
    ],
)
def test_commit_rejects_a_bad_num_tokens_before_changing_anything(num_tokens, message):
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", PROMPT)
    m.commit("a", 4)
    with pytest.raises(ValueError, match=message):
        m.commit("a", num_tokens)
    assert m.committed_len("a") == 4 and cached_blocks(m) == [0] and refcounts(m)[:3] == [2, 1, 1]
    m.check_integrity()


def test_commit_without_a_prefix_cache_only_counts():
    m = KVCacheManager(4, 4)
    m.add_sequence("a")
    m.append_tokens("a", 6, list(range(6)))
    m.commit("a")
    assert m.committed_len("a") == 6 and refcounts(m) == [1, 1, 0, 0]
    m.check_integrity()


def test_fork_child_inherits_the_committed_count_and_commits_the_shared_pages():
    # "a" holds 8 tokens on pages 0, 1 and has committed only block 0. The child
    # shares both pages and a's count; committing the child's 8 tokens caches page 1,
    # which a and the child both name.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.add_sequence("a")
    m.append_tokens("a", 8, list(range(8)))
    m.commit("a", 4)
    m.fork("a", "b")
    assert m.committed_len("b") == 4 and cached_blocks(m) == [0]
    m.commit("b")
    assert m.committed_len("b") == 8 and m.committed_len("a") == 4
    assert cached_blocks(m) == [0, 1] and refcounts(m)[:2] == [3, 3]
    m.commit("a")  # a's block 1 is the same hash on the same page: nothing changes
    assert refcounts(m)[:2] == [3, 3]
    m.check_integrity()


def test_commit_after_copy_on_write_caches_the_private_copy_not_the_shared_page():
    # "a" holds 6 tokens (page 0 full, page 1 with 2 rows), commits, forks "b". Each
    # side completes block 1 with different tokens: b first, so b copies page 1 to
    # page 2; a then writes page 1 in place. After the commits each block 1 is cached
    # on its own page under its own hash.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m.commit("a")
    m.fork("a", "b")
    m.append_tokens("b", 2, [70, 80])
    assert m.pop_copies() == [(1, 2, 2)] and m.block_table("b") == [0, 2]
    m.commit("b")
    m.append_tokens("a", 2, [7, 8])
    assert m.pop_copies() == [] and m.block_table("a") == [0, 1]
    m.commit("a")
    assert cached_blocks(m) == [0, 1, 2]
    assert m.prefix_cache.hash_of(1) == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert m.prefix_cache.hash_of(2) == block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 70, 80])
    m.check_integrity()
    assert m.admit("c", [1, 2, 3, 4, 5, 6, 70, 80, 9]).num_cached_tokens == 8
    assert m.block_table("c") == [0, 2, 3]


def test_commit_caches_the_tracked_prefix_even_after_an_untracked_append():
    # Ids for tokens 0-7, then 4 tokens without ids, then one commit of all 12: the
    # blocks with ids (0, 1) are cached, the one without (2) is not.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m.append_tokens("a", 2, [7, 8])
    m.append_tokens("a", 4)
    m.append_tokens("a", 4, [13, 14, 15, 16])  # untracked for good: these ids are dropped
    m.commit("a")
    assert m.block_table("a") == [0, 1, 2, 3] and cached_blocks(m) == [0, 1]
    adm = m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert adm.num_cached_tokens == 8
    m.check_integrity()


def test_prompt_whose_every_block_hits_recomputes_its_last_block_into_a_fresh_page():
    # "b" is exactly a's first 8 tokens: both of its blocks are cached, but the last
    # prompt token must be computed, so only 4 tokens come from the cache and block 1
    # is recomputed into page 3 (never written into a's shared page 1).
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", PROMPT)
    m.commit("a")
    adm = m.admit("b", PROMPT[:8])
    assert adm.num_cached_tokens == 4 and m.committed_len("b") == 4
    assert adm.slots == [12, 13, 14, 15]
    assert m.block_table("b") == [0, 3]
    assert refcounts(m)[:4] == [3, 2, 1, 1]
    m.commit("b")
    assert 3 not in m.prefix_cache  # block 1's hash is already served by page 1
    m.check_integrity()


def test_one_token_prompt_is_never_served_from_cache():
    m = KVCacheManager(4, 1, prefix_cache=True)
    m.admit("a", [7])
    m.commit("a")
    assert cached_blocks(m) == [0]
    adm = m.admit("b", [7])
    assert adm.num_cached_tokens == 0 and adm.slots == [1]
    assert m.block_table("b") == [1]


def test_one_token_difference_in_block_k_shares_exactly_blocks_before_k():
    # 16-token prompt = 4 full blocks of 4. "b" changes one token inside block 2, so
    # it shares blocks 0 and 1; block 3 has a's tokens but a different parent, so it
    # is not shared either.
    prompt = list(range(16))
    changed = list(prompt)
    changed[9] = 999
    m = KVCacheManager(12, 4, prefix_cache=True)
    m.admit("a", prompt + [16])
    m.commit("a")
    assert m.block_table("a") == [0, 1, 2, 3, 4]
    adm = m.admit("b", changed + [16])
    assert adm.num_cached_tokens == 8
    assert m.block_table("b") == [0, 1, 5, 6, 7]
    m.commit("b")
    assert refcounts(m)[:8] == [3, 3, 2, 2, 1, 2, 2, 1]
    m.check_integrity()


def test_identical_prompts_share_pages_and_hit_rate_counts_block_lookups():
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", PROMPT)  # looks up block 0 only: miss
    m.commit("a")
    m.admit("b", PROMPT)  # blocks 0, 1 hit, no block 2 to look up (partial)
    assert m.block_table("a")[:2] == m.block_table("b")[:2] == [0, 1]
    assert (m.prefix_cache.queries, m.prefix_cache.hits) == (3, 2)
    assert m.prefix_cache.hit_rate() == pytest.approx(2 / 3)


def test_appends_with_token_ids_keep_caching_and_without_them_stop():
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6])  # page 0 full, page 1 has 2 rows
    m.commit("a")
    assert cached_blocks(m) == [0]
    m.append_tokens("a", 2, [7, 8])  # completes page 1 ...
    assert cached_blocks(m) == [0]
    m.commit("a")  # ... which is cached once written
    assert cached_blocks(m) == [0, 1]
    m.append_tokens("a", 4)  # no ids: page 2 fills but is never cached
    m.commit("a")
    assert m.block_table("a") == [0, 1, 2] and cached_blocks(m) == [0, 1]
    m.append_tokens("a", 4, [13, 14, 15, 16])  # untracked for good
    m.commit("a")
    assert cached_blocks(m) == [0, 1]
    adm = m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert adm.num_cached_tokens == 8
    m.check_integrity()


def test_float_prompt_is_refused_not_served_from_the_int_blocks():
    # PROMPT's two full blocks are cached. The same prompt as floats used to hash
    # through int() and hit them; now it is refused with nothing counted or changed.
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", PROMPT)
    m.commit("a")
    m.free_sequence("a")
    before = (refcounts(m), m.num_free, m.prefix_cache.evictable_blocks(), m.prefix_cache.queries)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=100.0 is not an int"):
        m.admit("b", [float(t) for t in PROMPT])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\]=100.0 is not an int"):
        m.admit("b", torch.tensor(PROMPT, dtype=torch.float32))
    assert (refcounts(m), m.num_free, m.prefix_cache.evictable_blocks(), m.prefix_cache.queries) == before
    assert m.sequences == []
    # Integer-like ids are the same tokens: they hit.
    assert m.admit("b", torch.tensor(PROMPT)).num_cached_tokens == 8
    assert m.admit("c", np.array(PROMPT)).num_cached_tokens == 8
    m.check_integrity()


def test_admit_errors():
    m = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        m.admit("a", [1])
    m = KVCacheManager(4, 4, prefix_cache=True)
    with pytest.raises(ValueError, match="empty"):
        m.admit("a", [])
    m.admit("a", [1, 2])
    with pytest.raises(ValueError, match="'a'"):
        m.admit("a", [1, 2])
    assert m.sequences == ["a"] and m.num_free == 3


@pytest.mark.parametrize("bad", [None, 2.0, "3"])
def test_admit_with_a_bad_prompt_registers_nothing_and_a_retry_succeeds(bad):
    # The old admit registered the sequence before hashing the prompt: None failed with
    # a TypeError and left "a" live, so a corrected retry was refused as a duplicate;
    # 2.0 and "3" were hashed through int() and accepted.
    m = KVCacheManager(8, 4, prefix_cache=True)
    with pytest.raises(ValueError, match=re.escape(f"prompt_token_ids[2]={bad!r} is not an int")):
        m.admit("a", [1, 2, bad, 4, 5])
    assert m.sequences == [] and m.num_free == 8 and len(m.prefix_cache) == 0
    assert (m.prefix_cache.queries, m.prefix_cache.hits) == (0, 0)
    m.check_integrity()
    assert m.admit("a", [1, 2, 3, 4, 5]).slots == [0, 1, 2, 3, 4]


def test_admit_of_a_live_id_changes_nothing():
    m = KVCacheManager(8, 4, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5])
    queries = m.prefix_cache.queries
    with pytest.raises(ValueError, match="seq_id='a' is already a live sequence"):
        m.admit("a", [1, 2, 3, 4, 5, 6])
    assert m.seq_len("a") == 5 and m.num_free == 6 and m.prefix_cache.queries == queries
    m.check_integrity()


# ----------------------------------------------------------------------------- freeing and eviction


def test_freed_cached_blocks_stay_reusable_tail_first_evictable():
    m = KVCacheManager(8, 2, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4, 5, 6, 7])
    m.commit("a")  # pages 0, 1, 2 full and cached, page 3 partial
    m.free_sequence("a")
    # Page 3 (uncached) is free again; the cached pages keep the cache's reference
    # and are evictable, tail first (a later block is useless without its prefix).
    assert refcounts(m)[:4] == [1, 1, 1, 0]
    assert m.prefix_cache.evictable_blocks() == [2, 1, 0]
    assert m.num_free == 5
    m.check_integrity()
    # Until evicted they serve a new request as if "a" were still alive.
    adm = m.admit("b", [1, 2, 3, 4, 5, 6, 9])
    assert adm.num_cached_tokens == 6
    assert m.block_table("b") == [0, 1, 2, 4]
    assert m.prefix_cache.evictable_blocks() == []
    m.check_integrity()


def test_eviction_is_lru_and_evicted_block_is_not_found_by_its_old_hash():
    m = KVCacheManager(6, 2, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])  # pages 0, 1
    m.commit("a")
    m.free_sequence("a")  # evictable [1, 0]
    m.admit("b", [5, 6, 7, 8])  # pages 2, 3
    m.commit("b")
    m.free_sequence("b")  # evictable [1, 0, 3, 2]
    assert m.prefix_cache.evictable_blocks() == [1, 0, 3, 2] and m.num_free == 2
    # "c" needs 3 pages: pages 4, 5 from the free list, then the LRU cached page, 1.
    m.admit("c", [9, 9, 9, 9, 9, 9])
    m.commit("c")
    assert m.block_table("c") == [4, 5, 1]
    assert m.prefix_cache.evictable_blocks() == [0, 3, 2]
    # Page 1 now holds c's third block; a's second block is gone from the cache.
    h0 = block_hash(None, [1, 2])
    assert m.prefix_cache.lookup(block_hash(h0, [3, 4]), [3, 4]) is None
    assert m.prefix_cache.lookup(h0, [1, 2]) == 0
    assert m.prefix_cache.hash_of(1) != block_hash(h0, [3, 4])
    # A request for a's prompt finds only block 0; the next two pages come from
    # evicting 3, then 2 (b's tail first).
    adm = m.admit("d", [1, 2, 3, 4, 0])
    assert adm.num_cached_tokens == 2
    assert m.block_table("d") == [0, 3, 2]
    assert m.prefix_cache.evictable_blocks() == []
    m.check_integrity()


def test_eviction_never_frees_a_referenced_page():
    # "a" is alive: its two cached pages are referenced, not evictable. "b" needs 3
    # pages and only 2 are free: it must fail rather than take a's pages.
    m = KVCacheManager(4, 2, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])
    m.commit("a")
    before = (m.block_table("a"), refcounts(m), m.num_free, cached_blocks(m))
    with pytest.raises(OutOfBlocksError, match="asked for 3 blocks but only 2 are free"):
        m.admit("b", [5, 6, 7, 8, 9, 10])
    assert (m.block_table("a"), refcounts(m), m.num_free, cached_blocks(m)) == before
    assert m.sequences == ["a"]
    m.check_integrity()


def state(m):
    """Everything a failed admission must leave as it was, LRU order and counters included."""
    cache = m.prefix_cache
    tables = {s: (m.seq_len(s), m.committed_len(s), m.block_table(s)) for s in m.sequences}
    return tables, refcounts(m), m.num_free, cached_blocks(m), cache.evictable_blocks(), cache.queries, cache.hits


def test_failed_admission_releases_its_cache_hits_again():
    # "b" hits a's cached block 0, then runs out of pages for the rest: afterwards b
    # does not exist and block 0 is back to being evictable-only.
    m = KVCacheManager(3, 2, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])
    m.commit("a")
    m.free_sequence("a")  # pages 0, 1 evictable, page 2 free
    m.add_sequence("x")
    m.append_tokens("x", 2)  # takes page 2
    before = state(m)
    with pytest.raises(OutOfBlocksError, match="asked for 3 blocks but only 1 are free"):
        m.admit("b", [1, 2, 7, 7, 7, 7, 7])  # needs 3 pages beyond the hit, has 1 evictable
    assert state(m) == before
    assert m.sequences == ["x"]
    m.check_integrity()


def test_admit_out_of_blocks_leaves_lru_order_and_counters_unchanged():
    # Evictable pages, least recently used first: [1, 0, 3, 2]; pages 4, 5 are x's.
    # "c" hits block 0 (page 0, in the middle of the LRU order), misses block 1 and
    # needs 4 new pages where only 3 can be evicted. The old admit took the hit, failed,
    # and gave page 0 back as the most recently used, [1, 3, 2, 0], with the lookups
    # counted; now it fails before touching anything.
    m = KVCacheManager(6, 2, prefix_cache=True)
    for seq, prompt in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        m.admit(seq, prompt)
        m.commit(seq)
        m.free_sequence(seq)
    m.add_sequence("x")
    m.append_tokens("x", 4)
    assert m.prefix_cache.evictable_blocks() == [1, 0, 3, 2] and m.num_free == 0
    before = state(m)
    with pytest.raises(OutOfBlocksError, match="asked for 4 blocks but only 3 are free"):
        m.admit("c", [1, 2, 9, 9, 9, 9, 9, 9, 9])
    assert state(m) == before
    assert m.prefix_cache.evictable_blocks() == [1, 0, 3, 2]
    assert (m.prefix_cache.queries, m.prefix_cache.hits) == (2, 0)  # a's and b's first lookups only
    assert m.sequences == ["x"]
    m.check_integrity()


def test_admit_does_not_count_its_own_hit_blocks_as_room():
    # Pages 0, 1 hold a's two cached blocks, evictable; pages 2, 3 are free. "b" hits
    # both and needs 3 new pages: 2 free + 2 evictable looks like room for 4, but the 2
    # evictable ones are the hits b is about to use, so only 2 are room.
    m = KVCacheManager(4, 2, prefix_cache=True)
    m.admit("a", [1, 2, 3, 4])
    m.commit("a")
    m.free_sequence("a")
    before = state(m)
    with pytest.raises(OutOfBlocksError, match="asked for 3 blocks but only 2 are free"):
        m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert state(m) == before and m.sequences == []
    m.check_integrity()
    # One block fewer fits exactly, with the hits and both free pages.
    adm = m.admit("b", [1, 2, 3, 4, 5, 6, 7])
    assert adm.num_cached_tokens == 4 and m.block_table("b") == [0, 1, 2, 3] and m.num_free == 0
    assert m.prefix_cache.evictable_blocks() == []
    assert (m.prefix_cache.queries, m.prefix_cache.hits) == (1 + 3, 2)  # a's miss, then b's 3 lookups
    m.check_integrity()


# ----------------------------------------------------------------------------- served from cache == computed


def _fake_model_kv(tokens, heads, dim):
    """K/V of a prompt as a toy model would produce them: a function of (token, position)
    only, so equal prefixes give equal cached values (what prefix caching relies on)."""
    t = torch.tensor(tokens, dtype=torch.float64)[:, None, None]
    p = torch.arange(len(tokens), dtype=torch.float64)[:, None, None]
    f = torch.arange(heads * dim, dtype=torch.float64).view(1, heads, dim)
    k = torch.sin(0.37 * t + 0.11 * p + 0.05 * f)
    v = torch.cos(0.23 * t - 0.07 * p + 0.03 * f)
    return k.float(), v.float()


@pytest.mark.parametrize("second", ["shares_two_blocks", "all_hit"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_of_request_served_from_prefix_cache_equals_unshared(second, layout):
    heads_q, heads, dim, ps = 4, 2, 16, 4
    first = list(range(50, 62))  # 12 tokens, 3 full blocks
    prompt = first[:8] + [7, 8, 9, 10, 11] if second == "shares_two_blocks" else first[:8]
    q = torch.randn(len(prompt) + 1, heads_q, dim, generator=torch.Generator().manual_seed(1))

    def serve(prefix_cache):
        pool = PagedKVPool(16, ps, heads, dim, dtype=torch.float32, layout=layout)
        m = KVCacheManager(16, ps, prefix_cache=prefix_cache)
        if prefix_cache:
            k, v = _fake_model_kv(first, heads, dim)
            append_paged_kv(k, v, pool.cache, m.admit("first", first).slots, layout)
            m.commit("first")  # written: now its full blocks can be shared
            adm = m.admit("req", prompt)
        else:
            m.add_sequence("req")
            adm = Admission(0, m.append_tokens("req", len(prompt)))
        k, v = _fake_model_kv(prompt, heads, dim)
        c = adm.num_cached_tokens
        shared_before = pool.cache.clone()
        append_paged_kv(k[c:], v[c:], pool.cache, adm.slots, layout)
        if prefix_cache:  # writing b's new tokens touched no page a still holds
            for page in m.block_table("first"):
                assert torch.equal(pool.cache[page], shared_before[page])
        table = torch.tensor([m.block_table("req")])
        n = len(prompt)
        pre = paged_prefill_attention(q[c:n], pool.cache, [0, n - c], table, [n], layout=layout)
        # one decode step on top
        kd, vd = _fake_model_kv(prompt + [3], heads, dim)
        append_paged_kv(kd[n:], vd[n:], pool.cache, m.append_tokens("req", 1), layout)
        table = torch.tensor([m.block_table("req")])
        dec = paged_decode_attention(q[n:], pool.cache, table, [n + 1], layout=layout)
        return c, pre, dec

    c, pre_shared, dec_shared = serve(True)
    assert c == (8 if second == "shares_two_blocks" else 4)
    _, pre_plain, dec_plain = serve(False)
    assert torch.equal(pre_shared, pre_plain[c:])
    assert torch.equal(dec_shared, dec_plain)
    # and both are right: an independent SDPA over the contiguous K/V
    k, v = _fake_model_kv(prompt + [3], heads, dim)
    kk = k.double().repeat_interleave(2, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(2, dim=1).transpose(0, 1)
    full = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1), kk, vv, is_causal=True)
    full = full.transpose(0, 1)
    torch.testing.assert_close(pre_shared.double(), full[c : len(prompt)], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec_shared.double(), full[len(prompt) :], rtol=1e-5, atol=1e-5)

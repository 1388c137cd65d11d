"""The two-level pool (pagedkv_lib.offload under KVCacheManager): eviction offloads a
cached block to the secondary pool, a prefix hit restores it bit-exact across every
layer, a full secondary pool drops its least recently used block, and integrity holds
after every step. Pure bookkeeping plus torch block copies on tiny pools: well under 1 s."""

import pytest
import torch

from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.sharing import block_hash

PS, LAYERS = 2, 3


class Pools:
    """A primary and a secondary multi-layer pool ``[layers, pages, 2, PS, 1, 2]`` and the
    manager's copy function over them (the torch reference block copy)."""

    def __init__(self, primary, secondary):
        self.primary = torch.zeros(LAYERS, primary, 2, PS, 1, 2)
        self.secondary = torch.zeros(LAYERS, secondary, 2, PS, 1, 2)
        self.kinds = []

    def copy(self, kind, src, dst, num_tokens):
        self.kinds.append(kind)
        s, d, n = (torch.tensor(x) for x in (src, dst, num_tokens))
        if kind == "cow":
            copy_blocks(self.primary, s, d, n)
        elif kind == "offload":
            copy_blocks(self.primary, s, d, n, dst_cache=self.secondary)
        else:
            copy_blocks(self.secondary, s, d, n, dst_cache=self.primary)

    def write(self, slots, seed):
        """Distinct values into every layer's K/V rows of ``slots``."""
        g = torch.Generator().manual_seed(seed)
        for slot in slots:
            self.primary[:, slot // PS, :, slot % PS] = torch.randn(LAYERS, 2, 1, 2, generator=g)


def serve(mgr, pools, seq, prompt, seed):
    adm = mgr.admit(seq, prompt)
    pools.write(adm.slots, seed)
    mgr.commit(seq)
    mgr.check_integrity()
    return adm


def make(primary=3, secondary=2, copy=None):
    pools = Pools(primary, secondary)
    mgr = KVCacheManager(primary, PS, prefix_cache=True, copy_fn=copy or pools.copy, secondary_blocks=secondary,
                         block_bytes=pools.primary[:, 0].nbytes)  # fmt: skip
    return mgr, pools


def test_eviction_offloads_and_a_hit_restores_the_block_bit_exact_in_every_layer():
    mgr, pools = make()
    shared = [1, 2, 3, 4, 5]  # two full blocks + one token
    serve(mgr, pools, "a", shared, seed=0)
    table = mgr.block_table("a")
    before = pools.primary[:, table[:2]].clone()
    mgr.free_sequence("a")
    serve(mgr, pools, "b", [9, 8, 7, 6, 5], seed=1)  # needs all 3 pages: evicts both of a's blocks
    st = mgr.secondary.stats
    assert (st.offloads, st.restores, st.drops) == (2, 0, 0)
    mgr.free_sequence("b")
    adm = serve(mgr, pools, "c", shared, seed=2)
    assert adm.num_cached_tokens == 4  # restored, not recomputed
    assert (st.offloads, st.restores) == (4, 2)  # b's two blocks went down to make room
    assert st.bytes_moved == 6 * pools.primary[:, 0].nbytes
    assert torch.equal(pools.primary[:, mgr.block_table("c")[:2]], before)
    assert pools.kinds.count("restore") == 2


def test_a_full_secondary_pool_drops_its_least_recently_used_block():
    mgr, pools = make(primary=3, secondary=1)
    serve(mgr, pools, "a", [1, 2, 3], seed=0)
    mgr.free_sequence("a")
    serve(mgr, pools, "b", [4, 5, 6, 7, 8], seed=1)  # evicts a's block into the one slot
    mgr.free_sequence("b")
    serve(mgr, pools, "c", [9, 10, 11, 12, 13], seed=2)  # evicts b's two: a's dropped, then b's first
    st = mgr.secondary.stats
    assert (st.offloads, st.drops) == (3, 2)
    mgr.free_sequence("c")
    assert mgr.admit("d", [1, 2, 3]).num_cached_tokens == 0  # a's block is gone for good
    mgr.check_integrity()


def forgetful_restore(pools):
    """A mutant copy function whose restore skips the last layer."""

    def copy(kind, src, dst, num_tokens):
        if kind != "restore":
            return pools.copy(kind, src, dst, num_tokens)
        keep = pools.primary[-1, dst].clone()
        pools.copy(kind, src, dst, num_tokens)
        pools.primary[-1, dst] = keep

    return copy


def test_a_restore_that_forgets_a_layer_is_caught_by_the_bit_exact_check():
    pools = Pools(3, 2)
    mgr = KVCacheManager(3, PS, prefix_cache=True, copy_fn=forgetful_restore(pools), secondary_blocks=2)
    serve(mgr, pools, "a", [1, 2, 3, 4, 5], seed=0)
    before = pools.primary[:, mgr.block_table("a")[:2]].clone()
    mgr.free_sequence("a")
    serve(mgr, pools, "b", [9, 8, 7, 6, 5], seed=1)
    mgr.free_sequence("b")
    serve(mgr, pools, "c", [1, 2, 3, 4, 5], seed=2)
    assert not torch.equal(pools.primary[:, mgr.block_table("c")[:2]], before)


def test_integrity_catches_a_hash_left_in_both_levels():
    mgr, pools = make()
    serve(mgr, pools, "a", [1, 2, 3], seed=0)
    h = mgr.prefix_cache.hashes().pop()
    mgr.secondary.place(h, (1, 2))  # the stale twin a buggy offload would leave
    with pytest.raises(AssertionError, match="both levels"):
        mgr.check_integrity()


def test_a_prefix_committed_again_in_the_primary_pool_leaves_the_secondary_pool():
    mgr, pools = make()
    serve(mgr, pools, "a", [1, 2, 3], seed=0)
    mgr.free_sequence("a")
    serve(mgr, pools, "b", [4, 5, 6, 7, 8], seed=1)  # a's block is offloaded
    mgr.free_sequence("b")
    mgr.add_sequence("c")  # computes the same block itself (no admit, so no restore)
    pools.write(mgr.append_tokens("c", 2, [1, 2]), seed=2)
    assert len(mgr.secondary) == 1  # a's block, offloaded
    mgr.commit("c")
    mgr.check_integrity()  # one level per hash: the secondary copy is forgotten
    assert len(mgr.secondary) == 0 and mgr.secondary.stats.drops == 0


def test_secondary_blocks_need_a_prefix_cache_and_a_copy_fn():
    with pytest.raises(ValueError, match="secondary_blocks"):
        KVCacheManager(4, PS, prefix_cache=True, secondary_blocks=2)
    with pytest.raises(ValueError, match="secondary_blocks"):
        KVCacheManager(4, PS, secondary_blocks=-1)


# --------------------------------------------------------------------------- a copy that fails
# A copy function may raise (a KeyboardInterrupt in a notebook, a device error) after
# writing some of its destinations. The operation is then undone: the manager is exactly
# as before, except entries whose storage a started copy wrote are forgotten, and no
# entry that remains names bytes other than its hash's K/V.


class Interrupted(Pools):
    """Pools whose copy function, on its ``fail_at``-th call, fills the call's destination
    blocks with NaN (a copy that died half way) and raises KeyboardInterrupt."""

    fail_at = 0

    def copy(self, kind, src, dst, num_tokens):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls != self.fail_at:
            return super().copy(kind, src, dst, num_tokens)
        (self.secondary if kind == "offload" else self.primary)[:, dst] = float("nan")
        raise KeyboardInterrupt


def state(mgr) -> dict:
    """Everything the manager keeps: tables, refcounts, free lists in order, both levels'
    entries in LRU order, counters, pending copies."""
    cache, sec, alloc = mgr.prefix_cache, mgr.secondary, mgr.allocator
    return {
        "tables": {s: (mgr.block_table(s), mgr.seq_len(s), mgr.committed_len(s)) for s in mgr.sequences},
        "refcounts": [mgr.refcount(b) for b in range(mgr.num_blocks)],
        "free": list(alloc._free),
        "cache": {b: cache.entry_of(b) for b in range(mgr.num_blocks) if b in cache},
        "evictable": cache.evictable_blocks(),
        "lookups": (cache.queries, cache.hits),
        "secondary": sec.entries(),
        "secondary_free": list(sec._free),
        "stats": dict(vars(sec.stats)),
        "pending": list(mgr._copies),
    }


def truth_of(mgr, pools) -> dict:
    """Hash -> the K/V bytes (every layer) of each cached block of either level."""
    truth = {h: pools.secondary[:, b].clone() for b, h, _ in mgr.secondary.entries()}
    for b in range(mgr.num_blocks):
        if (entry := mgr.prefix_cache.entry_of(b)) is not None:
            truth[entry[0]] = pools.primary[:, b].clone()
    return truth


def assert_entries_hold_their_bytes(mgr, pools, truth):
    for b, h, _ in mgr.secondary.entries():
        assert torch.equal(pools.secondary[:, b], truth[h]), f"secondary block {b} does not hold hash {h}'s K/V"
    for b in range(mgr.num_blocks):
        if (entry := mgr.prefix_cache.entry_of(b)) is not None:
            assert torch.equal(pools.primary[:, b], truth[entry[0]]), f"cached page {b} does not hold its K/V"


def roomy(pools):
    """8 pages, 4 secondary blocks: a's two full blocks offloaded into free secondary
    blocks by b's admission (b never committed, so freeing it frees all 8 pages)."""
    mgr = KVCacheManager(8, PS, prefix_cache=True, copy_fn=pools.copy, secondary_blocks=4)
    serve(mgr, pools, "a", [1, 2, 3, 4, 5], seed=0)
    mgr.free_sequence("a")
    return mgr


def admit_b(mgr, pools):  # evicts a's two blocks into free secondary blocks: 2 offloads
    pools.write(mgr.admit("b", list(range(20, 35))).slots, seed=1)


def offload_two(mgr, pools):
    return lambda: admit_b(mgr, pools)


def restore_two(mgr, pools):  # a's two blocks come back into free pages: 2 restores
    admit_b(mgr, pools)
    mgr.free_sequence("b")
    return lambda: mgr.admit("c", [1, 2, 3, 4, 5, 6])


def copy_on_write(mgr, pools):  # a fork's first write into its shared partial page: 1 copy
    serve(mgr, pools, "d", [7, 8, 9], seed=3)
    mgr.fork("d", "e")
    return lambda: mgr.append_tokens("e", 1, [10])


OPERATIONS = {
    "offload": offload_two,
    "restore": restore_two,
    "copy_on_write": copy_on_write,
}


@pytest.mark.parametrize(
    "operation, fail_at", [("offload", 1), ("offload", 2), ("restore", 1), ("restore", 2), ("copy_on_write", 1)]
)
def test_a_copy_that_raises_into_free_storage_leaves_the_manager_exactly_as_before(operation, fail_at):
    """Every destination was free before the call: nothing may be forgotten. The same
    operation then succeeds, and every entry holds its K/V (well under 0.1 s each)."""
    pools = Interrupted(8, 4)
    mgr = roomy(pools)
    call = OPERATIONS[operation](mgr, pools)
    before, truth = state(mgr), truth_of(mgr, pools)
    pools.calls, pools.fail_at = 0, fail_at
    with pytest.raises(KeyboardInterrupt):
        call()
    assert state(mgr) == before
    mgr.check_integrity()
    assert_entries_hold_their_bytes(mgr, pools, truth)
    pools.fail_at = 0
    call()
    mgr.check_integrity()


def tight():
    """3 pages and 2 secondary blocks (the first test's pools): a's two blocks offloaded
    by b's admission; c's admission of a's prefix then restores them while evicting b's
    (restore into the free page, offload b2 over a1's secondary block, restore into b2's
    page, offload b1 over a2's block)."""
    pools = Interrupted(3, 2)
    mgr = KVCacheManager(3, PS, prefix_cache=True, copy_fn=pools.copy, secondary_blocks=2)
    serve(mgr, pools, "a", [1, 2, 3, 4, 5], seed=0)
    mgr.free_sequence("a")
    serve(mgr, pools, "b", [9, 8, 7, 6, 5], seed=1)
    mgr.free_sequence("b")
    return mgr, pools


A1, A2 = block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])
B2 = block_hash(block_hash(None, [9, 8]), [7, 6])  # b's last full block: freed last, evicted first


@pytest.mark.parametrize(
    "fail_at, forgotten",
    [(1, set()), (2, {A1}), (3, {A1, B2}), (4, {A1, A2, B2})],
    ids=["restore_into_a_free_page", "offload_over_a1", "restore_into_b2s_page", "offload_over_a2"],
)
def test_a_copy_that_raises_forgets_only_the_entries_whose_storage_it_wrote(fail_at, forgotten):
    """Each copy of c's admission raises in turn, after writing NaN into its destination.
    Undone, the manager equals its state before the call with exactly the entries whose
    storage a started copy wrote forgotten (the rest of their state as before), and a
    later hit never restores garbage (well under 0.1 s each)."""
    mgr, pools = tight()
    before, truth = state(mgr), truth_of(mgr, pools)
    pools.calls, pools.fail_at = 0, fail_at
    with pytest.raises(KeyboardInterrupt):
        mgr.admit("c", [1, 2, 3, 4, 5])
    mgr.check_integrity()
    after = state(mgr)
    for level in ("cache", "secondary"):
        before_hashes = {e[0] for e in before[level].values()} if level == "cache" else {h for _, h, _ in before[level]}
        after_hashes = {e[0] for e in after[level].values()} if level == "cache" else {h for _, h, _ in after[level]}
        assert before_hashes - after_hashes == forgotten & before_hashes, level
        assert after_hashes <= before_hashes, level
    kept = {b: e for b, e in before["cache"].items() if e[0] not in forgotten}
    assert after["cache"] == kept and after["tables"] == before["tables"] and after["lookups"] == before["lookups"]
    assert after["secondary"] == [e for e in before["secondary"] if e[1] not in forgotten]
    assert after["stats"]["drops"] == before["stats"]["drops"] + len(forgotten & {A1, A2})
    assert_entries_hold_their_bytes(mgr, pools, truth)
    pools.fail_at = 0
    adm = serve(mgr, pools, "c", [1, 2, 3, 4, 5], seed=2)
    assert adm.num_cached_tokens == (0 if A1 in forgotten else 4 if A2 not in forgotten else 2)
    assert_entries_hold_their_bytes(mgr, pools, truth | truth_of(mgr, pools))


# --------------------------------------------------------------------------- the engine


def tiny_llama():
    """The tiny random Llama of tests/test_engine_units.py (2 layers, GQA, head_dim 16)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def test_engine_with_offload_restores_the_evicted_system_prompt_and_matches_transformers():
    """A 16-token system prompt (2 pages of 8), then a 30-token request that needs 4 of
    the pool's 5 pages (evicting the system prompt), then the system prompt again: with
    offload it is restored, not recomputed; both runs token-identical to transformers.
    About 3 s (two engine runs and the oracle)."""
    from pagedkv_engine import Engine
    from pagedkv_engine.check import check_engine
    from pagedkv_engine.engine import default_stats_lines
    from pagedkv_engine.scheduler import SamplingParams

    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    system, a, other, b = (torch.randint(2, 128, (n,), generator=g).tolist() for n in (16, 3, 30, 3))
    params = SamplingParams(max_new_tokens=2)
    arrivals = {0: [(system + a, params)], 3: [(other, params)], 6: [(system + b, params)]}
    runs, references = {}, {}
    for offload in (0, 4):
        engine = Engine(model, "torch", num_pages=5, page_size=8, max_num_batched_tokens=64, record_logits=True,
                        offload_blocks=offload)  # fmt: skip
        engine.run(arrivals)
        assert check_engine(engine, model, tol=2e-4, references=references).ok
        runs[offload] = engine
    stats = runs[4].manager.secondary.stats
    assert stats.restores > 0 and stats.offloads >= stats.restores
    assert runs[4].stats.computed_prefill_tokens < runs[0].stats.computed_prefill_tokens
    assert runs[4].outputs() == runs[0].outputs()
    lines = default_stats_lines(runs[4])
    assert any(
        line.startswith(f"offload: {stats.offloads} blocks offloaded, {stats.restores} restored") for line in lines
    )
    assert not any(line.startswith("offload") for line in default_stats_lines(runs[0]))
    with pytest.raises(ValueError, match="offload_blocks"):
        Engine(model, "torch", num_pages=5, page_size=8, offload_blocks=-1)

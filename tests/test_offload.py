"""The two-level pool (pagedkv_lib.offload under KVCacheManager): eviction offloads a
cached block to the secondary pool, a prefix hit restores it bit-exact across every
layer, a full secondary pool drops its least recently used block, and integrity holds
after every step. Pure bookkeeping plus torch block copies on tiny pools: well under 1 s."""

import pytest
import torch

from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.manager import KVCacheManager

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

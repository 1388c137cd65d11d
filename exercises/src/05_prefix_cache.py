# %% [markdown]
# # Exercise 05 · The prefix hash chain, and the token a full hit still computes
#
# *About 20 minutes. Goes with notebook 05.*
#
# A prefix cache keeps full KV blocks of earlier prompts. Block `j` is named by a hash of
# its parent's hash and its own tokens,
#
# $$h_0 = \text{block\_hash}(\text{None}, \text{tokens}_0), \qquad
#   h_j = \text{block\_hash}(h_{j-1}, \text{tokens}_j),$$
#
# so two blocks get the same name only when their *whole prefixes* are equal. Only full
# blocks are hashed.
#
# **Write two functions.**
#
# 1. `block_hashes(token_ids, page_size)`: the chain `[h_0, h_1, ...]` of the full blocks,
#    using `block_hash` from `pagedkv_lib.sharing` (imported below).
# 2. `num_cached_tokens(prompt, cached, page_size)`: how many leading prompt tokens can
#    reuse cached KV, given `cached`, the set of block hashes in the cache: the longest run
#    of leading blocks whose hashes are all in `cached`, in tokens. But the model must
#    still compute at least one prompt token (its logits give the next token): if every
#    token would come from the cache, give back the last block.
#
# Example, pages of 4: a 12-token prompt whose 3 blocks are all cached reuses 8 tokens,
# not 12; the same prompt plus 2 tokens reuses 12.

# %%
from pagedkv_lab.exercises import check
from pagedkv_lib.sharing import block_hash

# %% [markdown]
# ## Your code


# %%
def block_hashes(token_ids, page_size):
    """Chained hashes of the full blocks of token_ids."""
    raise NotImplementedError("write block_hashes")


def num_cached_tokens(prompt, cached, page_size):
    """Leading prompt tokens whose KV comes from the cache (at least one token left to compute)."""
    raise NotImplementedError("write num_cached_tokens")


# %% [markdown]
# ## Check

# %%
check("prefix_cache", block_hashes, num_cached_tokens)

# %% [markdown]
# **Stuck?** Why the chain: two prompts can share their second block's tokens but not
# their first block; without the parent's hash the second block would wrongly hit.
# The library's version is `pagedkv_lib.KVCacheManager.admit`; vLLM's is
# `hash_block_tokens` in `vllm/v1/core/kv_cache_utils.py`, nano-vllm's
# `BlockManager.compute_hash` in `nanovllm/engine/block_manager.py`.

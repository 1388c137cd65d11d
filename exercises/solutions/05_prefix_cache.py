"""Solution of exercise 05: the prefix hash chain."""

from pagedkv_lib.sharing import block_hash


def block_hashes(token_ids, page_size):
    hashes, parent = [], None
    for j in range(len(token_ids) // page_size):  # full blocks only
        parent = block_hash(parent, token_ids[j * page_size : (j + 1) * page_size])
        hashes.append(parent)
    return hashes


def num_cached_tokens(prompt, cached, page_size):
    hits = 0
    for h in block_hashes(prompt, page_size):
        if h not in cached:
            break
        hits += 1
    if hits * page_size >= len(prompt):  # the last token must be computed: recompute the last block
        hits -= 1
    return max(hits, 0) * page_size

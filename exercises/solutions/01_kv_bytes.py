"""Solution of exercise 01: KV bytes per token and fragmentation."""


def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    # K and V, in every layer, for every KV head: one head_dim vector each.
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def fragmentation(seq_lens, page_size):
    allocated = sum(-(-n // page_size) * page_size for n in seq_lens)  # whole pages per sequence
    if allocated == 0:
        return 0.0
    return 1 - sum(seq_lens) / allocated

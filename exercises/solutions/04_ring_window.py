"""Solution of exercise 04: the ring window's kv_token_idx."""


def kv_token_idx(t, max_attention_window, sink_tokens, tokens_per_block):
    if t < sink_tokens:
        return t  # sinks stay where they were written
    bubble = (tokens_per_block - sink_tokens % tokens_per_block) % tokens_per_block
    cyclic = max_attention_window - sink_tokens
    return sink_tokens + bubble + (t - sink_tokens) % cyclic

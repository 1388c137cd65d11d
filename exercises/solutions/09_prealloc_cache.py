"""Solution of exercise 09: prefill and decode writes into a preallocated cache."""


def prefill_write(k_cache, v_cache, seq_lens, slot, k, v):
    n = k.shape[0]
    k_cache[slot, :n] = k
    v_cache[slot, :n] = v
    seq_lens[slot] = n  # a new sequence: set the length, never add to an old one


def decode_write(k_cache, v_cache, seq_lens, slots, k, v):
    max_seq_len = k_cache.shape[1]
    for slot in slots:  # every slot checked before the first write
        if seq_lens[slot] >= max_seq_len:
            raise ValueError(f"slot {slot} is full: it holds max_seq_len={max_seq_len} tokens")
    for i, slot in enumerate(slots):
        row = seq_lens[slot]  # the first free row
        k_cache[slot, row] = k[i]
        v_cache[slot, row] = v[i]
        seq_lens[slot] += 1

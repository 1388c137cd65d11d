"""Solution of exercise 10: GQA's read through a view."""


def broadcast_kv_for_gqa(kv, num_q_heads):
    num_kv_heads = kv.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    shape = (kv.shape[0], num_kv_heads, group, kv.shape[2])
    return kv.unsqueeze(2).expand(shape)  # a view: stride 0 along the group, nothing copied

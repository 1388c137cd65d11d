"""The KV-cache memory formula, checked against hand-computed byte counts.

Every expected number below is written out as the product a reader can redo on
paper (layers * K/V * kv heads * head_dim * bytes), so dropping a factor (the 2
for K and V, the layer count, the scale bytes of fp4) makes a test fail.
"""

import pytest
import torch

import pagedkv_lib as P
from pagedkv_lib.memory import get_preset, kv_dtype, kv_heads_per_rank, padded_tokens

GiB = 2**30


def spec(name):
    return get_preset(name)


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "name, layers, q_heads, kv_heads, head_dim, kind",
    [
        ("llama-2-7b", 32, 32, 32, 128, "MHA"),
        ("llama-2-70b", 80, 64, 8, 128, "GQA"),
        ("llama-3-8b", 32, 32, 8, 128, "GQA"),
        ("llama-3-70b", 80, 64, 8, 128, "GQA"),
        ("mistral-7b", 32, 32, 8, 128, "GQA"),
        ("qwen2.5-7b", 28, 28, 4, 128, "GQA"),
        ("falcon-7b", 32, 71, 1, 64, "MQA"),
    ],
)
def test_preset_has_published_attention_shape(name, layers, q_heads, kv_heads, head_dim, kind):
    s = P.PRESETS[name]
    assert (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim) == (layers, q_heads, kv_heads, head_dim)
    assert s.attention == kind
    assert s.kv_factor == 2 and s.cached_dim == head_dim


def test_deepseek_v2_preset_is_mla_with_512_latent_and_64_rope_dims():
    s = P.PRESETS["deepseek-v2"]
    assert s.attention == "MLA"
    assert s.num_layers == 60 and s.kv_lora_rank == 512 and s.qk_rope_head_dim == 64
    # MLA caches one shared latent (512) plus the decoupled RoPE key (64): 576 wide, once.
    assert s.kv_factor == 1 and s.cached_dim == 576


def test_get_preset_is_case_insensitive_and_rejects_unknown_names():
    assert get_preset("Llama-3-8B") is P.PRESETS["llama-3-8b"]
    with pytest.raises(ValueError, match="preset='gpt-5'"):
        get_preset("gpt-5")


# ----------------------------------------------------------------------------- bytes per token


@pytest.mark.parametrize(
    "name, expected",
    [
        # layers * 2 (K and V) * kv_heads * head_dim * 2 bytes (fp16)
        ("llama-2-7b", 32 * 2 * 32 * 128 * 2),  # 524288 = 512 KiB
        ("llama-2-70b", 80 * 2 * 8 * 128 * 2),  # 327680
        ("llama-3-8b", 32 * 2 * 8 * 128 * 2),  # 131072
        ("llama-3-70b", 80 * 2 * 8 * 128 * 2),
        ("mistral-7b", 32 * 2 * 8 * 128 * 2),
        ("qwen2.5-7b", 28 * 2 * 4 * 128 * 2),  # 57344
        ("falcon-7b", 32 * 2 * 1 * 64 * 2),  # 8192: one KV head (MQA)
        # MLA: layers * 1 latent * (512 + 64) * 2 bytes
        ("deepseek-v2", 60 * 576 * 2),  # 69120
    ],
)
def test_fp16_bytes_per_token_match_hand_computation(name, expected):
    assert P.kv_bytes_per_token(spec(name)) == expected


def test_hand_computed_constants_are_the_published_numbers():
    # Guard against a typo in the parametrize table itself.
    assert P.kv_bytes_per_token(spec("llama-3-8b"), "fp16") == 131072
    assert P.kv_bytes_per_token(spec("deepseek-v2"), "fp16") == 69120
    assert P.kv_bytes_per_token(spec("llama-2-7b"), "fp16") == 512 * 1024


@pytest.mark.parametrize(
    "dtype, per_vector",
    [
        # bytes of one 128-wide head vector
        (torch.float32, 128 * 4),
        ("fp32", 512),
        (torch.float16, 256),
        ("half", 256),
        (torch.bfloat16, 256),
        ("bf16", 256),
        (torch.float8_e4m3fn, 128),
        (torch.float8_e5m2, 128),
        ("fp8", 128),
        # fp4: 128 values at 4 bits = 64 bytes, plus one scale byte per 16 values = 8
        ("fp4", 64 + 8),
        ("NVFP4", 72),
    ],
)
def test_dtype_sets_vector_cost_of_llama_3_8b(dtype, per_vector):
    assert kv_dtype(dtype).vector_bytes(128) == per_vector
    assert P.kv_bytes_per_token(spec("llama-3-8b"), dtype) == 32 * 2 * 8 * per_vector


def test_fp4_rounds_scales_up_per_started_group_of_16():
    # 80 values: 40 data bytes, ceil(80/16)=5 scales; 20 values: 10 bytes + 2 scales.
    assert kv_dtype("fp4").vector_bytes(80) == 45
    assert kv_dtype("fp4").vector_bytes(20) == 12
    # DeepSeek-V2 latent in fp4: 576/2 = 288 data + 576/16 = 36 scales, per layer.
    assert P.kv_bytes_per_token(spec("deepseek-v2"), "fp4") == 60 * (288 + 36)


# ----------------------------------------------------------------------------- batches


def test_llama_2_7b_four_sequences_of_2048_fp16_is_exactly_4_gib():
    # 4 * 2048 tokens * 512 KiB = 4 GiB
    total = P.kv_cache_bytes(spec("llama-2-7b"), [2048] * 4, torch.float16)
    assert total == 4 * GiB
    assert isinstance(total, int)


def test_cache_bytes_is_sum_of_lengths_times_bytes_per_token():
    # llama-3-8b fp16: (100 + 1 + 0) tokens * 131072
    assert P.kv_cache_bytes(spec("llama-3-8b"), [100, 1, 0]) == 101 * 131072
    assert P.kv_cache_bytes(spec("llama-3-8b"), torch.tensor([100, 1, 0])) == 101 * 131072
    assert P.kv_cache_bytes(spec("llama-3-8b"), []) == 0


def test_page_rounding_charges_whole_pages_per_sequence():
    # page 16: 100 -> 7 pages (112 rows), 1 -> 1 page (16), 16 -> 1 page, 0 -> nothing
    assert padded_tokens([100, 1, 16, 0], 16) == 112 + 16 + 16
    assert P.kv_cache_bytes(spec("llama-3-8b"), [100, 1, 16, 0], "fp16", page_size=16) == 144 * 131072
    # a page size of 1 is no rounding at all
    assert P.kv_cache_bytes(spec("llama-3-8b"), [100, 1], page_size=1) == 101 * 131072
    # non-power-of-two page: 11 tokens in pages of 5 -> 3 pages = 15 rows
    assert P.kv_cache_bytes(spec("falcon-7b"), [11], page_size=5) == 15 * 8192


def test_tensor_parallel_splits_kv_heads_evenly():
    # llama-3-70b has 8 KV heads: TP=2 -> 4 per rank, TP=8 -> 1 per rank.
    s = spec("llama-3-70b")
    assert kv_heads_per_rank(s, 2) == 4
    assert P.kv_bytes_per_token(s, "fp16", tensor_parallel=2) == 80 * 2 * 4 * 128 * 2
    assert P.kv_bytes_per_token(s, "fp16", tensor_parallel=8) == 80 * 2 * 1 * 128 * 2
    assert P.kv_cache_bytes(s, [10], "fp16", tensor_parallel=4) == 10 * 80 * 2 * 2 * 128 * 2


def test_tensor_parallel_replicates_kv_heads_when_ranks_outnumber_them():
    # 8 KV heads over 16 ranks: each head lives on 2 ranks, every rank holds one head.
    assert kv_heads_per_rank(spec("llama-3-70b"), 16) == 1
    assert P.kv_bytes_per_token(spec("llama-3-70b"), tensor_parallel=16) == 80 * 2 * 1 * 128 * 2
    # MQA: the single KV head is replicated on all 8 ranks, so no saving at all.
    assert P.kv_bytes_per_token(spec("falcon-7b"), tensor_parallel=8) == P.kv_bytes_per_token(spec("falcon-7b"))
    # MLA's latent is replicated on every rank too.
    assert P.kv_bytes_per_token(spec("deepseek-v2"), tensor_parallel=8) == 69120


@pytest.mark.parametrize("tp", [3, 12])
def test_tensor_parallel_that_cannot_split_or_replicate_evenly_is_rejected(tp):
    # 8 heads: TP=3 does not divide 8; TP=12 is not a multiple of 8.
    with pytest.raises(ValueError, match=f"tensor_parallel={tp}"):
        P.kv_bytes_per_token(spec("llama-3-70b"), tensor_parallel=tp)


def test_max_tokens_is_the_inverse_of_the_formula():
    s = spec("llama-3-8b")  # 131072 B/token
    assert P.max_tokens(s, 4 * GiB) == 4 * GiB // 131072 == 32768
    assert P.max_tokens(s, 131072 * 10 - 1) == 9  # one byte short of 10 tokens
    assert P.max_tokens(s, 0) == 0
    # With pages of 16 only whole pages fit: 100 tokens' worth of bytes -> 6 pages = 96 tokens.
    assert P.max_tokens(s, 100 * 131072, page_size=16) == 96
    # Round trip: n tokens' bytes fit exactly n tokens (fp8 halves the cost, doubles the count).
    for n in (1, 17, 4096):
        assert P.max_tokens(s, P.kv_cache_bytes(s, [n], "fp8"), "fp8") == n
    assert P.max_tokens(s, 131072, "fp8") == 2
    assert P.max_tokens(s, 131072, tensor_parallel=8) == 8


# ----------------------------------------------------------------------------- a real tensor


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_real_one_layer_pool_tensor_has_exactly_the_formula_bytes(layout, dtype):
    # Three sequences of 5, 1 and 9 tokens in pages of 4 need 2 + 1 + 3 = 6 pages.
    one_layer = P.ModelSpec("tiny", num_layers=1, num_q_heads=6, num_kv_heads=3, head_dim=80)
    pool = P.PagedKVPool(6, 4, 3, 80, dtype=dtype, layout=layout)
    assert pool.nbytes == pool.cache.nbytes == P.kv_cache_bytes(one_layer, [5, 1, 9], dtype, page_size=4)
    # and by hand: 6 pages * 2 (K,V) * 4 rows * 3 heads * 80 * itemsize
    assert pool.nbytes == 6 * 2 * 4 * 3 * 80 * torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("field", ["num_layers", "num_q_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1])
def test_model_spec_rejects_non_positive_sizes_naming_the_field(field, bad):
    kwargs = dict(name="x", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8)
    kwargs[field] = bad
    with pytest.raises(ValueError, match=field):
        P.ModelSpec(**kwargs)


def test_model_spec_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        P.ModelSpec("x", 2, 4, 2, 8, kv_lora_rank=-1)
    with pytest.raises(ValueError, match="qk_rope_head_dim needs kv_lora_rank"):
        P.ModelSpec("x", 2, 4, 2, 8, qk_rope_head_dim=64)
    with pytest.raises(ValueError, match="num_q_heads=6 is not a multiple of num_kv_heads=4"):
        P.ModelSpec("x", 2, 6, 4, 8)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda s: P.kv_bytes_per_token(s, "int3"), "dtype='int3'"),
        (lambda s: P.kv_bytes_per_token(s, torch.float64), "dtype="),
        (lambda s: P.kv_bytes_per_token(s, tensor_parallel=0), "tensor_parallel=0"),
        (lambda s: P.kv_bytes_per_token(s, tensor_parallel=-2), "tensor_parallel=-2"),
        (lambda s: P.kv_cache_bytes(s, [4, -1]), r"seq_lens\[1\]=-1"),
        (lambda s: P.kv_cache_bytes(s, [2.5]), r"seq_lens\[0\]=2.5"),
        (lambda s: P.kv_cache_bytes(s, [4], page_size=0), "page_size=0"),
        (lambda s: P.kv_cache_bytes(s, [4], page_size=-16), "page_size=-16"),
        (lambda s: P.max_tokens(s, -1), "budget_bytes=-1"),
        (lambda s: P.max_tokens(s, 10**9, page_size=0), "page_size=0"),
        (lambda s: P.max_tokens(s, 10**9, "fp5"), "dtype='fp5'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call(spec("llama-3-8b"))

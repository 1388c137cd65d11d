"""QuantizedKVPool: tensors per format and layout, bytes equal to the memory formula for
every preset, and the Python references that write and read it."""

import math

import pytest
import torch

from pagedkv_lib import PRESETS, RingWindow, checks, formats, memory, quant, quant_reference
from pagedkv_lib.memory import kv_cache_bytes, kv_heads_per_rank
from pagedkv_lib.quant_pool import QuantizedKVPool

FORMATS = [("fp8", "tensor"), ("fp8", "token"), ("nvfp4", "block")]


def test_fp8_per_tensor_pool_holds_one_code_byte_per_element_and_no_scale_pool():
    pool = QuantizedKVPool(3, 4, 2, 32, "fp8", k_scale=0.5, v_scale=0.25)
    assert pool.data.shape == (3, 2, 4, 2, 32) and pool.data.dtype == torch.uint8
    assert pool.scales is None and pool.global_scale.tolist() == [0.5, 0.25]
    assert pool.nbytes == 3 * 2 * 4 * 2 * 32 and pool.memory_dtype == "fp8"


def test_fp8_per_token_pool_has_one_fp32_scale_per_row_and_head():
    pool = QuantizedKVPool(3, 4, 2, 32, "fp8", "HND", scale_mode="token")
    assert pool.data.shape == (3, 2, 2, 4, 32)
    assert pool.scales.shape == (3, 2, 2, 4, 1) and pool.scales.dtype == torch.float32
    assert pool.nbytes == 3 * 2 * 4 * 2 * (32 + 4)


def test_nvfp4_pool_packs_two_codes_per_byte_and_one_scale_byte_per_16():
    pool = QuantizedKVPool(3, 4, 2, 64, "nvfp4")
    assert pool.data.shape == (3, 2, 4, 2, 32) and pool.scales.shape == (3, 2, 4, 2, 4)
    assert pool.scales.dtype == torch.uint8 and pool.scale_mode == "block"
    assert pool.nbytes == 3 * 2 * 4 * 2 * (32 + 4)
    assert pool.shape_proxy.shape == (3, 2, 4, 2, 64) and pool.shape_proxy.device.type == "meta"


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("kv_dtype, mode", FORMATS)
def test_memory_formula_equals_the_real_bytes_of_a_quantized_pool_for_every_preset(name, kv_dtype, mode):
    spec = PRESETS[name]
    # One layer's pool holds K and V of width cached_dim for the KV heads of one rank;
    # MLA caches one latent per token instead of K and V, half of such a pool.
    pool = QuantizedKVPool(5, 16, kv_heads_per_rank(spec), spec.cached_dim, kv_dtype, scale_mode=mode)
    per_layer = pool.nbytes * spec.kv_factor // 2
    assert kv_cache_bytes(spec, [5 * 16 - 3], pool.memory_dtype, page_size=16) == spec.num_layers * per_layer


def test_bytes_per_token_of_llama_3_8b_by_hand():
    # 32 layers x K,V x 8 heads: bf16 256 bytes per vector, fp8 128, fp8 + fp32 token
    # scale 132, nvfp4 64 + 8 = 72.
    spec = PRESETS["llama-3-8b"]
    per = {fmt: memory.kv_bytes_per_token(spec, fmt) for fmt in ("bf16", "fp8", "fp8_per_token", "nvfp4")}
    assert per == {"bf16": 131072, "fp8": 65536, "fp8_per_token": 67584, "nvfp4": 36864}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"kv_dtype": "nvfp4", "head_dim": 24}, "multiple of 16"),
        ({"kv_dtype": "fp8", "scale_mode": "block"}, "scale_mode"),
        ({"kv_dtype": "nvfp4", "scale_mode": "token"}, "scale_mode"),
        ({"layout": "NDH"}, "layout"),
        ({"k_scale": 0.0}, "k_scale"),
        ({"v_scale": math.nan}, "v_scale"),
        ({"num_pages": 0}, "num_pages"),
    ],
)
def test_bad_pool_arguments_raise_naming_the_argument(kwargs, match):
    args = {"num_pages": 2, "page_size": 4, "num_kv_heads": 1, "head_dim": 32, **kwargs}
    with pytest.raises(ValueError, match=match):
        QuantizedKVPool(**args)


def test_inconsistent_pool_tensors_are_refused_before_any_write():
    pool = QuantizedKVPool(2, 4, 1, 32, "nvfp4")
    pool.scales = torch.zeros(2, 2, 4, 1, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pool.scales has shape \(2, 2, 4, 1, 3\)"):
        checks.check_quant_pool(pool)
    pool = QuantizedKVPool(2, 4, 1, 32, "fp8")
    pool.global_scale[1] = -1.0
    with pytest.raises(ValueError, match="v_scale"):
        quant_reference.append_paged_kv_quant(torch.ones(1, 1, 32), torch.ones(1, 1, 32), pool, torch.tensor([0]))
    assert pool.data.eq(0).all()


@pytest.mark.parametrize("kv_dtype, mode", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_append_writes_quantized_rows_that_read_back_within_the_bound(kv_dtype, mode, layout):
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(7, 2, 32, generator=gen), torch.randn(7, 2, 32, generator=gen)
    pool = QuantizedKVPool(4, 3, 2, 32, kv_dtype, layout, scale_mode=mode)
    pool.set_global_scales(quant.global_scale_for(k, kv_dtype), quant.global_scale_for(v, kv_dtype))
    slots = torch.tensor([5, -1, 0, 11, 2, 7, -1])
    quant_reference.append_paged_kv_quant(k, v, pool, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        page, row = divmod(slot, 3)
        for kv, x in ((0, k[i]), (1, v[i])):
            got = pool.rows(page, kv)[row]
            if kv_dtype == "nvfp4":
                idx = (page, kv, row) if layout == "NHD" else (page, kv, slice(None), row)
                bound = quant.nvfp4_error_bound(pool.scales[idx], float(pool.global_scale[kv]))
            else:
                scale = float(pool.global_scale[kv]) if mode == "tensor" else quant.fp8_token_scales(x)
                bound = quant.fp8_error_bound(x, scale)
            assert ((got - x).abs() <= bound).all()
    for slot in (1, 3, 4, 6, 8, 9, 10):  # slots nobody wrote still read back 0
        page, row = divmod(slot, 3)
        assert pool.rows(page, 0)[row].eq(0).all() and pool.rows(page, 1)[row].eq(0).all()


@pytest.mark.parametrize("kv_dtype, mode", FORMATS)
def test_reference_v_tail_zeroing_turns_poisoned_rows_into_zeros_not_nan(kv_dtype, mode):
    pool = QuantizedKVPool(4, 4, 1, 32, kv_dtype, "HND", scale_mode=mode).poison_()
    assert pool.dequantize().isnan().all()
    k = v = torch.randn(6, 1, 32)
    batch, pos = torch.tensor([0] * 6), torch.arange(6)
    indices, indptr, last = torch.tensor([2, 0]), torch.tensor([0, 2]), torch.tensor([2])
    quant_reference.append_paged_kv_quant_csr(k, v, pool, batch, pos, indices, indptr, kv_last_page_len=last)
    assert pool.rows(0, 1)[2:].eq(0).all()  # V tail of the last page: 0
    assert pool.rows(0, 0)[2:].isnan().all()  # K tail is left alone (the reader masks its scores)
    assert not pool.rows(2, 1).isnan().any() and not pool.rows(0, 1)[:2].isnan().any()


def test_reference_decode_equals_float64_attention_over_the_dequantized_rows():
    gen = torch.Generator().manual_seed(1)
    pool = QuantizedKVPool(6, 4, 2, 32, "nvfp4", k_scale=0.003, v_scale=0.002).poison_()
    table = torch.tensor([[4, 1, 3]])
    n = 10
    k, v = torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen)
    slots = formats.slot_mapping(table, torch.zeros(n, dtype=torch.long), torch.arange(n), 4)
    quant_reference.append_paged_kv_quant(k, v, pool, slots)
    q = torch.randn(1, 4, 32, generator=gen, dtype=torch.float64)
    rows = [pool.rows(int(table[0, t // 4]), kv)[t % 4] for kv in (0, 1) for t in range(n)]
    kd, vd = torch.stack(rows[:n]).double(), torch.stack(rows[n:]).double()
    scores = torch.einsum("hd,thd->ht", q[0], kd.repeat_interleave(2, 1)) / math.sqrt(32)
    want = torch.einsum("ht,thd->hd", scores.softmax(-1), vd.repeat_interleave(2, 1))
    got = quant_reference.paged_decode_attention_quant(q, pool, table, torch.tensor([n]), precision="fp64")
    assert torch.allclose(got[0], want, atol=1e-12, rtol=0)
    csr = quant_reference.paged_decode_attention_quant_csr(
        q, pool, torch.tensor([0, 3]), table[0], torch.tensor([2]), precision="fp64"
    )
    assert torch.equal(csr, got)


def test_reference_append_with_rope_quantizes_the_rotated_k():
    from pagedkv_lib.reference import rope_reference

    gen = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(3, 1, 32, generator=gen) for _ in range(3))
    pos = torch.tensor([0, 7, 100])
    pool = QuantizedKVPool(1, 4, 1, 32, "fp8", scale_mode="token")
    q_before = q.clone()
    quant_reference.append_paged_kv_quant(k, v, pool, torch.tensor([0, 1, 2]), rope="gptj", positions=pos, q=q)
    rotated = rope_reference(k, pos, 10000.0, "gptj").float()
    codes, _ = quant_reference.quantize_rows(rotated, pool, 0)
    assert torch.equal(pool.data[0, 0, :3], codes)
    assert torch.allclose(q, rope_reference(q_before, pos, 10000.0, "gptj").float(), atol=1e-6)


def test_reference_decode_refuses_a_table_outside_the_pool_and_a_window_of_another_page_size():
    pool = QuantizedKVPool(2, 4, 1, 32, "fp8")
    q = torch.randn(1, 1, 32)
    with pytest.raises(ValueError, match="block_tables"):
        quant_reference.paged_decode_attention_quant(q, pool, torch.tensor([[5]]), torch.tensor([3]))
    with pytest.raises(ValueError, match="tokens_per_block"):
        quant_reference.paged_decode_attention_quant(
            q, pool, torch.tensor([[0, 1]]), torch.tensor([3]), window=RingWindow(8, 0, 2)
        )

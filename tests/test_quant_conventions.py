"""Quantization scales in the peers' conventions, against re-statements of the peers' own
references (written here from their arithmetic, not imported: none of them runs on CPU).

* NVFP4 with an *encode* global scale, as TensorRT-LLM's ``cvt_warp_fp16_to_fp4`` and
  FlashInfer's ``fp4_quantize`` take it (``448 * 6 / amax``). FlashInfer's Python reference
  ``ref_fp4_quant`` (``tests/test_helpers/utils_fp4.py``) forms the block scale as
  ``gs_enc * (amax * (1/6))`` in fp32 and the codes' factor as ``1 / (sf8 * (1 / gs_enc))``;
  the suite's own form is ``amax / (6 * gs_dec)``. Codes and block scales must be equal
  bit for bit to the re-statement when the encode form is chosen, on a fixed input of
  32,256 blocks, 12 of them built next to E4M3 midpoints: the two forms disagree on those
  12 and on none of the random ones.
* FP8 with one scale per KV head, by the logic of vLLM's ``test_reshape_and_cache_flash``
  (``kv_scale_type="attn_head"``): ``k_scale = key.amax(dim=(0, 2)) / 64`` per head, the
  cache dequantized as ``fp8.to(fp16) * scale.view(1, 1, -1, 1)`` and compared with the
  input at ``atol=0.001, rtol=0.1``; the codes also bit for bit against torch's
  ``float8_e4m3fn`` cast, as vLLM's reference quantizes.
* FP8 with vLLM's per-token mode: one scale per token across its heads,
  ``max(amax / 448, 1e-6)``.

Each promise has a mutant (one line of a kernel changed) that a test here catches.
"""

import math

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import quant, quant_reference, runtime
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
from test_quant_kernels import assert_same_pool, mutant

import pagedkv_kernels as kernels
from pagedkv_kernels import quant_decode, quant_write

DEV = runtime.device()
FP32_TOL = verify.TOLERANCES[torch.float32]


# ----------------------------------------------------------------------------- NVFP4


def flashinfer_ref_fp4_quant(x: torch.Tensor, global_scale: torch.Tensor):
    """FlashInfer's ``ref_fp4_quant(x, global_scale, 16)``, re-stated: ``(e2m1 values,
    block scales as fp32)`` of ``x [m, n]`` with the *encode* ``global_scale`` (fp32 0-d).
    Every operation is the fp32 one FlashInfer's torch code performs, in its order."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, 16)
    vec_max = blocks.abs().amax(-1, keepdim=True)
    recip6 = torch.tensor(1 / 6, dtype=torch.float32)  # get_reciprocal(6.0), used by an fp32 tensor
    scale = global_scale * (vec_max * recip6)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    decode = torch.where(global_scale == 0, 0.0, 1.0 / global_scale)  # get_reciprocal(global_scale)
    den = scale * decode
    output_scale = torch.where(den == 0, 0.0, 1.0 / torch.where(den == 0, 1.0, den))
    clipped = torch.clamp(blocks * output_scale, -6.0, 6.0)
    # cast_to_fp4: nearest E2M1 value, the boundaries as FlashInfer writes them
    a = clipped.abs()
    grid = [(0.25, 0.0, True), (0.75, 0.5, False), (1.25, 1.0, True), (1.75, 1.5, False), (2.5, 2.0, True)]
    grid += [(3.5, 3.0, False), (5.0, 4.0, True)]
    value = torch.full_like(a, 6.0)
    for upper, v, inclusive in reversed(grid):
        value = torch.where(a <= upper if inclusive else a < upper, v, value)
    return (torch.sign(clipped) * value).reshape(x.shape), scale.squeeze(-1)


def e2m1_codes_of(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of exact E2M1 values, the sign bit from the value's sign (-0.0 included)."""
    index = torch.bucketize(values.abs(), torch.tensor(quant.E2M1_VALUES))
    return index.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)


FIXED_INPUT = (2016, 2, 128)  # tokens x KV heads x head_dim: 32,256 blocks of 16


def encode_scale_of(x: torch.Tensor) -> torch.Tensor:
    """FlashInfer's test fixture: ``global_scale = 448 * 6 / amax`` (fp32)."""
    return (448.0 * 6.0 / x.float().abs().amax()).to(torch.float32)


def near_midpoint_amaxes(gs_enc: torch.Tensor) -> list[float]:
    """One block amax per E4M3 midpoint in (16, 300) where the two forms round the block
    scale to different codes: the fp32 values within 8 ulps of ``6 * M / gs_enc`` whose
    ``gs_enc * (amax * fp32(1/6))`` and ``amax / (6 * fp32(1 / gs_enc))`` straddle ``M``."""
    grid = quant.fp8_decode(torch.arange(127, dtype=torch.uint8)).double()
    mids = (grid[1:] + grid[:-1]) / 2
    recip6, gs_dec = torch.tensor(1 / 6, dtype=torch.float32), 1.0 / gs_enc
    found = []
    for m in mids[(mids > 16) & (mids < 300)].tolist():
        center = torch.tensor(6 * m / float(gs_enc), dtype=torch.float32)
        near = (center.view(torch.int32) + torch.arange(-8, 9, dtype=torch.int32)).view(torch.float32)
        apart = quant.fp8_encode(gs_enc * (near * recip6)) != quant.fp8_encode(near / (6.0 * gs_dec))
        found += near[apart][:1].tolist()
    return found


def fixed_input() -> tuple[torch.Tensor, int]:
    """``(x, n)``: fp32 ``randn`` of :data:`FIXED_INPUT` whose first ``n`` blocks are
    rebuilt around :func:`near_midpoint_amaxes` (values below that amax, the amax itself
    in lane 0), the rest left random. The tensor amax, and so ``gs_enc``, is unchanged."""
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(FIXED_INPUT, generator=gen)
    gs = encode_scale_of(x)
    blocks = x.view(-1, 16)
    amaxes = near_midpoint_amaxes(gs)
    for i, a in enumerate(amaxes):
        blocks[i] = a * 0.99 * torch.tanh(blocks[i])
        blocks[i, 0] = a
    assert torch.equal(encode_scale_of(x), gs)
    return x, len(amaxes)


def test_nvfp4_block_scale_gs_enc_times_amax_times_recip6_equals_flashinfer_ref_fp4_quant_bit_for_bit():
    x, _ = fixed_input()
    gs = encode_scale_of(x)
    assert float(gs) == quant.nvfp4_encode_scale_for(x)
    want_values, want_scales = flashinfer_ref_fp4_quant(x.reshape(-1, 128), gs)
    # FlashInfer's python-scalar form (vec_max * (1/6) as a double) is the same fp32 product
    blocks_max = x.reshape(-1, 8, 16).abs().amax(-1)
    assert torch.equal(gs * (blocks_max * (1 / 6)), gs * (blocks_max * torch.tensor(1 / 6, dtype=torch.float32)))

    packed, scales = quant.nvfp4_quantize(x, global_scale_encode=float(gs))
    want_sf8 = want_scales.to(torch.float8_e4m3fn).view(torch.uint8).reshape(scales.shape)
    assert torch.equal(scales.view(torch.uint8), want_sf8), "block scales differ from FlashInfer's"
    codes = quant.unpack_nibbles(packed)
    assert torch.equal(codes, e2m1_codes_of(want_values.reshape(codes.shape))), "codes differ from FlashInfer's"
    assert torch.equal(quant.e2m1_decode(codes), want_values.reshape(codes.shape))
    loop_packed, loop_scales = quant.nvfp4_quantize_loop(x[:40], global_scale_encode=float(gs))
    assert torch.equal(loop_packed, packed[:40])
    assert torch.equal(loop_scales.view(torch.uint8), scales[:40].view(torch.uint8))


def test_nvfp4_suite_form_amax_over_6_gs_dec_differs_from_gs_enc_times_amax_over_6_only_near_e4m3_midpoints():
    """Same input, same tensor amax: the suite's ``amax / (6 * gs_dec)`` with ``gs_dec =
    fp32(1 / gs_enc)`` (the multiplier FlashInfer's reference reads back with) against
    ``gs_enc * (amax * fp32(1/6))``. Equal in exact arithmetic; in fp32 they differ by
    an ulp or two, which moves a block scale to the neighbouring E4M3 code only when it
    lies that close to a midpoint: none of the 32,244 random blocks, every one of the
    12 blocks built there."""
    x, crafted = fixed_input()
    assert crafted == 12
    gs = float(encode_scale_of(x))
    _, enc_scales = quant.nvfp4_quantize(x, global_scale_encode=gs)
    _, dec_scales = quant.nvfp4_quantize(x, quant.nvfp4_decode_scale(global_scale_encode=gs))
    differ = (enc_scales.view(torch.uint8) != dec_scales.view(torch.uint8)).flatten()
    assert differ.numel() == 32256
    assert int(differ.sum()) == crafted and differ[:crafted].all(), f"{int(differ.sum())} of 32,256 differ"
    step = enc_scales.view(torch.uint8).int().flatten() - dec_scales.view(torch.uint8).int().flatten()
    assert step[differ].abs().max() == 1, "the forms differ by one E4M3 step at most"


def encode_pool(layout="NHD", k_enc=448.0 * 6 / 4.5, v_enc=448.0 * 6 / 3.5, pages=6, heads=2, d=128):
    return QuantizedKVPool(pages, 16, heads, d, "nvfp4", layout, DEV, k_scale_encode=k_enc, v_scale_encode=v_enc)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_kernel_in_the_encode_form_stores_flashinfers_codes_and_scales(layout):
    x, _ = fixed_input()
    gs = float(encode_scale_of(x))
    x = x[:64]  # the kernel sees 64 tokens (1,024 blocks), the 12 built near midpoints among them
    pool = encode_pool(layout, gs, gs)
    slots = torch.randperm(pool.num_slots, generator=torch.Generator().manual_seed(1))[: x.shape[0]]
    want = pool.to("cpu")
    quant_reference.append_paged_kv_quant(x, x, want, slots)
    kernels.append_paged_kv_quant_pool(x.to(DEV), x.to(DEV), pool, slots.to(DEV))
    assert_same_pool(pool, want)
    _, want_scales = flashinfer_ref_fp4_quant(x.reshape(-1, 128), torch.tensor(gs, dtype=torch.float32))
    stored = pool.to("cpu").scales[:, 0]  # K's block scales
    page, row = slots // 16, slots % 16
    got = stored[page, row] if layout == "NHD" else stored[page, :, row]
    assert torch.equal(got.reshape(-1, 8), want_scales.to(torch.float8_e4m3fn).view(torch.uint8))


def test_kernel_mutant_with_the_suite_formula_under_encode_scales_fails_the_flashinfer_check(tmp_path):
    bad = mutant(
        quant_write,
        "sf8 = fp8_encode(gs * (amax * 0.1666666716337204))",
        "sf8 = fp8_encode(tl.math.div_rn(amax, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), gs) * 6.0))",
        tmp_path,
    )
    x, crafted = fixed_input()
    gs = float(encode_scale_of(x))
    x = x[:64]
    pool = encode_pool("NHD", gs, gs)
    slots = torch.arange(x.shape[0])
    bad.append_paged_kv_quant(x.to(DEV), x.to(DEV), slot_mapping=slots.to(DEV), **pool.kernel_args())
    _, want_scales = flashinfer_ref_fp4_quant(x.reshape(-1, 128), torch.tensor(gs, dtype=torch.float32))
    got = pool.to("cpu").scales[:, 0].reshape(-1, 8)[: x.shape[0] * 2]
    assert int((got != want_scales.to(torch.float8_e4m3fn).view(torch.uint8)).sum()) == crafted


def encode_decode_case(pool_maker):
    gen = torch.Generator().manual_seed(3)
    lens = [37, 20]
    pool = pool_maker().to("cpu")
    table = torch.tensor([[4, 0, 2], [1, 3, 5]])
    for b, n in enumerate(lens):
        slots = table[b, torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        quant_reference.append_paged_kv_quant(
            torch.randn(n, 2, 128, generator=gen), torch.randn(n, 2, 128, generator=gen), pool, slots
        )
    q = torch.randn(2, 4, 128, generator=gen)
    return q, pool, table, torch.tensor(lens)


def test_decode_reads_an_encode_pool_with_the_reciprocal_of_the_encode_scale():
    q, pool, table, lens = encode_decode_case(encode_pool)
    values = pool.dequantize()
    k_dec = quant.nvfp4_decode_scale(global_scale_encode=float(pool.global_scale[0]))
    assert torch.equal(values[:, 0], quant.nvfp4_dequantize(pool.data[:, 0], pool.scales[:, 0], k_dec))
    want = quant_reference.paged_decode_attention_quant(q, pool, table, lens, precision="fp64")
    got = kernels.paged_decode_attention_quant_pool(q.to(DEV), pool.to(DEV), table.to(DEV), lens.to(DEV))
    result = verify.compare.compare(got, want, *FP32_TOL)
    assert result.passed, result


def test_kernel_mutant_reading_the_encode_scale_as_a_multiplier_fails_decode(tmp_path):
    bad = mutant(
        quant_decode,
        "k_gs = tl.math.div_rn(tl.full([1], 1.0, tl.float32), k_gs)",
        "k_gs = k_gs + tl.zeros([1], tl.float32)",
        tmp_path,
    )
    q, pool, table, lens = encode_decode_case(encode_pool)
    want = quant_reference.paged_decode_attention_quant(q, pool, table, lens, precision="fp64")
    tables = {"block_tables": table.to(DEV), "seq_lens": lens.to(DEV)}
    got = bad.paged_decode_attention_quant(q.to(DEV), **tables, **pool.to(DEV).kernel_args())
    assert not verify.compare.compare(got, want, *FP32_TOL).passed


# ----------------------------------------------------------------------------- FP8 per head (vLLM)


def vllm_per_head_case(layout, dtype, num_tokens=21, heads=8, head_size=64, block_size=16, num_blocks=6):
    """vLLM's ``test_reshape_and_cache_flash`` with ``kv_scale_type="attn_head"``, scaled down."""
    gen = torch.Generator().manual_seed(11)
    key, value = torch.randn(2, num_tokens, heads, head_size, generator=gen).to(dtype).unbind(0)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k_scale = (key.amax(dim=(0, 2)) / 64.0).to(torch.float32)
    v_scale = (value.amax(dim=(0, 2)) / 64.0).to(torch.float32)
    pool = QuantizedKVPool(
        num_blocks,
        block_size,
        heads,
        head_size,
        "fp8",
        layout,
        DEV,
        scale_mode="head",
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return key, value, slot_mapping, k_scale, v_scale, pool


def vllm_dequantize(codes: torch.Tensor, scale: torch.Tensor, layout: str) -> torch.Tensor:
    """vLLM's ``convert_fp8_local`` per head: ``fp8.to(fp16) * scale`` broadcast on the head dim."""
    view = (1, 1, -1, 1) if layout == "NHD" else (1, -1, 1, 1)
    return (codes.view(torch.float8_e4m3fn).to(torch.float16) * scale.view(view)).to(torch.float16)


@pytest.mark.parametrize("layout, dtype", [("NHD", torch.bfloat16), ("HND", torch.float16)])
def test_fp8_per_head_scales_pass_vllms_reshape_and_cache_flash_check(layout, dtype):
    key, value, slots, k_scale, v_scale, pool = vllm_per_head_case(layout, dtype)
    reference = pool.to("cpu")
    quant_reference.append_paged_kv_quant(key, value, reference, slots)
    kernels.append_paged_kv_quant_pool(key.to(DEV), value.to(DEV), pool, slots.to(DEV))
    host = pool.to("cpu")
    page, row = slots // 16, slots % 16
    for kv, x, scale in ((0, key, k_scale), (1, value, v_scale)):
        cache = vllm_dequantize(host.data[:, kv], scale, layout)
        got = cache[page, row] if layout == "NHD" else cache[page, :, row]
        torch.testing.assert_close(got, x.to(torch.float16), atol=0.001, rtol=0.1)
        # the codes, bit for bit, against torch's float8_e4m3fn cast of x / scale[head]
        codes = host.data[page, kv, row] if layout == "NHD" else host.data[page, kv, :, row]
        want = (x.float() / scale.view(1, -1, 1)).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(codes, want), f"{int((codes != want).sum())} codes differ from torch's cast"
    assert_same_pool(pool, reference)


def test_fp8_per_head_decode_matches_the_reference():
    key, value, slots, *_, pool = vllm_per_head_case("HND", torch.float32)
    table = torch.tensor([[2, 0, 5], [1, 3, 4]])
    pool = pool.to("cpu")
    lens = torch.tensor([40, 33])
    for b, n in enumerate(lens.tolist()):
        s = table[b, torch.arange(n) // 16] * 16 + torch.arange(n) % 16
        gen = torch.Generator().manual_seed(b)
        quant_reference.append_paged_kv_quant(
            torch.randn(n, 8, 64, generator=gen), torch.randn(n, 8, 64, generator=gen), pool, s
        )
    q = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(4))
    want = quant_reference.paged_decode_attention_quant(q, pool, table, lens, precision="fp64")
    got = kernels.paged_decode_attention_quant_pool(q.to(DEV), pool.to(DEV), table.to(DEV), lens.to(DEV), num_splits=2)
    assert verify.compare.compare(got, want, *FP32_TOL).passed


def test_kernel_mutant_using_head_0s_scale_for_every_head_fails_the_vllm_check(tmp_path):
    bad = mutant(
        quant_write, "gscale_ptr + kv * num_kv_heads + heads,", "gscale_ptr + kv * num_kv_heads + heads * 0,", tmp_path
    )
    key, value, slots, k_scale, _, pool = vllm_per_head_case("NHD", torch.bfloat16)
    bad.append_paged_kv_quant(key.to(DEV), value.to(DEV), slot_mapping=slots.to(DEV), **pool.kernel_args())
    got = vllm_dequantize(pool.to("cpu").data[:, 0], k_scale, "NHD")[slots // 16, slots % 16]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, key.to(torch.float16), atol=0.001, rtol=0.1)


# ----------------------------------------------------------------------------- FP8 per token (vLLM)


def per_token_case():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(9, 3, 32, generator=gen)
    x[2] = 0.0  # a token of zeros: floor, never a zero scale
    x[4] *= 1e-9  # a token far below the floor: scaled by 1e-6, not by its amax / 448
    x[6, 1, :3] = torch.tensor([math.nan, math.inf, -7.0])  # non-finite values stay out of amax
    return x


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_per_token_mode_has_one_scale_per_token_across_heads_floored_at_1e_6(layout):
    x = per_token_case()
    pool = QuantizedKVPool(4, 4, 3, 32, "fp8", layout, DEV, scale_mode="token_all_heads").poison_()
    assert tuple(pool.scales.shape) == ((4, 2, 4, 1, 1) if layout == "NHD" else (4, 2, 1, 4, 1))
    slots = torch.tensor([3, 0, 7, 12, 9, 1, 5, 15, 2])
    want = pool.to("cpu")
    quant_reference.append_paged_kv_quant(x, -x, want, slots)
    kernels.append_paged_kv_quant_pool(x.to(DEV), (-x).to(DEV), pool, slots.to(DEV))
    assert_same_pool(pool, want)
    scales = want.scales[:, 0].reshape(4, 4) if layout == "NHD" else want.scales[:, 0].reshape(4, 4)
    per_token = scales.flatten()[slots]
    floor = torch.tensor(1e-6, dtype=torch.float32)
    amax = torch.where(x.isfinite(), x.abs(), 0.0).flatten(1).amax(1)
    assert torch.equal(per_token, torch.maximum(amax / 448.0, floor))
    assert per_token[2] == floor and per_token[4] == floor
    codes = want.data[slots // 4, 0, slots % 4] if layout == "NHD" else want.data[slots // 4, 0, :, slots % 4]
    torch_codes = (x / per_token[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    finite = x.isfinite()
    assert torch.equal(codes[finite], torch_codes[finite])


def test_fp8_per_token_mode_decode_matches_the_reference():
    gen = torch.Generator().manual_seed(13)
    pool = QuantizedKVPool(6, 4, 2, 32, "fp8", "HND", scale_mode="token_all_heads")
    table, lens = torch.tensor([[1, 4, 0], [5, 2, 3]]), torch.tensor([11, 9])
    for b, n in enumerate(lens.tolist()):
        s = table[b, torch.arange(n) // 4] * 4 + torch.arange(n) % 4
        quant_reference.append_paged_kv_quant(
            torch.randn(n, 2, 32, generator=gen), torch.randn(n, 2, 32, generator=gen), pool, s
        )
    q = torch.randn(2, 6, 32, generator=gen)
    want = quant_reference.paged_decode_attention_quant(q, pool, table, lens, precision="fp64")
    got = kernels.paged_decode_attention_quant_pool(q.to(DEV), pool.to(DEV), table.to(DEV), lens.to(DEV))
    assert verify.compare.compare(got, want, *FP32_TOL).passed


def test_kernel_mutant_without_the_1e_6_floor_fails_the_per_token_check(tmp_path):
    bad = mutant(
        quant_write,
        "tl.full([BLOCK_T], 448.0, tl.float32)), 1e-6)",
        "tl.full([BLOCK_T], 448.0, tl.float32)), 0.0)",
        tmp_path,
    )
    x = per_token_case()
    pool = QuantizedKVPool(4, 4, 3, 32, "fp8", "NHD", DEV, scale_mode="token_all_heads")
    want = pool.to("cpu")
    slots = torch.arange(9)
    quant_reference.append_paged_kv_quant(x, x, want, slots)
    bad.append_paged_kv_quant(x.to(DEV), x.to(DEV), slot_mapping=slots.to(DEV), **pool.kernel_args())
    with pytest.raises(AssertionError, match="bytes of (data|scales) differ"):
        assert_same_pool(pool, want)


# ----------------------------------------------------------------------------- arguments


def test_scales_in_the_wrong_convention_are_refused_by_name():
    cases = [
        (lambda: QuantizedKVPool(2, 4, 2, 32, "fp8", k_scale_encode=448.0, v_scale_encode=448.0), "k_scale_encode"),
        (lambda: QuantizedKVPool(2, 4, 2, 32, "nvfp4", scale_mode="block_encode"), "k_scale_encode"),
        (
            lambda: QuantizedKVPool(2, 4, 2, 32, "nvfp4", k_scale=1.0, k_scale_encode=2.0, v_scale_encode=2.0),
            "not both",
        ),
        (lambda: QuantizedKVPool(2, 4, 2, 32, "fp8", scale_mode="head", k_scale=[0.1, 0.2, 0.3]), "3 per-head"),
        (lambda: QuantizedKVPool(2, 4, 2, 32, "fp8", scale_mode="head", k_scale=[0.1, -0.2]), "k_scale\\[1\\]"),
        (lambda: QuantizedKVPool(2, 4, 2, 32, "nvfp4", k_scale_encode=0.0, v_scale_encode=1.0), "k_scale_encode=0.0"),
        (lambda: quant.nvfp4_quantize(torch.ones(2, 16), 1.0, global_scale_encode=2.0), "exactly one"),
        (lambda: quant.nvfp4_quantize(torch.ones(2, 16)), "exactly one"),
        (lambda: encode_pool().set_global_scales(1.0, 1.0), "set_encode_scales"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()


def test_a_per_head_pool_with_a_global_scale_of_the_wrong_shape_is_refused_before_launch():
    pool = QuantizedKVPool(2, 4, 2, 32, "fp8", "NHD", DEV, scale_mode="head", k_scale=[0.1, 0.2], v_scale=0.1)
    pool.global_scale = torch.ones(2, device=DEV)
    k = torch.randn(2, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="pool.global_scale must be a float32 tensor \\[2, 2\\]"):
        kernels.append_paged_kv_quant_pool(k, k, pool, torch.tensor([0, 1], device=DEV))
    assert pool.data.eq(0).all()

"""The FP8 (E4M3) and NVFP4 references of pagedkv_lib.quant: loop and vectorized forms
equal over every fp16 value and every fp32 class that rounding can get wrong, values
worked by hand, saturation, the NaN rule and the argument checks."""

import math

import pytest
import torch

from pagedkv_lab import faults
from pagedkv_lib import quant

ALL_FP16 = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)


def fp8_grid() -> torch.Tensor:
    """The non-negative finite E4M3 values, ascending (float64)."""
    values = quant.fp8_decode(torch.arange(128, dtype=torch.uint8)).double()
    return values[~values.isnan()]


def fp32_classes() -> torch.Tensor:
    """fp32 inputs that a rounding rule can get wrong: every midpoint between neighbouring
    E4M3 values (exact ties) and the fp32 values one ulp either side, both signs; the
    values around the saturation point; fp32 subnormals; +-0, +-inf and NaN of both signs."""
    grid = fp8_grid()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf))
    edges = torch.tensor([448.0, 456.0, 463.99997, 464.0, 464.00003, 480.0, 1e4, 3.4e38, 2**-9, 2**-10, 2**-11])
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-45, -1e-45, 1.1754942e-38, 2**-126])
    nans = torch.tensor([math.nan, -math.nan])
    body = torch.cat([mids, up, down, edges])
    return torch.cat([body, -body, specials, nans])


# ----------------------------------------------------------------------------- FP8


def test_fp8_encode_loop_and_vectorized_agree_on_every_fp16_value():
    assert torch.equal(quant.fp8_encode(ALL_FP16), quant.fp8_encode_loop(ALL_FP16))


def test_fp8_encode_loop_and_vectorized_agree_on_ties_subnormals_and_non_finite_fp32():
    x = fp32_classes()
    assert torch.equal(quant.fp8_encode(x), quant.fp8_encode_loop(x))


def test_fp8_decode_loop_and_vectorized_agree_on_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(quant.fp8_decode(codes).nan_to_num(7.5e7), quant.fp8_decode_loop(codes).nan_to_num(7.5e7))


def test_fp8_code_fields_by_hand():
    # 1.0 = 2**0: exponent field 0 + 7 = 7, mantissa 0 -> 0b0_0111_000 = 0x38.
    # 448 = 1.75 * 2**8: exponent 15, mantissa 6 -> 0x7E, the largest finite code.
    # 2**-9, the smallest subnormal, is mantissa 1 with exponent 0 -> 0x01.
    # -2.5 = -1.25 * 2**1: sign, exponent 8, mantissa 2 -> 0b1_1000_010 = 0xC2.
    x = torch.tensor([1.0, 448.0, 2**-9, -2.5, 0.0, -0.0])
    assert quant.fp8_encode(x).tolist() == [0x38, 0x7E, 0x01, 0xC2, 0x00, 0x80]


def test_fp8_ties_round_to_the_even_mantissa():
    # Between 1.0 (mantissa 0) and 1.125 (mantissa 1) the tie 1.0625 goes down to 1.0;
    # between 1.125 and 1.25 (mantissa 2) the tie 1.1875 goes up; subnormal ties too:
    # 1.5 * 2**-9 -> 2 * 2**-9, 0.5 * 2**-9 -> 0.
    x = torch.tensor([1.0625, 1.1875, 1.5 * 2**-9, 0.5 * 2**-9, 2.5 * 2**-9])
    assert quant.fp8_decode(quant.fp8_encode(x)).tolist() == [1.0, 1.25, 2 * 2**-9, 0.0, 2 * 2**-9]


def test_fp8_encode_saturates_at_448_instead_of_making_nan():
    # E4M3FN has no infinity. Older torch casts turn values past 464 into the NaN code;
    # the format's rule (PTX cvt.rn.satfinite) saturates, which fp8_encode implements by
    # clamping first, whatever the torch version does.
    x = torch.tensor([500.0, 1e30, math.inf, -464.0, -math.inf])
    assert quant.fp8_decode(quant.fp8_encode(x)).tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]


def test_fp8_nan_input_becomes_the_positive_nan_code_whatever_its_sign():
    assert quant.fp8_encode(torch.tensor([math.nan, -math.nan])).tolist() == [0x7F, 0x7F]


def test_fp8_quantize_divides_by_the_scale_and_dequantize_multiplies():
    x = torch.tensor([3.0, -0.75, 1000.0])
    codes = quant.fp8_quantize(x, 0.5)  # 6.0, -1.5, 2000 -> saturated 448
    assert codes.dtype == torch.float8_e4m3fn
    assert quant.fp8_dequantize(codes, 0.5).tolist() == [3.0, -0.75, 224.0]


def test_fp8_token_scales_use_the_finite_amax_of_each_row():
    x = torch.tensor([[[1.0, -896.0, math.inf], [0.0, 0.0, math.nan]]])
    assert quant.fp8_token_scales(x).flatten().tolist() == [2.0, 0.0]
    codes = quant.fp8_quantize(x, quant.fp8_token_scales(x))
    # Row 0: -896 / 2 = -448; +inf saturates. Row 1 (scale 0) is encoded as it is.
    assert quant.fp8_decode(codes)[0, 0].tolist() == [0.5, -448.0, 448.0]
    assert quant.fp8_decode(codes)[0, 1, :2].tolist() == [0.0, 0.0] and quant.fp8_decode(codes)[0, 1, 2].isnan()


def test_fp8_error_stays_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * torch.logspace(-4, 2, 4096)
    for scale in (quant.global_scale_for(x, "fp8") * f for f in (1.0, 3.7, 1e3)):
        err = (quant.fp8_dequantize(quant.fp8_quantize(x, scale), scale) - x).abs()
        assert (err <= quant.fp8_error_bound(x, scale)).all()


# ----------------------------------------------------------------------------- E2M1


def test_e2m1_loop_and_vectorized_agree_on_a_dense_sweep_and_every_tie():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    sweep = torch.linspace(-8, 8, 40001)
    y = torch.cat([sweep, ties, -ties, torch.nextafter(ties, torch.tensor(0.0)), torch.tensor([math.inf, math.nan])])
    assert torch.equal(quant.e2m1_encode(y), quant.e2m1_encode_loop(y))


def test_e2m1_grid_ties_to_even_and_saturation_by_hand():
    # Each tie goes to the neighbour with the even index (even mantissa):
    # 0.25 -> 0 (idx 0), 0.75 -> 1 (idx 2), 1.25 -> 1 (idx 2), 1.75 -> 2 (idx 4),
    # 2.5 -> 2 (idx 4), 3.5 -> 4 (idx 6), 5 -> 4 (idx 6); 7 saturates at 6 (idx 7).
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -1.5, -0.0, math.nan])
    assert quant.e2m1_encode(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 0b1011, 0b1000, 0]
    assert quant.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ]  # fmt: skip


def test_nibbles_pack_the_even_element_low():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert quant.pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    assert torch.equal(quant.unpack_nibbles(quant.pack_nibbles(codes)), codes)


# ----------------------------------------------------------------------------- NVFP4


def test_one_nvfp4_block_worked_by_hand():
    # amax 5 at global scale 1/8: sf = 5 / (6/8) = 6.6667 -> sf8 = 6.5 (E4M3 steps of
    # 0.5 in [4, 8)); the values are divided by 6.5 / 8 = 0.8125:
    # 5 -> 6.154 -> 6; 1 -> 1.231 -> 1; -2 -> -2.46 -> -2; 0.4 -> 0.49 -> 0.5;
    # 3 -> 3.69 -> 4; 0.3 -> 0.37 -> 0.5; the zeros stay 0.
    x = torch.tensor([5.0, 1.0, -2.0, 0.4, 3.0, 0.3] + [0.0] * 10)
    packed, scales = quant.nvfp4_quantize(x, 0.125)
    assert float(scales.float()) == 6.5
    codes = quant.unpack_nibbles(packed)
    assert quant.e2m1_decode(codes).tolist()[:6] == [6.0, 1.0, -2.0, 0.5, 4.0, 0.5]
    assert packed.tolist()[:3] == [0x2 << 4 | 0x7, 0x1 << 4 | 0xC, 0x1 << 4 | 0x6]
    assert quant.nvfp4_dequantize(packed, scales, 0.125).tolist()[:6] == [4.875, 0.8125, -1.625, 0.40625, 3.25, 0.40625]


def test_nvfp4_loop_and_vectorized_agree_with_zeros_nan_inf_and_tiny_blocks():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, generator=gen) * 4
    x[0, 0, 3], x[1, 1, 17], x[1, 2, 40] = math.nan, math.inf, -math.inf
    x[2, 0, :16] = 0.0
    x[3, 1, 16:32] *= 1e-6  # its block scale underflows E4M3
    for gs in (0.01, 1.0, 3e-5):
        p1, s1 = quant.nvfp4_quantize(x, gs)
        p2, s2 = quant.nvfp4_quantize_loop(x, gs)
        assert torch.equal(p1, p2) and torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))


def test_nvfp4_block_with_nan_reads_back_nan_and_inf_saturates():
    x = torch.ones(32)
    x[3] = math.nan
    x[20] = math.inf
    packed, scales = quant.nvfp4_quantize(x, 1.0)
    back = quant.nvfp4_dequantize(packed, scales, 1.0)
    assert back[:16].isnan().all()  # E2M1 has no NaN: the block scale carries it
    assert back[20] == 6 * float(scales[1].float()) and back[16:20].eq(back[21]).all()


def test_nvfp4_error_stays_within_one_block_unit():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    gs = quant.global_scale_for(x, "nvfp4")
    packed, scales = quant.nvfp4_quantize(x, gs)
    err = (quant.nvfp4_dequantize(packed, scales, gs) - x).abs()
    assert (err <= quant.nvfp4_error_bound(scales, gs)).all()


def test_calibrated_global_scale_maps_the_largest_block_to_scale_448():
    x = torch.tensor([0.5] * 15 + [-12.0] + [1.0] * 16)
    packed, scales = quant.nvfp4_quantize(x, quant.global_scale_for(x, "nvfp4"))
    assert scales.float().tolist()[0] == 448.0
    assert float(quant.nvfp4_dequantize(packed, scales, quant.global_scale_for(x, "nvfp4"))[15]) == pytest.approx(-12)


def test_unrounded_scale_fault_changes_codes_but_not_stored_scales():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen)
    gs = quant.global_scale_for(x, "nvfp4")
    good, s_good = quant.nvfp4_quantize(x, gs)
    bad, s_bad = faults.nvfp4_quantize_unrounded_scale(x, gs)
    assert torch.equal(s_good.view(torch.uint8), s_bad.view(torch.uint8))  # the reader cannot tell
    d_good, d_bad = quant.nvfp4_dequantize(good, s_good, gs), quant.nvfp4_dequantize(bad, s_bad, gs)
    assert (d_good != d_bad).float().mean() > 0.01  # measured: 5 % of the values change
    # The reader multiplies by the stored sf8, so the fault's values drift by sf8 / sf:
    # beyond the format's bound for some, never for the right writer.
    bound = quant.nvfp4_error_bound(s_good, gs)
    assert ((d_good - x).abs() <= bound).all() and ((d_bad - x).abs() > bound).any()


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan, 1e-50, 1e38, True, "1", torch.ones(2)], ids=repr)
def test_bad_global_scale_is_refused_by_name(scale):
    with pytest.raises(ValueError, match="global_scale"):
        quant.nvfp4_quantize(torch.ones(16), scale)
    if not isinstance(scale, torch.Tensor):  # a tensor of scales broadcasts for FP8 (per token)
        with pytest.raises(ValueError, match="scale"):
            quant.fp8_quantize(torch.ones(4), scale)


def test_fp8_tensor_scale_must_broadcast_against_x():
    with pytest.raises(ValueError, match=r"scale has shape \(3,\)"):
        quant.fp8_quantize(torch.ones(2, 4), torch.ones(3))


def test_nvfp4_head_dim_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        quant.nvfp4_quantize(torch.ones(2, 24), 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.nvfp4_quantize_loop(torch.ones(8), 1.0)


def test_global_scale_for_refuses_unknown_formats_and_handles_all_zero_input():
    with pytest.raises(ValueError, match="kv_dtype"):
        quant.global_scale_for(torch.ones(4), "int8")
    assert quant.global_scale_for(torch.zeros(4), "fp8") == 1.0
    assert quant.global_scale_for(torch.tensor([896.0, math.inf]), "fp8") == 2.0

"""The one RoPE of the write kernels (:mod:`pagedkv_kernels.device.rope`): shared by construction, exact.

* the three write families (MHA, quantized, MLA) rotate through
  :func:`pagedkv_kernels.device.rope.rope_rotate` and hold no rotation of their own;
* ``rope_rotate`` on its pairs (:func:`pagedkv_kernels.device.rope.rope_pair_features` for half tiles,
  :func:`pagedkv_kernels.device.rope.rope_feature_pair` for whole-head tiles, as the quantized write
  loads them) equals a float64 torch rotation rounded once to fp32, bit for bit, for
  GPT-NeoX and GPT-J pairs. Inputs, ``cos`` and ``sin`` carry 12-bit mantissas, so the
  fp32 products are exact and the fp32 result has one rounding, the reference's.
"""

import inspect
import re

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import runtime

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels.device.rope as rope
import pagedkv_kernels.mla_write as kmla
import pagedkv_kernels.quant_write as quant_write
import pagedkv_kernels.write as write
from pagedkv_kernels.device.rope import rope_feature_pair, rope_pair_features, rope_rotate

DEV = runtime.device()

# ``a * b - c * d`` or ``a * b + c * d``: the shape of a rotation written out.
_ROTATION = re.compile(r"\w+(\[[^\]]*\])?\s*\*\s*\w+(\[[^\]]*\])?\s*[-+]\s*\w+(\[[^\]]*\])?\s*\*\s*\w+")


def _jit_source(fn) -> str:
    return inspect.getsource(fn.fn)


@pytest.mark.parametrize(
    "fn",
    [rope.rope_tile, quant_write._load_rows, kmla._rope_rows],
    ids=["mha rope_tile", "quant _load_rows", "mla _rope_rows"],
)
def test_every_rope_caller_rotates_through_rope_rotate(fn):
    """Each caller keeps its load, rounding and store; the rotation is the shared one."""
    source = _jit_source(fn)
    assert "rope_rotate" in source, (
        f"{fn.fn.__name__} does not call pagedkv_kernels.device.rope.rope_rotate (or its halves)"
    )
    body = source.split('"""', 2)[-1]  # the code after the docstring
    own = [m.group(0) for m in _ROTATION.finditer(body)]
    assert not own, f"{fn.fn.__name__} writes its own rotation: {own}"


@pytest.mark.parametrize("module", [write, quant_write, kmla], ids=lambda m: m.__name__)
def test_no_write_module_holds_a_rotation_of_its_own(module):
    """Outside kernels/pagedkv_kernels/device/rope.py no write module writes ``x1 * cos - x2 * sin`` again."""
    code = [line.split("#")[0] for line in inspect.getsource(module).splitlines()]
    hits = [line.strip() for line in code if re.search(r"\*\s*(cos|sin|c|s|sn)\b\s*[-+]", line)]
    assert not hits, f"{module.__name__} rotates on its own: {hits}"


def _short(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to 12 significant bits (exactly representable in fp32)."""
    m, e = torch.frexp(t.double())
    return torch.ldexp(torch.round(m * 4096) / 4096, e).float()


@triton.jit
def _rotate_probe(
    x_ptr, cos_ptr, sin_ptr, half_out_ptr, whole_out_ptr, half, NEOX: tl.constexpr, BLOCK_P: tl.constexpr
):
    """One head of ``2 * half`` features, rotated twice: as half tiles (the MHA and MLA
    writes) into ``half_out``, and as a whole-head tile in feature order (the quantized
    write) into ``whole_out``. ``cos``/``sin [half]`` are given per pair."""
    pair = tl.arange(0, BLOCK_P)
    pmask = pair < half
    f1, f2 = rope_pair_features(pair, half, NEOX)
    c = tl.load(cos_ptr + pair, mask=pmask, other=0.0)
    s = tl.load(sin_ptr + pair, mask=pmask, other=0.0)
    r1, r2 = rope_rotate(tl.load(x_ptr + f1, mask=pmask), tl.load(x_ptr + f2, mask=pmask), c, s)
    tl.store(half_out_ptr + f1, r1, mask=pmask)
    tl.store(half_out_ptr + f2, r2, mask=pmask)
    feat = tl.arange(0, 2 * BLOCK_P)
    fmask = feat < 2 * half
    p, first = rope_feature_pair(feat, half, NEOX)
    g1, g2 = rope_pair_features(p, half, NEOX)
    c = tl.load(cos_ptr + p, mask=fmask, other=0.0)
    s = tl.load(sin_ptr + p, mask=fmask, other=0.0)
    w1, w2 = rope_rotate(tl.load(x_ptr + g1, mask=fmask), tl.load(x_ptr + g2, mask=fmask), c, s)
    tl.store(whole_out_ptr + feat, tl.where(first, w1, w2), mask=fmask)


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """float64 rotation of ``x [2 * half]`` rounded once to fp32."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.numel() // 2
    x1, x2 = (x[:half], x[half:]) if neox else (x[0::2], x[1::2])
    out = torch.empty_like(x)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if neox:
        out[:half], out[half:] = r1, r2
    else:
        out[0::2], out[1::2] = r1, r2
    return out.float()


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_rope_rotate_equals_float64_rotation_rounded_once(style, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    half = head_dim // 2
    x = _short(torch.randn(head_dim, generator=gen) * 4)
    angle = torch.rand(half, generator=gen, dtype=torch.float64) * 6.2 - 3.1
    cos, sin = _short(torch.cos(angle)), _short(torch.sin(angle))
    want = _reference(x, cos, sin, style == "neox")
    got_half = torch.full((head_dim,), float("nan"), device=DEV)
    got_whole = torch.full((head_dim,), float("nan"), device=DEV)
    block_p = triton.next_power_of_2(half)
    _rotate_probe[(1,)](x.to(DEV), cos.to(DEV), sin.to(DEV), got_half, got_whole, half, style == "neox", block_p)
    for name, got in (("half tiles", got_half), ("whole-head tile", got_whole)):
        diff = got.cpu().view(torch.int32) != want.view(torch.int32)
        assert not diff.any(), f"{style} {name}: features {torch.nonzero(diff).flatten().tolist()} differ"

"""The quantized Triton kernels (pagedkv_kernels.device.quant_codes / quant_write / quant_decode) against
the references of pagedkv_lib.quant and pagedkv_lib.quant_reference.

Codes and scales must be equal bit for bit (a quantization is a deterministic sequence
of IEEE operations); decode outputs within the fp32 pass rule of the harness against
the float64 reference over the dequantized pool (the dequantized values are exact, so
only accumulation order differs). Runs in Triton's interpreter on CPU and compiled on
CUDA.
"""

import importlib.util
import math
import sys

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import RingWindow, formats, quant, quant_reference, runtime
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels as kernels
from pagedkv_kernels import quant_write
from pagedkv_kernels.device import quant_codes
from pagedkv_kernels.write import append_paged_kv

# The special inputs (inf, NaN) make numpy warn inside the interpreter (inf * 0); intended.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEV = runtime.device()
FORMATS = {"fp8": ("fp8", "tensor"), "fp8_token": ("fp8", "token"), "nvfp4": ("nvfp4", "block")}
FP32_TOL = verify.TOLERANCES[torch.float32]


def make_pool(fmt, num_pages, page_size, heads, head_dim, layout="NHD", k_scale=0.01, v_scale=0.02):
    kv_dtype, mode = FORMATS[fmt]
    return QuantizedKVPool(
        num_pages, page_size, heads, head_dim, kv_dtype, layout, DEV, scale_mode=mode, k_scale=k_scale, v_scale=v_scale
    )


def assert_same_pool(got: QuantizedKVPool, want: QuantizedKVPool) -> None:
    for name in ("data", "scales"):
        a, b = getattr(got, name), getattr(want, name)
        if a is None:
            assert b is None
            continue
        a, b = a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
        diff = a != b
        assert not diff.any(), f"{int(diff.sum())} bytes of {name} differ, first at {torch.nonzero(diff)[0].tolist()}"


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """Zeros, NaN, +-inf, a value past the formats' range and a subnormal in token 0-2."""
    x = x.clone()
    x[0] = 0.0
    x[1, 0, :6] = torch.tensor([math.nan, math.inf, -math.inf, -3e4, 1e-7, -0.0], dtype=torch.float64).to(x.dtype)
    return x


# ----------------------------------------------------------------------------- codecs


@triton.jit
def _codec_kernel(x_ptr, fp8_ptr, e2m1_ptr, fp8_value_ptr, e2m1_value_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(fp8_ptr + i, quant_codes.fp8_encode(x).to(tl.uint8), mask=m)
    tl.store(e2m1_ptr + i, quant_codes.e2m1_encode(x).to(tl.uint8), mask=m)
    tl.store(fp8_value_ptr + i, quant_codes.fp8_decode(i & 255), mask=m)
    tl.store(e2m1_value_ptr + i, quant_codes.e2m1_decode(i & 15), mask=m)


def run_codecs(x: torch.Tensor):
    x = x.to(torch.float32).to(DEV)
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.uint8, device=DEV) for _ in range(2)]
    outs += [torch.empty(n, dtype=torch.float32, device=DEV) for _ in range(2)]
    _codec_kernel[(triton.cdiv(n, 1 << 16),)](x, *outs, n, BLOCK=1 << 16)
    return [o.cpu() for o in outs]


def test_device_codecs_equal_the_reference_on_every_fp16_value_and_every_fp32_class():
    from test_quant import ALL_FP16, fp32_classes

    x = torch.cat([ALL_FP16.float(), fp32_classes(), torch.linspace(-8, 8, 4097)])
    fp8, e2m1, fp8_value, e2m1_value = run_codecs(x)
    assert torch.equal(fp8, quant.fp8_encode(x)), "fp8_encode differs from pagedkv_lib.quant"
    assert torch.equal(e2m1, quant.e2m1_encode(x)), "e2m1_encode differs from pagedkv_lib.quant"
    codes = torch.arange(x.numel())
    want = quant.fp8_decode((codes & 255).to(torch.uint8))
    assert torch.equal(fp8_value.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert fp8_value[want.isnan()].isnan().all()
    assert torch.equal(e2m1_value.view(torch.int32), quant.e2m1_decode((codes & 15).to(torch.uint8)).view(torch.int32))


# ----------------------------------------------------------------------------- append


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_codes_and_scales_equal_the_reference_bit_for_bit(fmt, head_dim, page_size, layout):
    gen = torch.Generator().manual_seed(page_size * head_dim)
    dtype = (torch.float16, torch.bfloat16, torch.float32)[(page_size + head_dim // 64) % 3]
    n, heads = 23, 2
    k = with_specials(torch.randn(n, heads, head_dim, generator=gen).to(dtype))
    v = with_specials(torch.randn(heads, n, head_dim, generator=gen).to(dtype)).transpose(0, 1)  # strided
    pool = make_pool(fmt, -(-n // page_size) + 2, page_size, heads, head_dim, layout)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=gen).to(torch.uint8))
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    slots[[3, 9]] = -1
    want = pool.to("cpu")
    quant_reference.append_paged_kv_quant(k, v, want, slots)
    kernels.append_paged_kv_quant_pool(k.to(DEV), v.to(DEV), pool, slots.to(DEV))
    assert_same_pool(pool, want)


def test_csr_append_through_a_ring_window_with_v_tails_equals_the_reference():
    gen = torch.Generator().manual_seed(5)
    window = RingWindow(12, 2, 4)
    for fmt in FORMATS:
        pool = make_pool(fmt, 8, 4, 2, 32).poison_()
        want = pool.to("cpu")
        # request 0 holds positions 0..19 through a 4-page ring, request 1 its first 5
        batch = torch.tensor([0] * 6 + [1] * 5)
        pos = torch.tensor([14, 15, 16, 17, 18, 19, 0, 1, 2, 3, 4])
        indices, indptr = torch.tensor([6, 1, 3, 0, 2, 5]), torch.tensor([0, 4, 6])
        last = torch.tensor([4, 1])
        k, v = torch.randn(11, 2, 32, generator=gen), torch.randn(11, 2, 32, generator=gen)
        args = (batch, pos, indices, indptr)
        quant_reference.append_paged_kv_quant_csr(k, v, want, *args, window=window)
        quant_reference.zero_paged_v_tail_quant(want, indptr, indices, last)
        kernels.append_paged_kv_quant_csr_pool(k.to(DEV), v.to(DEV), pool, *(t.to(DEV) for t in args), window=window)
        kernels.zero_paged_v_tail_quant_pool(pool, indptr.to(DEV), indices.to(DEV), last.to(DEV))
        assert_same_pool(pool, want)
        assert pool.to("cpu").rows(5, 1)[1:].eq(0).all()  # request 1's V tail reads 0, not NaN


@pytest.mark.parametrize("fmt, rope", [("nvfp4", "neox"), ("fp8_token", "gptj"), ("fp8", "neox")])
def test_rope_then_quantize_equals_quantizing_the_rotation_the_write_kernel_stores(fmt, rope):
    gen = torch.Generator().manual_seed(6)
    n, heads, d = 9, 2, 64
    k, v = torch.randn(n, heads, d, generator=gen).half(), torch.randn(n, heads, d, generator=gen).half()
    q = torch.randn(n, 4, d, generator=gen).half()
    pos = torch.randint(0, 40000, (n,), generator=gen)
    slots = torch.randperm(12, generator=gen)[:n]
    slots[4] = -1
    # The rotation pagedkv_kernels.write stores, in fp32 (its math is fp32; an fp32 pool keeps it).
    rotated = torch.zeros(3, 2, 4, heads, d, device=DEV)
    q_write = q.to(DEV).clone()
    append_paged_kv(
        k.float().to(DEV), v.float().to(DEV), rotated, slots.to(DEV), rope=rope, positions=pos.to(DEV), q=q_write
    )
    pool = make_pool(fmt, 3, 4, heads, d)
    q_quant = q.to(DEV).clone()
    kernels.append_paged_kv_quant_pool(
        k.to(DEV), v.to(DEV), pool, slots.to(DEV), rope=rope, positions=pos.to(DEV), q=q_quant
    )
    keep = slots >= 0
    page, row = slots[keep] // 4, slots[keep] % 4
    want = pool.to("cpu")
    quant_reference.write_rows(want, 0, page, row, rotated.cpu()[page, 0, row])
    quant_reference.write_rows(want, 1, page, row, v[keep].float())
    assert_same_pool(pool, want)
    assert torch.equal(q_quant, q_write)  # Q is rotated exactly as pagedkv_kernels.write rotates it
    # Against the reference, which rotates in float64: an fp32 ulp of rotation can move a
    # value across a rounding boundary, so a few codes may differ (none did here), by
    # one step at most.
    ref = pool.to("cpu")
    quant_reference.append_paged_kv_quant(k, v, ref, slots, rope=rope, positions=pos)
    differ = (pool.to("cpu").data != ref.data).float().mean()
    assert differ < 0.01, f"{differ:.2%} of the RoPE'd codes differ from the float64 rotation's"


def test_csr_entry_point_stores_the_same_rope_codes_as_the_slot_entry_point():
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(7, 2, 64, generator=gen).bfloat16(), torch.randn(7, 2, 64, generator=gen).bfloat16()
    batch, pos = torch.tensor([0, 0, 1, -1, 1, 0, 1]), torch.tensor([300, 301, 5, 0, 6, 302, 7])
    indices, indptr = torch.tensor([2, 5, 0, 1, 3, 4]), torch.tensor([0, 3, 6])  # 3 ring pages of 4 rows each
    window = RingWindow(9, 1, 4)  # request 0 has wrapped its ring many times
    slots = formats.csr_slot_mapping(batch, pos, indices, indptr, 4, window, 6)
    by_slot, by_csr = make_pool("nvfp4", 6, 4, 2, 64), make_pool("nvfp4", 6, 4, 2, 64)
    kernels.append_paged_kv_quant_pool(
        k.to(DEV), v.to(DEV), by_slot, slots.to(DEV), rope="gptj", positions=pos.clamp(min=0).to(DEV)
    )
    args = (t.to(DEV) for t in (batch, pos, indices, indptr))
    kernels.append_paged_kv_quant_csr_pool(k.to(DEV), v.to(DEV), by_csr, *args, window=window, rope="gptj")
    assert_same_pool(by_csr, by_slot)
    assert by_csr.data.count_nonzero() > 0


def test_append_with_zero_v_tail_in_a_poisoned_pool_leaves_no_nan_to_read():
    gen = torch.Generator().manual_seed(7)
    for fmt in FORMATS:
        pool = make_pool(fmt, 5, 4, 1, 32, "HND").poison_()
        table = torch.tensor([[3, 0], [1, 4]])
        lens = torch.tensor([6, 7])
        batch = torch.repeat_interleave(torch.arange(2), lens)
        pos = torch.cat([torch.arange(n) for n in lens])
        slots = formats.slot_mapping(table, batch, pos, 4)
        csr = formats.block_table_to_csr(table, lens, 4)
        k, v = torch.randn(13, 1, 32, generator=gen), torch.randn(13, 1, 32, generator=gen)
        want = pool.to("cpu")
        quant_reference.append_paged_kv_quant(k, v, want, slots, zero_v_tail=csr)
        kernels.append_paged_kv_quant_pool(
            k.to(DEV), v.to(DEV), pool, slots.to(DEV), zero_v_tail=tuple(t.to(DEV) for t in csr)
        )
        assert_same_pool(pool, want)
        values = pool.to("cpu").dequantize()
        assert not values[[0, 4], 1, 0, 2:].isnan().any() and values[0, 1, 0, 2:].eq(0).all()


def test_bad_arguments_raise_naming_them_before_anything_is_written():
    pool = make_pool("nvfp4", 2, 4, 1, 32)
    k = torch.randn(2, 1, 32, device=DEV)
    cases = [
        ((k, k, pool, torch.tensor([0, 8], device=DEV)), "slot_mapping\\[1\\] = 8"),
        ((k, k, pool, torch.tensor([3, 3], device=DEV)), "more than once"),
        ((k.double(), k.double(), pool, torch.tensor([0, 1], device=DEV)), "k.dtype"),
        ((k[:, :, :16], k[:, :, :16], pool, torch.tensor([0, 1], device=DEV)), "head_dim 32"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.append_paged_kv_quant_pool(*args)
        assert pool.data.eq(0).all() and pool.scales.eq(0).all()
    with pytest.raises(ValueError, match="rope"):
        kernels.append_paged_kv_quant_pool(k, k, pool, torch.tensor([0, 1], device=DEV), rope="xpos", positions=None)
    view = make_pool("nvfp4", 2, 4, 1, 32)
    view.scales = view.data[..., :2]  # codes and scales in the same bytes
    with pytest.raises(ValueError, match="overlaps"):
        kernels.append_paged_kv_quant_pool(k, k, view, torch.tensor([0, 1], device=DEV))


def test_a_global_scale_inside_the_scale_pool_is_refused_before_anything_is_written():
    """An NVFP4 append writes pool.scales while its programs read the global scale: a
    global scale that is a view of the scale pool would be overwritten mid-launch."""
    pool = make_pool("nvfp4", 2, 4, 1, 32)
    alias = pool.scales.view(-1)[:8].view(torch.float32)
    alias.fill_(1.0)  # a valid K and V scale, as check_quant_pool requires
    pool.global_scale = alias[:2]
    before = pool.scales.clone()
    k = torch.randn(2, 1, 32, device=DEV)
    with pytest.raises(ValueError, match="pool.global_scale overlaps the memory of pool.scales"):
        kernels.append_paged_kv_quant_pool(k, k, pool, torch.tensor([0, 1], device=DEV))
    assert torch.equal(pool.scales, before) and pool.data.eq(0).all()


def test_an_index_tensor_inside_the_pool_is_refused_before_anything_is_written():
    pool = make_pool("fp8", 2, 4, 1, 32)
    slots = pool.data.view(-1)[:16].view(torch.int64)
    slots.copy_(torch.tensor([0, 1]))  # valid slots, stored in the codes the append writes
    before = pool.data.clone()
    k = torch.randn(2, 1, 32, device=DEV)
    with pytest.raises(ValueError, match="slot_mapping overlaps the memory of pool.data"):
        kernels.append_paged_kv_quant_pool(k, k, pool, slots)
    assert torch.equal(pool.data, before)


def test_a_plan_runs_again_only_on_a_pool_of_the_same_format_and_shape():
    pool = make_pool("fp8_token", 2, 4, 1, 32)
    k = torch.randn(3, 1, 32, device=DEV)
    args = pool.kernel_args()
    plan = kernels.plan_append_quant(k, k, slot_mapping=torch.tensor([0, 5, 2], device=DEV), **args)
    other = make_pool("fp8_token", 2, 4, 1, 32)
    kernels.run_append_quant(plan, k, k, other.data, other.scales, other.global_scale)
    assert other.scales.count_nonzero() == 2 * 3  # K and V scale of 3 rows
    fp8 = make_pool("fp8", 2, 4, 1, 32)
    with pytest.raises(ValueError, match="plan was made for"):
        kernels.run_append_quant(plan, k, k, fp8.data, fp8.scales, fp8.global_scale)


# ----------------------------------------------------------------------------- decode


def written_pool(fmt, layout, lens, page_size, heads, d, gen, window=None):
    """A poisoned pool holding ``lens`` sequences on scattered pages, and its page table."""
    pages_each = [int(window.num_blocks(n)) if window else -(-n // page_size) for n in lens]
    rows = formats.scatter_pages(pages_each, sum(pages_each) + 2, gen)
    table = formats.pad_block_tables(rows, max(pages_each) + 1)
    pool = make_pool(fmt, sum(pages_each) + 2, page_size, heads, d, layout, 0.004, 0.003).to("cpu").poison_()
    for b, n in enumerate(lens):
        slots = formats.slot_mapping(table, torch.full((n,), b), torch.arange(n), page_size, window)
        if window is not None:  # only the newest token of each ring row survives
            last = {s: i for i, s in enumerate(slots.tolist())}
            slots = torch.where(torch.isin(torch.arange(n), torch.tensor(list(last.values()))), slots, -1)
        k, v = torch.randn(n, heads, d, generator=gen), torch.randn(n, heads, d, generator=gen)
        quant_reference.append_paged_kv_quant(k, v, pool, slots)
    return pool, table


@pytest.mark.parametrize(
    "fmt, layout, page_size, group, d, lens, splits, dtype",
    [
        ("fp8", "NHD", 16, 4, 128, [0, 1, 37], None, torch.float32),
        ("fp8_token", "HND", 5, 1, 64, [16, 70, 5], 3, torch.float16),
        ("nvfp4", "NHD", 1, 5, 64, [33, 32], 2, torch.bfloat16),
        ("nvfp4", "HND", 16, 2, 64, [150, 129], 4, torch.float32),  # 2 tiles of 128 keys
    ],
)
def test_decode_matches_the_reference_over_the_dequantized_pool(fmt, layout, page_size, group, d, lens, splits, dtype):
    gen = torch.Generator().manual_seed(len(lens) * d)
    pool, table = written_pool(fmt, layout, lens, page_size, 2, d, gen)
    q = torch.randn(len(lens), 2 * group, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens)
    want = quant_reference.paged_decode_attention_quant(q, pool, table, seq_lens, precision="fp64")
    dev_pool = pool.to(DEV)
    got = kernels.paged_decode_attention_quant_pool(
        q.to(DEV), dev_pool, table.to(DEV), seq_lens.to(DEV), num_splits=splits
    )
    result = verify.compare.compare(got, want, *verify.TOLERANCES[dtype])
    assert result.passed, result
    assert_same_pool(dev_pool, pool)  # a decode only reads
    csr = formats.block_table_to_csr(table, seq_lens, page_size)
    got_csr = kernels.paged_decode_attention_quant_csr_pool(
        q.to(DEV), dev_pool, *(t.to(DEV) for t in csr), num_splits=splits
    )
    assert verify.compare.compare(got_csr, want, *verify.TOLERANCES[dtype]).passed


def test_decode_through_a_wrapped_ring_window_matches_the_reference():
    gen = torch.Generator().manual_seed(8)
    window = RingWindow(20, 3, 4)
    pool, table = written_pool("nvfp4", "HND", [75, 9], 4, 1, 32, gen, window)
    q = torch.randn(2, 2, 32, generator=gen)
    lens = torch.tensor([75, 9])
    want = quant_reference.paged_decode_attention_quant(q, pool, table, lens, window=window, precision="fp64")
    got = kernels.paged_decode_attention_quant_pool(q.to(DEV), pool.to(DEV), table.to(DEV), lens.to(DEV), window=window)
    assert verify.compare.compare(got, want, *FP32_TOL).passed


def test_decode_refuses_a_bad_table_and_a_float64_query_by_name():
    pool = make_pool("fp8", 2, 4, 1, 32)
    q = torch.randn(1, 1, 32, device=DEV)
    with pytest.raises(ValueError, match="block_tables\\[0, 0\\]=7"):
        kernels.paged_decode_attention_quant_pool(
            q, pool, torch.tensor([[7]], device=DEV), torch.tensor([2], device=DEV)
        )
    with pytest.raises(ValueError, match="q.dtype"):
        kernels.paged_decode_attention_quant_pool(
            q.double(), pool, torch.tensor([[0]], device=DEV), torch.tensor([2], device=DEV)
        )


# ----------------------------------------------------------------------------- mutants


def mutant(module, old: str, new: str, tmp_path):
    """``module`` with one line of its source replaced, imported from a file (Triton reads
    a kernel's source): a kernel with a bug put in on purpose."""
    source = open(module.__file__).read()
    assert source.count(old) == 1, f"the mutation site {old!r} moved"
    path = tmp_path / f"mutant_{module.__name__.rsplit('.', 1)[-1]}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"{module.__name__.rpartition('.')[0]}.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def on_pool(module):
    """A mutated ``pagedkv_kernels.quant_write``'s append with the harness's signature, on a pool
    object (as ``kernels.append_paged_kv_quant_pool`` does for the real one)."""

    def append(k, v, pool, slot_mapping, **options):
        return module.append_paged_kv_quant(k, v, slot_mapping=slot_mapping, **pool.kernel_args(), **options)

    return append


def test_kernel_mutant_quantizing_with_the_unrounded_block_scale_fails_quant_append(tmp_path):
    bad = mutant(quant_write, "den = fp8_decode(sf8) * gs", "den = tl.math.div_rn(amax, gs * 6.0) * gs", tmp_path)
    case = {"format": "nvfp4", "layout": "HND", "dtype": "bf16", "head_dim": 64, "page_size": 5, "num_tokens": 45,
            "num_kv_heads": 1, "padding": 3, "specials": False, "noncontiguous": False}  # fmt: skip
    assert verify.quant_append_case(kernels.append_paged_kv_quant_pool, case).passed
    result = verify.quant_append_case(on_pool(bad), case)
    assert not result.passed and "codes differ" in result.detail


def test_kernel_mutant_sharing_one_global_scale_fails_quant_scales(tmp_path):
    # (The unmutated kernel passes this check in test_quant_verify.)
    bad = mutant(quant_write, "gs = tl.load(gscale_ptr + kv)", "gs = tl.load(gscale_ptr + 1)", tmp_path)
    result = verify.check_quant_scales(on_pool(bad), kernels.paged_decode_attention_quant_pool, set())
    assert not result.passed and "nvfp4 K" in result.detail

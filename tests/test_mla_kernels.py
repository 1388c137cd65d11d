"""The MLA Triton kernels (pagedkv_kernels.mla_write, pagedkv_kernels.mla_decode) against the float64 references.

Runs in Triton's interpreter on CPU and compiled on CUDA (``runtime.device()``). The
grids are the conformance harness's MLA grids (:mod:`pagedkv_lab.verify.mla_checks`),
so CI and ``python -m pagedkv_kernels.tools.verify`` judge the same cases:

* append: latent rows bit-exact (raw bits, NaN payloads included), every other byte of
  the pool unchanged; RoPE keys within the dtype's tolerance of the float64 rotation;
* decode: the absorbed kernel against the *naive* float64 reference (every ``c_kv``
  projected up), by the harness's pass rule ``|err| <= atol + rtol |ref|`` with
  ``TOLERANCES`` (fp32 1e-5 + 1e-6 rel; fp16 1e-2 + 2**-11 rel; bf16 1e-2 + 2**-8 rel),
  in NaN-poisoned pools, with the pool and inputs required unchanged.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lib import formats, mla, runtime

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels as kernels
from pagedkv_kernels.device.rounding import round_to
from pagedkv_kernels.host.validate import MAX_HEAD_DIM, MAX_KV_LORA_RANK

DEV = runtime.device()
DECODE_ARGS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "w_uk", "w_uv")


def _id(case: dict) -> str:
    return "-".join(str(v).replace(" ", "") for k, v in case.items() if k != "seed")


def decode_args(case: dict, device=DEV):
    t = verify.mla_decode_inputs(case)
    return [t[a].to(device) for a in DECODE_ARGS]


SMALL = {"dtype": "fp32", "page_size": 16, "num_heads": 4, "dims": (64, 16, 32, 32), "seq_lens": [300, 0, 1, 129]}


# ----------------------------------------------------------------------------- append


@pytest.mark.parametrize("case", verify.mla_append_grid(), ids=_id)
def test_append_grid_is_bit_exact_against_the_reference(case):
    result = verify.mla_append_case(kernels.append_paged_mla_kv, case)
    assert result.passed, result.detail


@pytest.mark.parametrize("rope", [None, "gptj"])
def test_csr_append_equals_the_slot_append_bit_for_bit(rope):
    gen = torch.Generator().manual_seed(0)
    lens, ps = [5, 0, 19], 4
    rows = formats.scatter_pages([-(-n // ps) for n in lens], 9, gen)
    table = formats.pad_block_tables(rows)
    indptr, indices, _ = formats.block_table_to_csr(table, torch.tensor(lens), ps)
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    batch[3], pos[3] = -1, -1  # a padding token
    slots = formats.csr_slot_mapping(batch, pos, indices, indptr, ps)
    ckv, kpe = torch.randn(24, 80, generator=gen).to(DEV), torch.randn(24, 8, generator=gen).to(DEV)
    pools = [(torch.full((9, ps, 80), float("nan"), device=DEV), torch.full((9, ps, 8), float("nan"), device=DEV))]
    pools.append(tuple(c.clone() for c in pools[0]))
    kernels.append_paged_mla_kv_csr(ckv, kpe, *pools[0], *(x.to(DEV) for x in (batch, pos, indices, indptr)), rope=rope)
    kernels.append_paged_mla_kv(ckv, kpe, *pools[1], slots.to(DEV), rope=rope, positions=pos.to(DEV))
    for a, b in zip(*pools):
        assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))
    assert int(pools[0][0].isnan().any(-1).sum()) == 9 * ps - 23  # exactly the 23 real tokens were written


def test_plan_append_runs_again_on_other_tensors_of_the_planned_shapes():
    ckv_cache, kpe_cache = torch.zeros(3, 4, 16, device=DEV), torch.zeros(3, 4, 8, device=DEV)
    slots = torch.tensor([5, -1, 0], device=DEV)
    plan = kernels.plan_append_mla(torch.zeros(3, 16, device=DEV), torch.zeros(3, 8, device=DEV), ckv_cache,
                                   kpe_cache, slots)  # fmt: skip
    for step in (1.0, 2.0):
        kernels.run_append_mla(plan, torch.full((3, 16), step, device=DEV), torch.full((3, 8), -step, device=DEV),
                               ckv_cache, kpe_cache)  # fmt: skip
        assert ckv_cache[1, 1].eq(step).all() and kpe_cache[0, 0].eq(-step).all() and ckv_cache.sum() == 2 * 16 * step
    with pytest.raises(ValueError, match=r"ckv must be torch.float32 of shape \(3, 16\) as planned"):
        kernels.run_append_mla(plan, torch.zeros(2, 16, device=DEV), torch.zeros(3, 8, device=DEV), ckv_cache,
                               kpe_cache)  # fmt: skip
    with pytest.raises(ValueError, match=r"kpe_cache has shape .* the plan was made for"):
        kernels.run_append_mla(plan, torch.zeros(3, 16, device=DEV), torch.zeros(3, 8, device=DEV), ckv_cache,
                               kpe_cache[:, :, :4])  # fmt: skip


def test_two_slices_of_one_buffer_are_accepted_and_overlapping_ones_refused():
    """vLLM keeps ``[pages, page_size, rank + rope]``; its two column slices are a valid
    pool. Slices that share a column, or whose rows spill into the next row, are not."""
    buf = torch.zeros(3, 4, 24, device=DEV)
    ckv, kpe, slots = torch.ones(2, 16, device=DEV), 2 * torch.ones(2, 8, device=DEV), torch.tensor([0, 11], device=DEV)
    kernels.append_paged_mla_kv(ckv, kpe, buf[..., :16], buf[..., 16:], slots)
    assert buf[0, 0].tolist() == [1.0] * 16 + [2.0] * 8 and buf[2, 3].sum() == 32 and buf.sum() == 64
    kernels.append_paged_mla_kv(ckv, kpe, buf[..., 8:], buf[..., :8], slots)  # RoPE part first: also fine
    with pytest.raises(ValueError, match="kpe_cache overlaps the memory of ckv_cache"):
        kernels.append_paged_mla_kv(ckv, kpe, buf[..., :16], buf[..., 15:23], slots)
    flat = torch.zeros(3 * 80 + 8, device=DEV)  # rows 20 apart, but 16 + 8 = 24 wide
    ckv_cache, kpe_cache = flat.as_strided((3, 4, 16), (80, 20, 1)), flat.as_strided((3, 4, 8), (80, 20, 1), 16)
    with pytest.raises(ValueError, match="kpe_cache overlaps the memory of ckv_cache"):
        kernels.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slots)
    assert not flat.any()


def _bad_appends():
    """(id, call(fn, ckv, kpe, ckv_cache, kpe_cache, slots), message): the kernel and the
    reference must refuse each with the same message (one home for the rules)."""
    return [
        ("width", lambda f, c, p, cc, pc, s: f(c[:, :15], p, cc, pc, s), r"ckv has width 15 but the pool's kv_lora"),
        ("dtype", lambda f, c, p, cc, pc, s: f(c, p.half(), cc, pc, s), r"kpe\.dtype=torch\.float16 differs"),
        ("slot", lambda f, c, p, cc, pc, s: f(c, p, cc, pc, s + 10), r"slot_mapping\[1\] = 12 is outside the pool"),
        ("twice", lambda f, c, p, cc, pc, s: f(c, p, cc, pc, s * 0), r"writes slot 0 more than once"),
        ("pages", lambda f, c, p, cc, pc, s: f(c, p, cc[:2], pc, s), r"same pages"),
        ("rope", lambda f, c, p, cc, pc, s: f(c, p, cc, pc, s, rope="gptj"), r"rope needs positions"),
        ("position", lambda f, c, p, cc, pc, s: f(c, p, cc, pc, s, rope="gptj", positions=s - 5),
         r"positions\[0\]=-4 must be >= 0"),
    ]  # fmt: skip


@pytest.mark.parametrize("name,call,message", _bad_appends(), ids=[b[0] for b in _bad_appends()])
def test_kernel_and_reference_refuse_bad_appends_alike_and_write_nothing(name, call, message):
    ckv, kpe, slots = torch.ones(2, 16, device=DEV), torch.ones(2, 8, device=DEV), torch.tensor([1, 2], device=DEV)
    for fn in (kernels.append_paged_mla_kv, mla.append_paged_mla_kv):
        cc, pc = torch.full((3, 4, 16), 7.0, device=DEV), torch.full((3, 4, 8), 7.0, device=DEV)
        with pytest.raises(ValueError, match=message):
            call(fn, ckv, kpe, cc, pc, slots)
        assert cc.eq(7).all() and pc.eq(7).all(), fn.__module__


def test_kernel_launch_checks_refuse_what_only_a_launch_cannot_take():
    cc, pc, slots = torch.zeros(3, 4, 16, device=DEV), torch.zeros(3, 4, 8, device=DEV), torch.tensor([1], device=DEV)
    ckv, kpe = torch.ones(1, 16, device=DEV), torch.ones(1, 8, device=DEV)
    with pytest.raises(ValueError, match=r"ckv_cache\.dtype=torch\.float64; the kernels take"):
        kernels.append_paged_mla_kv(ckv.double(), kpe.double(), cc.double(), pc.double(), slots)
    with pytest.raises(ValueError, match="ckv_cache .* reaches some elements twice"):
        kernels.append_paged_mla_kv(ckv, kpe, cc[:, :1].expand(3, 4, 16), pc, slots)
    with pytest.raises(ValueError, match="ckv_cache overlaps the memory of ckv"):
        kernels.append_paged_mla_kv(cc[0, :1], kpe, cc, pc, slots)
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        kernels.append_paged_mla_kv(ckv, kpe, cc, pc, slots.to(torch.int16))


def test_a_slot_mapping_inside_a_latent_cache_is_refused_before_anything_is_written():
    cc, pc = torch.zeros(3, 4, 16, device=DEV), torch.zeros(3, 4, 8, device=DEV)
    inside = pc.view(-1)[:1].view(torch.int32)  # slot 1, stored in the bytes of kpe_cache the append writes
    inside.fill_(1)
    before = pc.clone()
    with pytest.raises(ValueError, match="slot_mapping overlaps the memory of kpe_cache"):
        kernels.append_paged_mla_kv(torch.ones(1, 16, device=DEV), torch.ones(1, 8, device=DEV), cc, pc, inside)
    assert torch.equal(pc, before) and cc.eq(0).all()


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("case", verify.mla_decode_grid(), ids=_id)
def test_absorbed_decode_equals_the_naive_float64_reference(case):
    result = verify.mla_decode_case(kernels.mla_decode_attention, case)
    assert result.passed, result.detail


def test_split_kv_merges_to_the_unsplit_latent_and_output():
    args = decode_args(SMALL)
    plan = kernels.plan_mla_decode(*args, num_splits=1)
    out1, latent1 = kernels.run_mla_decode(plan, *args[:4], *args[6:], return_latent=True)
    ref_out, ref_latent = mla.mla_decode_absorbed(*(a.cpu() for a in args), return_latent=True)
    assert (latent1.cpu().double() - ref_latent).abs().max() < 1e-5
    assert (out1.cpu().double() - ref_out).abs().max() < 1e-5
    for splits in (2, 3, 7):
        out = kernels.mla_decode_attention(*args, num_splits=splits)
        assert (out - out1).abs().max() < 1e-6, splits


def test_poisoned_pool_gives_the_result_of_a_clean_one():
    """Every unused slot NaN versus every unused slot 0: the same output, within fp32
    reordering (the tiles read the same real rows)."""
    poisoned = decode_args(SMALL)
    clean = [a.nan_to_num(0.0) if i in (2, 3) else a for i, a in enumerate(poisoned)]
    assert poisoned[2].isnan().any() and not clean[2].isnan().any()
    out_p = kernels.mla_decode_attention(*poisoned, num_splits=3)
    out_c = kernels.mla_decode_attention(*clean, num_splits=3)
    assert out_p.isfinite().all() and torch.equal(out_p, out_c) and not out_p[1].any()


def test_plan_decode_runs_again_and_refuses_other_shapes():
    args = decode_args(SMALL)
    plan = kernels.plan_mla_decode(*args)
    first = kernels.run_mla_decode(plan, *args[:4], *args[6:])
    again = kernels.run_mla_decode(plan, 2 * args[0], *args[1:4], *args[6:])
    assert plan.num_splits == 1 or runtime.gpu_plans()  # interpreter plans never split by themselves
    assert not torch.equal(first, again)
    with pytest.raises(ValueError, match=r"q_nope must be torch.float32 of shape \(4, 4, 32\) as planned"):
        kernels.run_mla_decode(plan, args[0][:, :2], *args[1:4], *args[6:])
    with pytest.raises(ValueError, match="w_uv must be torch.float32 of shape"):
        kernels.run_mla_decode(plan, *args[:4], args[6], args[7].half())


def test_decode_launch_checks_name_the_argument():
    args = decode_args(SMALL)
    with pytest.raises(ValueError, match=r"q_nope\.dtype=torch\.float64; the kernels take"):
        kernels.mla_decode_attention(args[0].double(), args[1].double(), *args[2:])
    with pytest.raises(ValueError, match=r"w_uk\.dtype=torch\.float64; the kernels take"):
        kernels.mla_decode_attention(*args[:6], args[6].double(), args[7])
    with pytest.raises(ValueError, match=r"num_splits=0"):
        kernels.mla_decode_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match=r"block_tables has values outside int32"):
        big = args[4].to(torch.int64).clone()
        big[0, -1] = 2**40
        kernels.mla_decode_attention(*args[:4], big, *args[5:])


@pytest.mark.parametrize(
    "rank,rope,message",
    [
        (MAX_KV_LORA_RANK + 1, 4, "kv_lora_rank=1025 is wider"),
        (8, MAX_HEAD_DIM + 2, "qk_rope_head_dim=258 is wider"),
    ],
)
def test_widths_beyond_one_register_tile_are_refused_before_launch(rank, rope, message):
    zeros = lambda *shape: torch.zeros(shape, device=DEV)  # noqa: E731
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=DEV), torch.ones(1, dtype=torch.int32, device=DEV)
    args = (zeros(1, 1, 4), zeros(1, 1, rope), zeros(1, 1, rank), zeros(1, 1, rope), table, lens)
    with pytest.raises(ValueError, match=message):
        kernels.mla_decode_attention(*args, zeros(1, 4, rank), zeros(1, 4, rank))


def test_empty_batch_returns_empty_outputs():
    args = decode_args({**SMALL, "seq_lens": [0]})
    out = kernels.mla_decode_attention(*(a[:0] if i in (0, 1, 4, 5) else a for i, a in enumerate(args)))
    assert out.shape == (0, 4, 32) and out.dtype == torch.float32


@pytest.mark.slow
def test_deepseek_v2_dimensions_match_the_naive_reference():
    """128 heads, rank 512, RoPE 64, nope 128, v 128, bf16, pages of 64 (about 4 s
    interpreted; CI deselects ``slow``)."""
    result = verify.mla_decode_case(kernels.mla_decode_attention, verify.deepseek_v2_case())
    assert result.passed, result.detail


# ----------------------------------------------------------------------------- rounding


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to(x, y_ptr.dtype.element_ty), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 overflow to inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_computed_values_round_to_nearest_even_like_torch(dtype):
    """The interpreter's own fp32-to-bf16 cast truncates (1.01171875, a tie, would become
    1.0078125); the kernels' rounding must give torch's (and a GPU's) answer bit for bit:
    ties to even, carries into the exponent, overflow to inf, subnormals, NaN stays NaN."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = [1.01171875, 1.00390625, 2.4976005, -2.4976005, 3.3895313e38, 1e-40, -0.0, float("inf"), 65520.0]
    x = torch.cat([bits.view(torch.float32), torch.tensor(special), torch.randn(1000, generator=gen) * 3])
    y = torch.empty(x.shape, dtype=dtype)
    x_dev, y_dev = x.to(DEV), y.to(DEV)
    _round_kernel[(1,)](x_dev, y_dev, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    got, want = y_dev.cpu(), x.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip

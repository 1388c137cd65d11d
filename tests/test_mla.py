"""The MLA latent pool, its float64 references and its argument rules
(:mod:`pagedkv_lib.mla`, the MLA section of :mod:`pagedkv_lib.checks`). Pure Python:
no kernel runs here (tests/test_mla_kernels.py holds those)."""

import math

import pytest
import torch

from pagedkv_lab.verify import mla_decode_inputs
from pagedkv_lib import formats, memory, mla
from pagedkv_lib.reference import rope_reference

DECODE_ARGS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "w_uk", "w_uv")
CASE = {"dtype": "fp32", "page_size": 5, "num_heads": 3, "dims": (24, 8, 12, 10), "seq_lens": [0, 1, 23, 11]}


def decode_args(case=CASE, **changes):
    t = mla_decode_inputs({**case, **changes})
    return [t[a] for a in DECODE_ARGS]


def filled_pool(num_pages=4, page_size=4, rank=8, rope=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = mla.MLAPool(num_pages, page_size, rank, rope, torch.float32)
    pool.ckv_cache.copy_(torch.randn(pool.ckv_cache.shape, generator=gen))
    pool.kpe_cache.copy_(torch.randn(pool.kpe_cache.shape, generator=gen))
    return pool


# ----------------------------------------------------------------------------- the pool


def test_pool_holds_one_latent_row_and_one_rope_row_per_slot_zero_filled():
    pool = mla.MLAPool(6, 16, 512, 64, torch.bfloat16)
    assert pool.ckv_cache.shape == (6, 16, 512) and pool.kpe_cache.shape == (6, 16, 64)
    assert pool.num_slots == 96 and pool.dtype == torch.bfloat16
    assert pool.row_bytes == (512 + 64) * 2 and pool.nbytes == 96 * 576 * 2
    assert not pool.ckv_cache.any() and not pool.kpe_cache.any()
    assert pool.dims == (6, 16, 512, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_real_pool_bytes_of_every_layer_equal_the_memory_formula_for_deepseek_v2(dtype, page_size):
    """One pool per layer, exactly the pages the batch needs: their allocated bytes are
    what ``kv_cache_bytes`` predicts for the MLA preset (page rounding included)."""
    spec, lens = memory.PRESETS["deepseek-v2"], [100, 37, 0, 1]
    pages = sum(-(-n // page_size) for n in lens)
    real = sum(mla.MLAPool.for_model(spec, pages, page_size, dtype).nbytes for _ in range(spec.num_layers))
    assert real == memory.kv_cache_bytes(spec, lens, dtype, page_size=page_size)


def test_pool_for_a_model_without_a_latent_is_refused():
    with pytest.raises(ValueError, match="llama-3-8b.* is GQA, not MLA"):
        mla.MLAPool.for_model(memory.PRESETS["llama-3-8b"], 4, 16)


@pytest.mark.parametrize("field", ["num_pages", "page_size", "kv_lora_rank", "qk_rope_head_dim"])
def test_pool_sizes_must_be_positive_ints(field):
    sizes = {"num_pages": 2, "page_size": 4, "kv_lora_rank": 8, "qk_rope_head_dim": 4, field: 0}
    with pytest.raises(ValueError, match=f"{field}=0"):
        mla.MLAPool(**sizes)


# ----------------------------------------------------------------------------- append


def test_append_loop_and_vectorized_forms_write_the_same_pool():
    pool, gen = filled_pool(), torch.Generator().manual_seed(1)
    ckv, kpe = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    slots = torch.tensor([3, -1, 12, 0, 9])
    a = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
    b = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
    mla.append_paged_mla_kv(ckv, kpe, *a, slots)
    mla.append_paged_mla_kv_loop(ckv, kpe, *b, slots)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0][3, 0], ckv[2]) and torch.equal(a[1][2, 1], kpe[4])  # slots 12 and 9
    untouched = torch.ones(4, 4, dtype=torch.bool)
    untouched.view(-1)[[3, 12, 0, 9]] = False
    assert torch.equal(a[0][untouched], pool.ckv_cache[untouched])  # the padding token wrote nothing


def test_csr_append_lands_where_the_slot_mapping_says():
    pool, gen = filled_pool(), torch.Generator().manual_seed(2)
    ckv, kpe = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    batch, pos = torch.tensor([0, 1, 1, -1]), torch.tensor([5, 0, 2, -1])
    kv_indices, kv_indptr = torch.tensor([2, 0, 3]), torch.tensor([0, 2, 3])
    slots = formats.csr_slot_mapping(batch, pos, kv_indices, kv_indptr, 4)
    assert slots.tolist() == [1, 12, 14, -1]
    a = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
    b = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
    mla.append_paged_mla_kv_csr(ckv, kpe, *a, batch, pos, kv_indices, kv_indptr, rope="gptj")
    mla.append_paged_mla_kv(ckv, kpe, *b, slots, rope="gptj", positions=pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_append_rotates_the_rope_key_only_and_never_its_inputs(style):
    pool, gen = filled_pool(), torch.Generator().manual_seed(3)
    ckv, kpe = torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen)
    before = (ckv.clone(), kpe.clone())
    pos = torch.tensor([0, 7, 30000])
    mla.append_paged_mla_kv(
        ckv, kpe, pool.ckv_cache, pool.kpe_cache, torch.tensor([1, 2, 3]), rope=style, positions=pos
    )
    want = rope_reference(kpe[:, None], pos, style=style)[:, 0].float()
    assert torch.equal(pool.kpe_cache[0, 1:4], want) and torch.equal(pool.ckv_cache[0, 1:4], ckv)
    assert torch.equal(pool.kpe_cache[0, 1], kpe[0])  # position 0 does not turn
    assert torch.equal(ckv, before[0]) and torch.equal(kpe, before[1])


def _bad_appends():
    """(id, call(ckv, kpe, ckv_cache, kpe_cache, slots), message): each must raise a
    ValueError matching the message and write nothing."""
    ap = mla.append_paged_mla_kv
    return [
        ("ckv width", lambda c, p, cc, pc, s: ap(c[:, :7], p, cc, pc, s), r"ckv has width 7 but the pool's"),
        ("kpe 3-D", lambda c, p, cc, pc, s: ap(c, p[:, None], cc, pc, s), r"kpe must be \[num_tokens, qk_rope"),
        ("kpe dtype", lambda c, p, cc, pc, s: ap(c, p.half(), cc, pc, s), r"kpe\.dtype=torch\.float16 differs"),
        ("token counts", lambda c, p, cc, pc, s: ap(c, p[:2], cc, pc, s), r"ckv has 3 tokens but kpe has 2"),
        ("slot count", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s[:2]), r"slot_mapping has 2 entries for 3 tokens"),
        ("slot range", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s + 14), r"slot_mapping\[2\] = 16 is outside the pool"),
        ("slot twice", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s * 0 + 1), r"writes slot 1 more than once"),
        ("pages differ", lambda c, p, cc, pc, s: ap(c, p, cc, pc[:3], s), r"kpe_cache has \(3, 4\).*same pages"),
        ("cache dtypes", lambda c, p, cc, pc, s: ap(c, p, cc, pc.double(), s), r"float32 differs from kpe_cache"),
        ("cache 5-D", lambda c, p, cc, pc, s: ap(c, p, cc[:, None], pc, s), r"ckv_cache must be \[num_pages"),
        ("rope style", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s, rope="yarn", positions=s), r"rope='yarn'"),
        ("no positions", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s, rope="gptj"), r"rope needs positions"),
        ("negative position", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s, rope="neox", positions=s - 3),
         r"positions\[0\]=-3 must be >= 0"),
        ("theta", lambda c, p, cc, pc, s: ap(c, p, cc, pc, s, rope="neox", positions=s, rope_theta=1.0),
         r"rope_theta=1\.0 must be > 1"),
        ("odd rope dim", lambda c, p, cc, pc, s: ap(c, p[:, :3], cc, pc[..., :3], s, rope="neox", positions=s),
         r"even qk_rope_head_dim"),
    ]  # fmt: skip


@pytest.mark.parametrize("name,call,message", _bad_appends(), ids=[b[0] for b in _bad_appends()])
def test_bad_append_arguments_are_named_and_nothing_is_written(name, call, message):
    pool, gen = filled_pool(), torch.Generator().manual_seed(4)
    ckv, kpe = torch.randn(3, 8, generator=gen), torch.randn(3, 4, generator=gen)
    before = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
    with pytest.raises(ValueError, match=message):
        call(ckv, kpe, pool.ckv_cache, pool.kpe_cache, torch.tensor([0, 1, 2]))
    assert torch.equal(pool.ckv_cache, before[0]) and torch.equal(pool.kpe_cache, before[1])


# ----------------------------------------------------------------------------- decode references


def test_weights_follow_the_kv_b_proj_convention():
    """``w_uk``/``w_uv`` are DeepSeek-V2's ``kv_b_proj.weight [H * (nope + v), rank]`` viewed
    per head and split: an ``nn.Linear`` of that weight gives exactly the K_nope and V
    that :func:`expand_latent` builds (so ``w[h] @ c_kv``, the weight is not transposed)."""
    gen = torch.Generator().manual_seed(5)
    heads, rank, nope, rope, v_dim = 3, 16, 6, 4, 5
    kv_b_proj = torch.randn(heads * (nope + v_dim), rank, generator=gen, dtype=torch.float64)
    w_uk, w_uv = kv_b_proj.view(heads, nope + v_dim, rank).split([nope, v_dim], dim=1)
    ckv, kpe = torch.randn(7, rank, generator=gen), torch.randn(7, rope, generator=gen)
    kv = torch.nn.functional.linear(ckv.double(), kv_b_proj).view(7, heads, nope + v_dim)
    k, v = mla.expand_latent(ckv, kpe, w_uk, w_uv)
    torch.testing.assert_close(k[..., :nope], kv[..., :nope], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, kv[..., nope:], rtol=1e-12, atol=1e-12)
    assert torch.equal(k[:, 2, nope:], kpe.double())  # the RoPE key is every head's


def test_naive_loop_and_vectorized_forms_agree():
    args = decode_args()
    torch.testing.assert_close(mla.mla_decode_naive(*args), mla.mla_decode_naive_loop(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_absorbed_algebra_equals_the_naive_expansion_in_float64(dtype):
    args = decode_args(dtype=dtype)
    naive, absorbed = mla.mla_decode_naive(*args), mla.mla_decode_absorbed(*args)
    assert naive.dtype == absorbed.dtype == torch.float64
    assert (naive - absorbed).abs().max() < 1e-12 and naive.abs().max() > 0.1


def test_naive_fp32_precision_returns_the_query_dtype_close_to_fp64():
    args = decode_args(dtype="bf16")
    out = mla.mla_decode_naive(*args, precision="fp32")
    assert out.dtype == torch.bfloat16 and (out.double() - mla.mla_decode_naive(*args)).abs().max() < 2e-2
    with pytest.raises(ValueError, match="precision='fp16'"):
        mla.mla_decode_naive(*args, precision="fp16")


def test_empty_sequence_gives_zeros_and_poisoned_slots_never_reach_the_output():
    args = decode_args()  # unused slots of the pool hold NaN
    assert args[2].isnan().any() and args[3].isnan().any()
    for fn in (mla.mla_decode_naive, mla.mla_decode_naive_loop, mla.mla_decode_absorbed):
        out = fn(*args)
        assert out.isfinite().all() and not out[0].any(), fn.__name__


def test_scale_defaults_to_the_query_key_width():
    args = decode_args()
    assert mla.default_scale(128, 64) == 1 / math.sqrt(192)
    torch.testing.assert_close(mla.mla_decode_naive(*args), mla.mla_decode_naive(*args, scale=1 / math.sqrt(12 + 8)))
    assert not torch.allclose(mla.mla_decode_naive(*args), mla.mla_decode_naive(*args, scale=0.5))


def test_absorbed_latent_output_is_a_convex_combination_of_cached_latents():
    args = decode_args()
    out, latent = mla.mla_decode_absorbed(*args, return_latent=True)
    ckv, _ = mla.gather_mla_latent(args[2], args[3], args[4][2], 23)
    lo, hi = ckv.double().min(0).values, ckv.double().max(0).values
    assert ((latent[2] >= lo - 1e-12) & (latent[2] <= hi + 1e-12)).all()
    torch.testing.assert_close(out, torch.einsum("hvr,bhr->bhv", args[7].double(), latent))


def _bad_decodes():
    """(id, change(args) -> args, message)."""

    def swap(i, f):
        return lambda a: [f(x) if j == i else x for j, x in enumerate(a)]

    return [
        ("q_pe width", swap(1, lambda x: x[..., :-1]), r"q_pe has shape \(4, 3, 7\); q_nope and kpe_cache need"),
        ("q_pe dtype", swap(1, lambda x: x.half()), r"q_pe\.dtype=torch\.float16 differs"),
        ("q_nope 2-D", swap(0, lambda x: x[0]), r"q_nope must be \[batch, num_heads, qk_nope_head_dim\]"),
        ("w_uk shape", swap(6, lambda x: x.transpose(1, 2)), r"w_uk has shape \(3, 24, 12\); .*\[3, 12, 24\]"),
        ("w_uv rank", swap(7, lambda x: x[..., :-1]), r"w_uv has shape \(3, 10, 23\)"),
        ("w_uv int", swap(7, lambda x: x.int()), r"w_uv\.dtype=torch\.int32 is not a float dtype"),
        ("batch", swap(5, lambda x: x[:3]), r"block_tables has 4 rows but seq_lens has 3 entries"),
        ("page id", swap(4, lambda x: x.clone().fill_(99)), r"block_tables\[1, 0\]=99 is not a page of the pool"),
        ("length", swap(5, lambda x: x + 20), r"seq_lens\[2\]=43 needs 9 pages"),
    ]


@pytest.mark.parametrize("name,change,message", _bad_decodes(), ids=[b[0] for b in _bad_decodes()])
def test_bad_decode_arguments_are_named(name, change, message):
    args = change(decode_args())
    for fn in (mla.mla_decode_naive, mla.mla_decode_naive_loop, mla.mla_decode_absorbed):
        with pytest.raises(ValueError, match=message):
            fn(*args)


def test_bad_scale_is_named():
    with pytest.raises(ValueError, match="scale=nan"):
        mla.mla_decode_naive(*decode_args(), scale=float("nan"))


# ----------------------------------------------------------------------------- cost


def test_decode_flops_by_hand_for_deepseek_v2():
    h, r, nope, rope, v = mla.DEEPSEEK_V2
    assert (h, r, nope, rope, v) == (128, 512, 128, 64, 128)
    n = 4096
    assert mla.decode_flops(mla.DEEPSEEK_V2, n, "naive") == 2 * 128 * n * (512 * 256 + 192 + 128)
    assert mla.decode_flops(mla.DEEPSEEK_V2, n, "absorbed") == 2 * 128 * (128 * 512 + n * 576 + n * 512 + 512 * 128)
    assert mla.decode_flops(mla.DEEPSEEK_V2, n, "mha") == 2 * 128 * n * 320


def test_absorbed_reads_win_from_the_second_token_and_by_over_100x_at_32k():
    flops = lambda n, form: mla.decode_flops(mla.DEEPSEEK_V2, n, form)  # noqa: E731
    assert flops(1, "absorbed") > flops(1, "naive")  # one token: absorbing costs a little more
    assert all(flops(n, "absorbed") < flops(n, "naive") for n in (2, 3, 64, 4096))
    assert flops(32768, "naive") / flops(32768, "absorbed") > 100
    # ... and the absorbed read does more arithmetic per cached token than the MHA it replaces.
    assert 3 < flops(32768, "absorbed") / flops(32768, "mha") < 4


def test_decode_flops_refuses_unknown_forms_and_lengths():
    with pytest.raises(ValueError, match="form='fast'"):
        mla.decode_flops(mla.DEEPSEEK_V2, 8, "fast")
    with pytest.raises(ValueError, match="seq_len=-1"):
        mla.decode_flops(mla.DEEPSEEK_V2, -1, "naive")

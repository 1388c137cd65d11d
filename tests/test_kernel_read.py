"""The Triton read kernel (paged decode attention) and the Triton gather, against the
Python references.

Runs in Triton's interpreter on CPU and compiled on CUDA (``runtime.device()``); the
references always run on CPU copies, in float64 for attention (the oracle).

Tolerances: fp32 1e-5 (abs and rel); fp16 and bf16 1e-2 abs + 1e-2 rel (the output
is rounded to the storage dtype: half an ulp of bf16 at 2.0 is already 0.0078).

The main grid covers every pair of (head_dim in {64, 80, 128, 256}, page_size in
{1, 5, 16, 64}, GQA group in {1, 4, 5, 8}, dtype, layout) with 16 cases instead of
the 384 of the cartesian product: an orthogonal array of strength 2 built from GF(4).
"""

import math

import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import PagedKVPool, RingWindow, formats, reference, runtime

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels.decode as decode
import pagedkv_kernels.gather as gather
import pagedkv_kernels.merge as merge
from pagedkv_kernels.decode import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_csr,
    paged_decode_attention_partials,
    visible_lengths,
)
from pagedkv_kernels.device.addressing import table_row_offset
from pagedkv_kernels.gather import gather_paged_kv
from pagedkv_kernels.host.validate import MAX_SPLITS
from pagedkv_kernels.merge import merge_partials

DEV = runtime.device()
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
}


# ----------------------------------------------------------------------------- helpers


def make_pool(lens, num_kv_heads, head_dim, page_size, dtype, layout="NHD", *, fill=0.0, spare=3, seed=0, kv=None):
    """A pool holding sequences of ``lens`` tokens on randomly permuted pages, every
    other slot (and ``spare`` unreferenced pages) set to ``fill``. Returns
    ``(cache, block_tables int32, seq_lens int32, (k, v))`` on CPU, ``k, v`` being the
    logical ``[sum(lens), Hk, D]`` values (pass ``kv`` to store the same ones again)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare
    pool = PagedKVPool(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, layout=layout)
    pool.cache.fill_(fill)
    rows = formats.scatter_pages(need, num_pages, gen)
    table = formats.pad_block_tables(rows, max(need, default=0) + 1)  # one -1 column past every row
    batch = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.long)
    if kv is None:
        kv = tuple(torch.randn(len(pos), num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    reference.append_paged_kv(*kv, pool.cache, formats.slot_mapping(table, batch, pos, page_size), layout)
    return pool.cache, table, torch.tensor(lens, dtype=torch.int32), kv


def make_q(batch, num_q_heads, head_dim, dtype, seed=1):
    return torch.randn(batch, num_q_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def run(q, cache, table, lens, **kw):
    """The kernel on the backend's device, result back on CPU."""
    qd, cd, td, ld = dev(q, cache, table, lens)
    return paged_decode_attention(qd, cd, td, ld, **kw).cpu()


def oracle(q, cache, table, lens, **kw):
    """The float64 reference on the very same (possibly NaN-poisoned) pool."""
    return reference.paged_decode_attention(q, cache, table, lens, precision="fp64", **kw)


def assert_matches(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


# GF(4) multiplication (elements 0..3, addition is XOR): rows i, j and i ^ a*j for
# a = 1, 2, 3 form an orthogonal array OA(16, 5, 4, 2), so every pair of values of
# any two of the five factors occurs in some case.
_GF4_MUL = [[0, 0, 0, 0], [0, 1, 2, 3], [0, 2, 3, 1], [0, 3, 1, 2]]
HEAD_DIMS, PAGE_SIZES, GROUPS = (64, 80, 128, 256), (1, 5, 16, 64), (1, 4, 5, 8)
DTYPES4 = (torch.float32, torch.float16, torch.bfloat16, torch.float32)
LAYOUTS4 = ("NHD", "HND", "HND", "NHD")
SPLITS = (None, 1, 2, 3, 7)


def _grid():
    cases = []
    for i in range(4):
        for j in range(4):
            g, t, lay = (i ^ _GF4_MUL[a][j] for a in (1, 2, 3))
            values = (HEAD_DIMS[i], PAGE_SIZES[j], GROUPS[g], DTYPES4[t], LAYOUTS4[lay], SPLITS[len(cases) % 5])
            name = "d{}-p{}-g{}-{}-{}-s{}".format(*values[:3], str(values[3])[6:], *values[4:])
            cases.append(pytest.param(*values, id=name))
    return cases


def test_grid_covers_every_pair():
    values = [(c.values[0], c.values[1], c.values[2], c.values[3], c.values[4]) for c in _grid()]
    for a in range(5):
        for b in range(a + 1, 5):
            pairs = {(v[a], v[b]) for v in values}
            left = {x[a] for x in values}
            right = {x[b] for x in values}
            assert pairs == {(x, y) for x in left for y in right}, (a, b)
    assert {v[0] for v in values} == set(HEAD_DIMS) and {v[1] for v in values} == set(PAGE_SIZES)
    assert {v[2] for v in values} == set(GROUPS) and {v[3] for v in values} == set(DTYPES4)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("head_dim, page_size, group, dtype, layout, num_splits", _grid())
def test_matches_reference(head_dim, page_size, group, dtype, layout, num_splits):
    lens = [1, 0, 23 + page_size, 150]
    hk = 2
    # Every unused slot and page is NaN: a masked lane that leaks shows up as NaN.
    cache, table, sl, _ = make_pool(lens, hk, head_dim, page_size, dtype, layout, fill=float("nan"), seed=head_dim)
    q = make_q(len(lens), hk * group, head_dim, dtype, seed=page_size)
    out = run(q, cache, table, sl, layout=layout, num_splits=num_splits)
    assert_matches(out, oracle(q, cache, table, sl, layout=layout), dtype)
    assert (out[1] == 0).all()  # length 0: zeros


def test_nan_poisoned_pool():
    """Every slot the sequences do not own (the tail of each last page, all
    unreferenced pages) is NaN; only the valid rows are written."""
    lens = [1, 15, 16, 17, 61]
    cache, table, sl, _ = make_pool(lens, 2, 64, 16, torch.float32, fill=float("nan"), spare=6)
    assert cache.isnan().any()
    q = make_q(len(lens), 8, 64, torch.float32)
    ref = oracle(q, cache, table, sl)
    for num_splits in (1, 3):
        out = run(q, cache, table, sl, num_splits=num_splits)
        assert_matches(out, ref, torch.float32)


def test_scale_and_nonpow2_group_fp32():
    lens = [40, 3]
    cache, table, sl, _ = make_pool(lens, 3, 80, 5, torch.float32)
    q = make_q(2, 15, 80, torch.float32)
    out = run(q, cache, table, sl, scale=0.3, num_splits=2)
    assert_matches(out, oracle(q, cache, table, sl, scale=0.3), torch.float32)


def test_strided_inputs():
    """Kernels take any strides: a pool sliced out of a wider tensor, a transposed q."""
    lens = [30, 9]
    wide, table, sl, _ = make_pool(lens, 2, 96, 8, torch.float32)
    cache = wide[..., 16:80]  # head_dim 64 with a feature stride of 1 and row stride 96
    q = make_q(2, 8, 64, torch.float32).transpose(0, 1).contiguous().transpose(0, 1)
    assert not cache.is_contiguous() and not q.is_contiguous()
    out = run(q, cache, table, sl, num_splits=2)
    assert_matches(out, oracle(q, cache.contiguous(), table, sl), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_size_invariance(dtype):
    """The same logical KV with page sizes 1, 5, 16 and 64 and either layout gives
    bit-identical output: tiles run over logical tokens, so the arithmetic does not
    depend on where the pages are."""
    lens = [77, 2, 130]
    q = make_q(3, 8, 64, dtype)
    outs, kv = [], None
    for page_size, layout in ((1, "NHD"), (16, "NHD"), (5, "HND"), (64, "HND")):
        cache, table, sl, kv = make_pool(
            lens, 2, 64, page_size, dtype, layout, fill=float("nan"), seed=page_size, kv=kv
        )
        outs.append(run(q, cache, table, sl, layout=layout, num_splits=1))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert_matches(outs[0], oracle(q, cache, table, sl, layout="HND"), dtype)


def test_num_splits_invariance_and_merge():
    lens = [300, 1, 0, 129]
    cache, table, sl, _ = make_pool(lens, 2, 64, 16, torch.float32, fill=float("nan"))
    q = make_q(4, 8, 64, torch.float32)
    ref = oracle(q, cache, table, sl)
    unsplit = run(q, cache, table, sl, num_splits=1)
    for num_splits in (2, 7, 16):  # 16 splits: more than the tiles of every sequence
        out = run(q, cache, table, sl, num_splits=num_splits)
        torch.testing.assert_close(out, unsplit, atol=2e-6, rtol=2e-6)
        assert_matches(out, ref, torch.float32)
    # The most splits the merge takes (one program per split in stage 1: one KV head).
    q1 = q[:1, :4]
    args = (cache[:, :, :, :1], table[:1], sl[:1])
    out = run(q1, *args, num_splits=MAX_SPLITS)
    torch.testing.assert_close(out, run(q1, *args, num_splits=1), atol=2e-6, rtol=2e-6)
    # Stage 1 and stage 2 separately: the merge of the partials is the split result,
    # and a torch merge of the same partials agrees.
    part, lse = paged_decode_attention_partials(*dev(q, cache, table, sl), num_splits=7)
    part, lse = part.cpu(), lse.cpu()
    assert part.shape == (4, 8, 7, 64) and lse.shape == (4, 8, 7)
    assert torch.isneginf(lse[2]).all() and (part[2] == 0).all()  # length 0: every split empty
    assert torch.isneginf(lse[1, :, 1:]).all()  # length 1: only split 0 has a key
    merged = merge_partials(*dev(part, lse)).cpu()
    torch.testing.assert_close(merged, run(q, cache, table, sl, num_splits=7), atol=0, rtol=0)
    m = lse.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    w = torch.exp2(lse - m)
    by_torch = (w[..., None] * part).sum(2) / w.sum(-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(merged, by_torch, atol=1e-6, rtol=1e-6)


def test_single_split_lse_is_base2_logsumexp():
    lens = [50]
    cache, table, sl, (k, _) = make_pool(lens, 1, 64, 16, torch.float32)
    q = make_q(1, 2, 64, torch.float32)
    _, lse = paged_decode_attention_partials(*dev(q, cache, table, sl), num_splits=1)
    scores = torch.einsum("hd,td->ht", q[0].double(), k[:, 0].double()) / 8.0
    torch.testing.assert_close(
        lse.cpu()[0, :, 0].double(), torch.logsumexp(scores, -1) / math.log(2), atol=1e-5, rtol=0
    )


def test_all_empty_batch_and_zero_batch():
    cache, table, sl, _ = make_pool([0, 0], 2, 64, 16, torch.float16, fill=float("nan"))
    q = make_q(2, 4, 64, torch.float16)
    for num_splits in (None, 1, 4):
        out = run(q, cache, table, sl, num_splits=num_splits)
        assert out.shape == (2, 4, 64) and (out == 0).all()
    empty = run(q[:0], cache, table[:0], sl[:0])
    assert empty.shape == (0, 4, 64)


def test_default_num_splits_matches_reference():
    lens = [700, 5]
    cache, table, sl, _ = make_pool(lens, 1, 64, 16, torch.float32)
    q = make_q(2, 4, 64, torch.float32)
    assert_matches(run(q, cache, table, sl), oracle(q, cache, table, sl), torch.float32)


def test_choose_num_splits():
    # The interpreter (one program at a time) and a full device never split.
    assert choose_num_splits(1, 8, 100_000, 64, parallel_units=1) == 1
    assert choose_num_splits(64, 8, 100_000, 64, parallel_units=132) == 1
    # One tile: nothing to split.
    assert choose_num_splits(1, 1, 64, 64, parallel_units=132) == 1
    # A long single sequence: about two waves, capped so each split keeps >= 256 tokens.
    assert choose_num_splits(1, 8, 100_000, 64, parallel_units=132) == 33
    assert choose_num_splits(1, 8, 1024, 64, parallel_units=132) == 4
    assert choose_num_splits(1, 1, 10**7, 16, parallel_units=1000) == MAX_SPLITS


# ----------------------------------------------------------------------------- windows


def ring_pool(window, lens, num_kv_heads, head_dim, dtype, layout, seed=0):
    """Decode-style ring writes, one position at a time for the whole batch (a plain
    ring only allows one new token per step). Returns the cache, table and lens."""
    gen = torch.Generator().manual_seed(seed)
    ps = window.tokens_per_block
    need = [window.num_blocks(n) for n in lens]
    num_pages = sum(need) + 2
    pool = PagedKVPool(num_pages, ps, num_kv_heads, head_dim, dtype=dtype, layout=layout)
    pool.cache.fill_(float("nan"))
    rows = formats.scatter_pages(need, num_pages, gen)
    table = formats.pad_block_tables(rows)
    for t in range(max(lens)):
        batch = torch.tensor([b for b, n in enumerate(lens) if n > t])
        pos = torch.full((len(batch),), t)
        k, v = (torch.randn(len(batch), num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        reference.append_paged_kv(k, v, pool.cache, formats.slot_mapping(table, batch, pos, ps, window), layout)
    return pool.cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "window, layout, dtype",
    [
        (RingWindow(24, 0, 16), "NHD", torch.float32),
        (RingWindow(24, 3, 5), "HND", torch.float32),  # 3 sinks in pages of 5: a bubble of 2
        (RingWindow(20, 4, 16, one_more_block=True), "NHD", torch.bfloat16),  # bubble of 12
        (RingWindow(13, 2, 1), "HND", torch.float16),
    ],
    ids=["w24-s0-p16", "w24-s3-p5", "w20-s4-p16-omb", "w13-s2-p1"],
)
def test_ring_window_matches_reference(window, layout, dtype):
    # Lengths before, at and past the window, and long enough to wrap the ring ~4 times.
    w = window.max_attention_window
    lens = [1, window.sink_tokens + 1, w, w + 1, 4 * window.max_cache_len + 3]
    cache, table, sl = ring_pool(window, lens, 2, 64, dtype, layout)
    q = make_q(len(lens), 8, 64, dtype)
    ref = oracle(q, cache, table, sl, layout=layout, window=window)
    for num_splits in (1, 3):
        out = run(q, cache, table, sl, layout=layout, window=window, num_splits=num_splits)
        assert_matches(out, ref, dtype)


def test_visible_lengths():
    win = RingWindow(10, 3, 4)
    lens = torch.arange(0, 30)
    for n in lens.tolist():
        mask = pagedkv_lib.window.window_mask(torch.tensor([n - 1]), torch.arange(n), win)
        assert int(visible_lengths(torch.tensor([n]), win)) == int(mask.sum()), n
    assert torch.equal(visible_lengths(lens), lens)


# ----------------------------------------------------------------------------- CSR


def test_csr_equals_padded():
    lens = [33, 0, 16, 1, 90]
    cache, table, sl, _ = make_pool(lens, 2, 128, 16, torch.float16, "HND", fill=float("nan"))
    q = make_q(len(lens), 10, 128, torch.float16)
    indptr, indices, last = formats.block_table_to_csr(table, sl, 16)
    for num_splits in (1, 2):
        out = paged_decode_attention_csr(*dev(q, cache, indptr, indices, last), layout="HND", num_splits=num_splits)
        assert torch.equal(out.cpu(), run(q, cache, table, sl, layout="HND", num_splits=num_splits))
    assert_matches(out.cpu(), oracle(q, cache, table, sl, layout="HND"), torch.float16)


def test_csr_all_empty():
    cache, _, _, _ = make_pool([4], 1, 64, 4, torch.float32)
    q = make_q(2, 1, 64, torch.float32)
    indptr, indices, last = torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(2)
    out = paged_decode_attention_csr(*dev(q, cache, indptr, indices, last.to(torch.int32)))
    assert (out == 0).all()


# ----------------------------------------------------------------------------- gather


@pytest.mark.parametrize(
    "page_size, layout, dtype",
    [(1, "NHD", torch.bfloat16), (5, "HND", torch.float16), (16, "NHD", torch.float32), (64, "HND", torch.bfloat16)],
)
def test_gather_bit_exact(page_size, layout, dtype):
    lens = [0, 1, 70, 21]
    cache, table, sl, _ = make_pool(lens, 3, 80, page_size, dtype, layout, fill=float("nan"))
    k, v, indptr = (t.cpu() for t in gather_paged_kv(*dev(cache, table, sl), layout=layout))
    assert k.shape == (sum(lens), 3, 80) and k.dtype == dtype and k.is_contiguous()
    assert indptr.tolist() == [0, 0, 1, 71, 92]
    for b, n in enumerate(lens):
        rk, rv = reference.gather_paged_kv(cache, table[b], n, layout)
        # Bit for bit (compared as integers so that no NaN could hide an inequality).
        assert torch.equal(k[indptr[b] : indptr[b + 1]].view(torch.uint8), rk.contiguous().view(torch.uint8))
        assert torch.equal(v[indptr[b] : indptr[b + 1]].view(torch.uint8), rv.contiguous().view(torch.uint8))


def test_gather_then_attend_equals_paged():
    """The two read routes agree: gather, then plain attention on the contiguous copy."""
    lens = [45, 8]
    cache, table, sl, _ = make_pool(lens, 2, 64, 16, torch.float32, fill=float("nan"))
    q = make_q(2, 8, 64, torch.float32)
    k, v, indptr = (t.cpu() for t in gather_paged_kv(*dev(cache, table, sl)))
    paged = run(q, cache, table, sl)
    for b in range(2):
        kb = k[indptr[b] : indptr[b + 1]].repeat_interleave(4, dim=1).transpose(0, 1)  # [Hq, n, D]
        vb = v[indptr[b] : indptr[b + 1]].repeat_interleave(4, dim=1).transpose(0, 1)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kb, vb)[:, 0]
        torch.testing.assert_close(paged[b], sdpa, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- int64


@triton.jit
def _offsets_probe(table_ptr, out_ptr, n, stride_page, stride_n, page_size, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    valid = t < n
    off = table_row_offset(table_ptr, t, page_size, valid, stride_page, stride_n)
    tl.store(out_ptr + t, off, mask=valid)


def test_row_offsets_are_int64():
    """Page ids times the page stride beyond 2**31 elements (a pool of tens of GB)
    stay exact: the helper both kernels use widens the page id first. Checked on the
    offsets themselves, since such a pool does not fit a CI machine."""
    page_size, stride_n, stride_page = 4, 1024, 2 * 4 * 1024  # NHD, 1 KV head of 1024, K and V
    table = torch.tensor([3, 2**20, 2**21 - 1, 7], dtype=torch.int32, device=DEV)
    out = torch.zeros(16, dtype=torch.int64, device=DEV)
    _offsets_probe[(1,)](table, out, 14, stride_page, stride_n, page_size, BLOCK=16)
    want = [int(table[t // 4]) * stride_page + (t % 4) * stride_n for t in range(14)] + [0, 0]
    assert out.cpu().tolist() == want
    assert max(want) > 2**31


@pytest.mark.skipif(runtime.BACKEND.interpreted, reason="needs a > 4 GiB pool on a GPU")
def test_pool_beyond_int32_elements_gpu():
    pages, page_size, hk, d = 33_000, 16, 8, 256  # 2**16 elements a page: 2.16e9 > 2**31 in all
    if torch.cuda.mem_get_info()[0] < 2 * pages * 2**16 * 2:
        pytest.skip("not enough GPU memory")
    cache = torch.zeros(pages, 2, page_size, hk, d, dtype=torch.float16, device=DEV)
    assert cache.numel() > 2**31
    table = torch.tensor([[0, pages - 1]], dtype=torch.int32)
    k, v = torch.randn(2, 32, hk, d).half()
    slots = formats.slot_mapping(table, torch.zeros(32, dtype=torch.long), torch.arange(32), page_size)
    reference.append_paged_kv(k.to(DEV), v.to(DEV), cache, slots.to(DEV))
    q = make_q(1, 16, d, torch.float16)
    sl = torch.tensor([32], dtype=torch.int32)
    out = paged_decode_attention(q.to(DEV), cache, table.to(DEV), sl.to(DEV)).cpu()
    small = torch.stack([cache[0], cache[-1]]).cpu()
    assert_matches(out, oracle(q, small, torch.tensor([[0, 1]], dtype=torch.int32), sl), torch.float16)


# ----------------------------------------------------------------------------- validation


@pytest.fixture
def no_launch(monkeypatch):
    for module, name in ((decode, "decode_split_kernel"), (merge, "merge_kernel"), (gather, "_gather_kernel")):
        monkeypatch.setattr(module, name, NoLaunch())


def _args():
    cache, table, sl, _ = make_pool([20, 5], 2, 64, 16, torch.float16)
    return make_q(2, 8, 64, torch.float16), cache, table, sl


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(q=a["q"][:, :, :32]), "head_dim"),
        (lambda a: a.update(q=a["q"][:, :7]), "multiple"),
        (lambda a: a.update(q=a["q"][:1]), "q has 1 rows"),
        (lambda a: a.update(q=a["q"].double()), r"q\.dtype"),
        (lambda a: a.update(cache=a["cache"].double(), q=a["q"].double()), r"q\.dtype|cache\.dtype"),
        (lambda a: a.update(seq_lens=torch.tensor([40, 5], dtype=torch.int32)), r"seq_lens\[0\]"),
        (lambda a: a.update(seq_lens=torch.tensor([-1, 5], dtype=torch.int32)), "seq_lens"),
        (lambda a: a.update(seq_lens=torch.tensor([20.0, 5.0])), "seq_lens"),
        (lambda a: a["block_tables"].__setitem__((1, 0), -1), r"block_tables\[1, 0\]"),
        (lambda a: a["block_tables"].__setitem__((0, 1), 99), r"block_tables\[0, 1\]"),
        (lambda a: a.update(block_tables=a["block_tables"].tolist()), "block_tables must be a torch tensor"),
        (lambda a: a.update(num_splits=0), "num_splits"),
        (lambda a: a.update(num_splits=True), "num_splits"),
        (lambda a: a.update(num_splits=MAX_SPLITS + 1), "num_splits"),
        (lambda a: a.update(scale=float("nan")), "scale"),
        (lambda a: a.update(window=24), "window"),
        (lambda a: a.update(window=RingWindow(8, 0, 4)), "tokens_per_block"),
        (lambda a: a.update(layout="XYZ"), "layout"),
    ],
)
def test_decode_validation(no_launch, change, match):
    q, cache, table, sl = _args()
    a = dict(q=q, cache=cache, block_tables=table, seq_lens=sl)
    change(a)
    a = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**a)


def test_head_dim_limit(no_launch):
    cache, table, sl, _ = make_pool([3], 1, 512, 4, torch.float32)
    with pytest.raises(ValueError, match="head_dim=512"):
        paged_decode_attention(*dev(make_q(1, 1, 512, torch.float32), cache, table, sl))


def test_csr_validation(no_launch):
    q, cache, table, sl = _args()
    indptr, indices, last = formats.block_table_to_csr(table, sl, 16)
    bad = indices.clone()
    bad[0] = 500
    with pytest.raises(ValueError, match=r"kv_indices\[0\]"):
        paged_decode_attention_csr(*dev(q, cache, indptr, bad, last))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_decode_attention_csr(*dev(q, cache, indptr, indices, last + 16))
    with pytest.raises(ValueError, match="kv_indptr"):
        paged_decode_attention_csr(*dev(q, cache, indptr[:-1], indices, last))
    with pytest.raises(ValueError, match="q has 1 rows"):
        paged_decode_attention_csr(*dev(q[:1], cache, indptr, indices, last))
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention_csr(*dev(q, cache, indptr, indices, last), num_splits=-2)


def test_gather_validation(no_launch):
    _, cache, table, sl = _args()
    with pytest.raises(ValueError, match=r"seq_lens\[1\]"):
        gather_paged_kv(*dev(cache, table, torch.tensor([20, 99], dtype=torch.int32)))
    with pytest.raises(ValueError, match="block_tables"):
        gather_paged_kv(*dev(cache, table[0], sl))
    with pytest.raises(ValueError, match="cache"):
        gather_paged_kv(*dev(cache[0], table, sl))


def test_merge_validation(no_launch):
    with pytest.raises(ValueError, match="lse"):
        merge_partials(torch.zeros(1, 2, 3, 4, device=DEV), torch.zeros(1, 2, 4, device=DEV))
    with pytest.raises(ValueError, match="partials"):
        merge_partials(torch.zeros(1, 2, 3, 4, device=DEV).half(), torch.zeros(1, 2, 3, device=DEV))


def test_merge_ignores_the_nan_partial_of_a_split_with_no_keys():
    """A split whose LSE is -inf weighs exactly 0; its partial (NaN here, as an
    unwritten buffer may hold) must not turn the row into NaN through 0 * NaN. A row
    whose splits are all empty becomes zeros. Kernel and float64 reference agree."""
    part = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(3))
    lse = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(4))
    part[0, :, 2], lse[0, :, 2] = float("nan"), float("-inf")  # one empty split with garbage
    part[1], lse[1] = float("nan"), float("-inf")  # a row with no keys at all
    want = reference.merge_partials(part, lse)
    got = merge_partials(*dev(part, lse)).cpu()
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros(3, 16))
    keep = [0, 1, 3]  # the same row without the empty split
    torch.testing.assert_close(want[0], reference.merge_partials(part[:1, :, keep], lse[:1, :, keep])[0])
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)

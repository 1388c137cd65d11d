"""The Triton write kernel (paged KV append) against the Python references.

Runs in Triton's interpreter on CPU and compiled on CUDA (``runtime.device()``); the
references run on CPU copies. The plain write must be bit-exact (compared as raw
bits, so NaN and -0.0 count too); RoPE is compared with the float64
``rope_reference`` with tolerances by dtype (fp32 1e-5, fp16 2e-3, bf16 1.6e-2 abs +
rel: the stored value is rounded to the dtype, half an ulp of bf16 at 2.0 is 0.0078).

Every test compares the *whole* pool with a snapshot the reference wrote, so bytes
outside the target slots are checked to be unchanged, too.
"""

import math

import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import RingWindow, formats, reference, runtime

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels.write as write
from pagedkv_kernels.device.addressing import cache_offset
from pagedkv_kernels.host.validate import check_no_self_overlap
from pagedkv_kernels.v_tail import zero_paged_v_tail
from pagedkv_kernels.write import append_paged_kv, append_paged_kv_csr
from pagedkv_lib.formats import csr_slot_mapping

DEV = runtime.device()
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ----------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (bit-exact, NaN-aware comparison)."""
    return t.contiguous().cpu().view(INT_VIEW[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = bits(got) != bits(want)
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {torch.nonzero(diff)[0].tolist()}"


def pool_shape(num_pages, page_size, heads, head_dim, layout):
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    return (num_pages, 2, *inner, head_dim)


def random_pool(num_pages, page_size, heads, head_dim, dtype, layout, gen):
    return torch.randn(pool_shape(num_pages, page_size, heads, head_dim, layout), generator=gen).to(dtype)


def strided_kv(num_tokens, heads, head_dim, dtype, gen, v_transposed):
    """``k`` is a slice of a wider tensor (head stride > head_dim); ``v`` is contiguous,
    or a transposed view of ``[heads, tokens, head_dim]`` storage."""
    k = torch.randn(num_tokens, heads, head_dim + 24, generator=gen).to(dtype)[:, :, 5 : 5 + head_dim]
    v = torch.randn(heads, num_tokens, head_dim, generator=gen).to(dtype)
    v = v.transpose(0, 1) if v_transposed else v.transpose(0, 1).contiguous()
    return k, v


def random_slots(num_tokens, num_slots, gen, pad_every=7):
    """Distinct random slots, every ``pad_every``-th token padding (``-1``)."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[3::pad_every] = -1
    return slots


def on_dev(*ts):
    """Copies on the device (always copies: ``.to`` returns the tensor itself on CPU,
    and the kernels write in place)."""
    return tuple(t.to(DEV, copy=True) for t in ts)


def to_dev_view(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` on the device with the same strides (``.to`` makes views contiguous)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEV)
    return out.copy_(t)


# ----------------------------------------------------------------------------- slot mapping grid

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
GRID = [
    (layout, dtype, head_dim, page_size, num_tokens)
    for layout in ("NHD", "HND")
    for dtype in DTYPES
    for head_dim in (64, 80, 128)
    for page_size in (1, 5, 16)
    for num_tokens in (0, 1, 45, 300)
]


@pytest.mark.parametrize(
    "layout,dtype,head_dim,page_size,num_tokens",
    GRID,
    ids=[f"{g[0]}-{str(g[1])[6:]}-d{g[2]}-p{g[3]}-t{g[4]}" for g in GRID],
)
def test_append_matches_reference(layout, dtype, head_dim, page_size, num_tokens):
    heads = 2
    gen = torch.Generator().manual_seed(head_dim * 1000 + page_size * 10 + num_tokens)
    num_pages = -(-(num_tokens + 20) // page_size)
    cache = random_pool(num_pages, page_size, heads, head_dim, dtype, layout, gen)
    k, v = strided_kv(num_tokens, heads, head_dim, dtype, gen, v_transposed=num_tokens % 2 == 1)
    slots = random_slots(num_tokens, num_pages * page_size, gen)
    want = cache.clone()
    reference.append_paged_kv(k, v, want, slots, layout)
    (got,) = on_dev(cache)
    append_paged_kv(to_dev_view(k), to_dev_view(v), got, slots.to(DEV), layout)
    assert_same_bits(got, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_view_and_nan_payload(layout):
    """A pool that is itself a strided view (one layer of a ``[layers, ...]`` buffer) is
    written through its strides, the slot mapping may be a view; NaN and -0.0 in K/V
    are copied bit for bit."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(3, *pool_shape(6, 4, 3, 96, layout), generator=gen).to(torch.float16)
    k, v = strided_kv(10, 3, 96, torch.float16, gen, v_transposed=True)
    k[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    slots = random_slots(10, 24, gen)
    want = big.clone()
    reference.append_paged_kv(k, v, want[1], slots, layout)
    (got,) = on_dev(big)
    slots_view = torch.stack([slots, -slots - 2], 1).to(DEV)[:, 0]  # a strided slot mapping, too
    append_paged_kv(to_dev_view(k), to_dev_view(v), got[1], slots_view, layout)
    assert_same_bits(got, want)


def test_small_tiles_many_programs(monkeypatch):
    """The compiled tile shapes (several token tiles, one head per program, Q head
    blocks after the KV ones, a V-tail loop over row chunks) run here too."""
    monkeypatch.setattr(write, "write_tiles", lambda n, h, d: (4, 1, triton.next_power_of_2(d)))
    gen = torch.Generator().manual_seed(4)
    lens, appended, page_size = [13, 7], [13, 2], 4
    cache, indptr, indices, last, batch, pos, slots = csr_batch(lens, appended, page_size, 3, 64, "HND", gen)
    k, v = strided_kv(batch.numel(), 3, 64, torch.float32, gen, v_transposed=True)
    q = torch.randn(batch.numel(), 6, 64, generator=gen)
    want = cache.clone()
    reference.append_paged_kv(reference.rope_reference(k, pos).float(), v, want, slots, "HND")
    reference.zero_paged_v_tail(want, indptr, indices, last, "HND")
    got, q_dev = on_dev(cache, q)
    append_paged_kv(
        *on_dev(k, v), got, slots.to(DEV), "HND", rope="neox", positions=pos.to(DEV), q=q_dev,
        zero_v_tail=on_dev(indptr, indices, last),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])
    real = slots >= 0
    q_want = reference.rope_reference(q[real], pos[real])
    torch.testing.assert_close(q_dev.cpu()[real].double(), q_want, **TOL[torch.float32])


# ----------------------------------------------------------------------------- CSR entry


def csr_batch(lens, appended, page_size, heads, head_dim, layout, gen, dtype=torch.float32, window=None, spare=2):
    """A random pool and a CSR page table for requests of final lengths ``lens`` whose
    last ``appended`` tokens are new; two padding tokens (``-1``) are mixed in.
    Returns ``(cache, kv_indptr, kv_indices, kv_last_page_len, batch_indices,
    positions, slots)``, the slots computed by :func:`formats.slot_mapping`."""
    rows = torch.tensor(lens) if window is None else window.cache_len(torch.tensor(lens))
    need = [-(-int(n) // page_size) for n in rows]
    num_pages = sum(need) + spare
    tables = formats.scatter_pages(need, num_pages, gen)
    table = formats.pad_block_tables(tables)
    indptr, indices, last = formats.block_table_to_csr(table, rows, page_size)
    app_indptr = torch.tensor([0, *torch.tensor(appended).cumsum(0).tolist()])
    batch, pos = formats.get_batch_indices_positions(app_indptr, torch.tensor(lens))
    pad = torch.full((1,), -1, dtype=torch.int32)
    batch = torch.cat([pad, batch[:3], pad, batch[3:]])
    pos = torch.cat([torch.tensor([5], dtype=torch.int32), pos[:3], pad, pos[3:]])  # a pad with a position
    slots = formats.slot_mapping(table, torch.where(pos < 0, -1, batch), pos, page_size, window)
    slots[0] = -1
    cache = random_pool(num_pages, page_size, heads, head_dim, dtype, layout, gen)
    return cache, indptr, indices, last, batch, pos, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("windowed", [False, True])
def test_csr_matches_reference(layout, page_size, windowed):
    """The kernel's own CSR addressing (and ring mapping) equals the slot mapping the
    library computes from the padded table."""
    gen = torch.Generator().manual_seed(page_size + 2 * windowed)
    window = RingWindow(24, 3, page_size) if windowed else None
    lens, appended = [37, 1, 60, 9], [37, 1, 1, 4]  # prefill, decode, decode after wrap, chunk
    cache, indptr, indices, last, batch, pos, slots = csr_batch(
        lens, appended, page_size, 2, 80, layout, gen, torch.bfloat16, window
    )
    if windowed:  # a wrapped prefill writes a ring slot more than once: keep the last write per slot
        keep = torch.ones_like(slots, dtype=torch.bool)
        seen = set()
        for i in reversed(range(slots.numel())):
            if int(slots[i]) >= 0 and int(slots[i]) in seen:
                keep[i] = False
            seen.add(int(slots[i]))
        batch, pos, slots = batch[keep], pos[keep], slots[keep]
    k, v = strided_kv(batch.numel(), 2, 80, torch.bfloat16, gen, v_transposed=True)
    assert torch.equal(csr_slot_mapping(batch, pos, indices, indptr, page_size, window), slots)
    want = cache.clone()
    reference.append_paged_kv(k, v, want, slots, layout)
    (got,) = on_dev(cache)
    append_paged_kv_csr(
        to_dev_view(k), to_dev_view(v), got, *on_dev(batch, pos, indices, indptr), layout, window=window
    )
    assert_same_bits(got, want)


# ----------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("entry", ["slots", "csr"])
def test_rope_k_and_q(style, dtype, entry):
    """K is stored rotated (``k`` itself untouched), V plainly, Q rotated in place (GQA:
    4 query heads per KV head), all at the tokens' absolute positions, theta 500000.
    Padding tokens' Q rows stay as they were."""
    gen = torch.Generator().manual_seed(7)
    layout = "NHD" if entry == "slots" else "HND"
    lens, appended = [300, 2100], [40, 5]  # positions up to 2099: the angle's precision matters
    cache, indptr, indices, last, batch, pos, slots = csr_batch(lens, appended, 16, 2, 80, layout, gen, dtype)
    k, v = strided_kv(batch.numel(), 2, 80, dtype, gen, v_transposed=False)
    q = torch.randn(batch.numel(), 8, 80, generator=gen).to(dtype)
    theta, real = 500000.0, slots >= 0
    k_rot = reference.rope_reference(k, pos.clamp(min=0), theta, style)
    k_in, want = k.clone(), cache.clone()
    reference.append_paged_kv(k_rot.to(dtype), v, want, slots, layout)
    got, q_dev, k_dev, v_dev = on_dev(cache, q, k, v)
    args = dict(rope=style, rope_theta=theta, q=q_dev)
    if entry == "slots":
        append_paged_kv(k_dev, v_dev, got, slots.to(DEV), layout, positions=pos.to(DEV), **args)
    else:
        append_paged_kv_csr(k_dev, v_dev, got, *on_dev(batch, pos, indices, indptr), layout, **args)
    got = got.cpu()
    assert_same_bits(k_dev, k_in)
    # K rows: the written slots must match the rotated reference; all else bit-exact.
    rows = formats.PAD != slots
    page, row = slots[rows] // 16, slots[rows] % 16
    sel = (page, 0, row) if layout == "NHD" else (page, 0, slice(None), row)
    torch.testing.assert_close(got[sel].double(), k_rot[rows], **TOL[dtype])  # [n, heads, dim] in both layouts
    got[sel] = want[sel]  # the rest (V, untouched slots) must equal the snapshot exactly
    assert_same_bits(got, want)
    q_got = q_dev.cpu()
    torch.testing.assert_close(
        q_got[real].double(), reference.rope_reference(q[real], pos[real], theta, style), **TOL[dtype]
    )
    assert_same_bits(q_got[~real], q[~real])


def test_rope_window_uses_absolute_position():
    """With a ring window the row comes from ``kv_token_idx`` but the rotation from the
    absolute position (a wrapped token is not rotated as if it sat at its ring row)."""
    gen = torch.Generator().manual_seed(8)
    window = RingWindow(16, 2, 4)
    cache, indptr, indices, last, batch, pos, slots = csr_batch([50], [1], 4, 1, 64, "NHD", gen, window=window)
    k, v = strided_kv(batch.numel(), 1, 64, torch.float32, gen, v_transposed=False)
    want = cache.clone()
    reference.append_paged_kv(reference.rope_reference(k, pos.clamp(min=0), style="gptj").float(), v, want, slots)
    (got,) = on_dev(cache)
    append_paged_kv_csr(*on_dev(k, v), got, *on_dev(batch, pos, indices, indptr), window=window, rope="gptj")
    torch.testing.assert_close(got.cpu(), want, **TOL[torch.float32])


# ----------------------------------------------------------------------------- V tail


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [5, 16])
def test_v_tail_zeroed_rest_untouched(layout, page_size):
    """A NaN-poisoned pool, a prefill of 3 requests: every byte equals the reference
    write plus zeroed V tails (rows ``last .. page_size - 1`` of each last page), NaN
    elsewhere untouched; the same through the CSR entry and the standalone kernel."""
    gen = torch.Generator().manual_seed(page_size)
    lens = [11, 16, 1]
    cache, indptr, indices, last, batch, pos, slots = csr_batch(lens, lens, page_size, 2, 64, layout, gen, spare=3)
    cache.fill_(float("nan"))
    k, v = strided_kv(batch.numel(), 2, 64, torch.float32, gen, v_transposed=True)
    want = cache.clone()
    reference.append_paged_kv(k, v, want, slots, layout)
    reference.zero_paged_v_tail(want, indptr, indices, last, layout)
    assert want.isnan().any() and (want == 0).any()
    table = on_dev(indptr, indices, last)
    (got,) = on_dev(cache)
    append_paged_kv(to_dev_view(k), to_dev_view(v), got, slots.to(DEV), layout, zero_v_tail=table)
    assert_same_bits(got, want)
    (got,) = on_dev(cache)
    append_paged_kv_csr(
        to_dev_view(k), to_dev_view(v), got, *on_dev(batch, pos), table[1], table[0], layout, zero_v_tail=table
    )
    assert_same_bits(got, want)
    (got,) = on_dev(cache)
    append_paged_kv(*on_dev(k[:0], v[:0]), got, slots[:0].to(DEV), layout)  # zero tokens: nothing
    assert_same_bits(got, cache)
    zero_paged_v_tail(got, *table, layout)
    reference.zero_paged_v_tail(cache, indptr, indices, last, layout)
    assert_same_bits(got, cache)


# ----------------------------------------------------------------------------- int64 addressing


@triton.jit
def _offset_probe(out_ptr, page_ptr, row_ptr, stride_page, stride_n, stride_h, N: tl.constexpr):
    i = tl.arange(0, N)
    page = tl.load(page_ptr + i)
    row = tl.load(row_ptr + i)
    off = cache_offset(page, 1, row, i, i, stride_page, 7, stride_n, stride_h, 1)
    tl.store(out_ptr + i, off)


def test_cache_offset_is_int64():
    """The write kernel's offset helper with int32 page ids and strides whose products pass
    2**31 (a pool of 2**33 elements): exact, where int32 arithmetic would wrap.

    Allocating such a pool (8 GiB at fp16 for the smallest honest case) is not cheap
    on CPU CI, so the arithmetic is checked directly (the write kernel computes every
    cache address through this helper; the read kernel's ``_kv_row_offsets`` has its own
    probe in test_kernel_read.py), and :func:`test_large_pool_gpu` writes a real one.
    """
    page = torch.tensor([0, 1, 70_000, 2**20 - 1], dtype=torch.int32, device=DEV)
    row = torch.tensor([0, 3, 15, 15], dtype=torch.int32, device=DEV)
    stride_page, stride_n, stride_h = 2 * 16 * 8 * 128 * 2, 8 * 128, 128  # offsets up to ~2**36
    out = torch.empty(4, dtype=torch.int64, device=DEV)
    _offset_probe[(1,)](out, page, row, stride_page, stride_n, stride_h, N=4)
    want = [
        p * stride_page + 7 + r * stride_n + i * stride_h + i
        for i, (p, r) in enumerate(zip(page.tolist(), row.tolist()))
    ]
    assert out.tolist() == want
    assert max(want) > 2**32


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 24 * 2**30,
    reason="needs a CUDA GPU with >= 24 GiB (a pool of more than 2**31 fp16 elements)",
)
def test_large_pool_gpu():
    """A real pool past 2**31 elements (4.3 GB fp16): tokens on its last pages land right."""
    layout, page_size, heads, head_dim = "NHD", 16, 8, 128
    num_pages = 2**31 // (2 * page_size * heads * head_dim) + 8
    cache = torch.zeros(pool_shape(num_pages, page_size, heads, head_dim, layout), dtype=torch.float16, device=DEV)
    assert cache.numel() > 2**31
    gen = torch.Generator().manual_seed(9)
    k, v = (torch.randn(40, heads, head_dim, generator=gen).half() for _ in range(2))
    slots = torch.arange(num_pages * page_size - 40, num_pages * page_size)
    slots[::2] = torch.arange(20) + 3  # half at the front
    append_paged_kv(*on_dev(k, v), cache, slots.to(DEV), layout)
    page, row = slots // page_size, slots % page_size
    assert_same_bits(cache[page.to(DEV), 0, row.to(DEV)], k)
    assert_same_bits(cache[page.to(DEV), 1, row.to(DEV)], v)
    cache[page.to(DEV), :, row.to(DEV)] = 0
    assert int(torch.count_nonzero(cache)) == 0


# ----------------------------------------------------------------------------- validation


def _tail(last: int):
    """``zero_v_tail`` of one request owning page 2, its last page ``last`` rows long."""
    i32 = dict(dtype=torch.int32, device=DEV)
    return torch.tensor([0, 1], **i32), torch.tensor([2], **i32), torch.tensor([last], **i32)


# (name, call(k, v, cache, slots, extra), message): each call must raise a ValueError
# matching ``message`` and leave the pool untouched (the inputs are built by
# test_validation_names_argument_and_writes_nothing).
BAD_CALLS = [
    ("shape", lambda k, v, c, s, e: append_paged_kv(k[:, :1], v, c, s), r"^k has shape"),
    ("dtype", lambda k, v, c, s, e: append_paged_kv(k.half(), v, c, s), r"k\.dtype"),
    ("slot range", lambda k, v, c, s, e: append_paged_kv(k, v, c, s.clone().fill_(-2)), r"slot_mapping\[0\]"),
    ("slot high", lambda k, v, c, s, e: append_paged_kv(k, v, c, s + 40), r"slot_mapping\[\d+\].*outside"),
    ("duplicate", lambda k, v, c, s, e: append_paged_kv(k, v, c, s.clone().fill_(3)), r"slot 3 more than once"),
    ("list slots", lambda k, v, c, s, e: append_paged_kv(k, v, c, s.tolist()), r"slot_mapping must be a torch"),
    ("float slots", lambda k, v, c, s, e: append_paged_kv(k, v, c, s.float()), r"slot_mapping must hold int"),
    ("layout", lambda k, v, c, s, e: append_paged_kv(k, v, c, s, "NDH"), r"layout"),
    ("fp64 cache", lambda k, v, c, s, e: append_paged_kv(k.double(), v.double(), c.double(), s), r"cache\.dtype"),
    (
        "expanded cache",
        lambda k, v, c, s, e: append_paged_kv(k, v, c[:1].expand(c.shape), s),
        r"cache .*reaches some elements twice",
    ),
    ("q without rope", lambda k, v, c, s, e: append_paged_kv(k, v, c, s, q=e["q"]), r"q is given but rope"),
    ("rope style", lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="llama", positions=e["pos"]), r"rope="),
    ("no positions", lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="neox"), r"needs positions"),
    (
        "negative position",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="neox", positions=e["pos"] - 5),
        r"positions\[0\]=-5",
    ),
    (
        "theta",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="neox", positions=e["pos"], rope_theta=float("inf")),
        r"rope_theta",
    ),
    (
        "q shape",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="gptj", positions=e["pos"], q=e["q"][:1]),
        r"q has shape",
    ),
    (
        "q expanded",
        lambda k, v, c, s, e: append_paged_kv(
            k, v, c, s, rope="gptj", positions=e["pos"], q=e["q"][:, :1].expand(e["q"].shape)
        ),
        r"q .*reaches some elements twice",
    ),
    (
        "tail overwrites a token",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, zero_v_tail=_tail(1)),
        r"token \d+ is written to slot 9, inside a V tail",
    ),
    (
        "tail last len",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, zero_v_tail=_tail(5)),
        r"kv_last_page_len\[0\]=5",
    ),
    (
        "csr beyond pages",
        lambda k, v, c, s, e: append_paged_kv_csr(k, v, c, e["batch"], e["pos"] + 4, *e["csr"]),
        r"positions\[\d+\]=\d+ falls in block 2 but request 0 owns 2 pages",
    ),
    (
        "csr request id",
        lambda k, v, c, s, e: append_paged_kv_csr(k, v, c, e["batch"] + 1, e["pos"], *e["csr"]),
        r"batch_indices\[0\]=1 but kv_indptr describes 1",
    ),
    (
        "csr more tokens than k rows",
        lambda k, v, c, s, e: append_paged_kv_csr(k[:3], v[:3], c, e["batch"], e["pos"], *e["csr"]),
        r"batch_indices has 4 entries but k has only 3 rows",
    ),
    (
        "csr batch index -2",
        lambda k, v, c, s, e: append_paged_kv_csr(k, v, c, e["batch"] - 2, e["pos"], *e["csr"]),
        r"batch_indices\[0\]=-2 is negative; only -1 marks a padding token",
    ),
    (
        "csr position -3",
        lambda k, v, c, s, e: append_paged_kv_csr(k, v, c, e["batch"], e["pos"] - 3, *e["csr"]),
        r"positions\[0\]=-3 is negative; only -1 marks a padding token",
    ),
    (
        "csr page outside the pool",
        lambda k, v, c, s, e: append_paged_kv_csr(
            k, v, c, e["batch"], e["pos"], torch.tensor([1, 25], dtype=torch.int32, device=DEV), e["csr"][1]
        ),
        r"kv_indices\[1\]=25 is not a page id of the pool \(3 pages\); token 1 \(request 0, position 5\)",
    ),
    (
        "slot_mapping None",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, None),
        r"slot_mapping is None",
    ),
    (
        "q overlaps the pool through another storage",
        lambda k, v, c, s, e: append_paged_kv(k, v, c, s, rope="neox", positions=e["pos"], q=_alias(c, (4, 4, 8))),
        r"q overlaps the memory of cache",
    ),
    (
        "k is a view of the pool",
        lambda k, v, c, s, e: append_paged_kv(c[0, 0], v, c, s),
        r"k overlaps the memory of cache",
    ),
    (
        "csr window page size",
        lambda k, v, c, s, e: append_paged_kv_csr(k, v, c, e["batch"], e["pos"], *e["csr"], window=RingWindow(8, 0, 2)),
        r"tokens_per_block",
    ),
]


@pytest.mark.parametrize("name,call,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_validation_names_argument_and_writes_nothing(name, call, message):
    """4 tokens of page size 4 into pages 1 and 2 (slots 4, 9, 5, 8); 3 pages."""
    gen = torch.Generator().manual_seed(10)
    cache = random_pool(3, 4, 2, 8, torch.float32, "NHD", gen).to(DEV)
    k, v = on_dev(*strided_kv(4, 2, 8, torch.float32, gen, v_transposed=False))
    slots = torch.tensor([4, 9, 5, 8], device=DEV)
    extra = dict(
        q=torch.randn(4, 4, 8, device=DEV),
        pos=torch.tensor([0, 5, 1, 4], device=DEV),
        batch=torch.zeros(4, dtype=torch.int32, device=DEV),
        csr=(torch.tensor([1, 2], dtype=torch.int32, device=DEV), torch.tensor([0, 2], dtype=torch.int32, device=DEV)),
    )
    before = cache.clone()
    with pytest.raises(ValueError, match=message):
        call(k, v, cache, slots, extra)
    assert torch.equal(cache, before)


def _alias(cache: torch.Tensor, shape) -> torch.Tensor:
    """A tensor over the pool's bytes that shares no storage object with it (a second
    storage on the same memory, as ``torch.from_numpy`` or an arena allocator makes):
    comparing storage pointers cannot see the overlap, comparing byte ranges does."""
    alias = torch.utils.dlpack.from_dlpack(cache.view(-1)[8 : 8 + math.prod(shape)]).view(shape)
    assert alias.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    return alias


def test_a_slot_mapping_inside_the_pool_is_refused_before_anything_is_written():
    """The append writes the pool while its programs read the slots: slots stored in the
    pool's own bytes would be overwritten mid-launch."""
    cache = torch.zeros(3, 2, 4, 2, 8, device=DEV)
    slots = cache.view(-1)[-4:].view(torch.int32)
    slots.copy_(torch.tensor([4, 9, 5, 8], dtype=torch.int32))  # valid slots, in page 2's V rows
    before = cache.clone()
    k = torch.ones(4, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="slot_mapping overlaps the memory of cache"):
        append_paged_kv(k, k, cache, slots)
    assert torch.equal(cache, before)


def test_empty_pool_dimension_is_refused_before_any_launch(monkeypatch):
    """A pool with page_size 0 used to be launched for an all-padding append (and divide
    by zero in the interpreter); now its empty dimension is refused first."""
    monkeypatch.setattr(write, "append_kernel", NoLaunch())
    cache = torch.zeros(3, 2, 0, 2, 8, device=DEV)
    k = torch.ones(2, 2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"cache has shape \(3, 2, 0, 2, 8\): page_size is 0"):
        append_paged_kv(k, k, cache, torch.full((2,), -1, device=DEV))


def test_valid_call_of_the_validation_setup():
    """The setup of the validation table is itself valid (so each bad call fails for
    its own reason), including the CSR form."""
    cache = torch.zeros(3, 2, 4, 2, 8, device=DEV)
    k, v = torch.ones(4, 2, 8, device=DEV), 2 * torch.ones(4, 2, 8, device=DEV)
    append_paged_kv_csr(
        k, v, cache, torch.zeros(4, dtype=torch.int32, device=DEV), torch.tensor([0, 5, 1, 4], device=DEV),
        torch.tensor([1, 2], dtype=torch.int32, device=DEV), torch.tensor([0, 2], dtype=torch.int32, device=DEV),
    )  # fmt: skip
    assert int(cache[1:, 0].sum()) == 4 * 2 * 8 and int(cache[0].abs().sum()) == 0


def test_self_overlap_check():
    base = torch.zeros(4, 6)
    check_no_self_overlap("x", base[:, :3])  # a slice: fine
    check_no_self_overlap("x", base.t())
    check_no_self_overlap("x", base[:1].expand(1, 6))  # size-1 dims do not matter
    with pytest.raises(ValueError, match="x .*twice"):
        check_no_self_overlap("x", base.as_strided((4, 4), (1, 1)))

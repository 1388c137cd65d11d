"""The Triton prefill kernel (many queries per sequence over the paged pool) against the
float64 reference, the decode kernel, and one-shot attention over a contiguous prompt.

Runs in Triton's interpreter on CPU and compiled on CUDA (``runtime.device()``); the
references run on CPU copies. Tolerances are the harness's decode tolerances
(:data:`pagedkv_lab.verify.TOLERANCES`, pass rule ``|err| <= atol + rtol |ref|``).
The case grid is the harness's (:func:`pagedkv_lab.verify.prefill_grid`), one test
per case, so a failure names its case.
"""

import dataclasses

import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import faults, verify
from pagedkv_lab.verify.compare import DTYPES, TOLERANCES, compare
from pagedkv_lab.verify.prefill_checks import prefill_case, prefill_grid, prefill_inputs
from pagedkv_lib import PagedKVPool, RingWindow, formats, reference, runtime
from pagedkv_lib.cache_layouts import kv_cache_view, to_native

# isort: split
from gpu_plans import skip_interpreted_bf16_dot

import pagedkv_kernels as kernels
import pagedkv_kernels.prefill as prefill
from pagedkv_kernels import paged_decode_attention, paged_prefill_attention, paged_prefill_attention_csr
from pagedkv_kernels.prefill_plan import tile_list

DEV = runtime.device()


def dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def run(q, cache, qo, table, lens, **kw):
    """The kernel on the backend's device, result back on CPU."""
    return paged_prefill_attention(*dev(q, cache, qo, table, lens), **kw).cpu()


def oracle(q, cache, qo, table, lens, **kw):
    return reference.paged_prefill_attention(q, cache, qo, table, lens, precision="fp64", **kw)


def assert_within_tolerance(out, ref, dtype):
    assert out.dtype == dtype and torch.isfinite(out).all()
    result = compare(out, ref, *TOLERANCES[dtype])
    assert result.passed, f"max |err| {result.max_abs:.3g}, err/tol {result.tol_ratio:.3g} at {result.worst}"


def indptr(q_lens):
    return torch.tensor([0, *torch.tensor(q_lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def case_inputs(requests, *, dtype="fp32", layout="NHD", head_dim=64, page_size=16, group=2, hk=2, **extra):
    case = {"layout": layout, "dtype": dtype, "head_dim": head_dim, "page_size": page_size, "group": group,
            "num_kv_heads": hk, "requests": tuple(requests), **extra}  # fmt: skip
    return prefill_inputs(case)


# ----------------------------------------------------------------------------- the case grid


def _case_id(case):
    window = f"-w{case['window'][0]}s{case['window'][1]}" if case.get("window") else ""
    reqs = "_".join(f"{n}q{m}" for n, m in case["requests"])
    return f"{case['layout']}-{case['dtype']}-d{case['head_dim']}-p{case['page_size']}-g{case['group']}{window}-{reqs}"


GRID = prefill_grid()


@pytest.mark.parametrize("case", GRID, ids=[_case_id(c) for c in GRID])
def test_harness_grid_case_matches_float64_reference(case):
    skip_interpreted_bf16_dot(case["dtype"])
    result = prefill_case(paged_prefill_attention, case)
    assert result.passed, result.detail


def test_grid_covers_what_the_issue_lists():
    cases = [(c, n, m) for c in GRID for n, m in c["requests"]]
    assert {c["dtype"] for c in GRID} == {"fp32", "fp16", "bf16"} and {c["layout"] for c in GRID} == {"NHD", "HND"}
    assert {1, 5, 16} <= {c["page_size"] for c in GRID} and {1, 4, 5, 8} <= {c["group"] for c in GRID}
    assert any(c["head_dim"] & (c["head_dim"] - 1) for c in GRID)  # a head dim that is not a power of two
    assert any(m == n > 16 for _, n, m in cases)  # a whole prompt in one chunk
    assert any(n == 2 * m for _, n, m in cases) and any(n == 3 * m for _, n, m in cases)  # 2nd and 3rd chunk
    assert any((n - m) % c["page_size"] for c, n, m in cases if 0 < m < n)  # a query range starting mid-page
    assert any(m == 1 < n for _, n, m in cases) and any(m == 0 < n for _, n, m in cases)  # decode step, no queries
    assert any(n == 0 for _, n, _ in cases)  # an empty request
    # A window narrower than a chunk: its last queries do not see its first keys.
    assert any(c.get("window") and m > c["window"][0] - c["window"][1] for c, _, m in cases)
    assert all(c.get("poison", True) for c in GRID[:6])


# ----------------------------------------------------------------------------- decode and one-shot equalities


@pytest.mark.parametrize(
    "dtype, layout, group, window",
    [
        ("fp32", "NHD", 5, None),
        ("fp16", "HND", 4, None),
        ("bf16", "NHD", 1, None),
        ("fp32", "HND", 2, (10, 3)),
    ],
)
def test_one_query_per_request_equals_the_decode_kernel(dtype, layout, group, window):
    skip_interpreted_bf16_dot(dtype)
    requests = [(1, 1), (37, 1), (0, 0), (130, 1)]
    q, cache, qo, table, lens, win = case_inputs(
        requests, dtype=dtype, layout=layout, group=group, page_size=5, window=window, one_more_block=False
    )
    out = run(q, cache, qo, table, lens, layout=layout, window=win)
    real = lens > 0  # the decode query of an empty sequence has no row in the prefill batch
    dec = paged_decode_attention(*dev(q, cache, table[real], lens[real]), layout=layout, window=win).cpu()
    atol, rtol = TOLERANCES[DTYPES[dtype]]
    assert compare(out, dec.double(), atol, rtol).passed
    assert_within_tolerance(out, oracle(q, cache, qo, table, lens, layout=layout, window=win), DTYPES[dtype])


def test_chunked_prefill_through_the_write_kernel_equals_one_shot_attention():
    """A 77-token prompt written and attended in chunks of 32, 32 and 13 (pages of 16,
    so the later chunks start mid-page) gives what one causal attention over the whole
    contiguous prompt gives."""
    gen = torch.Generator().manual_seed(7)
    n, ps, hk, group, d = 77, 16, 2, 3, 64
    k, v = (torch.randn(n, hk, d, generator=gen) for _ in range(2))
    q = torch.randn(n, hk * group, d, generator=gen)
    pool = PagedKVPool(8, ps, hk, d, torch.float32, device=DEV)
    pool.cache.fill_(float("nan"))
    table = torch.tensor([[6, 1, 4, 0, 7]], dtype=torch.int32)
    outs = []
    for start, end in ((0, 32), (32, 64), (64, 77)):
        slots = formats.slot_mapping(table, torch.zeros(end - start, dtype=torch.long), torch.arange(start, end), ps)
        kernels.append_paged_kv(*dev(k[start:end], v[start:end]), pool.cache, slots.to(DEV))
        qo = torch.tensor([0, end - start], dtype=torch.int32)
        outs.append(paged_prefill_attention(*dev(q[start:end]), pool.cache, *dev(qo, table, torch.tensor([end]))))
    chunked = torch.cat(outs).cpu()
    one_shot = reference.contiguous_attention(q, k, v, torch.arange(n))
    assert_within_tolerance(chunked, one_shot, torch.float32)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_page_size_and_layout_change_no_bit(dtype):
    """The same logical K/V on shuffled pages of 1, 5 and 16 rows in both layouts: key
    tiles run over logical tokens, so the output is bit-identical."""
    skip_interpreted_bf16_dot(dtype)
    gen = torch.Generator().manual_seed(3)
    lens, q_lens, hk, d = [45, 9, 33], [20, 9, 1], 2, 64
    k, v = (torch.randn(sum(lens), hk, d, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    q = torch.randn(sum(q_lens), 2 * hk, d, generator=gen).to(DTYPES[dtype])
    qo, sl = indptr(q_lens), torch.tensor(lens, dtype=torch.int32)
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    outs = []
    for page_size, layout in ((1, "NHD"), (5, "HND"), (16, "NHD"), (16, "HND")):
        need = [-(-n // page_size) for n in lens]
        pool = PagedKVPool(sum(need) + 1, page_size, hk, d, DTYPES[dtype], layout)
        pool.cache.fill_(float("nan"))
        table = formats.pad_block_tables(formats.scatter_pages(need, pool.num_pages, gen))
        reference.append_paged_kv(k, v, pool.cache, formats.slot_mapping(table, batch, pos, page_size), layout)
        outs.append(run(q, pool.cache, qo, table, sl, layout=layout))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert_within_tolerance(outs[-1], oracle(q, pool.cache, qo, table, sl, layout="HND"), DTYPES[dtype])


def test_csr_entry_point_equals_padded_and_its_reference_twin():
    requests = [(33, 10), (0, 0), (16, 16), (50, 1)]
    q, cache, qo, table, lens, _ = case_inputs(requests, dtype="fp16", layout="HND", group=5, page_size=16)
    kv_indptr, kv_indices, last = formats.block_table_to_csr(table, lens, 16)
    out = paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices, last), layout="HND").cpu()
    assert torch.equal(out, run(q, cache, qo, table, lens, layout="HND"))
    ref_csr = reference.paged_prefill_attention_csr(q, cache, qo, kv_indptr, kv_indices, last, layout="HND",
                                                    precision="fp64")  # fmt: skip
    assert torch.equal(ref_csr, oracle(q, cache, qo, table, lens, layout="HND"))
    assert_within_tolerance(out, ref_csr, torch.float16)


def test_strided_q_and_pool_and_a_scale():
    requests = [(40, 12), (7, 7)]
    q, wide, qo, table, lens, _ = case_inputs(requests, head_dim=96)
    cache = wide[..., 16:80]  # head dim 64 out of 96: strided rows
    q = q[..., 16:80].transpose(0, 1).contiguous().transpose(0, 1)
    assert not cache.is_contiguous() and not q.is_contiguous()
    out = run(q, cache, qo, table, lens, scale=0.3)
    assert_within_tolerance(out, oracle(q, cache.contiguous(), qo, table, lens, scale=0.3), torch.float32)


def test_contiguous_oracle_is_causal_sdpa():
    """The one-shot oracle of the chunked tests equals torch's own causal attention."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, 2, 16, generator=gen) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(x.double().transpose(0, 1) for x in (q, k, v)),
                                                            is_causal=True).transpose(0, 1)  # fmt: skip
    assert torch.allclose(reference.contiguous_attention(q, k, v, torch.arange(9)), sdpa, atol=1e-12)


def test_no_queries_at_all_returns_an_empty_result():
    q, cache, qo, table, lens, _ = case_inputs([(5, 0), (0, 0)])
    out = run(q, cache, qo, table, lens)
    assert out.shape == (0, 4, 64)


# ----------------------------------------------------------------------------- work skipped, not only masked


def test_keys_past_a_tiles_last_query_are_never_read():
    """Poison the V rows past the last query of the first query tile with NaN: that
    tile's rows stay exact only if its key loop stops at its causal limit (a loaded
    but masked key would give 0 * NaN = NaN)."""
    q, cache, qo, table, lens, _ = case_inputs([(300, 100)], group=4, hk=1)
    plan = kernels.plan_prefill(*dev(q, cache, qo, table, lens))
    last_query = plan.block_m // plan.group - 1  # the first tile's last query index
    limit = 300 - 100 + last_query  # its absolute position
    assert limit < 299
    poisoned = cache.clone()
    for pos in range(limit + 1, 300):
        poisoned[table[0, pos // 16], 1, pos % 16] = float("nan")
    out = run(q, poisoned, qo, table, lens)
    rows = slice(0, last_query + 1)
    assert_within_tolerance(out[rows], oracle(q, cache, qo, table, lens)[rows], torch.float32)
    assert out[last_query + 1 :].isnan().any()  # the later tiles do read those keys


def test_keys_between_the_sinks_and_the_window_are_never_read():
    """A ring that has not wrapped (so every position keeps its own row): the rows of
    positions between the sinks and the window's start are NaN, and no query sees them."""
    window = RingWindow(8, 2, 4, one_more_block=True)  # 2 sinks, bubble 2, a ring of 10 rows
    q, cache, qo, table, lens, _ = case_inputs([(12, 3)], page_size=4, window=(8, 2))
    assert window.cache_len(12) == 14 and window.max_chunk_len() >= 3
    poisoned = cache.clone()
    for pos in (2, 3):  # visible to nobody: queries at 9..11 see 0, 1 and from 4 (resp. 5, 6) on
        row = window.kv_token_idx(pos)
        poisoned[table[0, row // 4], :, row % 4] = float("nan")
    out = run(q, poisoned, qo, table, lens, window=window)
    assert_within_tolerance(out, oracle(q, cache, qo, table, lens, window=window), torch.float32)


# ----------------------------------------------------------------------------- the plain kernel and its variants


@pytest.mark.parametrize(
    "dtype, layout, extra, csr, causal",
    [("bf16", "HND", {"window": (10, 3)}, False, True), ("fp32", "NHD", {"window_left": 6}, True, False)],
    ids=["ring-padded", "linear-csr-non-causal"],
)
def test_on_the_pool_the_any_layout_kernel_gives_the_plain_kernels_bits(dtype, layout, extra, csr, causal):
    """The variants layer on the plain kernel, they do not fork it: the plan of a call on
    the suite's pool runs ``prefill_kernel``, and ``prefill_any_layout_kernel`` launched
    on that plan (K and V through the pool's view, V after K) writes the same output and
    log-sum-exp, bit for bit (each case: two launches of two tiles, about 0.2 s)."""
    skip_interpreted_bf16_dot(dtype)
    q, cache, qo, table, lens, win = case_inputs([(30, 6), (0, 0), (11, 3)], dtype=dtype, layout=layout,
                                                 head_dim=32, page_size=5, hk=1, **extra)  # fmt: skip
    if csr:
        plan = kernels.plan_prefill_csr(*dev(q, cache, qo, *formats.block_table_to_csr(table, lens, 5)), layout,
                                        causal=causal, window=win)  # fmt: skip
    else:
        plan = kernels.plan_prefill(*dev(q, cache, qo, table, lens), layout, window=win, causal=causal)
    assert plan.plain, "a call on the suite's pool, with no tree and no new tokens apart, runs the plain kernel"
    q, cache = dev(q, cache)
    out, lse = kernels.run_prefill(plan, q, cache, return_lse=True)
    out_any, lse_any = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    prefill.launch_any_layout(plan, q, kv_cache_view(cache, layout), None, None, out_any, lse_any, True)
    assert torch.equal(out_any, out) and torch.equal(lse_any, lse)
    assert lse.isfinite().all() and not out.isnan().any()


def test_the_plan_picks_the_plain_kernel_for_the_pool_and_the_any_layout_one_otherwise():
    q, cache, qo, table, lens, _ = case_inputs([(12, 4)], page_size=4)
    pool = kernels.plan_prefill(*dev(q, cache, qo, table, lens))
    pair = kernels.plan_prefill(*dev(q), to_native(cache.to(DEV), "kv_tuple"), *dev(qo, table, lens))
    tree = kernels.plan_prefill(*dev(q, cache, qo, table, lens), tree_mask=torch.ones(4, 4, dtype=torch.bool).tril()
                                .to(DEV))  # fmt: skip
    k_new, v_new = (torch.zeros(4, 2, 64, device=DEV) for _ in range(2))
    apart = kernels.plan_prefill(*dev(q, cache, qo, table, lens), k_new=k_new, v_new=v_new)
    assert [p.plain for p in (pool, pair, tree, apart)] == [True, False, False, False]


# ----------------------------------------------------------------------------- product modes


@pytest.mark.parametrize("mode, dtype", [("fp32", "fp32"), ("fp32", "bf16"), ("fp16", "fp16")])
def test_tl_dot_modes_match_the_reference_in_the_interpreter(mode, dtype):
    """The ``tl.dot`` paths a GPU takes, forced through the plan: fp32 operands (also a
    bf16 pool converted on load) and fp16 operands with P rounded to fp16. (The bf16
    operand mode cannot run in the interpreter, whose bf16 arithmetic is wrong.)"""
    q, cache, qo, table, lens, _ = case_inputs([(40, 12), (5, 5), (20, 1)], dtype=dtype, group=5, head_dim=80)
    plan = dataclasses.replace(kernels.plan_prefill(*dev(q, cache, qo, table, lens)), dot_mode=mode)
    out = kernels.run_prefill(plan, *dev(q, cache)).cpu()
    assert_within_tolerance(out, oracle(q, cache, qo, table, lens), DTYPES[dtype])


def test_dot_mode_choice():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    if not runtime.gpu_plans():
        assert {prefill.dot_mode(a, b) for a in (f32, f16, bf16) for b in (f32, f16, bf16)} == {"sum"}
    else:
        assert prefill.dot_mode(f16, f16) == "fp16" and prefill.dot_mode(bf16, bf16) == "bf16"
        assert prefill.dot_mode(f32, f32) == prefill.dot_mode(f16, bf16) == prefill.dot_mode(bf16, f32) == "fp32"


def test_tile_list_covers_every_row_once_longest_first():
    q_lens, seq_lens = torch.tensor([5, 0, 40, 1]), torch.tensor([5, 9, 100, 30])
    request, row, pairs = tile_list(q_lens, seq_lens, group=3, block_m=16, window=None)
    covered = sorted((int(b), int(r) + i) for b, r in zip(request, row) for i in range(16) if r + i < q_lens[b] * 3)
    assert covered == [(b, r) for b in range(4) for r in range(int(q_lens[b]) * 3)]
    last = seq_lens[request] - q_lens[request] + torch.minimum((row + 15) // 3, q_lens[request] - 1)
    assert (last[:-1] >= last[1:]).all()  # longest key range first
    assert pairs == sum(int(min(16, q_lens[b] * 3 - r)) * int(k + 1) for b, r, k in zip(request, row, last))


# ----------------------------------------------------------------------------- the fault


def test_chunk_local_mask_hides_on_whole_prompts_and_shows_on_later_chunks():
    broken = faults.chunk_local_mask(paged_prefill_attention)
    whole = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 16, "group": 2, "num_kv_heads": 2,
             "requests": ((37, 37), (9, 9))}  # fmt: skip
    assert prefill_case(broken, whole).passed  # a first chunk is right: the bug needs later chunks to show
    later = prefill_case(broken, {**whole, "requests": ((48, 16), (9, 9))})
    assert not later.passed and "request 0 (seq_len 48, q_len 16), query 0 (position 32)" in later.detail


# ----------------------------------------------------------------------------- the harness's own checks


def test_prefill_case_fails_a_callable_that_writes_the_pool_or_its_inputs():
    case = {"layout": "HND", "dtype": "fp16", "head_dim": 64, "page_size": 5, "group": 2, "num_kv_heads": 1,
            "requests": ((12, 4),)}  # fmt: skip

    def scribbles(q, cache, qo_indptr, block_tables, seq_lens, **kw):
        out = reference.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, **kw)
        cache[0, 1, 0, 0, 0] = 7.0
        q[0, 0, 0] = 0.5
        return out

    result = prefill_case(scribbles, case)
    assert not result.passed
    assert "wrote into the pool" in result.detail and "modified its input q" in result.detail
    assert prefill_case(reference.paged_prefill_attention, case).passed


def test_prefill_repro_line_replays_a_failure():
    case = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 5, "group": 2, "num_kv_heads": 1,
            "requests": ((21, 5),)}  # fmt: skip
    failure = verify.run_case("prefill", case, prefill_fn=paged_prefill_attention, faults={"chunk_local_mask"})
    assert failure.passed is False
    assert "prefill_fn='pagedkv_kernels.prefill:paged_prefill_attention'" in failure.repro
    assert "chunk_local_mask" in failure.repro
    replay = {}
    exec(failure.repro.replace("verify.run_case(", "result = verify.run_case(", 1), replay)
    assert replay["result"].passed is False and replay["result"].detail == failure.detail
    assert verify.run_case("prefill", case, prefill_fn=paged_prefill_attention).passed


# ----------------------------------------------------------------------------- validation


@pytest.fixture
def no_launch(monkeypatch):
    for kernel in ("prefill_kernel", "prefill_any_layout_kernel"):
        monkeypatch.setattr(prefill, kernel, NoLaunch())


def _args():
    q, cache, qo, table, lens, _ = case_inputs([(20, 8), (5, 5)], dtype="fp16")
    return dict(q=q, cache=cache, qo_indptr=qo, block_tables=table, seq_lens=lens)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple"),
        (lambda a: a.update(q=a["q"].double()), r"q\.dtype"),
        (lambda a: a.update(qo_indptr=torch.tensor([1, 8, 13])), "qo_indptr"),
        (lambda a: a.update(qo_indptr=torch.tensor([0, 8, 12])), r"qo_indptr\[-1\]"),
        (lambda a: a.update(qo_indptr=torch.tensor([0, 8])), "qo_indptr"),
        (lambda a: a.update(qo_indptr=torch.tensor([0, 14, 13])), "request 1"),
        (lambda a: a.update(seq_lens=torch.tensor([7, 5], dtype=torch.int32)), r"request 0 has 8 queries"),
        (lambda a: a.update(seq_lens=torch.tensor([40, 5], dtype=torch.int32)), r"seq_lens\[0\]"),
        (lambda a: a["block_tables"].__setitem__((1, 0), -1), r"block_tables\[1, 0\]"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables"),
        (lambda a: a.update(scale=float("inf")), "scale"),
        (lambda a: a.update(window=8), "window"),
        (lambda a: a.update(window=RingWindow(8, 0, 16)), "overwrites ring slots"),
        (lambda a: a.update(layout="XYZ"), "layout"),
    ],
)
def test_bad_input_is_refused_by_name_before_launch(no_launch, change, match):
    a = _args()
    change(a)
    a = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**a)


def test_csr_bad_input_is_refused_by_name_before_launch(no_launch):
    a = _args()
    kv_indptr, kv_indices, last = formats.block_table_to_csr(a["block_tables"], a["seq_lens"], 16)
    q, cache, qo = a["q"], a["cache"], a["qo_indptr"]
    with pytest.raises(ValueError, match=r"kv_indices\[0\]"):
        paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices + 100, last))
    with pytest.raises(ValueError, match="request 1 has 5 queries.*kv_last_page_len"):
        paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices, torch.tensor([16, 4])))
    with pytest.raises(ValueError, match="kv_last_page_len"):
        paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices, last + 16))


def test_run_prefill_refuses_other_shapes_than_planned(no_launch):
    a = _args()
    plan = kernels.plan_prefill(*dev(*a.values()))
    with pytest.raises(ValueError, match="q has shape"):
        kernels.run_prefill(plan, a["q"][:5].to(DEV), a["cache"].to(DEV))
    with pytest.raises(ValueError, match="q.dtype"):
        kernels.run_prefill(plan, a["q"].float().to(DEV), a["cache"].to(DEV))
    with pytest.raises(ValueError, match="cache has shape"):
        kernels.run_prefill(plan, a["q"].to(DEV), a["cache"][:-1].to(DEV))

"""The read side's other two routes (issue 38): the page-pointer decode (MMHA's
host-flattened page addresses, ``kernels.paged_decode_attention_page_pointers``) and
the descriptor decode (XQA's TMA page tiles, ``kernels.paged_decode_attention_descriptors``).

Each is compared with the float64 reference and with the generic decode on a few small
cases (GQA, both layouts, a ring and a linear window, an empty sequence, a pool whose
unwritten rows hold NaN); its bad inputs are refused with a ValueError naming the
argument before launch; the page-pointer route's host checks are proven by the faulty
parts of :mod:`pagedkv_lab.faults.read_routes`, and each kernel's reading by the
mutants of ``tests/mutants.py`` (``ROUTE_MUTANTS``). The harness's whole decode grid on
both routes (with isolation for the page-pointer route) is behind ``-m slow`` (about
30 s); the compile check runs it under GPU plans.

Cost: about 10 s on 2 cores (interpreter launches on pools of a few pages; each mutant
copies the kernels package once).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import mutants
import pytest
import torch

import pagedkv_kernels as kernels
from pagedkv_kernels import decode_page_pointers
from pagedkv_lab import faults
from pagedkv_lib import reference
from pagedkv_lib.window import LinearWindow, RingWindow

ROOT = Path(__file__).resolve().parents[1]
ROUTES = {
    "pointers": kernels.paged_decode_attention_page_pointers,
    "descriptors": kernels.paged_decode_attention_descriptors,
}
ATOL = {torch.float32: 2e-6, torch.float16: 2e-3}  # against float64: fp32 arithmetic, fp16 output rounding

PAGE, NUM_KV_HEADS, GROUP, HEAD_DIM, NUM_PAGES = 8, 2, 2, 16, 12


def _written_rows(table, lens, window) -> set[tuple[int, int]]:
    """``(page, row)`` of every cache row a sequence's positions were written to."""
    rows = set()
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        cache_rows = pos if not isinstance(window, RingWindow) else window.kv_token_idx(pos)
        rows |= {(int(table[b, r // PAGE]), int(r % PAGE)) for r in cache_rows}
    return rows


def _case(layout="NHD", dtype=torch.float32, window=None, lens=(23, 9, 0), seed=0):
    """A pool of 12 pages of 8 rows, 2 KV heads, head dim 16, GQA group 2; rows no
    sequence wrote hold NaN (what the route must never let into its output)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES, 2, PAGE, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.full(shape, float("nan"))
    lens = torch.tensor(lens, dtype=torch.int32)
    table = torch.tensor([[3, 1, 7, 10], [0, 5, -1, -1], [2, -1, -1, -1]], dtype=torch.int32)
    for page, row in _written_rows(table, lens, window):
        cache[page, :, row] = torch.randn((2, NUM_KV_HEADS, HEAD_DIM), generator=gen)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    q = torch.randn((len(lens), NUM_KV_HEADS * GROUP, HEAD_DIM), generator=gen)
    return q.to(dtype), cache.to(dtype), table, lens


CASES = {
    "nhd_fp32": {},
    "hnd_fp16": {"layout": "HND", "dtype": torch.float16},
    "ring": {"window": RingWindow(12, 2, PAGE), "lens": (30, 9, 0)},
    "linear": {"window": LinearWindow(5), "lens": (30, 9, 1)},
}


def _max_error(fn, **kw) -> float:
    q, cache, table, lens = _case(**kw)
    window = kw.get("window")
    layout = kw.get("layout", "NHD")
    want = reference.paged_decode_attention(q, cache, table, lens, layout=layout, window=window, precision="fp64")
    got = fn(q, cache, table, lens, layout=layout, window=window)
    assert got.dtype == q.dtype and got.shape == q.shape
    return (got.double() - want).abs().max().item()


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("route", ROUTES)
def test_each_route_equals_float64_and_the_generic_decode(route, name):
    kw = CASES[name]
    err = _max_error(ROUTES[route], **kw)
    tol = ATOL[kw.get("dtype", torch.float32)]
    assert err <= tol, f"{route} on {name}: {err:.3g} from float64 (tolerance {tol:g})"
    q, cache, table, lens = _case(**kw)
    layout, window = kw.get("layout", "NHD"), kw.get("window")
    plain = kernels.paged_decode_attention(q, cache, table, lens, layout=layout, window=window)
    got = ROUTES[route](q, cache, table, lens, layout=layout, window=window)
    torch.testing.assert_close(got, plain, atol=tol, rtol=0, msg=f"{route} on {name}: not the generic decode's result")


@pytest.mark.parametrize("mutant", mutants.ROUTE_MUTANTS, ids=lambda m: m.name)
def test_each_route_mutant_is_caught_against_float64(mutant):
    fn = mutants.build(mutant)
    errors = {name: _max_error(fn, **kw) for name, kw in CASES.items() if "dtype" not in kw}
    assert any(not (e <= ATOL[torch.float32]) for e in errors.values()), f"{mutant.bug}: passed {errors}"


# --------------------------------------------------------------------------- the page pointers


def test_page_pointers_are_the_pages_byte_addresses_and_padding_is_zero():
    q, cache, table, lens = _case()
    plan = kernels.plan_page_pointers(q, cache, table, lens)
    ptr = plan.page_pointers
    size = cache.element_size()
    assert ptr.dtype == torch.int64 and ptr.shape == (3, 2, 4)
    assert int(ptr[0, 0, 2]) == cache[7, 0].data_ptr() and int(ptr[0, 1, 2]) == cache[7, 1].data_ptr()
    assert int(ptr[1, 1, 1]) - int(ptr[1, 0, 1]) == cache.stride(1) * size
    assert ptr[1, :, 2:].eq(0).all() and ptr[2].eq(0).all()  # padding, and a sequence of length 0
    assert plan.aligned


def test_a_page_pointer_array_built_with_an_element_stride_is_refused_before_launch(monkeypatch):
    q, cache, table, lens = _case()
    fault = faults.faults_of("read route")["page_pointers_element_stride"]
    monkeypatch.setattr(decode_page_pointers, "build_page_pointers", fault.part("builder"))
    with pytest.raises(ValueError, match=r"page_pointers\[0, 0, 0\] = .* page 3's K: .* refusing to launch"):
        kernels.paged_decode_attention_page_pointers(q, cache, table, lens)


def test_a_page_pointer_plan_is_refused_on_another_pool_or_after_its_pool_moved(monkeypatch):
    q, cache, table, lens = _case()
    plan = kernels.plan_page_pointers(q, cache, table, lens)
    other = torch.nan_to_num(cache) + 1.0  # same shape, strides and dtype; other memory, other values
    with pytest.raises(ValueError, match="cache is not the pool this plan's page pointers were built from"):
        kernels.run_page_pointers(plan, q, other)
    moved = cache.clone()
    moved_plan = kernels.plan_page_pointers(q, moved, table, lens)
    moved.set_(torch.empty_like(moved))  # same tensor object, its data now elsewhere
    with pytest.raises(ValueError, match="another pool, or this one after it moved"):
        kernels.run_page_pointers(moved_plan, q, moved)
    # The part this check stands for: without it the plan reads the pool it was built from.
    fault = faults.faults_of("read route")["page_pointers_any_pool"]
    monkeypatch.setattr(decode_page_pointers, "check_same_placement", fault.part("placement_check"))
    got = kernels.run_page_pointers(plan, q, other)
    want = reference.paged_decode_attention(q, other, table, lens, precision="fp64")
    assert (got.double() - want).abs().max() > 0.1, "the faulty plan read the launch's pool after all"


def test_page_pointer_route_refuses_bad_tables_before_building_addresses():
    q, cache, table, lens = _case()
    bad = table.clone()
    bad[0, 1] = NUM_PAGES  # one past the pool
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\]=12 is not a page of the pool"):
        kernels.paged_decode_attention_page_pointers(q, cache, bad, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        kernels.paged_decode_attention_page_pointers(q, cache, table, torch.tensor([23, 9, -1]))


# --------------------------------------------------------------------------- the descriptors


def _pool(shape, dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    "cache, match",
    [
        (_pool((4, 2, 6, 2, 16)), r"page_size=6: a tensor-descriptor \(TMA\) tile has power-of-two sides"),
        (_pool((4, 2, 8, 2, 24)), r"head_dim=24: a tensor-descriptor \(TMA\) tile"),
        (_pool((4, 2, 512, 1, 16)), r"page_size=512: .* up to 256"),
        (_pool((4, 2, 8, 2, 2), torch.float32), r"head_dim=2 of torch.float32 is 8 bytes: .* at least 16 bytes"),
        (_pool((4 * 2 * 8 * 2 * 16 + 1,))[1:].view(4, 2, 8, 2, 16), r"starts at 0x[0-9a-f]+, not a multiple of 16"),
        (_pool((4, 2, 8, 2, 17))[..., :16], r"cache.stride\(2\) = 34 elements = 68 bytes"),
        (_pool((4, 2, 8, 16, 2)).transpose(3, 4), r"features\) contiguous, stride 1"),
    ],
    ids=["page_not_pow2", "head_dim_not_pow2", "page_over_256", "row_under_16_bytes", "base_unaligned",
         "stride_unaligned", "features_strided"],
)  # fmt: skip
def test_descriptor_route_refuses_pools_a_descriptor_cannot_describe(cache, match):
    dims = (cache.shape[3] * 2, cache.shape[4]) if cache.shape[4] != 2 else (4, 2)
    q = torch.zeros((1, *dims), dtype=cache.dtype)
    table = torch.zeros((1, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        kernels.paged_decode_attention_descriptors(q, cache, table, torch.tensor([1]))


def test_a_descriptor_plan_is_refused_on_a_pool_of_another_shape():
    q, cache, table, lens = _case()
    plan = kernels.plan_descriptors(q, cache, table, lens)
    with pytest.raises(ValueError, match="cache"):
        kernels.run_descriptors(plan, q, cache[:-1])


def test_descriptor_tiles_never_straddle_a_page():
    q, cache, table, lens = _case(lens=(32, 9, 0))
    plan = kernels.plan_descriptors(q, cache, table, lens)
    assert PAGE % plan.block_n == 0 and plan.block_d == HEAD_DIM, plan


# --------------------------------------------------------------------------- the harness


@pytest.mark.slow
def test_the_harness_decode_grid_passes_on_both_routes_under_gpu_plans():
    """The decode family's grid (poisoned masked lanes on, contracts of
    pagedkv_kernels.tools.verify.DECODE_ROUTES), GPU plans, the page-pointer route with
    isolation (a wrong address would kill the child, not the run). About 30 s."""
    code = (
        "from pagedkv_lab.verify import run; from pagedkv_kernels.tools.verify import DECODE_ROUTES\n"
        "for name, fn in DECODE_ROUTES.items():\n"
        "    r = run(decode_fn=fn, checks=('decode',), isolate=name == 'pointers')\n"
        "    assert r.passed, (name, str(r))\n"
        "    print(name, len(r.results))\n"
    )
    env = {"PAGEDKV_BACKEND": "interpreter", "PAGEDKV_PLAN": "gpu", "PAGEDKV_POISON_MASKED": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code], env={**_env(), **env}, capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pointers" in run.stdout and "descriptors" in run.stdout


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")}


def test_scale_defaults_and_explicit_scale_agree():
    q, cache, table, lens = _case()
    for fn in ROUTES.values():
        a = fn(q, cache, table, lens)
        b = fn(q, cache, table, lens, scale=1 / math.sqrt(HEAD_DIM))
        assert torch.equal(a, b)


@pytest.mark.parametrize("route", ["pointers", "descriptors"])
def test_a_route_plan_owns_its_table(route):
    """Changing the caller's table after planning changes nothing the run reads (the
    plan holds its own copy, and route 2's addresses were built from that copy)."""
    q, cache, table, lens = _case()
    plan_fn, run_fn = {
        "pointers": (kernels.plan_page_pointers, kernels.run_page_pointers),
        "descriptors": (kernels.plan_descriptors, kernels.run_descriptors),
    }[route]
    plan = plan_fn(q, cache, table, lens)
    want = reference.paged_decode_attention(q, cache, table, lens, precision="fp64")
    table[0, :3] = torch.tensor([0, 5, 2], dtype=table.dtype)  # other valid pages
    got = run_fn(plan, q, cache)
    assert (got.double() - want).abs().max() <= ATOL[torch.float32], f"{route}: the run read the changed table"

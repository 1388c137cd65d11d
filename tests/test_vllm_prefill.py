"""vLLM's layouts for the suite's prefill kernel: the x-packed ``(key_cache,
value_cache)`` pair and FlashInfer's K/V tuple read in place, and the new tokens' K/V
given apart (``k_new``/``v_new``, vLLM's ``context_attention_fwd`` form), through the
harness's prefill family and directly against the float64 reference.

The story each test tells:

* the harness builds the pool in the declared layout, and for the separate form leaves
  the new tokens' rows of the pool NaN and passes their K/V apart: the suite's kernel
  passes in every layout, and a kernel that reads the new tokens from the pool, or
  takes vLLM's key with its two feature strides swapped, fails;
* the kernel against the float64 reference (tolerances: :data:`pagedkv_lib.compare.TOLERANCES`,
  ``|err| <= atol + rtol |ref|``: fp32 1e-5 + 1e-6, fp16 1e-2 + 2**-11) for fp32 and
  fp16, GQA, a linear window (vLLM's ``sliding_window``), a request with no queries and
  one with no context, padded and CSR tables, and vLLM's own argument names;
* bad inputs are refused with a ValueError naming the argument, before any launch.

Small shapes: the module runs in a few seconds in the interpreter.
"""

import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lab.verify.prefill_checks import prefill_case, prefill_inputs, split_new_tokens
from pagedkv_lib import LinearWindow, RingWindow, reference, runtime
from pagedkv_lib.cache_layouts import kv_cache_view, to_native
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare
from pagedkv_lib.formats import block_table_to_csr

# isort: split
from gpu_plans import skip_interpreted_bf16_dot

import pagedkv_kernels as kernels
import pagedkv_kernels.host.validate as validate
import pagedkv_kernels.prefill as prefill

DEV = runtime.device()
SHAPE = {"head_dim": 64, "num_kv_heads": 2, "group": 2}
# (seq_len, q_len): a chunk after 16 cached keys, a whole prompt (no context), keys but
# no queries, a decode step.
REQUESTS = ((32, 16), (9, 9), (16, 0), (20, 1))


def harness_cases() -> list[dict]:
    """Small cases of the prefill family: both dtypes the GPU plans check, both layouts
    (vllm_x ignores it), pages of 1, 5 and 16, GQA 1 and 5, a linear window and a ring
    window (projected out for the separate form)."""
    base = {**SHAPE, "requests": REQUESTS}
    return [
        {**base, "layout": "NHD", "dtype": "fp32", "page_size": 5},
        {**base, "layout": "HND", "dtype": "fp16", "page_size": 16, "group": 5, "num_kv_heads": 1},
        {**base, "layout": "NHD", "dtype": "fp16", "page_size": 1, "window_left": 6},
        {**base, "layout": "HND", "dtype": "fp32", "page_size": 4, "window": (8, 2), "requests": ((23, 5), (3, 3))},
    ]


def run_harness(fn, contract: verify.Contract, case: dict):
    """One harness case, moved inside the contract first as the runner does."""
    return prefill_case(fn, contract.project(case), contract)


# ----------------------------------------------------------------------------- the harness


@pytest.mark.parametrize(
    "cache_layout, new_tokens, cases",
    [
        ("vllm_x", "separate", (0, 1, 2, 3)),  # vLLM's context_attention_fwd form
        ("kv_tuple", "separate", (0, 1)),  # FlashInfer's tuple, NHD and HND
        ("kv_tuple", "cache", (1, 3)),
        ("vllm_x", "cache", (3,)),  # a ring window through the x-packed pair
        ("paged", "cache", (0, 2)),  # the suite's 5-D pool, unchanged
        ("paged", "separate", (2,)),
    ],
)
def test_the_suite_prefill_passes_the_harness_in_every_layout_and_calling_form(cache_layout, new_tokens, cases):
    contract = verify.Contract(cache_layout=cache_layout, new_tokens=new_tokens)
    for i in cases:
        case = harness_cases()[i]
        result = run_harness(kernels.paged_prefill_attention, contract, case)
        assert result.passed, f"{case}: {result.detail}"


def test_the_separate_form_drops_a_ring_window_and_refuses_more_queries_than_keys():
    contract = verify.Contract(new_tokens="separate")
    moved = contract.project({**SHAPE, "dtype": "fp32", "layout": "NHD", "page_size": 4, "window": (8, 2),
                              "requests": ((23, 5),)})  # fmt: skip
    assert moved["window"] is None and "window" in moved["substituted"]
    assert "more queries than keys" in contract.outside({"requests": ((5, 9),)})
    assert "read back from the pool" in contract.outside({"new_tokens": "cache"})
    with pytest.raises(ValueError, match="new_tokens"):
        verify.Contract(new_tokens="apart")


def test_the_prefill_scenarios_are_outside_the_separate_form():
    report = verify.run(
        prefill_fn=kernels.paged_prefill_attention,
        checks=("prefill_chunks", "prefix_hit"),
        contracts={"prefill_fn": verify.Contract(cache_layout="vllm_x", new_tokens="separate")},
        isolate=False,
    )
    assert {r.status for r in report.results if r.check in ("prefill_chunks", "prefix_hit")} == {"outside"}


def test_split_new_tokens_copies_them_out_and_poisons_their_rows():
    q, cache, qo, tables, lens, _ = prefill_inputs({**SHAPE, "layout": "HND", "dtype": "fp32", "page_size": 5,
                                                    "requests": REQUESTS})  # fmt: skip
    full = cache.clone()
    k_new, v_new = split_new_tokens(cache, tables, qo, lens, "HND")
    assert k_new.shape == (q.shape[0], 2, 64) and torch.isfinite(k_new).all() and torch.isfinite(v_new).all()
    k_all, _ = reference.gather_paged_kv(full, tables[0], 32, "HND")
    assert torch.equal(k_new[:16], k_all[16:])
    k_left, v_left = reference.gather_paged_kv(cache, tables[0], 32, "HND")
    assert torch.isnan(k_left[16:]).all() and torch.isnan(v_left[16:]).all() and torch.equal(k_left[:16], k_all[:16])


# ----------------------------------------------------------------------------- mutants


def reads_new_tokens_from_the_cache(q, cache, qo_indptr, block_tables, seq_lens, layout="NHD", k_new=None,
                                    v_new=None):  # fmt: skip
    """A separate-form kernel that ignores ``k_new``/``v_new`` and reads the pool."""
    return kernels.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout)


def test_a_kernel_that_reads_the_new_tokens_from_the_cache_fails_on_the_poison():
    contract = verify.Contract(cache_layout="vllm_x", new_tokens="separate")
    result = run_harness(reads_new_tokens_from_the_cache, contract, harness_cases()[0])
    assert result.passed is False and "non-finite" in result.detail
    finite = run_harness(reads_new_tokens_from_the_cache, contract, {**harness_cases()[0], "poison": "none"})
    assert finite.passed is False  # finite stale rows instead of the new tokens: wrong values


def test_a_kernel_with_vllm_x_feature_strides_swapped_fails(monkeypatch):
    """vLLM's key feature ``d`` is at ``(d // x) * stride_outer + (d % x) * stride_inner``;
    a kernel that swaps the two strides reads other features of the same block."""

    def swapped(cache, layout="NHD"):
        view = kv_cache_view(cache, layout)
        sp, sn, sh, outer, inner = view.key_strides
        return view._replace(key_strides=(sp, sn, sh, inner, outer))

    monkeypatch.setattr(validate, "kv_cache_view", swapped)
    contract = verify.Contract(cache_layout="vllm_x", new_tokens="separate")
    result = run_harness(kernels.paged_prefill_attention, contract, harness_cases()[0])
    assert result.passed is False and "non-finite outputs" in result.detail  # it reads unwritten (NaN) rows
    finite = run_harness(kernels.paged_prefill_attention, contract, {**harness_cases()[0], "poison": "none"})
    assert finite.passed is False and "first beyond tolerance" in finite.detail  # and other features' values


# ----------------------------------------------------------------------------- against the reference


def vllm_inputs(dtype="fp32", group=2, page_size=5, requests=REQUESTS, seed=0):
    """``(q, (k_cache, v_cache), k_new, v_new, qo, tables, lens, full_pool)``: a vllm_x
    pair holding only the context (the new tokens' rows NaN) and the new tokens apart."""
    case = {**SHAPE, "layout": "NHD", "dtype": dtype, "page_size": page_size, "group": group,
            "requests": requests, "seed": seed}  # fmt: skip
    q, cache, qo, tables, lens, _ = prefill_inputs(case)
    full = cache.clone()
    k_new, v_new = split_new_tokens(cache, tables, qo, lens, "NHD")
    return q, to_native(cache, "vllm_x"), k_new, v_new, qo, tables, lens, full


def on_dev(*ts):
    return tuple(tuple(x.to(DEV) for x in t) if isinstance(t, tuple) else t.to(DEV) for t in ts)


def assert_close(out, expected, dtype):
    result = compare(out.cpu(), expected, *TOLERANCES[DTYPES[dtype]])
    assert result.passed, f"max |err| {result.max_abs:.3g}, err/tol {result.tol_ratio:.3g} at {result.worst}"


@pytest.mark.parametrize("dtype, group", [("fp32", 1), ("fp32", 4), ("fp16", 2), ("bf16", 5)])
def test_context_attention_fwd_matches_the_reference(dtype, group):
    skip_interpreted_bf16_dot(dtype)
    q, pair, k_new, v_new, qo, tables, lens, full = vllm_inputs(dtype, group)
    expected = reference.paged_prefill_attention(q, full, qo, tables, lens, precision="fp64")
    q, pair, k_new, v_new, qo, tables, lens = on_dev(q, pair, k_new, v_new, qo, tables, lens)
    o = torch.full_like(q, float("nan"))
    got = kernels.context_attention_fwd(q, k_new, v_new, o, "auto", *pair, tables, qo, lens, 16, 1.0, 1.0)
    assert got is o
    assert_close(o, expected, dtype)


@pytest.mark.parametrize("sliding_window", [1, 7, 100])
def test_vllm_sliding_window_is_a_linear_window_of_that_many_keys(sliding_window):
    q, pair, k_new, v_new, qo, tables, lens, full = vllm_inputs("fp16", page_size=16)
    window = LinearWindow.from_sliding_window(sliding_window)
    expected = reference.paged_prefill_attention(q, full, qo, tables, lens, window=window, scale=0.2, precision="fp64")
    q, pair, k_new, v_new, qo, tables, lens = on_dev(q, pair, k_new, v_new, qo, tables, lens)
    o = torch.empty_like(q)
    kernels.context_attention_fwd(q, k_new, v_new, o, "auto", *pair, tables, qo, lens, 16, torch.tensor(1.0),
                                  torch.tensor(1.0), sliding_window=sliding_window, sm_scale=0.2)  # fmt: skip
    assert_close(o, expected, "fp16")


@pytest.mark.parametrize("cache_layout, layout", [("kv_tuple", "NHD"), ("kv_tuple", "HND"), ("paged", "HND")])
def test_csr_table_of_the_context_with_the_new_tokens_apart(cache_layout, layout):
    """FlashInfer's CSR table then describes the cache, the context only: each request's
    KV length is its table's plus its ``q_len``."""
    case = {**SHAPE, "layout": layout, "dtype": "fp32", "page_size": 4, "requests": REQUESTS}
    q, cache, qo, tables, lens, _ = prefill_inputs(case)
    expected = reference.paged_prefill_attention(q, cache, qo, tables, lens, layout=layout, precision="fp64")
    k_new, v_new = split_new_tokens(cache, tables, qo, lens, layout)
    context = lens - (qo[1:] - qo[:-1])
    csr = block_table_to_csr(tables, context, 4)
    args = on_dev(q, to_native(cache, cache_layout, layout), qo, *csr, k_new, v_new)
    out = kernels.paged_prefill_attention_csr(*args[:6], layout=layout, k_new=args[6], v_new=args[7])
    assert_close(out, expected, "fp32")


def test_a_table_that_covers_only_the_context_is_enough():
    """Pages past the context are never read: a table whose later entries are -1 works."""
    q, pair, k_new, v_new, qo, tables, lens, full = vllm_inputs("fp32", page_size=4)
    expected = reference.paged_prefill_attention(q, full, qo, tables, lens, precision="fp64")
    context = lens - (qo[1:] - qo[:-1])
    trimmed = torch.where(torch.arange(tables.shape[1]) < ((context + 3) // 4)[:, None], tables, -1)
    out = kernels.paged_prefill_attention(*on_dev(q, pair, qo, trimmed, lens), k_new=k_new.to(DEV),
                                          v_new=v_new.to(DEV))  # fmt: skip
    assert_close(out, expected, "fp32")


# ----------------------------------------------------------------------------- bad inputs


@pytest.fixture
def no_launch(monkeypatch):
    for kernel in ("prefill_kernel", "prefill_any_layout_kernel"):
        monkeypatch.setattr(prefill, kernel, NoLaunch())


def _bad_calls():
    q, (kc, vc), k_new, v_new, qo, tables, lens, full = vllm_inputs("fp32", page_size=4)
    pair = (kc, vc)
    ok = dict(q=q, cache=pair, qo_indptr=qo, block_tables=tables, seq_lens=lens, k_new=k_new, v_new=v_new)
    kt, vt = to_native(full, "kv_tuple")
    return (
        ok,
        [
            ({"cache": (kc, vc, vc)}, "cache must be the suite's 5-D pool or a"),
            ({"cache": (kt, vt[:, :2])}, r"cache\[1\] \(value_cache\) has shape"),
            ({"cache": (kc.reshape(*kc.shape[:2], -1, kc.shape[3], 2), vc)}, "x=2"),
            ({"cache": (kc, vc[..., :3])}, r"cache\[1\] \(value_cache\)"),
            ({"cache": (kc, vc.half())}, "must share dtype and device"),
            ({"cache": (kc.double(), vc.double())}, "x=4"),  # float64: x would be 2; the kernels refuse it anyway
            ({"cache": (kc.to("meta"), vc.to("meta"))}, r"cache\[0\] is on meta"),
            ({"k_new": k_new[:-1], "v_new": v_new[:-1]}, "k_new has 25 rows but q has 26"),
            ({"k_new": k_new[:, :1]}, "k_new has shape"),
            ({"v_new": v_new.half()}, r"v_new.dtype=torch.float16 differs"),
            ({"v_new": None}, "k_new is given but v_new is None"),
            ({"k_new": k_new.to("meta"), "v_new": v_new.to("meta")}, "k_new is on meta"),
            ({"window": RingWindow(8, 0, 4)}, "window: a ring window with the new tokens"),
            ({"block_tables": tables[:, :1]}, "covers the context only"),
            (
                {"qo_indptr": torch.tensor([0, 16, 26, 26, 26], dtype=torch.int32), "causal": False},
                "request 1 has 10 queries but seq_lens",
            ),  # more queries than keys: fine non-causally, not apart
        ],
    )


def test_bad_cache_pairs_and_new_tokens_are_refused_by_name_before_a_launch(no_launch):
    ok, bad = _bad_calls()
    for change, message in bad:
        args = {**ok, **change}
        args = {k: v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v for k, v in args.items()}
        with pytest.raises(ValueError, match=message):
            kernels.paged_prefill_attention(**args)


def test_vllm_arguments_the_suite_does_not_implement_are_refused_by_name(no_launch):
    q, pair, k_new, v_new, qo, tables, lens, _ = vllm_inputs("fp32", page_size=4)
    args = (q, k_new, v_new, torch.empty_like(q), "auto", *pair, tables, qo, lens, 16)
    for change, message in (
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"k_scale": 0.5}, "k_scale=0.5"),
        ({"v_scale": torch.tensor([1.0, 1.0])}, "v_scale="),
        ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
        ({"sliding_window": 2.5}, "sliding_window=2.5"),
    ):
        kw = {"k_scale": 1.0, "v_scale": 1.0, **change}
        call = list(args)
        if "kv_cache_dtype" in kw:
            call[4] = kw.pop("kv_cache_dtype")
        with pytest.raises(ValueError, match=message):
            kernels.context_attention_fwd(*call, **kw)
    with pytest.raises(ValueError, match="k is k_new"):  # the suite's errors end with vLLM's names
        kernels.context_attention_fwd(q, k_new[:-1], v_new, *args[3:], 1.0, 1.0)


def test_run_refuses_a_cache_or_new_tokens_other_than_planned(no_launch):
    q, pair, k_new, v_new, qo, tables, lens, full = vllm_inputs("fp32", page_size=4)
    plan = kernels.plan_prefill(*on_dev(q, pair, qo, tables, lens), k_new=k_new.to(DEV), v_new=v_new.to(DEV))
    other = (pair[0].to(DEV), pair[1].to(DEV)[1:])
    with pytest.raises(ValueError, match=r"cache\[1\] has shape"):
        kernels.run_prefill(plan, q.to(DEV), other, k_new=k_new.to(DEV), v_new=v_new.to(DEV))
    with pytest.raises(ValueError, match="not what the plan was made for"):
        kernels.run_prefill(plan, q.to(DEV), full.to(DEV), k_new=k_new.to(DEV), v_new=v_new.to(DEV))
    with pytest.raises(ValueError, match="k_new has shape"):
        kernels.run_prefill(plan, q.to(DEV), on_dev(pair)[0])
    out = torch.empty_like(q.to(DEV))
    with pytest.raises(ValueError, match="overlaps the memory of out"):
        kernels.run_prefill(plan, out, on_dev(pair)[0], k_new=k_new.to(DEV), v_new=v_new.to(DEV), out=out)

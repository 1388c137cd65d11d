"""Linear-cache sliding windows (FlashInfer's ``window_left``, vLLM's ``sliding_window``)
in the decode and prefill kernels, padded and CSR, and the ring's exact chunk rule.

A :class:`~pagedkv_lib.window.LinearWindow` is a mask over absolute positions of a
linear cache: a query at position ``p`` sees keys ``p - window_left .. p``. The cases
follow FlashInfer's ``tests/test_sliding_window.py``: a batch of requests of ``qo_len``
queries over ``kv_len`` keys in pages of 1, 5 or 16, ``window_left`` of 0, a few keys or
more than the sequence, every request's output compared with attention over its own
contiguous K/V under FlashInfer's mask ``(row >= col) & (row - window_left <= col)``,
computed here by torch in float64 (an oracle that shares no code with the kernels or
the paged reference). Chunks are far longer than ``page_size + 1`` and run in one call.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lab.verify.compare import DTYPES, TOLERANCES, compare
from pagedkv_lab.verify.contract import Contract
from pagedkv_lab.verify.decode_checks import write_sequence
from pagedkv_lab.verify.prefill_checks import linear_window_prefill_cases
from pagedkv_lib import KVCacheManager, LinearWindow, PagedKVPool, RingWindow, formats, reference, runtime
from pagedkv_lib.quant_pool import QuantizedKVPool
from pagedkv_lib.window import window_mask

# isort: split
import mutants
from gpu_plans import skip_interpreted_bf16_dot

import pagedkv_kernels as kernels

DEV = runtime.device()


def dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def flashinfer_batch(batch, kv_len, qo_len, page_size, dtype, hq=4, hk=2, d=64, seed=0):
    """FlashInfer's test layout: ``batch`` requests of ``kv_len`` keys on their own pages
    (here scattered through the pool, NaN elsewhere), ``qo_len`` queries each. Returns
    ``(q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, block_tables,
    seq_lens)`` on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-kv_len // page_size)
    pool = PagedKVPool(batch * pages + 3, page_size, hk, d, dtype)
    pool.cache.fill_(float("nan"))
    order = torch.randperm(batch * pages + 3, generator=gen)[: batch * pages].reshape(batch, pages)
    table = order.to(torch.int32)
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    k = torch.randn(batch * kv_len, hk, d, generator=gen).to(dtype)
    v = torch.randn(batch * kv_len, hk, d, generator=gen).to(dtype)
    b = torch.arange(batch).repeat_interleave(kv_len)
    pos = torch.arange(kv_len).repeat(batch)
    reference.append_paged_kv(k, v, pool.cache, formats.slot_mapping(table, b, pos, page_size))
    kv_indptr, kv_indices, last = formats.block_table_to_csr(table, lens, page_size)
    qo = torch.arange(batch + 1, dtype=torch.int32) * qo_len
    q = torch.randn(batch * qo_len, hq, d, generator=gen).to(dtype)
    return q, pool.cache, qo, kv_indptr, kv_indices, last, table, lens


def flashinfer_oracle(q, cache, qo, table, lens, window_left, causal=True):
    """Per request: attention over its contiguous K/V (gathered from the pages) under
    FlashInfer's mask, by torch's SDPA in float64. ``window_left=None``: no window."""
    outs = []
    for b in range(lens.numel()):
        n, lo, hi = int(lens[b]), int(qo[b]), int(qo[b + 1])
        k, v = reference.gather_paged_kv(cache, table[b], n)
        row = torch.arange(n - (hi - lo), n)[:, None]
        col = torch.arange(n)[None, :]
        mask = (row >= col) if causal else torch.ones(hi - lo, n, dtype=torch.bool)
        if window_left is not None:
            mask = mask & (row - window_left <= col)
        group = q.shape[1] // k.shape[1]
        qq, kk, vv = (x.double().transpose(0, 1) for x in (q[lo:hi], k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qq, kk.repeat_interleave(group, 0), vv.repeat_interleave(group, 0), attn_mask=mask
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def assert_close(out, want, dtype):
    result = compare(out.cpu(), want, *TOLERANCES[dtype])
    assert result.passed, f"max |err| {result.max_abs:.3g}, err/tol {result.tol_ratio:.3g} at {result.worst}"


# ----------------------------------------------------------------------------- the conventions


def test_window_left_is_flashinfers_and_sliding_window_is_vllms():
    """FlashInfer's ``window_left = w`` is ``w + 1`` keys, the query's own included; vLLM's
    ``sliding_window = w`` is ``w`` keys. Both masks, written as their tests write them."""
    w = LinearWindow(13)
    assert (w.recent_tokens, w.sliding_window, w.sink_tokens) == (14, 14, 0)
    assert LinearWindow.from_sliding_window(14) == w and LinearWindow.from_sliding_window(1) == LinearWindow(0)
    row, col = torch.arange(40)[:, None], torch.arange(40)[None, :]
    flashinfer = (row >= col) & (row - 13 <= col)
    vllm = (row >= col) & (row - col < 14)
    assert torch.equal(window_mask(torch.arange(40), torch.arange(40), w), flashinfer)
    assert torch.equal(flashinfer, vllm)
    assert w.kv_token_idx(37) == 37 and w.cache_len(37) == 37  # linear: every position at its own row


@pytest.mark.parametrize("bad", [-1, -7, True, 2.0, None])
def test_window_left_must_be_an_int_from_zero(bad):
    with pytest.raises(ValueError, match="window_left="):
        LinearWindow(bad)


def test_sliding_window_must_count_at_least_the_query():
    with pytest.raises(ValueError, match="sliding_window=0"):
        LinearWindow.from_sliding_window(0)


def test_the_references_loop_and_vectorized_agree_with_flashinfers_mask():
    """The float64 references (loop and vectorized, decode and prefill) on a linear window
    equal the independent oracle: the kernels are judged by a reference that is right."""
    q, cache, qo, _, _, _, table, lens = flashinfer_batch(2, 23, 9, 4, torch.float64)
    window = LinearWindow(5)
    want = flashinfer_oracle(q, cache, qo, table, lens, 5)
    vectorized = reference.paged_prefill_attention(q, cache, qo, table, lens, window=window, precision="fp64")
    loop = reference.paged_prefill_attention_loop(q, cache, qo, table, lens, window=window, precision="fp64")
    torch.testing.assert_close(vectorized, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loop, want, rtol=1e-12, atol=1e-12)
    last = q[qo[1:] - 1]  # each request's last query is its decode step
    decode = reference.paged_decode_attention_loop(last, cache, table, lens, window=window, precision="fp64")
    torch.testing.assert_close(decode, want[qo[1:] - 1], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- prefill


PREFILL_CASES = [
    # (kv_len, qo_len, window_left, page_size, dtype): chunks far longer than page_size + 1
    (54, 37, 13, 16, "fp16"),
    (97, 47, 0, 1, "fp32"),
    (54, 37, 111, 5, "bf16"),
    (97, 47, 33, 16, "fp16"),
]


@pytest.mark.parametrize("kv_len, qo_len, window_left, page_size, dtype", PREFILL_CASES)
def test_flashinfer_sliding_window_prefill_runs_natively_on_csr(kv_len, qo_len, window_left, page_size, dtype):
    """FlashInfer's ``test_batch_paged_prefill_sliding_window``: one CSR call with the
    request's own ``window_left``, no per-query emulation and no ring copy; the padded
    entry gives the same bits."""
    skip_interpreted_bf16_dot(dtype)
    torch_dtype = DTYPES[dtype]
    q, cache, qo, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(3, kv_len, qo_len, page_size, torch_dtype)
    window = LinearWindow(window_left)
    out = kernels.paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices, last), window=window)
    assert_close(out, flashinfer_oracle(q, cache, qo, table, lens, window_left), torch_dtype)
    padded = kernels.paged_prefill_attention(*dev(q, cache, qo, table, lens), window=window)
    assert torch.equal(out.cpu(), padded.cpu())
    ref = reference.paged_prefill_attention_csr(q, cache, qo, kv_indptr, kv_indices, last, window=window)
    assert_close(out, ref.double(), torch_dtype)


def test_prefill_skips_the_key_tiles_before_the_window():
    """Work skipped, not only masked: the tiles' key ranges start at their first query's
    window, so a narrow window visits far fewer (query, key) pairs."""
    q, cache, qo, kv_indptr, kv_indices, last, *_ = flashinfer_batch(2, 400, 200, 16, torch.float16)
    args = dev(q, cache, qo, kv_indptr, kv_indices, last)
    narrow = kernels.plan_prefill_csr(*args, window=LinearWindow(13)).visited_pairs
    whole = kernels.plan_prefill_csr(*args).visited_pairs
    assert narrow < whole / 3, (narrow, whole)


def test_prefill_with_lse_and_a_single_query_equals_decode():
    """FlashInfer's ``test_single_decode_prefill_sliding_window_match``: one query per
    request is a decode step, through either kernel, log-sum-exps included."""
    q, cache, qo, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(3, 99, 1, 5, torch.float32)
    window = LinearWindow(23)
    out_p, lse_p = kernels.paged_prefill_attention_csr(
        *dev(q, cache, qo, kv_indptr, kv_indices, last), window=window, return_lse=True
    )
    out_d, lse_d = kernels.paged_decode_attention_csr(
        *dev(q, cache, kv_indptr, kv_indices, last), window=window, return_lse=True
    )
    assert_close(out_p, out_d.double().cpu(), torch.float32)
    torch.testing.assert_close(lse_p.cpu(), lse_d.cpu(), rtol=1e-5, atol=1e-5)
    _, lse_ref = reference.paged_decode_attention(q, cache, table, lens, window=window, return_lse=True)
    torch.testing.assert_close(lse_d.cpu().double(), lse_ref, rtol=1e-5, atol=1e-5)


def test_noncausal_linear_window_bounds_the_left_side_only():
    """FlashInfer's non-causal window: query ``p`` sees keys ``p - window_left ..
    seq_len - 1`` (a ring refuses ``causal=False``; a linear cache holds every key)."""
    q, cache, qo, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(2, 60, 20, 16, torch.float32)
    out = kernels.paged_prefill_attention_csr(
        *dev(q, cache, qo, kv_indptr, kv_indices, last), window=LinearWindow(9), causal=False
    )
    assert_close(out, flashinfer_oracle(q, cache, qo, table, lens, 9, causal=False), torch.float32)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("window_left", [0, 13, 533])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_flashinfer_sliding_window_decode_is_decode_over_the_last_keys(window_left, num_splits):
    """FlashInfer's ``test_batch_decode_sliding_window``: decode with ``window_left`` equals
    decode over the last ``window_left + 1`` keys alone; padded and CSR, split or not."""
    q, cache, _, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(3, 199, 1, 16, torch.float16, hq=8)
    window = LinearWindow(window_left)
    csr = kernels.paged_decode_attention_csr(
        *dev(q, cache, kv_indptr, kv_indices, last), window=window, num_splits=num_splits
    )
    padded = kernels.paged_decode_attention(*dev(q, cache, table, lens), window=window, num_splits=num_splits)
    want = flashinfer_oracle(q, cache, torch.arange(4, dtype=torch.int32), table, lens, window_left)
    assert_close(csr, want, torch.float16)
    assert torch.equal(csr.cpu(), padded.cpu())


def test_vllm_sliding_window_sees_that_many_keys():
    """vLLM's ``sliding_window = 32``, converted: the decode attends to the last 32 keys."""
    q, cache, _, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(2, 100, 1, 16, torch.float32)
    out = kernels.paged_decode_attention(*dev(q, cache, table, lens), window=LinearWindow.from_sliding_window(32))
    assert_close(out, flashinfer_oracle(q, cache, torch.arange(3, dtype=torch.int32), table, lens, 31), torch.float32)
    plan = kernels.plan_decode_csr(*dev(q, cache, kv_indptr, kv_indices, last), window=LinearWindow(31))
    assert plan.max_visible == 32  # the split heuristic counts the window's keys, not the sequence's


# ----------------------------------------------------------------------------- argument rules


def test_window_arguments_are_refused_by_name():
    q, cache, qo, kv_indptr, kv_indices, last, table, lens = flashinfer_batch(2, 20, 4, 4, torch.float32)
    ring = RingWindow(8, 0, 4)
    with pytest.raises(ValueError, match="page table is CSR"):
        kernels.paged_prefill_attention_csr(*dev(q, cache, qo, kv_indptr, kv_indices, last), window=ring)
    with pytest.raises(ValueError, match="page table is CSR"):
        kernels.paged_decode_attention_csr(*dev(q[:2], cache, kv_indptr, kv_indices, last), window=ring)
    with pytest.raises(ValueError, match="page table is CSR"):
        reference.paged_prefill_attention_csr(q, cache, qo, kv_indptr, kv_indices, last, window=ring)
    with pytest.raises(ValueError, match="window must be a RingWindow, a LinearWindow or None"):
        kernels.paged_decode_attention(*dev(q[:2], cache, table, lens), window=13)
    # a write stores tokens through a ring or not at all: a mask has nothing to say there
    k = torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="mask over a linear cache"):
        kernels.append_paged_kv_csr(
            *dev(k, k, cache, torch.tensor([0]), torch.tensor([3]), kv_indices, kv_indptr), window=LinearWindow(3)
        )
    with pytest.raises(ValueError, match="mask over a linear cache"):
        reference.append_paged_kv_csr(k, k, cache, [0], [3], kv_indices, kv_indptr, window=LinearWindow(3))


def test_the_quantized_decode_refuses_a_linear_window():
    """The quantized decode implements the ring only: a linear window is refused before
    launch, not read as a ring."""
    pool = QuantizedKVPool(4, 4, 2, 64, kv_dtype="fp8", device=DEV)
    q = torch.zeros(1, 2, 64, device=DEV)
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="mask over a linear cache"):
        kernels.paged_decode_attention_quant_pool(q, pool, table, torch.tensor([6], device=DEV), window=LinearWindow(3))


# ----------------------------------------------------------------------------- the ring's chunk rule


def ring_prefill_inputs(window: RingWindow, seq_len: int, q_len: int, seed=3):
    gen = torch.Generator().manual_seed(seed)
    ps, hk, d = window.tokens_per_block, 1, 32
    pages = int(window.num_blocks(seq_len))
    pool = PagedKVPool(pages + 2, ps, hk, d, torch.float32)
    pool.cache.fill_(float("nan"))
    table = formats.pad_block_tables([list(range(2, pages + 2))])
    write_sequence(pool, table, 0, seq_len, window, gen)
    q = torch.randn(q_len, 2, d, generator=gen)
    return q, pool.cache, torch.tensor([0, q_len], dtype=torch.int32), table, torch.tensor([seq_len], dtype=torch.int32)


def test_a_ring_chunk_longer_than_max_chunk_len_runs_while_it_overwrites_no_visible_key():
    """A plain ring (2 sinks, 6 slots: ``max_chunk_len() == 1``): a whole prompt of 8 has
    not wrapped and runs in one chunk; at 9 tokens a chunk of 1 runs and a chunk of 2
    (position 8 overwrote position 2, which the query at 7 sees) is refused."""
    ring = RingWindow(8, 2, 4)
    assert ring.max_chunk_len() == 1
    for seq_len, q_len in ((8, 8), (9, 1)):
        args = ring_prefill_inputs(ring, seq_len, q_len)
        out = kernels.paged_prefill_attention(*dev(*args), window=ring)
        assert_close(out, reference.paged_prefill_attention(*args, window=ring, precision="fp64"), torch.float32)
    with pytest.raises(ValueError, match="a chunk of 2 tokens overwrites ring slots.*overwrote position 2"):
        kernels.paged_prefill_attention(*dev(*ring_prefill_inputs(ring, 9, 2)), window=ring)


# ----------------------------------------------------------------------------- the harness


def linear_decode_cases():
    return [c for c in verify.long_decode_cases() if c.get("window_left") is not None]


def test_the_grids_hold_the_linear_window_cases():
    assert len(linear_decode_cases()) == 3 and all(c in verify.decode_grid() for c in linear_decode_cases())
    assert all(c in verify.prefill_grid() for c in linear_window_prefill_cases())


@pytest.mark.parametrize("case", linear_decode_cases(), ids=lambda c: f"window_left={c['window_left']}")
def test_the_decode_passes_the_grids_linear_window_cases(case):
    result = verify.decode_case(kernels.paged_decode_attention, case)
    assert result.passed, result.detail


@pytest.mark.parametrize("case", linear_window_prefill_cases(), ids=lambda c: f"window_left={c['window_left']}")
def test_the_prefill_passes_the_grids_linear_window_cases(case):
    skip_interpreted_bf16_dot(case["dtype"])
    result = verify.prefill_case(kernels.paged_prefill_attention, case)
    assert result.passed, result.detail


@pytest.mark.parametrize("mutant", mutants.WINDOW_MUTANTS, ids=lambda m: m.name)
def test_the_harness_fails_a_kernel_that_gets_the_linear_window_wrong(mutant):
    fn = mutants.build(mutant)
    if mutant.entry == "paged_decode_attention":
        results = [verify.decode_case(fn, c) for c in linear_decode_cases()]
    else:
        results = [verify.prefill_case(fn, c) for c in linear_window_prefill_cases()]
    failed = [r for r in results if not r.passed]
    assert failed, f"the harness passes a kernel whose bug is: {mutant.bug}"
    assert "first beyond tolerance" in failed[0].detail


def test_contracts_declare_linear_windows_apart_from_rings():
    case = {"window_left": 13, "requests": ((54, 37),)}
    assert Contract(windows=False).linear_windows is False  # no windows at all, as before
    assert Contract().outside(case) is None
    ring_only = Contract(linear_windows=False)
    assert ring_only.outside(case) == "a linear window" and ring_only.outside({"window": (8, 2)}) is None
    moved = ring_only.project(case)
    assert moved["window_left"] is None and moved["substituted"] == "window_left 13->none"
    assert Contract().meet(ring_only).linear_windows is False


def test_the_manager_lays_out_a_ring_and_refuses_a_linear_window():
    with pytest.raises(ValueError, match="not a RingWindow: the manager lays out a ring"):
        KVCacheManager(8, 4, window=LinearWindow(3))

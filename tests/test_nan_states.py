"""NaN is never an empty state (issue 36): a row is empty only when its softmax mass is 0
(no visible key); a NaN among the keys it sees makes its output and its base-2 LSE NaN,
whatever the split count, in every read kernel and every merge, and in the float64
references. A NaN the row does not see (masked, outside a window, past ``seq_len``)
changes nothing.

Each kernel check runs the mutant that restores the old rule (``l_i > 0`` for a
non-empty row, a merge that weighs a NaN split like an empty one:
:data:`mutants.NAN_IS_EMPTY`) and watches it fail. Runs in the interpreter with its own
plans and, in ``make test-gpu-plans``, with a GPU's tiles and split counts
(``PAGEDKV_PLAN=gpu``). Small shapes: 55 s on 2 loaded cores, six mutant builds included.
"""

from __future__ import annotations

import math

import mutants
import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import LinearWindow, mla, quant, quant_reference, reference, runtime
from pagedkv_lib import merge_state as ref_states
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
import pagedkv_kernels as kernels
from pagedkv_kernels import prefill

# NaN arithmetic makes numpy warn inside the interpreter (inf - inf, 0 * NaN); intended.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

DEV = runtime.device()
NAN = float("nan")
SPLITS = [1, 2, 4, None]  # None: the plan's own count (several under PAGEDKV_PLAN=gpu)
# Sequence 0 has 300 keys: 3 tiles of 128 in the interpreter, 5 of 64 under GPU plans,
# so 2 and 4 splits each hold the NaN key in one split and clean keys in the others
# (and 4 splits leave one empty in the interpreter). Sequence 1 (100 keys) stays clean.
LENS = torch.tensor([300, 100])
PAGE = 16
VISIBLE = 3  # a position of sequence 0 every query sees
PAST_END = 300  # the row of sequence 0's last page just past its seq_len

# Mutants that let an invisible key in, each a bug the finite-answer checks must catch.
READS_ONE_PAST_THE_END = mutants.Mutant(
    "reads_one_past_the_end", "attends to one key past seq_len",
    {"device.attention_core": (("valid = j < n_vis\n", "valid = j <= n_vis\n"),)}, "paged_decode_attention",
)  # fmt: skip
IGNORES_THE_WINDOW = next(m for m in mutants.WINDOW_MUTANTS if m.name == "ignores_linear_window_decode")
SEES_THE_FUTURE = mutants.Mutant(
    "prefill_sees_the_future", "a prefill without its causal mask",
    {"device.prefill_tile": (("see = valid[None, :] & (pos[None, :] <= qpos[:, None])", "see = valid[None, :]"),)},
    "paged_prefill_attention",
)  # fmt: skip


def nan_row(out: torch.Tensor, row: int) -> bool:
    return bool(out[row].isnan().all())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def clean_except(out: torch.Tensor, row: int) -> bool:
    rest = torch.cat([out[:row], out[row + 1 :]])
    return bool(rest.isfinite().all())


def tables():
    """Sequence 0 on pages 0-18 (its last page has rows past its end), sequence 1 on 19-25."""
    table = torch.full((2, 19), -1)
    table[0] = torch.arange(19)
    table[1, :7] = torch.arange(19, 26)
    return table


def at(pos: int) -> tuple[int, int]:
    """(page, row) of sequence 0's position ``pos``."""
    return pos // PAGE, pos % PAGE


# ----------------------------------------------------------------------------- decode


def decode_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn((28, 2, PAGE, 2, 8), generator=gen)
    q = torch.randn((2, 4, 8), generator=gen)
    return q, cache, tables(), LENS


@pytest.mark.parametrize("num_splits", SPLITS)
def test_a_nan_in_a_visible_key_gives_nan_for_every_split_count(num_splits):
    q, cache, table, lens = decode_inputs()
    page, row = at(VISIBLE)
    cache[page, 0, row, 1, 5] = NAN  # K of KV head 1: query heads 2 and 3
    args = (q.to(DEV), cache.to(DEV), table.to(DEV), lens.to(DEV))
    out, lse = kernels.paged_decode_attention(*args, num_splits=num_splits, return_lse=True)
    ref, ref_lse = reference.paged_decode_attention(q, cache, table, lens, precision="fp64", return_lse=True)
    for got, want in ((out, ref), (lse, ref_lse)):
        assert got[0, 2:].isnan().all() and want[0, 2:].isnan().all(), "the NaN the queries see must show"
        assert got[0, :2].isfinite().all() and got[1].isfinite().all(), "only the heads that see it"
    if num_splits is not None:  # the old rule: LSE -inf with one split, a plausible answer with more
        wrong, wrong_lse = mutants.build(mutants.NAN_IS_EMPTY)(*args, num_splits=num_splits, return_lse=True)
        assert not (wrong[0, 2:].isnan().all() and wrong_lse[0, 2:].isnan().all())


@pytest.mark.parametrize(
    "where, mutant",
    [("past_seq_len", READS_ONE_PAST_THE_END), ("outside_the_window", IGNORES_THE_WINDOW), ("unused_page", None)],
    ids=["past_seq_len", "outside_the_window", "unused_page"],
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_nan_in_an_invisible_key_leaves_the_answer_unchanged(where, mutant, num_splits):
    q, cache, table, lens = decode_inputs()
    window = LinearWindow(window_left=63) if where == "outside_the_window" else None
    page, row = at({"past_seq_len": PAST_END, "outside_the_window": VISIBLE}.get(where, 0))
    poisoned = cache.clone()
    poisoned[27 if where == "unused_page" else page, :, row] = NAN  # K and V, every head

    def run(fn, c):
        args = (q.to(DEV), c.to(DEV), table.to(DEV), lens.to(DEV))
        return fn(*args, num_splits=num_splits, window=window, return_lse=True)

    (clean, clean_lse), (out, lse) = (
        run(kernels.paged_decode_attention, cache),
        run(kernels.paged_decode_attention, poisoned),
    )
    assert out.isfinite().all() and torch.equal(out, clean) and torch.equal(lse, clean_lse)
    if mutant is not None:
        assert not run(mutants.build(mutant), poisoned)[0].isfinite().all(), f"{mutant.name} must see the NaN"


# ----------------------------------------------------------------------------- quantized decode


def fp8_pool(seed=0):
    """An FP8 (per-tensor scale) pool holding the two sequences."""
    gen = torch.Generator().manual_seed(seed)
    pool = QuantizedKVPool(28, PAGE, 2, 16, "fp8", "NHD", "cpu", scale_mode="tensor", k_scale=0.01, v_scale=0.01)
    table = tables()
    for b, n in enumerate(LENS.tolist()):
        pages = table[b][table[b] >= 0]
        slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        k, v = torch.randn((n, 2, 16), generator=gen), torch.randn((n, 2, 16), generator=gen)
        quant_reference.append_paged_kv_quant(k, v, pool, slots)
    return pool, table, torch.randn((2, 4, 16), generator=gen)


@pytest.mark.parametrize("num_splits", SPLITS)
def test_a_nan_code_in_a_visible_fp8_key_gives_nan_for_every_split_count(num_splits):
    pool, table, q = fp8_pool()
    page, row = at(VISIBLE)
    pool.data[page, 0, row, 1, 5] = quant.FP8_NAN
    args = (q.to(DEV), pool.to(DEV), table.to(DEV), LENS.to(DEV))
    out = kernels.paged_decode_attention_quant_pool(*args, num_splits=num_splits)
    ref = quant_reference.paged_decode_attention_quant(q, pool, table, LENS, precision="fp64")
    assert out[0, 2:].isnan().all() and ref[0, 2:].isnan().all(), "the NaN the queries see must show"
    assert out[0, :2].isfinite().all() and out[1].isfinite().all()
    if num_splits in (2, 4):
        wrong = mutants.package(mutants.NAN_IS_EMPTY).paged_decode_attention_quant_pool(*args, num_splits=num_splits)
        assert not wrong[0, 2:].isnan().all()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_nan_code_past_seq_len_leaves_the_fp8_answer_unchanged(num_splits):
    pool, table, q = fp8_pool()
    poisoned = pool.clone()
    page, row = at(PAST_END)
    poisoned.data[page, :, row] = quant.FP8_NAN
    clean, out = (
        kernels.paged_decode_attention_quant_pool(
            q.to(DEV), p.to(DEV), table.to(DEV), LENS.to(DEV), num_splits=num_splits
        )  # fmt: skip
        for p in (pool, poisoned)
    )
    assert out.isfinite().all() and torch.equal(out, clean)


# ----------------------------------------------------------------------------- MLA

RANK, ROPE, NOPE, HEADS = 32, 8, 16, 2
MLA_SCALE = 1 / math.sqrt(NOPE + ROPE)


def mla_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ckv, kpe = torch.randn((28, PAGE, RANK), generator=gen), torch.randn((28, PAGE, ROPE), generator=gen)
    q_nope, q_pe = torch.randn((2, HEADS, NOPE), generator=gen), torch.randn((2, HEADS, ROPE), generator=gen)
    w_uk, w_uv = torch.randn((HEADS, NOPE, RANK), generator=gen) / 4, torch.randn((HEADS, 16, RANK), generator=gen) / 4
    return q_nope, q_pe, ckv, kpe, tables(), LENS, w_uk, w_uv


@pytest.mark.parametrize("num_splits", SPLITS)
def test_a_nan_in_a_visible_latent_row_gives_nan_for_every_split_count(num_splits):
    """Both MLA conventions: the latent output and its LSE (FlashInfer's), and the heads'
    output after w_uv (the absorbed decode)."""
    q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv = mla_inputs()
    ckv[at(VISIBLE)][7] = NAN
    q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    latent = (q_lat.to(DEV), q_pe.to(DEV), ckv.to(DEV), kpe.to(DEV), table.to(DEV), lens.to(DEV), MLA_SCALE)
    o, lse = kernels.mla_latent_attention(*latent, num_splits, return_lse=True)
    absorbed = [t.to(DEV) for t in (q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv)]
    out = kernels.mla_decode_attention(*absorbed, num_splits=num_splits)
    for got in (o, lse, out):
        assert nan_row(got, 0) and clean_except(got, 0), "the NaN every head of sequence 0 sees must show"
    ref = mla.mla_decode_absorbed(q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv)
    assert nan_row(ref, 0) and clean_except(ref, 0)
    if num_splits is not None:
        broken = mutants.package(mutants.NAN_IS_EMPTY)
        wrong_o, wrong_lse = broken.mla_latent_attention(*latent, num_splits, return_lse=True)
        assert not nan_row(wrong_lse, 0), "the old rule gives LSE -inf (one split) or a finite one"
        if num_splits > 1:
            wrong = broken.mla_decode_attention(*absorbed, num_splits=num_splits)
            assert not nan_row(wrong_o, 0) and not nan_row(wrong, 0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_nan_latent_row_past_seq_len_leaves_the_mla_answer_unchanged(num_splits):
    q_nope, q_pe, ckv, kpe, table, lens, w_uk, w_uv = mla_inputs()
    poisoned = ckv.clone()
    poisoned[at(PAST_END)] = NAN
    clean, out = (
        kernels.mla_decode_attention(
            *(t.to(DEV) for t in (q_nope, q_pe, c, kpe, table, lens, w_uk, w_uv)), num_splits=num_splits
        )  # fmt: skip
        for c in (ckv, poisoned)
    )
    assert out.isfinite().all() and torch.equal(out, clean)


# ----------------------------------------------------------------------------- prefill


def test_prefill_rows_that_see_a_nan_key_are_nan_with_lse_and_the_others_unchanged():
    """Sequence 0's last 6 tokens are new queries; the NaN key is its position 296, so
    its queries at 295 and 294 (causally masked) must be unchanged, those from 296 on
    NaN, output and LSE. Sequence 1's queries see nothing of it."""
    _, cache, table, lens = decode_inputs()
    q = torch.randn((8, 4, 8), generator=torch.Generator().manual_seed(5))
    qo = torch.tensor([0, 6, 8])
    poisoned = cache.clone()
    page, row = at(296)
    poisoned[page, 0, row, 0, 0] = NAN  # K of KV head 0: query heads 0 and 1
    (clean, clean_lse), (out, lse) = (
        prefill.paged_prefill_attention(
            q.to(DEV), c.to(DEV), qo.to(DEV), table.to(DEV), lens.to(DEV), return_lse=True
        )  # fmt: skip
        for c in (cache, poisoned)
    )
    ref, ref_lse = reference.paged_prefill_attention(q, poisoned, qo, table, lens, precision="fp64", return_lse=True)
    for got, want in ((out, ref), (lse, ref_lse)):
        assert got[2:6, :2].isnan().all() and want[2:6, :2].isnan().all(), "positions 296-299 see the NaN"
    unchanged = torch.ones((8, 4), dtype=torch.bool)
    unchanged[2:6, :2] = False
    assert torch.equal(out[unchanged], clean[unchanged]) and torch.equal(lse[unchanged], clean_lse[unchanged])
    assert out[unchanged].isfinite().all()
    wrong = mutants.build(SEES_THE_FUTURE)(q.to(DEV), poisoned.to(DEV), qo.to(DEV), table.to(DEV), lens.to(DEV))
    assert wrong[:2, :2].isnan().all(), "without the causal mask the queries before position 296 see the NaN"


# ----------------------------------------------------------------------------- merges


def states_with_nan():
    """Five rows of four states: row 0 one NaN LSE, row 1 one +inf LSE, row 2 an empty
    state whose v is NaN (it must not leak), row 3 a state whose v is NaN and whose
    weight underflows to 0 (its NaN must reach the row's v, as unsplit; the scores, so
    the LSE, are finite), row 4 all empty."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn((5, 4, 2, 8), generator=gen)
    s = torch.randn((5, 4, 2), generator=gen) * 4
    s[0, 1] = NAN
    s[1, 2] = float("inf")
    s[2, 3], v[2, 3] = float("-inf"), NAN
    s[3, 0], v[3, 0] = -400.0, NAN
    s[4] = float("-inf")
    return v, s


def check_merged(v, s, what: str) -> None:
    for row in (0, 1):
        assert nan_row(v, row) and nan_row(s, row), f"{what}: row {row} must be NaN"
    assert nan_row(v, 3) and s[3].isfinite().all(), f"{what}: row 3's v must be NaN (its LSE is finite)"
    assert v[2].isfinite().all() and s[2].isfinite().all(), f"{what}: an empty state's NaN v leaked"
    assert (v[4] == 0).all() and torch.isneginf(s[4]).all(), f"{what}: all empty is zeros and -inf"


def test_merge_states_with_a_nan_or_inf_lse_gives_a_nan_row_in_kernel_and_reference():
    v, s = states_with_nan()
    out, lse = kernels.merge_states(v.to(DEV), s.to(DEV))
    check_merged(out.cpu(), lse.cpu(), "kernel")
    ref_v, ref_s = ref_states.merge_states(v, s)
    check_merged(ref_v, ref_s, "reference")
    finite = ref_v.isfinite()
    assert torch.allclose(out.cpu().double()[finite], ref_v[finite], atol=1e-6)
    # merge_state (two states) and the split-KV stage 2 (merge_partials) follow the same rule
    pair = kernels.merge_state(v[:, 0].to(DEV), s[:, 0].to(DEV), v[:, 1].to(DEV), s[:, 1].to(DEV))
    assert nan_row(pair[0], 0) and nan_row(pair[1], 0) and nan_row(pair[0], 3)  # states 0 and 1 of each row
    assert pair[0][[1, 2, 4]].isfinite().all() and pair[1][1:4].isfinite().all()
    part = kernels.merge_partials(v.transpose(1, 2).contiguous().to(DEV), s.transpose(1, 2).contiguous().to(DEV))
    assert all(nan_row(part, r) for r in (0, 1, 3)) and same_bits(part, out)
    assert all(nan_row(reference.merge_partials(v.transpose(1, 2), s.transpose(1, 2)), r) for r in (0, 1, 3))
    wrong = mutants.package(mutants.NAN_IS_EMPTY).merge_states(v.to(DEV), s.to(DEV))
    with pytest.raises(AssertionError, match="kernel: row 0 must be NaN"):
        check_merged(wrong[0].cpu(), wrong[1].cpu(), "kernel")


def old_reference_merge(v, s):
    """The float64 merge before issue 36 (the reference's mutant): weights <= 0 dropped,
    NaN and +inf LSEs included."""
    v, s = v.double(), s.double()
    m = s.max(dim=1).values
    w = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m)[:, None])
    v = torch.where(w[..., None] > 0, v, 0.0)
    den = w.sum(1)
    out = (w[..., None] * v).sum(1) / torch.where(den > 0, den, 1.0)[..., None]
    return out, torch.where(den > 0, m + torch.log2(torch.where(den > 0, den, 1.0)), float("-inf"))


def test_the_old_reference_merge_fails_the_nan_rows():
    with pytest.raises(AssertionError, match="reference: row 0 must be NaN"):
        check_merged(*old_reference_merge(*states_with_nan()), "reference")


# ----------------------------------------------------------------------------- cascade


def cascade_inputs():
    """A 10-token shared prefix on pages 0-2 (pages of 4), suffixes of 7, 3 and 12 tokens
    with 3, 3 and 5 new queries (tests/test_lse_merge.py's case)."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn((16, 2, 4, 2, 16), generator=gen)
    q = torch.randn((11, 4, 16), generator=gen)
    qo = torch.tensor([0, 3, 6, 11], dtype=torch.int32)
    suffix_tables = torch.tensor([[3, 4, -1], [5, -1, -1], [6, 7, 8]])
    return q, cache, qo, torch.tensor([0, 1, 2]), 10, suffix_tables, torch.tensor([7, 3, 12])


def run_cascade(fn, q, cache, qo, shared_pages, shared_len, suffix_tables, suffix_lens):
    return fn(q.to(DEV), cache.to(DEV), qo.to(DEV), shared_pages.to(DEV), shared_len,
              suffix_tables.to(DEV), suffix_lens.to(DEV))  # fmt: skip


def test_cascade_with_a_nan_query_row_gives_nan_for_that_row_only():
    args = list(cascade_inputs())
    clean = run_cascade(kernels.cascade_attention, *args)
    args[0] = args[0].clone()
    args[0][4, 1] = NAN  # query 4 (request 1), head 1
    out = run_cascade(kernels.cascade_attention, *args)
    assert out[4, 1].isnan().all(), "a NaN query must give NaN, not the zeros of an empty state"
    rest = torch.ones(out.shape[:2], dtype=torch.bool)
    rest[4, 1] = False
    assert torch.equal(out[rest], clean[rest])
    wrong = run_cascade(mutants.package(mutants.NAN_IS_EMPTY).cascade_attention, *args)
    assert not wrong[4, 1].isnan().any()


def test_cascade_with_a_nan_in_the_shared_prefix_gives_nan_for_every_row_that_sees_it():
    args = list(cascade_inputs())
    args[1] = args[1].clone()
    args[1][1, 0, 2, 0, 9] = NAN  # prefix position 6, K of KV head 0: query heads 0 and 1
    out = run_cascade(kernels.cascade_attention, *args)
    assert out[:, :2].isnan().all() and out[:, 2:].isfinite().all()
    wrong = run_cascade(mutants.package(mutants.NAN_IS_EMPTY).cascade_attention, *args)
    assert wrong[:, :2].isfinite().all(), "the old merge dropped the prefix's NaN state as empty"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__(3, torch.tensor([0, 1, 99])), r"shared_pages\[2\]=99 is not a page"),
        (lambda a: a.__setitem__(3, torch.tensor([0, 1])), "shared_pages has 2 pages of 4 tokens; shared_len=10"),
        (lambda a: a.__setitem__(6, torch.tensor([7, 2, 12])), r"request 1 has 3 queries but suffix_lens\[1\]=2"),
        (lambda a: a.__setitem__(5, torch.tensor([[3, 4, -1], [5, -1, -1], [6, 7, 99]])), r"suffix_tables\[2, 2\]"),
        (lambda a: a.__setitem__(3, torch.zeros(3, dtype=torch.int64, device="meta")), "shared_pages is on the meta"),
    ],
    ids=[
        "prefix_page_outside_the_pool",
        "too_few_prefix_pages",
        "suffix_shorter_than_its_queries",
        "suffix_page_outside_the_pool",
        "meta_prefix_pages",
    ],  # fmt: skip
)
def test_cascade_refuses_bad_arguments_by_their_names_before_either_pass(monkeypatch, change, message):
    """It used to launch the suffix pass before the prefix pass refused, and named the
    passes' own arguments (seq_lens for suffix_lens)."""
    monkeypatch.setattr(prefill, "prefill_kernel", NoLaunch())
    args = list(cascade_inputs())
    change(args)
    moved = [a.to(DEV) if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args]
    with pytest.raises(ValueError, match=message):
        kernels.cascade_attention(*moved)

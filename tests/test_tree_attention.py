"""Tree attention for speculative verification: the prefill kernel's ``tree_mask`` against
the float64 reference, and the draft-tree masks it is built from.

A request's new tokens are the nodes of a draft tree (:mod:`pagedkv_lib.draft_tree`):
each draft sees every cached key before them (the context) and the new tokens that are
itself or its ancestors, never its siblings or cousins. Pass rule: the harness's
tolerances (:data:`pagedkv_lib.compare.TOLERANCES`, ``|err| <= atol + rtol |ref|``:
fp32 ``1e-5 + 1e-6 |ref|``, fp16 ``1e-2 + 2**-11 |ref|``). The mutant that ignores the
mask (fault ``tree_mask_ignored``: plain causal, siblings see each other) must fail the
same cases. Small shapes: the whole file runs in a few seconds in the interpreter.
"""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import faults
from pagedkv_lab.verify.prefill_checks import prefill_case, prefill_inputs, tree_prefill_cases
from pagedkv_lib import LinearWindow, RingWindow, reference, runtime
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare
from pagedkv_lib.draft_tree import batch_tree_mask, check_parents, pack_tree_mask, tree_mask
from pagedkv_lib.formats import block_table_to_csr
from pagedkv_lib.rotary_positions import draft_tree_offsets

# isort: split
import pagedkv_kernels.prefill as prefill
import pagedkv_kernels.prefill_plan as prefill_plan
from pagedkv_kernels import paged_prefill_attention, paged_prefill_attention_csr

DEV = runtime.device()
# A root (node 0), two drafts after it (1, 2), two after 1 (3, 4), one after 2 (5), and a
# second root (6): an alternative for node 0's position.
BRANCHY = (-1, 0, 0, 1, 1, 2, -1)


def on_dev(*ts):
    return tuple(t.to(DEV) for t in ts)


def inputs(requests, dtype="fp32", layout="NHD", group=2, head_dim=16, page_size=4, num_kv_heads=2):
    case = {"layout": layout, "dtype": dtype, "head_dim": head_dim, "page_size": page_size, "group": group,
            "num_kv_heads": num_kv_heads, "requests": tuple(requests)}  # fmt: skip
    q, cache, qo, tables, lens, _ = prefill_inputs(case)
    return q, cache, qo, tables, lens


def oracle(q, cache, qo, tables, lens, **kw):
    return reference.paged_prefill_attention(q, cache, qo, tables, lens, precision="fp64", **kw)


def assert_within_tolerance(out, ref, dtype):
    result = compare(out.cpu(), ref, *TOLERANCES[DTYPES[dtype]])
    assert result.passed, f"max |err| {result.max_abs:.3g}, err/tol {result.tol_ratio:.3g} at {result.worst}"


def with_entry(mask, row, col, value):
    mask = mask.clone()
    mask[row, col] = value
    return mask


# ----------------------------------------------------------------------------- the masks


def test_a_draft_sees_itself_and_its_ancestors_only():
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],  # not its sibling 1
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],  # not its sibling 3
            [1, 0, 1, 0, 0, 1, 0],  # not its cousins 3, 4
            [0, 0, 0, 0, 0, 0, 1],  # a second root sees no other draft
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree_mask(BRANCHY), want)
    # A node's ancestors are its depth: the rotary offset of draft_tree_offsets.
    assert torch.equal(tree_mask(BRANCHY).sum(1) - 1, draft_tree_offsets(BRANCHY))
    assert torch.equal(tree_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())  # a chain
    assert torch.equal(tree_mask([-1, -1, -1]), torch.eye(3, dtype=torch.bool))  # alternatives only


def test_the_batch_mask_holds_each_requests_rows_and_causal_for_plain_requests():
    mask = batch_tree_mask([[-1, -1, 0], None, [], [-1]], [0, 3, 5, 5, 6])
    assert mask.shape == (6, 3) and mask.dtype == torch.bool
    assert mask[:3].int().tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert mask[3:5].int().tolist() == [[1, 0, 0], [1, 1, 0]]  # None: the causal triangle
    assert mask[5].int().tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match=r"parents\[0\] has 2 nodes but request 0 has 3 new tokens"):
        batch_tree_mask([[-1, 0], None], [0, 3, 4])
    with pytest.raises(ValueError, match="3 entries .* for 2 requests"):
        batch_tree_mask([None, None, None], [0, 1, 2])


def test_the_plan_packs_the_mask_in_int32_words_least_significant_bit_first():
    mask = torch.zeros((2, 40), dtype=torch.bool)
    mask[0, [0, 3, 31]] = True  # bit 31: the word's sign bit
    mask[1, [32, 39]] = True
    words = pack_tree_mask(mask)
    assert words.dtype == torch.int32 and words.shape == (2, 2)
    assert words.tolist() == [[1 + 8 - 2**31, 0], [0, 1 + 2**7]]
    assert pack_tree_mask(torch.zeros((0, 0), dtype=torch.bool)).shape == (0, 1)


def test_the_parents_rule_has_one_home_and_names_the_entry():
    assert check_parents([-1, 0, -1, 2]).tolist() == [-1, 0, -1, 2]
    with pytest.raises(ValueError, match=r"parents\[2\] = 2 must be -1 \(a root\) or name an earlier node"):
        tree_mask([-1, 0, 2])
    with pytest.raises(ValueError, match=r"parents\[0\] = 0"):
        draft_tree_offsets([0])  # the rotary offsets use the same rule
    with pytest.raises(ValueError, match=r"parents\[1\] = -3"):
        tree_mask([-1, -3])


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("dtype, layout, group", [("fp32", "NHD", 2), ("fp16", "HND", 4)])
def test_tree_prefill_matches_float64_reference_and_the_mutant_fails(dtype, layout, group):
    """A branchy tree after 13 cached tokens, a wide forest and a plain decode step."""
    q, cache, qo, tables, lens = inputs(((20, 7), (9, 4), (6, 1)), dtype, layout, group)
    mask = batch_tree_mask([BRANCHY, [-1, -1, -1, -1], None], qo)
    ref, ref_lse = oracle(q, cache, qo, tables, lens, layout=layout, tree_mask=mask, return_lse=True)
    args = on_dev(q, cache, qo, tables, lens)
    out, lse = paged_prefill_attention(*args, layout, tree_mask=mask.to(DEV), return_lse=True)
    assert out.dtype == q.dtype
    assert_within_tolerance(out, ref, dtype)
    assert compare(lse.cpu().double(), ref_lse, 1e-4, 1e-5).passed  # base-2 LSE over the keys each row sees
    wrong = faults.tree_mask_ignored(paged_prefill_attention)(*args, layout, tree_mask=mask.to(DEV))
    assert not compare(wrong.cpu(), ref, *TOLERANCES[DTYPES[dtype]]).passed


def test_a_chain_is_plain_causal_attention_bit_for_bit():
    q, cache, qo, tables, lens = inputs(((20, 6), (5, 5), (0, 0)))
    chain = batch_tree_mask([[-1, 0, 1, 2, 3, 4], None, []], qo)
    tree = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), tree_mask=chain.to(DEV))
    causal = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens))
    assert torch.equal(tree.cpu(), causal.cpu())
    assert torch.equal(oracle(q, cache, qo, tables, lens, tree_mask=chain), oracle(q, cache, qo, tables, lens))


def test_a_wide_tree_draft_sees_only_the_context_and_itself():
    """Four alternatives for one position: draft ``i`` equals one-shot attention of a
    query at position ``past`` over the context and its own key (SDPA, float64)."""
    q, cache, qo, tables, lens = inputs(((17, 4),), group=3)
    wide = batch_tree_mask([[-1] * 4], qo)
    out = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), tree_mask=wide.to(DEV)).cpu()
    k, v = reference.gather_paged_kv(cache, tables[0], 17)
    past = 13
    for i in range(4):
        keys = torch.cat([torch.arange(past), torch.tensor([past + i])])
        alone = reference.contiguous_attention(q[i : i + 1], k[keys], v[keys], torch.tensor([past]))
        assert_within_tolerance(out[i : i + 1], alone, "fp32")


def test_a_deep_branchy_tree_over_several_query_and_key_tiles(monkeypatch):
    """Tiles of 16 rows and 16 keys: 45 drafts x GQA 2 span six query tiles, 84 keys six
    key tiles; the drafts start inside a key tile (past = 39), and their mask spans two
    packed words, with a key tile across the boundary (drafts 25..40)."""
    monkeypatch.setattr(prefill_plan, "prefill_tiles", lambda group, head_dim, *a: (16, 16, max(16, head_dim), 4))
    gen = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(-1, j, (), generator=gen)) for j in range(1, 45)]
    q, cache, qo, tables, lens = inputs(((84, 45), (30, 30), (0, 0)))
    mask = batch_tree_mask([parents, None, []], qo)
    plan = prefill.plan_prefill(*on_dev(q, cache, qo, tables, lens), tree_mask=mask.to(DEV))
    assert (plan.block_m, plan.block_n) == (16, 16) and plan.num_tiles == 6 + 4
    assert tuple(plan.tree_mask.shape) == (75, 2)  # 45 columns: two int32 words per row
    out = prefill.run_prefill(plan, *on_dev(q, cache))
    assert_within_tolerance(out, oracle(q, cache, qo, tables, lens, tree_mask=mask), "fp32")
    causal = oracle(q, cache, qo, tables, lens)
    assert not compare(out.cpu(), causal, 1e-3).passed  # the tree made a difference


def test_csr_entry_equals_the_padded_one_on_a_mixed_batch():
    """A tree request, a whole prompt, an empty request and a decode step, through the
    CSR page table: the same bits as the padded entry, within tolerance of the reference
    (and the reference's CSR twin equal to its padded form)."""
    q, cache, qo, tables, lens = inputs(((23, 7), (9, 9), (0, 0), (12, 1)), "fp16", "HND")
    mask = batch_tree_mask([BRANCHY, None, [], None], qo)
    indptr, indices, last = block_table_to_csr(tables, lens, 4)
    padded = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), "HND", tree_mask=mask.to(DEV))
    csr = paged_prefill_attention_csr(*on_dev(q, cache, qo, indptr, indices, last), "HND", tree_mask=mask.to(DEV))
    assert torch.equal(csr.cpu(), padded.cpu())
    ref = oracle(q, cache, qo, tables, lens, layout="HND", tree_mask=mask)
    assert_within_tolerance(csr, ref, "fp16")
    twin = reference.paged_prefill_attention_csr(
        q, cache, qo, indptr, indices, last, layout="HND", precision="fp64", tree_mask=mask
    )
    assert torch.equal(twin, ref)


def test_a_linear_window_masks_on_top_of_the_tree():
    q, cache, qo, tables, lens = inputs(((24, 7),))
    mask = batch_tree_mask([BRANCHY], qo)
    window = LinearWindow(3)  # 4 keys: the deeper drafts no longer see the context
    out = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), window=window, tree_mask=mask.to(DEV))
    ref = oracle(q, cache, qo, tables, lens, window=window, tree_mask=mask)
    assert_within_tolerance(out, ref, "fp32")
    assert not compare(ref, oracle(q, cache, qo, tables, lens, tree_mask=mask), 1e-3).passed  # the window matters


def test_any_lower_triangular_mask_with_a_true_diagonal_is_taken():
    """The kernel checks the causal shape, not that the mask is a tree (FlashInfer's
    custom masks): a draft seeing its sibling is the caller's choice."""
    q, cache, qo, tables, lens = inputs(((20, 7),))
    mask = with_entry(batch_tree_mask([BRANCHY], qo), 2, 1, True)  # draft 2 sees its sibling 1
    out = paged_prefill_attention(*on_dev(q, cache, qo, tables, lens), tree_mask=mask.to(DEV))
    assert_within_tolerance(out, oracle(q, cache, qo, tables, lens, tree_mask=mask), "fp32")


def test_the_harness_tree_cases_pass_the_kernel_and_fail_the_fault():
    for case in tree_prefill_cases():
        assert prefill_case(paged_prefill_attention, case).passed
        caught = prefill_case(faults.tree_mask_ignored(paged_prefill_attention), case)
        assert caught.passed is False and "first beyond tolerance" in caught.detail
    plain = prefill_case(lambda q, c, qo, t, sl, layout="NHD", window=None: q, tree_prefill_cases()[0])
    assert plain.passed is None and "tree_mask" in plain.outside  # a kernel without the option: outside


# ----------------------------------------------------------------------------- bad inputs

BAD = {
    "above the diagonal": (lambda m: with_entry(m, 1, 5, True), {},
                           r"tree_mask\[1, 5\] is True but row 1 is new token 1 .* lower-triangular"),
    "missing diagonal": (lambda m: with_entry(m, 4, 4, False), {},
                         r"tree_mask\[4, 4\] is False: every draft sees itself"),
    "past its request": (lambda m: with_entry(m, 8, 2, True), {},
                         r"tree_mask\[8, 2\] is True but row 8 is new token 1"),
    "too narrow": (lambda m: m[:, :6], {}, r"tree_mask has shape \(9, 6\); expected \[9, max_q_len >= 7\]"),
    "too few rows": (lambda m: m[:8], {}, r"tree_mask has shape \(8, 7\); expected \[9"),
    "uint8": (lambda m: m.to(torch.uint8), {}, r"tree_mask must be a 2-D torch.bool tensor .*torch.uint8"),
    "1-D": (lambda m: m[0], {}, r"tree_mask must be a 2-D torch.bool tensor"),
    "not causal": (lambda m: m, {"causal": False}, r"tree_mask needs causal=True"),
    "ring window": (lambda m: m, {"window": RingWindow(16, 4, 4)}, r"tree_mask with a ring window"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD)
def test_bad_tree_mask_is_refused_by_name_by_kernel_and_reference(name):
    change, kwargs, match = BAD[name]
    q, cache, qo, tables, lens = inputs(((20, 7), (6, 2)))
    mask = change(batch_tree_mask([BRANCHY, None], qo))
    with pytest.raises(ValueError, match=match):
        prefill.plan_prefill(*on_dev(q, cache, qo, tables, lens), tree_mask=mask.to(DEV), **kwargs)
    with pytest.raises(ValueError, match=match):
        reference.paged_prefill_attention(q, cache, qo, tables, lens, tree_mask=mask, **kwargs)
    if "window" not in kwargs:  # no ring over a CSR table
        indptr, indices, last = block_table_to_csr(tables, lens, 4)
        with pytest.raises(ValueError, match=match):
            prefill.plan_prefill_csr(*on_dev(q, cache, qo, indptr, indices, last), tree_mask=mask.to(DEV), **kwargs)

"""Checks of exercises 06-08: the learner's Triton append kernel, split-KV merge and paged
decode kernel (each behind the launcher the exercise gives).

Each check runs a few small teaching cases first, whose failures are easy to read, then
cases of the conformance harness (:func:`pagedkv_lib.verify.append_case` and
:func:`~pagedkv_lib.verify.decode_case` on the harness's grid). Expectations are the
float64 references; a copy must match bit for bit, attention within
:data:`pagedkv_lib.compare.TOLERANCES`. In Triton's interpreter the learner's kernel runs
with masked lanes poisoned (``poison_masked=True``, the default: a masked ``tl.load``
without ``other=`` reads NaN, as undefined as on a GPU, instead of 0). This module never
imports triton: the learner's kernel brings it.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from .. import reference, runtime
from ..compare import DTYPES, TOLERANCES, bits, compare
from ..pool import PagedKVPool, cache_dims
from ..verify import append_case, append_grid, decode_case, decode_grid, long_decode_cases
from ..verify.decode_checks import decode_inputs
from ..verify.grid import rand
from ..verify.guards import CANARY, Guards
from .cases import Case, Mismatch, run_cases
from .result import LearnerError, call, show

__all__ = ["check_append_kernel", "check_merge_kernel", "check_decode_kernel", "picture_dir"]

_PICTURES: Path | None = None


def picture_dir() -> Path:
    """A folder of this process for the pictures of failed checks (created on first use)."""
    global _PICTURES
    if _PICTURES is None:
        _PICTURES = Path(tempfile.mkdtemp(prefix="pagedkv-exercises-"))
    return _PICTURES


def _save(fig, name: str) -> Path:
    import matplotlib.pyplot as plt

    path = picture_dir() / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)  # shown by the result itself, not again by the notebook's inline backend
    return path


def _poisoning(fn, on: bool, seen: list | None = None):
    """``fn`` (the learner's launcher) run with masked lanes poisoned (``on``) or reading 0;
    each :class:`~pagedkv_lib.interpreter_poison.PoisonedLoad` it poisons is added to ``seen``."""

    def poisoned(*args, **kwargs):
        with runtime.masked_lanes_poisoned(on) as loads:
            try:
                return fn(*args, **kwargs)
            finally:
                if seen is not None:
                    seen.extend(load for load in loads if load not in seen)

    return poisoned


def _nhd(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The pool as ``[pages, 2, page_size, heads, dim]`` whatever its layout."""
    return cache if layout == "NHD" else cache.transpose(2, 3)


# --------------------------------------------------------------------------- 06 append


def _describe_case(case: dict) -> str:
    words = [
        case["layout"],
        case["dtype"],
        f"head_dim {case['head_dim']}",
        f"pages of {case['page_size']}",
        f"{case['num_tokens']} tokens",
        f"{case['num_kv_heads']} KV heads",
    ]
    if case.get("padding"):
        words.append(f"{case['padding']} padding tokens")
    if case.get("noncontiguous"):
        words.append("k and v as strided views")
    return ", ".join(words)


def _append_hint(case: dict) -> str:
    hints = []
    if case["head_dim"] & (case["head_dim"] - 1):
        hints.append(f"head_dim {case['head_dim']} is not a power of two: BLOCK_D is larger, so mask d < head_dim.")
    if case["layout"] == "HND":
        hints.append("In HND a page is [2, heads, page_size, dim]: use the strides you are given, not an NHD formula.")
    if case.get("noncontiguous"):
        hints.append("k and v are strided views here: address them with stride_kt/kh/kd and stride_vt/vh/vd.")
    if case.get("padding"):
        hints.append("Tokens with slot -1 are padding and must write nothing.")
    if case["dtype"] != "fp32":
        hints.append(f"In {case['dtype']} a copy must stay bit-exact: store what you loaded, no conversion.")
    return " ".join(hints)


def _where_token_landed(got_nhd, k, t: int) -> tuple[int, int] | None:
    """``(page, row)`` where token ``t``'s K (head 0) ended up in the pool, or None."""
    hits = torch.nonzero((bits(got_nhd[:, 0, :, 0]) == bits(k[t, 0])).all(-1))
    return (int(hits[0][0]), int(hits[0][1])) if len(hits) else None


def _diagnose_append(got, expected, before, k, v, slots, layout: str, name: str) -> Mismatch | None:
    from ..viz import plot_wrong_rows, row_status, use_style

    status = row_status(got, expected, before, layout)
    if not ((status == 2) | (status == 3)).any():
        return None
    ps = cache_dims(got, layout).page_size
    got_n, exp_n, bef_n = (_nhd(x, layout) for x in (got, expected, before))
    use_style()
    picture = _save(
        plot_wrong_rows(
            got, expected, before, layout, "pool rows after your kernel (expected: the reference's write)", slots
        ),
        name,
    )
    wrong = torch.nonzero(torch.as_tensor(status == 2))
    changed = torch.nonzero(torch.as_tensor(status == 3))
    n_wrong, n_changed = len(wrong), len(changed)
    expected_text = f"{int((status == 1).sum() + n_wrong)} K/V rows written exactly as the reference writes them"
    got_text = f"{n_wrong} of those rows wrong or missing, {n_changed} other rows changed"
    if torch.equal(bits(got), bits(before)):
        return Mismatch(
            expected_text,
            "the pool is exactly as it was: your kernel wrote nothing",
            hint="is the kernel body still `pass`, or does your mask exclude every lane?",
            picture=picture,
        )
    slot_list = [int(x) for x in slots.tolist()]
    real = [t for t, sl in enumerate(slot_list) if sl >= 0]
    landed = {t: _where_token_landed(got_n, k, t) for t in real}
    detail, hint = "", ""
    # The first token (in order) whose K or V row is wrong, and what that row holds now.
    for t in real:
        page, row = divmod(slot_list[t], ps)
        bad = [kv for kv in (0, 1) if status[page, kv, row] == 2]
        if bad:
            kv = bad[0]
            detail = (
                f"token {t} has slot {slot_list[t]} = page {page} x {ps} + row {row}; that {'KV'[kv]} row "
                f"holds {_row_owner(got_n[page, kv, row], bef_n[page, kv, row], k, v)}"
            )
            if landed[t] is not None and landed[t] != (page, row):
                detail += f"; token {t}'s K was written to page {landed[t][0]}, row {landed[t][1]}"
            if kv == 0 and landed[t] == (page, row):
                heads_ok = [
                    torch.equal(bits(got_n[page, 0, row, h]), bits(exp_n[page, 0, row, h]))
                    for h in range(got_n.shape[3])
                ]
                if not all(heads_ok):
                    hint = "head 0 is right, later heads are not: add h * stride_h (and h * stride_kh for k)."
            if kv == 1 and (status[:, 0] != 2).all():
                hint = "K is right but V is not: V lives at the same offset plus stride_kv, read with v's strides."
            break
    else:
        page, kv, row = (int(x) for x in changed[0])
        detail = f"page {page}, {'KV'[kv]} row {row} belongs to no token of this call, but your kernel changed it"
    # A pattern in where the tokens' K landed names the bug.
    for t in real:
        if landed[t] is None or landed[t] == divmod(slot_list[t], ps):
            continue
        slot = slot_list[t]
        if landed[t] == (slot // ps, slot // ps):
            hint = "the row inside the page is slot % page_size; slot // page_size is the page."
        elif landed[t] == (slot % ps, slot // ps):
            hint = "page and row are swapped: page = slot // page_size, row = slot % page_size."
        elif landed[t][0] == slot:
            hint = "a slot is not a page id: page = slot // page_size, row = slot % page_size."
        break
    pads = [t for t, sl in enumerate(slot_list) if sl < 0]
    if pads and any(_where_token_landed(got_n, k, t) is not None for t in pads):
        hint = "a padding token (slot -1) was written: -1 must write nothing (as an index it is the last row)."
    return Mismatch(expected_text, got_text, detail, hint, picture)


def _outside_pool(cache, k, v, slots) -> Mismatch | None:
    """What the kernel wrote into the canary bytes around ``cache`` (placed by
    :class:`pagedkv_lib.verify.guards.Guards`), naming the token whose K or V (head 0)
    landed there; None when both guards are intact."""
    whole = torch.empty(0, dtype=torch.uint8, device=cache.device).set_(cache.untyped_storage()).cpu()
    start = cache.storage_offset() * cache.element_size()
    end = start + cache.numel() * cache.element_size()
    regions = {"before": whole[:start], "after the end of": whole[end:]}
    changed = {where: torch.nonzero(r != CANARY).flatten() for where, r in regions.items()}
    where = next((w for w, idx in changed.items() if idx.numel()), None)
    if where is None:
        return None
    idx = changed[where]
    reach = start - int(idx[0]) if where == "before" else int(idx[-1]) + 1
    slot_list = [int(x) for x in slots.tolist()]
    owner = None
    for t in sorted(range(len(slot_list)), key=lambda t: slot_list[t] >= 0):  # padding tokens first
        for src in (k, v):
            pattern = src[t, 0].contiguous().view(torch.uint8)
            region = regions[where]
            if region.numel() >= pattern.numel() and (region.unfold(0, pattern.numel(), 1) == pattern).all(1).any():
                owner = t
                break
        if owner is not None:
            break
    if owner is None:
        who, hint = "your kernel", "an address outside the pool: check the page, row and stride arithmetic."
    elif slot_list[owner] < 0:
        who = f"token {owner} (padding, slot -1)"
        hint = (
            "mask it out: a token with slot -1 must write nothing (in Triton -1 // page_size is 0 and "
            "-1 % page_size is -1: the row before page 0)."
        )
    else:
        who = f"token {owner} (slot {slot_list[owner]})"
        hint = "its page or row offset is wrong: page = slot // page_size, row = slot % page_size, times the strides."
    return Mismatch(
        "every write inside the pool, at the tokens' slots",
        f"{who} wrote {reach} bytes {where} the pool",
        f"{int(idx.numel())} bytes changed {where} the pool (in guard bytes the check placed there)",
        hint,
    )


def _row_owner(row, before_row, k, v) -> str:
    """Whose data a pool row ``[heads, dim]`` holds, in words."""
    if torch.equal(bits(row), bits(before_row)):
        return "what it held before (nothing was written there)"
    for name, src in (("K", k), ("V", v)):
        for u in range(src.shape[0]):
            if torch.equal(bits(row[0]), bits(src[u, 0])):
                return f"token {u}'s {name}"
    return "values of no token (a wrong source address, or part of a row)"


def _teaching_append_case(label, hint, slots, ps=4, heads=2, dim=8, num_pages=5, layout="NHD", strided=False):
    def run(append, name):
        gen = torch.Generator().manual_seed(len(slots) + ps + dim)
        before = PagedKVPool(num_pages, ps, heads, dim, torch.float32, layout).cache
        before.copy_(rand(before.shape, torch.float32, gen))
        n = len(slots)
        k = (
            rand((heads, n, dim), torch.float32, gen).transpose(0, 1)
            if strided
            else rand((n, heads, dim), torch.float32, gen)
        )
        v = rand((n, heads, dim), torch.float32, gen)
        slot_t = torch.tensor(slots)
        expected = before.clone()
        reference.append_paged_kv(k, v, expected, slot_t, layout)
        dev = runtime.device()
        cache = Guards().place("the pool", before.to(dev))  # canary bytes before and after it
        call("append", append, k.to(dev), v.to(dev), cache, slot_t.to(dev), layout=layout)
        stray = _outside_pool(cache, k, v, slot_t)
        return stray or _diagnose_append(cache.cpu(), expected, before, k, v, slot_t, layout, name)

    inputs = [
        ("slot_mapping", str(slots)),
        (
            "pool",
            f"{num_pages} pages x {ps} rows, {heads} KV heads, head_dim "
            f"{dim}, {layout}, fp32 (random, so stray writes show)",
        ),
        ("k, v", f"[{len(slots)}, {heads}, {dim}]" + (" (k is a strided view)" if strided else "")),
    ]
    return label, hint, inputs, run


def _grid_append_run(case):
    def run(append, name):
        seen: dict = {}

        def wrapper(k, v, cache, slot_mapping, layout="NHD"):
            seen.update(before=cache.detach().cpu().clone(), k=k.cpu(), v=v.cpu(), slots=slot_mapping.cpu())
            try:
                call("append", append, k, v, cache, slot_mapping, layout=layout)
            except LearnerError as err:
                seen["error"] = err
                raise
            seen["after"] = cache.detach().cpu().clone()

        result = append_case(wrapper, case)
        if "error" in seen:
            raise seen["error"]
        if result.passed:
            return None
        expected = seen["before"].clone()
        reference.append_paged_kv(seen["k"], seen["v"], expected, seen["slots"], case["layout"])
        mismatch = _diagnose_append(
            seen["after"], expected, seen["before"], seen["k"], seen["v"], seen["slots"], case["layout"], name
        )
        return mismatch or Mismatch("the harness's checks to pass", result.detail)

    return run


def check_append_kernel(append, *, isolate: bool = True, poison_masked: bool = True):
    """Exercise 06: ``append(k, v, cache, slot_mapping, layout="NHD")`` (the exercise's
    launcher around the learner's kernel), bit for bit against
    :func:`pagedkv_lib.reference.append_paged_kv`; the pools sit between guard bytes, so
    a write next to one is named. ``isolate``: run the cases in a child process
    (:func:`~pagedkv_lib.exercises.cases.run_cases`); False runs them in this one.
    ``poison_masked`` as in the module docstring."""
    append = _poisoning(append, poison_masked)
    teaching = [
        _teaching_append_case(
            "four tokens, NHD, pages of 4 rows",
            "Each program copies one token's [heads, "
            "head_dim] block: page = slot // page_size, row = slot % page_size.",
            [5, 0, 13, 2],
        ),
        _teaching_append_case(
            "padding: slot -1 writes nothing",
            "A token with slot -1 must not be written (in Python, -1 would index the pool's last row).",
            [3, -1, 9, -1, 16],
        ),
        _teaching_append_case(
            "head_dim 6 and 3 heads: more lanes than values",
            "BLOCK_D = 8 > head_dim = 6 and BLOCK_H = 4 > 3 heads: mask d < head_dim and h < num_heads.",
            [7, 1, 12],
            heads=3,
            dim=6,
        ),
        _teaching_append_case(
            "the HND layout",
            "HND puts a head's rows side by side; only the strides differ: use stride_n, stride_h, stride_d as given.",
            [5, 0, 13, 2],
            layout="HND",
        ),
        _teaching_append_case(
            "k as a strided view",
            "k is a transposed view: address it with stride_kt, stride_kh, stride_kd, never as if it were contiguous.",
            [4, 11, 6],
            strided=True,
        ),
    ]
    cases = []
    for label, hint, inputs, run in teaching:
        cases.append(Case(label, lambda run=run: run(append, "append_kernel"), inputs, hint))
    grid = append_grid()
    for i, case in enumerate(grid, 1):
        cases.append(
            Case(
                f"conformance grid case {i} of {len(grid)}: {_describe_case(case)}",
                lambda case=case: _grid_append_run(case)(append, "append_kernel"),
                [("case", show(case))],
                _append_hint(case),
            )
        )
    return run_cases(
        "append_kernel",
        cases,
        f"5 teaching cases and the {len(grid)} cases of verify.append_grid(), bit for bit",
        isolate,
    )


# --------------------------------------------------------------------------- 07 merge


def _split_partials(q, cache, tables, lens, layout, num_splits):
    """float64 split-KV partials ``[batch, heads, splits, dim]`` and base-2 LSE of a decode
    case, from contiguous K/V; an empty split's partial is NaN (garbage) and LSE -inf."""
    batch, heads, dim = q.shape
    group = heads // cache_dims(cache, layout).num_kv_heads
    part = torch.full((batch, heads, num_splits, dim), float("nan"), dtype=torch.float64)
    lse = torch.full((batch, heads, num_splits), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        k, v = reference.gather_paged_kv(cache, tables[b], n, layout)
        k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
        per = -(-n // num_splits) if n else 0
        for s in range(num_splits):
            lo, hi = s * per, min((s + 1) * per, n)
            if hi <= lo:
                continue
            scores = torch.einsum("hd,thd->ht", q[b].double(), k[lo:hi]) / math.sqrt(dim)
            lse[b, :, s] = scores.logsumexp(-1) / math.log(2)
            part[b, :, s] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[lo:hi])
    return part.float(), lse.float()


def _merge_run(merge, part, lse, expected, poisoned: list):
    dev = runtime.device()
    poisoned.clear()  # the loads this case poisons
    got = call("merge", merge, part.to(dev), lse.to(dev))
    if not isinstance(got, torch.Tensor):
        return Mismatch(f"a tensor {tuple(expected.shape)}", f"merge returned {show(got)}")
    got = got.detach().cpu()
    result = compare(got, expected, *TOLERANCES[torch.float32])
    if result.passed:
        return None
    if result.worst is None:
        return Mismatch(f"a tensor of shape {tuple(expected.shape)}", result.detail or show(got))
    b, h = result.worst[:2]
    detail = (
        f"row {b}, head {h}: expected {show([round(x, 4) for x in expected[b, h, :4].tolist()])}..., got "
        + show([round(x, 4) for x in got[b, h, :4].tolist()])
        + "..."
    )
    hint = ""
    row_lse = lse[b, h]
    if not torch.isfinite(got[b, h]).all():
        if poisoned:
            hint = _poisoned_hint(poisoned, MERGE_POISON_FIX)
        elif float(row_lse.max()) > 120:
            hint = "2**lse overflows fp32 for lse > 127: subtract the largest lse before exp2."
        elif torch.isinf(row_lse).all():
            hint = (
                "every split of this row is empty (a length-0 sequence): the max lse is -inf and "
                "2**(-inf - -inf) is NaN. Use 0 for the max there, and return 0 where the weights sum to 0."
            )
        elif torch.isinf(row_lse).any():
            hint = (
                "an empty split (lse -inf) weighs exactly 0, but its partial may hold NaN and 0 * NaN = NaN: "
                "tl.where(w > 0, partial, 0) before you multiply."
            )
        elif got.isnan().all():
            hint = "every output is NaN, as the launcher leaves it: your kernel stored nothing."
    elif _masked_lse_loaded_as_zero(part, lse, got):
        hint = (
            "the lse lanes past num_splits loaded as 0, not -inf, and took a share of the weights: give that "
            'tl.load other=float("-inf") (a masked lane without other= is 0 in the interpreter, garbage on a GPU).'
        )
    else:
        finite = torch.isfinite(lse)
        for name, w in (
            ("natural", torch.exp(lse.double() - lse.double().amax(-1, keepdim=True))),
            ("uniform", finite.double()),
        ):
            w = torch.where(finite, w, 0.0)
            guess = (w[..., None] * torch.nan_to_num(part.double())).sum(-2) / w.sum(-1, keepdim=True)
            if compare(got, guess, *TOLERANCES[torch.float32]).passed:
                hint = {
                    "natural": "lse is in base 2: weigh with exp2, not exp.",
                    "uniform": "weigh each split by 2**(lse_s - max lse): a plain mean ignores how much of the "
                    "softmax mass each split holds.",
                }[name]
    return Mismatch("the float64 merge, within 1e-5 + 1e-6 |ref|", f"max |error| {result.max_abs:.3g}", detail, hint)


def _masked_lse_loaded_as_zero(part, lse, got) -> bool:
    """Whether ``got`` is the merge a kernel computes when the lse lanes past the last
    split (up to the next power of two) load as 0 and their partials as 0."""
    splits = lse.shape[-1]
    pad = (1 << max(splits - 1, 0).bit_length()) - splits
    if pad == 0:
        return False
    lse_pad = torch.cat([lse.double(), lse.new_zeros((*lse.shape[:-1], pad)).double()], -1)
    part_pad = torch.cat([part.double(), part.new_zeros((*part.shape[:-2], pad, part.shape[-1])).double()], -2)
    w = torch.exp2(lse_pad - lse_pad.amax(-1, keepdim=True))
    guess = (w[..., None] * torch.where(w[..., None] > 0, part_pad.nan_to_num(), 0.0)).sum(-2) / w.sum(-1)[..., None]
    return compare(got, guess, *TOLERANCES[torch.float32]).passed


def check_merge_kernel(merge, *, isolate: bool = True, poison_masked: bool = True):
    """Exercise 07: ``merge(partials, lse) -> out`` (the exercise's launcher around the
    learner's kernel) against :func:`pagedkv_lib.reference.merge_partials` and, on partials
    of conformance cases, the float64 decode reference. ``isolate`` and ``poison_masked``
    as :func:`check_append_kernel`."""
    poisoned: list = []
    merge = _poisoning(merge, poison_masked, poisoned)
    gen = torch.Generator().manual_seed(7)

    def made(batch, heads, splits, dim, lse_values=None):
        part = rand((batch, heads, splits, dim), torch.float32, gen)
        lse = (
            rand((batch, heads, splits), torch.float32, gen) * 3
            if lse_values is None
            else torch.tensor(lse_values, dtype=torch.float32).expand(batch, heads, splits).clone()
        )
        return part, lse

    teaching = []
    part, lse = made(1, 1, 2, 4, [1.5, 1.5])
    teaching.append(("two splits of equal lse: the plain mean", part, lse, "Equal lse means equal weights."))
    part, lse = made(2, 3, 3, 8)
    teaching.append(
        ("three splits, random lse", part, lse, "out = sum_s w_s o_s / sum_s w_s with w_s = 2**(lse_s - max lse).")
    )
    part, lse = made(1, 2, 3, 8, [200.0, 180.0, 190.0])
    teaching.append(("large lse (200, 180, 190)", part, lse, "2**200 is inf in fp32: subtract the max first."))
    part, lse = made(2, 2, 3, 8)
    lse[0, :, 1] = float("-inf")
    part[0, :, 1] = float("nan")
    teaching.append(
        (
            "a split that saw no key: lse -inf, a NaN partial",
            part,
            lse,
            "A split with lse = -inf weighs exactly 0, whatever its partial holds.",
        )
    )
    part, lse = made(2, 1, 2, 4)
    lse[1] = float("-inf")
    teaching.append(("a row whose splits are all empty (a length-0 sequence)", part, lse, "Such a row is zeros."))
    part, lse = made(1, 2, 5, 80)
    teaching.append(
        (
            "5 splits and head_dim 80",
            part,
            lse,
            "BLOCK_S = 8 > 5 splits and BLOCK_D = 128 > 80: mask the extra lanes (a masked lse loads as -inf).",
        )
    )
    cases = []
    for label, part, lse, hint in teaching:
        inputs = [
            ("partials", f"[{', '.join(map(str, part.shape))}] fp32"),
            ("lse", show(lse) if lse.numel() <= 12 else f"[{', '.join(map(str, lse.shape))}] fp32"),
        ]
        cases.append(
            Case(
                label,
                lambda p=part, s=lse: _merge_run(merge, p, s, reference.merge_partials(p, s), poisoned),
                inputs,
                hint,
            )
        )
    conformance = [
        (
            {
                "layout": "NHD",
                "dtype": "fp32",
                "head_dim": 64,
                "page_size": 16,
                "group": 4,
                "num_kv_heads": 2,
                "seq_lens": [300, 1000, 0, 129],
            },
            3,
        ),
        (
            {
                "layout": "HND",
                "dtype": "fp32",
                "head_dim": 80,
                "page_size": 5,
                "group": 5,
                "num_kv_heads": 1,
                "seq_lens": [640, 1, 385],
            },
            7,
        ),
    ]
    for case, splits in conformance:

        def run(case=case, splits=splits):
            q, cache, tables, lens, _ = decode_inputs(case)
            part, lse = _split_partials(q, cache, tables, lens, case["layout"], splits)
            want = reference.paged_decode_attention(q, cache, tables, lens, layout=case["layout"], precision="fp64")
            return _merge_run(merge, part, lse, want, poisoned)

        label = f"partials of a harness decode case in {splits} splits: lengths {case['seq_lens']}"
        inputs = [("case", show(case)), ("num_splits", str(splits))]
        cases.append(Case(label, run, inputs, "The merged partials must equal the whole decode (float64 reference)."))
    return run_cases("merge_kernel", cases, "6 teaching cases and the partials of 2 harness decode cases", isolate)


# --------------------------------------------------------------------------- 08 decode


def _dense(q, cache, tables, lens, layout, scale, kv_head_of=None, pad_to: int = 1):
    """float64 decode attention from contiguous K/V with a given scale and head mapping;
    ``pad_to > 1`` adds keys and values of 0 up to a multiple of it (lanes past the end
    that load 0 and keep their score, as a kernel without the -inf mask computes)."""
    heads = q.shape[1]
    hk = cache_dims(cache, layout).num_kv_heads
    kv_head_of = kv_head_of or (lambda h: h // (heads // hk))
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if not n:
            continue
        k, v = (x.double() for x in reference.gather_paged_kv(cache, tables[b], n, layout))
        pad = (-n) % pad_to
        k, v = (torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) for x in (k, v))
        idx = torch.tensor([kv_head_of(h) for h in range(heads)])
        scores = torch.einsum("hd,thd->ht", q[b].double(), k[:, idx]) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[:, idx])
    return out


def _decode_picture(tables, lens, b: int, page_size: int, num_pages: int, block_n: int, name: str) -> Path:
    from ..viz import plot_access_pattern, use_style

    order = torch.full((num_pages, page_size), -1)
    masked = torch.zeros((num_pages, page_size), dtype=torch.bool)
    n = int(lens[b])
    for t in range(-(-n // page_size) * page_size):
        page, row = int(tables[b, t // page_size]), t % page_size
        if t < n:
            order[page, row] = t // block_n
        else:
            masked[page, row] = True
    use_style()
    title = f"the pool rows sequence {b} must read (number: tile of {block_n} tokens)"
    return _save(plot_access_pattern(order, title, masked, label="tile"), name)


DECODE_POISON_FIX = "load masked K/V lanes with other=0.0, and give masked tokens score -inf; 0 * NaN is NaN."
MERGE_POISON_FIX = (
    'load the masked lse lanes with other=float("-inf") (they then weigh exactly 0) and the masked '
    "partial lanes with other=0.0."
)


def _poisoned_hint(loads: list, fix: str = DECODE_POISON_FIX) -> str:
    where = "; ".join(f"`{load.source}` ({Path(load.filename).name}, line {load.lineno})" for load in loads)
    return (
        f"NaN came from the masked lanes of a tl.load without other=: {where}. A masked lane reads no "
        "memory; on a GPU it is undefined, whatever its register held (this check fills it with NaN; "
        f"Triton's interpreter alone gives 0): {fix}"
    )


def _decode_run(decode, case: dict, name: str, block_n: int, poisoned: list):
    seen: dict = {}
    poisoned.clear()  # the loads this case poisons

    def wrapper(q, cache, block_tables, seq_lens, layout="NHD"):
        try:
            out = call("decode", decode, q, cache, block_tables, seq_lens, layout=layout)
        except LearnerError as err:
            seen["error"] = err
            raise
        seen["out"] = out
        return out

    result = decode_case(wrapper, case)
    if "error" in seen:
        raise seen["error"]
    if result.passed:
        return None
    q, cache, tables, lens, _ = decode_inputs(case)
    layout, dims = case["layout"], cache_dims(cache, case["layout"])
    expected = reference.paged_decode_attention(q, cache, tables, lens, layout=layout, precision="fp64")
    out = seen.get("out")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected.shape):
        return Mismatch(f"a tensor of shape {tuple(expected.shape)}", f"decode returned {show(out)}", result.detail)
    out = out.detach().cpu()
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    check = compare(out, expected, atol, rtol)
    if check.passed:  # the output is right: the harness failed something else (the pool, an input)
        return Mismatch(
            "the pool and the inputs left unchanged",
            result.detail,
            hint="a decode only reads: store nothing but the output.",
        )
    b, h = check.worst[:2] if check.worst else (0, 0)
    picture = _decode_picture(tables, lens, b, dims.page_size, dims.num_pages, block_n, name)
    detail = (
        f"sequence {b} (length {int(lens[b])}, pages {tables[b, : -(-int(lens[b]) // dims.page_size)].tolist()}"
        f"), query head {h}: expected {show([round(x, 4) for x in expected[b, h, :3].tolist()])}..., got "
        f"{show([round(x, 4) for x in out[b, h, :3].tolist()])}..."
    )
    hint = ""
    if poisoned and not torch.isfinite(out[b, h]).all() and int(lens[b]) > 0:
        hint = _poisoned_hint(poisoned)  # before "stored nothing": all NaN is what poison gives too
    elif out.isnan().all():
        hint = "every output is NaN, as the launcher leaves it: your kernel stored nothing."
    elif not torch.isfinite(out[b, h]).all():
        hint = (
            "NaN from the pool's unused rows got in: masked lanes must load 0 (other=0.0) *and* their scores "
            "must be -inf; 0 * NaN is NaN."
        )
        if int(lens[b]) == 0:
            hint = "a sequence of length 0 must return zeros: guard l == 0 (0 / 0 is NaN) and a max of -inf."
    else:
        d = q.shape[2]
        hk = dims.num_kv_heads
        guesses = [
            (d**-0.5, lambda hh: hh % hk, "query head h reads KV head h // group: consecutive query heads share one."),
            (math.log(2), None, "multiply the scores by qk_scale (it is 1/sqrt(head_dim) times log2(e))."),
            (math.log2(math.e) * d**-0.5, None, "qk_scale already holds log2(e) for exp2: use tl.exp2, not tl.exp."),
            (math.log(2) * d**-0.5, None, "with tl.exp2 the scale needs the factor log2(e): use qk_scale as given."),
            (
                d**-0.5,
                "pad",
                "lanes past seq_len load k = 0, so their score is 0 and they still take a share of "
                "the softmax: set their scores to -inf.",
            ),
        ]
        for scale, head_of, text in guesses:
            if hk == q.shape[1] and callable(head_of):
                continue  # without GQA every mapping is the same
            pad_to = block_n if head_of == "pad" else 1
            head_of = head_of if callable(head_of) else None
            if compare(out, _dense(q, cache, tables, lens, layout, scale, head_of, pad_to), atol, rtol).passed:
                hint = text
                break
    return Mismatch(
        f"the float64 reference within {atol:g} + {rtol:g} |ref|",
        f"max |error| {check.max_abs:.3g}",
        detail,
        hint,
        picture,
    )


def _decode_label(case: dict) -> str:
    words = [
        case["layout"],
        case["dtype"],
        f"head_dim {case['head_dim']}",
        f"pages of {case['page_size']}",
        f"group {case['group']}",
        f"{case['num_kv_heads']} KV heads",
        f"lengths {case['seq_lens']}",
    ]
    if case.get("shared_pages"):
        words.append("a page shared by two sequences")
    if case.get("poison", True):
        words.append("NaN in unused rows")
    return ", ".join(words)


def _decode_hint(case: dict, block_n: int) -> str:
    hints = []
    if case["head_dim"] & (case["head_dim"] - 1):
        hints.append(f"head_dim {case['head_dim']}: mask d < head_dim.")
    if case["group"] > 1:
        hints.append(f"GQA group {case['group']}: query head h reads KV head h // group.")
    if 0 in case["seq_lens"]:
        hints.append("A sequence of length 0 returns zeros.")
    if case.get("poison", True):
        hints.append("Unused rows hold NaN: load masked lanes as 0 and give them score -inf.")
    if case["layout"] == "HND":
        hints.append("HND: use the strides as given.")
    if max(case["seq_lens"]) > block_n:
        hints.append("More than one tile: rescale l and acc by 2**(m_old - m_new) when the max grows.")
    return " ".join(hints)


def check_decode_kernel(decode, block_n: int = 32, *, isolate: bool = True, poison_masked: bool = True):
    """Exercise 08: ``decode(q, cache, block_tables, seq_lens, layout="NHD") -> out`` (the
    exercise's launcher around the learner's kernel; tiles of ``block_n`` tokens) on teaching
    cases, then the short cases of the harness's decode grid, within
    :data:`pagedkv_lib.compare.TOLERANCES` of the float64 reference. ``isolate`` and
    ``poison_masked`` as :func:`check_append_kernel`; a NaN result then names the masked
    loads that read poison."""
    poisoned: list = []
    decode = _poisoning(decode, poison_masked, poisoned)
    base = {
        "layout": "NHD",
        "dtype": "fp32",
        "head_dim": 16,
        "page_size": 4,
        "group": 1,
        "num_kv_heads": 2,
        "poison": False,
    }
    teaching = [
        (
            "one sequence of 5 tokens on one page",
            dict(base, head_dim=8, page_size=8, num_kv_heads=1, seq_lens=[5]),
            "Program (b, h): scores of q[b, h] with the sequence's keys, softmax, weighted sum of its values.",
        ),
        (
            "three sequences on scattered pages",
            dict(base, seq_lens=[9, 3, 14]),
            "Token t of sequence b lives in page block_tables[b, t // page_size], row t % page_size.",
        ),
        (
            "GQA: 4 query heads share each KV head",
            dict(base, group=4, seq_lens=[9, 6]),
            "The launcher passes group = num_q_heads // num_kv_heads.",
        ),
        (
            "unused rows hold NaN",
            dict(base, poison=True, seq_lens=[9, 6]),
            "Masked lanes must load 0 (other=0.0) and get score -inf: 0 * NaN is NaN.",
        ),
        (
            "a sequence of length 0",
            dict(base, poison=True, seq_lens=[0, 7]),
            "An empty sequence returns zeros: never divide 0 by 0.",
        ),
        (
            "head_dim 6 and pages of 5 rows",
            dict(base, head_dim=6, page_size=5, seq_lens=[12, 4]),
            "BLOCK_D = 8 > head_dim = 6: mask the features.",
        ),
        (
            f"a sequence longer than one tile of {block_n} tokens",
            dict(base, seq_lens=[100, 33]),
            "The online softmax: when the running max grows, rescale l and acc by 2**(m_old - m_new).",
        ),
        ("the HND layout", dict(base, layout="HND", group=2, seq_lens=[11, 5]), "Use the strides as given."),
    ]
    # The short grid (every layout, dtype, head_dim, page size, group, empty and length-1
    # sequences, a shared page, stale values). The long and windowed cases cost 10-30 s of
    # interpreter time with a one-query-head-per-program kernel, more than a workshop
    # check may take; `python -m pagedkv_lib.verify --decode-fn ...` runs them.
    long = long_decode_cases()
    grid = [c for c in decode_grid() if c not in long]
    cases = [
        Case(
            label,
            lambda case=case: _decode_run(decode, case, "decode_kernel", block_n, poisoned),
            [("case", show(case))],
            hint,
        )
        for label, case, hint in teaching
    ]
    for i, case in enumerate(grid, 1):
        cases.append(
            Case(
                f"conformance grid case {i} of {len(grid)}: {_decode_label(case)}",
                lambda case=case: _decode_run(decode, case, "decode_kernel", block_n, poisoned),
                [("case", show(case))],
                _decode_hint(case, block_n),
            )
        )
    return run_cases(
        "decode_kernel",
        cases,
        f"8 teaching cases and the {len(grid)} short cases of verify.decode_grid(), within the harness's tolerances",
        isolate,
    )

"""Check of exercise 06: the learner's Triton append kernel (behind the exercise's
launcher), bit for bit against :func:`pagedkv_lib.reference.append_paged_kv`, on the
teaching cases of :data:`APPEND_TEACHING` and then every case of the harness's
:func:`pagedkv_lab.verify.append_grid`. The pools sit between guard bytes, so a write
next to one is named; a wrong pool is drawn (:func:`pagedkv_lab.viz.plot_wrong_rows`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from pagedkv_lab.exercises.cases import Case, Mismatch, run_cases
from pagedkv_lab.exercises.kernel_checks import access_picture, nhd, poisoning, save_picture
from pagedkv_lab.exercises.result import LearnerError, call, show
from pagedkv_lab.poisoning import accesses_recorded
from pagedkv_lab.verify import append_case, append_grid
from pagedkv_lab.verify.grid import rand
from pagedkv_lab.verify.guards import CANARY, Guards
from pagedkv_lib import reference, runtime
from pagedkv_lib.compare import bits
from pagedkv_lib.pool import PagedKVPool, cache_dims

__all__ = ["AppendTeaching", "APPEND_TEACHING", "check_append_kernel"]

CHECK_NAME = "append_kernel"


@dataclass(frozen=True)
class AppendTeaching:
    """A teaching case: ``slots`` (the slot mapping, -1 padding) into a random fp32 pool of
    ``num_pages`` pages x ``page_size`` rows, ``heads`` KV heads of ``dim``, in ``layout``;
    ``strided``: k is a transposed (strided) view."""

    label: str
    hint: str
    slots: tuple[int, ...]
    page_size: int = 4
    heads: int = 2
    dim: int = 8
    num_pages: int = 5
    layout: str = "NHD"
    strided: bool = False


APPEND_TEACHING = (
    AppendTeaching(
        "four tokens, NHD, pages of 4 rows",
        "Each program copies one token's [heads, head_dim] block: page = slot // page_size, row = slot % page_size.",
        (5, 0, 13, 2),
    ),
    AppendTeaching(
        "padding: slot -1 writes nothing",
        "A token with slot -1 must not be written. In Python, -1 would index the pool's last row; in Triton, "
        "the row before page 0.",
        (3, -1, 9, -1, 16),
    ),
    AppendTeaching(
        "head_dim 6 and 3 heads: more lanes than values",
        "BLOCK_D = 8 > head_dim = 6 and BLOCK_H = 4 > 3 heads: mask d < head_dim and h < num_heads.",
        (7, 1, 12),
        heads=3,
        dim=6,
    ),
    AppendTeaching(
        "the HND layout",
        "HND puts a head's rows side by side; only the strides differ: use stride_n, stride_h, stride_d as given.",
        (5, 0, 13, 2),
        layout="HND",
    ),
    AppendTeaching(
        "k as a strided view",
        "k is a transposed view: address it with stride_kt, stride_kh, stride_kd, never as if it were contiguous.",
        (4, 11, 6),
        strided=True,
    ),
)


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


def _first_wrong_row(status, got_n, exp_n, bef_n, k, v, slot_list, landed, ps) -> tuple[str, str]:
    """``(detail, hint)`` of the first token (in order) whose K or V row is wrong, and what
    that row holds now; of the first changed row when no token's row is wrong."""
    for t in (t for t, sl in enumerate(slot_list) if sl >= 0):
        page, row = divmod(slot_list[t], ps)
        bad = [kv for kv in (0, 1) if status[page, kv, row] == 2]
        if not bad:
            continue
        kv, hint = bad[0], ""
        detail = (
            f"token {t} has slot {slot_list[t]} = page {page} x {ps} + row {row}; that {'KV'[kv]} row "
            f"holds {_row_owner(got_n[page, kv, row], bef_n[page, kv, row], k, v)}"
        )
        if landed[t] is not None and landed[t] != (page, row):
            detail += f"; token {t}'s K was written to page {landed[t][0]}, row {landed[t][1]}"
        if kv == 0 and landed[t] == (page, row):
            heads_ok = [
                torch.equal(bits(got_n[page, 0, row, h]), bits(exp_n[page, 0, row, h])) for h in range(got_n.shape[3])
            ]
            if not all(heads_ok):
                hint = "head 0 is right, later heads are not: add h * stride_h (and h * stride_kh for k)."
        if kv == 1 and (status[:, 0] != 2).all():
            hint = "K is right but V is not: V lives at the same offset plus stride_kv, read with v's strides."
        return detail, hint
    changed = torch.nonzero(torch.as_tensor(status == 3))
    page, kv, row = (int(x) for x in changed[0])
    return f"page {page}, {'KV'[kv]} row {row} belongs to no token of this call, but your kernel changed it", ""


def _landing_hint(got_n, k, slot_list, landed, ps) -> str:
    """A pattern in where the tokens' K landed that names the bug ("" when none does)."""
    hint = ""
    for t in (t for t, sl in enumerate(slot_list) if sl >= 0):
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
    return hint


def _diagnose_append(got, expected, before, k, v, slots, layout: str, name: str) -> Mismatch | None:
    from pagedkv_lab.viz import plot_wrong_rows, row_status, use_style

    status = row_status(got, expected, before, layout)
    if not ((status == 2) | (status == 3)).any():
        return None
    ps = cache_dims(got, layout).page_size
    got_n, exp_n, bef_n = (nhd(x, layout) for x in (got, expected, before))
    use_style()
    picture = save_picture(
        plot_wrong_rows(
            got, expected, before, layout, "pool rows after your kernel (expected: the reference's write)", slots
        ),
        name,
    )
    n_wrong, n_changed = int((status == 2).sum()), int((status == 3).sum())
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
    landed = {t: _where_token_landed(got_n, k, t) for t, sl in enumerate(slot_list) if sl >= 0}
    detail, hint = _first_wrong_row(status, got_n, exp_n, bef_n, k, v, slot_list, landed, ps)
    hint = _landing_hint(got_n, k, slot_list, landed, ps) or hint
    return Mismatch(expected_text, got_text, detail, hint, picture)


def _outside_pool(cache, k, v, slots) -> Mismatch | None:
    """What the kernel wrote into the canary bytes around ``cache`` (placed by
    :class:`pagedkv_lab.verify.guards.Guards`), naming the token whose K or V (head 0)
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
            "mask it out: a token with slot -1 must not be written. In Python, -1 would index the pool's last "
            "row; in Triton, the row before page 0 (-1 // page_size is 0 and -1 % page_size is -1)."
        )
    else:
        who = f"token {owner} (slot {slot_list[owner]})"
        hint = "its page or row offset is wrong: page = slot // page_size, row = slot % page_size, times the strides."
    changed = int(idx.numel())
    side = "before its start" if where == "before" else "past its end"
    farthest = f"; the farthest is {reach} bytes {side}" if reach != changed else ""
    return Mismatch(
        "every write inside the pool, at the tokens' slots",
        f"{who} wrote {changed} bytes {where} the pool",
        f"{changed} bytes changed in the guard bytes the check placed {where} the pool{farthest}",
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


def _run_teaching(c: AppendTeaching, append) -> Mismatch | None:
    gen = torch.Generator().manual_seed(len(c.slots) + c.page_size + c.dim)
    before = PagedKVPool(c.num_pages, c.page_size, c.heads, c.dim, torch.float32, c.layout).cache
    before.copy_(rand(before.shape, torch.float32, gen))
    n = len(c.slots)
    k = (
        rand((c.heads, n, c.dim), torch.float32, gen).transpose(0, 1)
        if c.strided
        else rand((n, c.heads, c.dim), torch.float32, gen)
    )
    v = rand((n, c.heads, c.dim), torch.float32, gen)
    slot_t = torch.tensor(c.slots)
    expected = before.clone()
    reference.append_paged_kv(k, v, expected, slot_t, c.layout)
    dev = runtime.device()
    cache = Guards().place("the pool", before.to(dev))  # canary bytes before and after it
    inputs = (k.to(dev), v.to(dev), cache, slot_t.to(dev))
    call("append", append, *inputs, layout=c.layout)
    stray = _outside_pool(cache, k, v, slot_t)
    if stray is not None:
        return dataclasses.replace(stray, picture=_access_map_picture(append, inputs, c.layout))
    return _diagnose_append(cache.cpu(), expected, before, k, v, slot_t, c.layout, CHECK_NAME)


def _access_map_picture(append, inputs, layout: str):
    """The access map of the learner's append launch on ``inputs`` ``(k, v, cache,
    slot_mapping)``, run again with its loads and stores recorded (only for a write
    outside the pool: the pool sits between guard bytes, so the replay writes into them
    again); None where nothing is recorded (a compiled kernel, another process)."""
    from pagedkv_lab.viz import access_map

    k, v, cache, slots = inputs
    with accesses_recorded() as accesses:
        call("append", append, k, v, cache, slots, layout=layout)
    if not accesses:
        return None
    slot_list = [int(x) for x in slots.tolist()]
    title = "your kernel's stores in the pool, one program per token (dots: the row of its slot; red: outside the pool)"
    amap = access_map(accesses, cache, layout, [k, v, slots])
    return access_picture(amap, title, lambda p: {slot_list[p[0]]} if slot_list[p[0]] >= 0 else set(), "(token)")


def _teaching_inputs(c: AppendTeaching) -> list[tuple[str, str]]:
    return [
        ("slot_mapping", str(list(c.slots))),
        (
            "pool",
            f"{c.num_pages} pages x {c.page_size} rows, {c.heads} KV heads, head_dim "
            f"{c.dim}, {c.layout}, fp32 (random, so stray writes show)",
        ),
        ("k, v", f"[{len(c.slots)}, {c.heads}, {c.dim}]" + (" (k is a strided view)" if c.strided else "")),
    ]


def _run_grid(case: dict, append) -> Mismatch | None:
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
        seen["after"], expected, seen["before"], seen["k"], seen["v"], seen["slots"], case["layout"], CHECK_NAME
    )
    return mismatch or Mismatch("the harness's checks to pass", result.detail)


def check_append_kernel(append, *, isolate: bool = True, poison_masked: bool = True):
    """Exercise 06: ``append(k, v, cache, slot_mapping, layout="NHD")`` (the exercise's
    launcher around the learner's kernel), bit for bit against
    :func:`pagedkv_lib.reference.append_paged_kv`; the pools sit between guard bytes, so
    a write next to one is named. ``isolate``: run the cases in a child process
    (:func:`~pagedkv_lab.exercises.cases.run_cases`); False runs them in this one.
    ``poison_masked`` as in :mod:`pagedkv_lab.exercises.kernel_checks`."""
    append = poisoning(append, poison_masked)
    cases = [Case(c.label, partial(_run_teaching, c, append), _teaching_inputs(c), c.hint) for c in APPEND_TEACHING]
    grid = append_grid()
    cases += [
        Case(
            f"conformance grid case {i} of {len(grid)}: {_describe_case(case)}",
            partial(_run_grid, case, append),
            [("case", show(case))],
            _append_hint(case),
        )
        for i, case in enumerate(grid, 1)
    ]
    return run_cases(
        CHECK_NAME,
        cases,
        f"5 teaching cases and the {len(grid)} cases of verify.append_grid(), bit for bit",
        isolate,
    )

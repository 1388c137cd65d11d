"""Check of exercise 08: the learner's Triton paged decode kernel (behind the exercise's
launcher; tiles of ``block_n`` tokens) on the teaching cases of :data:`DECODE_TEACHING`,
then the short cases of the harness's decode grid, within
:data:`pagedkv_lib.compare.TOLERANCES` of the float64 reference. A wrong output is
diagnosed (a NaN names the masked loads that read poison; a finite error is matched
against the outputs of typical bugs) and the rows the sequence must read are drawn."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch

from pagedkv_lab.exercises.cases import Case, Mismatch, run_cases
from pagedkv_lab.exercises.kernel_checks import poisoned_hint, poisoning, save_picture
from pagedkv_lab.exercises.result import LearnerError, call, show
from pagedkv_lab.verify import decode_case, decode_grid, long_decode_cases
from pagedkv_lab.verify.decode_checks import decode_inputs
from pagedkv_lib import reference
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare
from pagedkv_lib.pool import cache_dims

__all__ = ["DECODE_BASE", "DECODE_TEACHING", "check_decode_kernel"]

CHECK_NAME = "decode_kernel"
# What every teaching case shares; each row of DECODE_TEACHING overrides some of it.
DECODE_BASE = {
    "layout": "NHD",
    "dtype": "fp32",
    "head_dim": 16,
    "page_size": 4,
    "group": 1,
    "num_kv_heads": 2,
    "poison": False,
}
# (label, overrides of DECODE_BASE, hint); "{block_n}" in a label is the tile size.
DECODE_TEACHING = (
    (
        "one sequence of 5 tokens on one page",
        dict(head_dim=8, page_size=8, num_kv_heads=1, seq_lens=[5]),
        "Program (b, h): scores of q[b, h] with the sequence's keys, softmax, weighted sum of its values.",
    ),
    (
        "three sequences on scattered pages",
        dict(seq_lens=[9, 3, 14]),
        "Token t of sequence b lives in page block_tables[b, t // page_size], row t % page_size.",
    ),
    (
        "GQA: 4 query heads share each KV head",
        dict(group=4, seq_lens=[9, 6]),
        "The launcher passes group = num_q_heads // num_kv_heads.",
    ),
    (
        "unused rows hold NaN",
        dict(poison=True, seq_lens=[9, 6]),
        "Masked lanes must load 0 (other=0.0) and get score -inf: 0 * NaN is NaN.",
    ),
    (
        "a sequence of length 0",
        dict(poison=True, seq_lens=[0, 7]),
        "An empty sequence returns zeros: never divide 0 by 0.",
    ),
    (
        "head_dim 6 and pages of 5 rows",
        dict(head_dim=6, page_size=5, seq_lens=[12, 4]),
        "BLOCK_D = 8 > head_dim = 6: mask the features.",
    ),
    (
        "a sequence longer than one tile of {block_n} tokens",
        dict(seq_lens=[100, 33]),
        "The online softmax: when the running max grows, rescale l and acc by 2**(m_old - m_new).",
    ),
    ("the HND layout", dict(layout="HND", group=2, seq_lens=[11, 5]), "Use the strides as given."),
)


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
    from pagedkv_lab.viz import plot_access_pattern, use_style

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
    return save_picture(plot_access_pattern(order, title, masked, label="tile"), name)


# Diagnoses of a decode that reads the right rows and gets the arithmetic wrong.
NUMERICS_HINTS = frozenset(
    {
        "query head h reads KV head h // group: consecutive query heads share one.",
        "multiply the scores by qk_scale (it is 1/sqrt(head_dim) times log2(e)).",
        "qk_scale already holds log2(e) for exp2: use tl.exp2, not tl.exp.",
        "with tl.exp2 the scale needs the factor log2(e): use qk_scale as given.",
    }
)


def _guess_hint(out, q, cache, tables, lens, layout, block_n: int, atol: float, rtol: float) -> str:
    """The typical bug whose output ``out`` matches (a scale, the GQA head map, unmasked
    lanes past the end), in words; "" when none does."""
    d = q.shape[2]
    hk = cache_dims(cache, layout).num_kv_heads
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
            return text
    return ""


def _nan_hint(out, b: int, h: int, n: int, poisoned: list) -> str | None:
    """The hint for a non-finite (or never stored) output of sequence ``b`` (length ``n``),
    query head ``h``; None when the output is finite."""
    if poisoned and out[b, h].isnan().any() and n > 0:
        return poisoned_hint(poisoned)  # before "stored nothing": all NaN is what poison gives too
    if out.isnan().all():
        return "every output is NaN, as the launcher leaves it: your kernel stored nothing."
    if not torch.isfinite(out[b, h]).all():
        if n == 0:
            return "a sequence of length 0 must return zeros: guard l == 0 (0 / 0 is NaN) and a max of -inf."
        if not out[b, h].isnan().any():  # infinite, not NaN: no poison got in
            return (
                "the output is infinite (no NaN): a division by 0, such as by a running sum l that never grew "
                "(l = l * alpha + sum(p) on every tile), or 2**s overflowing fp32 (subtract the running max first)."
            )
        return (
            "NaN from the pool's unused rows got in: masked lanes must load 0 (other=0.0) *and* their scores "
            "must be -inf; 0 * NaN is NaN."
        )
    return None


def _diagnose_decode(out, case: dict, block_n: int, poisoned: list, harness_detail: str) -> Mismatch:
    """The mismatch of a decode output the harness failed: what is wrong where, why, and a
    picture of the rows the worst sequence must read."""
    q, cache, tables, lens, _ = decode_inputs(case)
    layout, dims = case["layout"], cache_dims(cache, case["layout"])
    expected = reference.paged_decode_attention(q, cache, tables, lens, layout=layout, precision="fp64")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected.shape):
        return Mismatch(f"a tensor of shape {tuple(expected.shape)}", f"decode returned {show(out)}", harness_detail)
    out = out.detach().cpu()
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    check = compare(out, expected, atol, rtol)
    if check.passed:  # the output is right: the harness failed something else (the pool, an input)
        return Mismatch(
            "the pool and the inputs left unchanged",
            harness_detail,
            hint="a decode only reads: store nothing but the output.",
        )
    b, h = check.worst[:2] if check.worst else (0, 0)
    detail = (
        f"sequence {b} (length {int(lens[b])}, pages {tables[b, : -(-int(lens[b]) // dims.page_size)].tolist()}"
        f"), query head {h}: expected {show([round(x, 4) for x in expected[b, h, :3].tolist()])}..., got "
        f"{show([round(x, 4) for x in out[b, h, :3].tolist()])}..."
    )
    hint = _nan_hint(out, b, h, int(lens[b]), poisoned)
    if hint is None:
        hint = _guess_hint(out, q, cache, tables, lens, layout, block_n, atol, rtol)
    # The rows-to-read picture helps where rows are the question; a wrong scale or head map
    # reads the right rows, so a picture of them would point the learner the wrong way.
    numerics = hint in NUMERICS_HINTS
    picture = (
        None if numerics else _decode_picture(tables, lens, b, dims.page_size, dims.num_pages, block_n, CHECK_NAME)
    )
    return Mismatch(
        f"the float64 reference within {atol:g} + {rtol:g} |ref|",
        f"max |error| {check.max_abs:.3g}",
        detail,
        hint,
        picture,
    )


def _run_decode(case: dict, decode, block_n: int, poisoned: list) -> Mismatch | None:
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
    return _diagnose_decode(seen.get("out"), case, block_n, poisoned, result.detail)


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
    ``poison_masked`` as :func:`pagedkv_lab.exercises.check_append.check_append_kernel`; a
    NaN result then names the masked loads that read poison."""
    poisoned: list = []
    decode = poisoning(decode, poison_masked, poisoned)
    cases = []
    for label, overrides, hint in DECODE_TEACHING:
        case = dict(DECODE_BASE, **overrides)
        run = partial(_run_decode, case, decode, block_n, poisoned)
        cases.append(Case(label.format(block_n=block_n), run, [("case", show(case))], hint))
    # The short grid (every layout, dtype, head_dim, page size, group, empty and length-1
    # sequences, a shared page, stale values). The long and windowed cases cost 10-30 s of
    # interpreter time with a one-query-head-per-program kernel, more than a workshop
    # check may take; `python -m pagedkv_lab.verify --decode-fn ...` runs them.
    long = long_decode_cases()
    grid = [c for c in decode_grid() if c not in long]
    cases += [
        Case(
            f"conformance grid case {i} of {len(grid)}: {_decode_label(case)}",
            partial(_run_decode, case, decode, block_n, poisoned),
            [("case", show(case))],
            _decode_hint(case, block_n),
        )
        for i, case in enumerate(grid, 1)
    ]
    return run_cases(
        CHECK_NAME,
        cases,
        f"8 teaching cases and the {len(grid)} short cases of verify.decode_grid(), within the harness's tolerances",
        isolate,
    )

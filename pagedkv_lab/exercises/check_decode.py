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
from pagedkv_lab.exercises.kernel_checks import access_picture, poisoned_hint, poisoning
from pagedkv_lab.exercises.result import LearnerError, call, show
from pagedkv_lab.poisoning import accesses_recorded
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


def _rows_to_read(tables, lens, page_size: int, program: tuple[int, int, int]) -> set[int]:
    """The pool slots program ``(b, h)`` of the exercise's launcher must read: the rows of
    sequence ``b``'s tokens, ``block_tables[b, t // page_size] * page_size + t % page_size``."""
    b = program[0]
    return {int(tables[b, t // page_size]) * page_size + t % page_size for t in range(int(lens[b]))}


def _access_map_picture(launch, layout: str, block_n: int, poisoned: bool) -> Path | None:
    """The access map of the learner's last launch when it shows an addressing fault: a
    program that read rows other than its sequence's, a write outside the pool and the
    launch's tensors, or masked loads that read poison (``poisoned``); None otherwise (a
    numeric fault reads the right rows: a map of them would point the learner the wrong way)."""
    from pagedkv_lab.viz import access_map

    launch = launch() if launch is not None else None
    if not launch or not launch[0]:
        return None
    accesses, cache, tensors = launch
    tables, lens = (t.cpu() for t in tensors[1:3])
    amap = access_map(accesses, cache, layout, tensors)
    should = partial(_rows_to_read, tables, lens, cache_dims(cache, layout).page_size)
    wrong = any(amap.slots(p, "read") != should(p) for p in amap.programs)
    if not (poisoned or wrong or amap.outside.any()):
        return None
    title = f"your kernel's loads in the pool, program (b, h), tiles of {block_n} tokens (dots: the rows of sequence b)"
    return access_picture(amap, title, should, "(b, h)")


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


def _diagnose_decode(out, case: dict, block_n: int, poisoned: list, harness_detail: str, launch=None) -> Mismatch:
    """The mismatch of a decode output the harness failed: what is wrong where, why, and
    for an addressing fault the access map of ``launch()`` (the learner's last launch
    replayed: ``(accesses, cache, [q, block_tables, seq_lens, out])``)."""
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
    from_poison = bool(poisoned) and hint == poisoned_hint(poisoned)
    if hint is None:
        hint = _guess_hint(out, q, cache, tables, lens, layout, block_n, atol, rtol)
    picture = None if hint in NUMERICS_HINTS else _access_map_picture(launch, layout, block_n, from_poison)
    return Mismatch(
        f"the float64 reference within {atol:g} + {rtol:g} |ref|",
        _error_words(out, expected, check.max_abs),
        detail,
        hint,
        picture,
    )


def _error_words(out, expected, max_abs: float) -> str:
    """``max |error| x``, or, where the output has NaN the reference has not, how many
    (an error against NaN is NaN, not inf)."""
    nan = out.isnan() & ~expected.isnan()
    if nan.any():
        return f"NaN in {int(nan.sum())} of {nan.numel()} outputs (max |error| NaN)"
    return f"max |error| {max_abs:.3g}"


def _run_decode(case: dict, decode, block_n: int, poisoned: list) -> Mismatch | None:
    seen: dict = {}
    poisoned.clear()  # the loads this case poisons

    def wrapper(q, cache, block_tables, seq_lens, layout="NHD"):
        try:
            out = call("decode", decode, q, cache, block_tables, seq_lens, layout=layout)
        except LearnerError as err:
            seen["error"] = err
            raise
        seen.update(out=out, inputs=(q, cache, block_tables, seq_lens, layout))
        return out

    result = decode_case(wrapper, case)
    if "error" in seen:
        raise seen["error"]
    if result.passed:
        return None
    return _diagnose_decode(seen.get("out"), case, block_n, poisoned, result.detail, partial(_replay, decode, seen))


def _replay(decode, seen: dict):
    """The learner's last launch run again with its loads and stores recorded (only for a
    failed case: recording triples the interpreter's time): ``(accesses, cache, [q,
    block_tables, seq_lens, out])``, or None when it did not return."""
    if "inputs" not in seen:
        return None
    q, cache, tables, lens, layout = seen["inputs"]
    with accesses_recorded() as accesses:
        out = call("decode", decode, q, cache, tables, lens, layout=layout)
    return accesses, cache, [q, tables, lens, out]


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

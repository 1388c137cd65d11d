"""Check of exercise 07: the learner's Triton split-KV merge (behind the exercise's
launcher) against :func:`pagedkv_lib.reference.merge_partials` on the teaching cases of
:data:`MERGE_TEACHING`, then on the partials of the harness decode cases of
:data:`MERGE_CONFORMANCE` against the float64 decode reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from pagedkv_lab.exercises.cases import Case, Mismatch, run_cases
from pagedkv_lab.exercises.kernel_checks import MERGE_POISON_FIX, poisoned_hint, poisoning
from pagedkv_lab.exercises.result import call, show
from pagedkv_lab.verify.decode_checks import decode_inputs
from pagedkv_lab.verify.grid import rand
from pagedkv_lib import reference, runtime
from pagedkv_lib.compare import TOLERANCES, compare
from pagedkv_lib.pool import cache_dims

__all__ = ["MergeTeaching", "MERGE_TEACHING", "MERGE_CONFORMANCE", "check_merge_kernel"]


MERGE_TOLERANCE = TOLERANCES[torch.float32]  # (atol, rtol): the merge's outputs are fp32
# The rule as the learner reads it: "1e-5 + 1e-6 |ref|" (numbers without the exponent's 0).
MERGE_RULE = " + ".join(f"{x:g}".replace("e-0", "e-") for x in MERGE_TOLERANCE) + " |ref|"


def _empty_split(part: torch.Tensor, lse: torch.Tensor) -> None:
    lse[0, :, 1] = float("-inf")
    part[0, :, 1] = float("nan")


def _empty_row(part: torch.Tensor, lse: torch.Tensor) -> None:
    lse[1] = float("-inf")


@dataclass(frozen=True)
class MergeTeaching:
    """A teaching case: random fp32 partials ``[batch, heads, splits, dim]`` and lse (random
    x 3, or ``lse_values`` per split), then ``edit(part, lse)`` in place (empty splits)."""

    label: str
    hint: str
    shape: tuple[int, int, int, int]
    lse_values: tuple[float, ...] | None = None
    edit: Callable[[torch.Tensor, torch.Tensor], None] | None = None


MERGE_TEACHING = (
    MergeTeaching(
        "two splits of equal lse: the plain mean", "Equal lse means equal weights.", (1, 1, 2, 4), (1.5, 1.5)
    ),
    MergeTeaching(
        "three splits, random lse", "out = sum_s w_s o_s / sum_s w_s with w_s = 2**(lse_s - max lse).", (2, 3, 3, 8)
    ),
    MergeTeaching(
        "large lse (200, 180, 190)",
        "2**200 is inf in fp32: subtract the max first.",
        (1, 2, 3, 8),
        (200.0, 180.0, 190.0),
    ),
    MergeTeaching(
        "a split that saw no key: lse -inf, a NaN partial",
        "A split with lse = -inf weighs exactly 0, whatever its partial holds.",
        (2, 2, 3, 8),
        edit=_empty_split,
    ),
    MergeTeaching(
        "a row whose splits are all empty (a length-0 sequence)", "Such a row is zeros.", (2, 1, 2, 4), edit=_empty_row
    ),
    MergeTeaching(
        "5 splits and head_dim 80",
        "BLOCK_S = 8 > 5 splits and BLOCK_D = 128 > 80: mask the extra lanes (a masked lse loads as -inf).",
        (1, 2, 5, 80),
    ),
)
# Harness decode cases (as :func:`pagedkv_lab.verify.decode_case` takes them) and the
# number of splits their partials are cut into.
MERGE_CONFORMANCE = (
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
)


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
    result = compare(got, expected, *MERGE_TOLERANCE)
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
            hint = poisoned_hint(poisoned, MERGE_POISON_FIX)
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
            if compare(got, guess, *MERGE_TOLERANCE).passed:
                hint = {
                    "natural": "lse is in base 2: weigh with exp2, not exp.",
                    "uniform": "weigh each split by 2**(lse_s - max lse): a plain mean ignores how much of the "
                    "softmax mass each split holds.",
                }[name]
    return Mismatch(f"the float64 merge, within {MERGE_RULE}", f"max |error| {result.max_abs:.3g}", detail, hint)


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
    return compare(got, guess, *MERGE_TOLERANCE).passed


def _teaching_inputs(gen: torch.Generator) -> list[tuple[MergeTeaching, torch.Tensor, torch.Tensor]]:
    """Each teaching case with its partials and lse, drawn from ``gen`` in table order."""
    made = []
    for c in MERGE_TEACHING:
        batch, heads, splits, dim = c.shape
        part = rand((batch, heads, splits, dim), torch.float32, gen)
        lse = (
            rand((batch, heads, splits), torch.float32, gen) * 3
            if c.lse_values is None
            else torch.tensor(c.lse_values, dtype=torch.float32).expand(batch, heads, splits).clone()
        )
        if c.edit is not None:
            c.edit(part, lse)
        made.append((c, part, lse))
    return made


def _run_conformance(case: dict, splits: int, merge, poisoned: list) -> Mismatch | None:
    q, cache, tables, lens, _ = decode_inputs(case)
    part, lse = _split_partials(q, cache, tables, lens, case["layout"], splits)
    want = reference.paged_decode_attention(q, cache, tables, lens, layout=case["layout"], precision="fp64")
    return _merge_run(merge, part, lse, want, poisoned)


def _run_teaching(part, lse, merge, poisoned: list) -> Mismatch | None:
    return _merge_run(merge, part, lse, reference.merge_partials(part, lse), poisoned)


def check_merge_kernel(merge, *, isolate: bool = True, poison_masked: bool = True):
    """Exercise 07: ``merge(partials, lse) -> out`` (the exercise's launcher around the
    learner's kernel) against :func:`pagedkv_lib.reference.merge_partials` and, on partials
    of conformance cases, the float64 decode reference. ``isolate`` and ``poison_masked``
    as :func:`pagedkv_lab.exercises.check_append.check_append_kernel`."""
    poisoned: list = []
    merge = poisoning(merge, poison_masked, poisoned)
    cases = []
    for c, part, lse in _teaching_inputs(torch.Generator().manual_seed(7)):
        inputs = [
            ("partials", f"[{', '.join(map(str, part.shape))}] fp32"),
            ("lse", show(lse) if lse.numel() <= 12 else f"[{', '.join(map(str, lse.shape))}] fp32"),
        ]
        cases.append(Case(c.label, partial(_run_teaching, part, lse, merge, poisoned), inputs, c.hint))
    for case, splits in MERGE_CONFORMANCE:
        cases.append(
            Case(
                f"partials of a harness decode case in {splits} splits: lengths {case['seq_lens']}",
                partial(_run_conformance, case, splits, merge, poisoned),
                [("case", show(case)), ("num_splits", str(splits))],
                "The merged partials must equal the whole decode (float64 reference).",
            )
        )
    return run_cases("merge_kernel", cases, "6 teaching cases and the partials of 2 harness decode cases", isolate)

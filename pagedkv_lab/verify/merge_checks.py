"""Merge cases: attention states merged into one (FlashInfer's ``merge_state(s)``,
vLLM's ``merge_attn_states``, a split-KV decode's stage 2, cascade attention's join),
judged by the float64 reference :func:`pagedkv_lib.merge_state.merge_states`.

A state ``(v, s)`` of a row over a key set is its normalised output and the
log-sum-exp of its scaled scores. A ``merge_fn`` takes ``v [seq_len, num_states,
num_heads, head_dim]`` (fp32/fp16/bf16) and ``s [seq_len, num_states, num_heads]``
fp32 and returns ``(v [seq_len, num_heads, head_dim]`` in ``v``'s dtype, ``s [seq_len,
num_heads]`` fp32``)`` (FlashInfer's ``merge_states``); its contract says in which base
its LSEs are (``lse``: ``"base2"``, FlashInfer's and the suite's, the default;
``"natural"``, vLLM's) and how it takes the states (``merge_inputs="pair"``: ``fn(v_a,
s_a, v_b, s_b)``, FlashInfer's ``merge_state``; cases of other state counts are moved to
two). The harness draws the LSEs in base 2 and hands them over in the declared base, so
a merge in the other base fails. A kernel that takes ``out=`` writes into a guarded
buffer.

The grid: each dtype, 1 to 8 states, head dims 64, 80 and 128; LSEs 300 apart (a merge
that does not subtract the maximum overflows fp32); **empty states** (``s = -inf``,
their ``v`` NaN: an empty state weighs exactly 0 and its ``v`` is never multiplied),
rows whose states are all empty (``v = 0``, ``s = -inf``); and **NaN states**: a NaN
LSE or a NaN in ``v`` of a non-empty state must come back NaN (the row's, or the
feature's), as must a ``+inf`` LSE; a merge that takes them for empty states hides the
NaN in a plausible number.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.contract import Contract, contract_of
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import accepts, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.read_call import lse_in_base
from pagedkv_lab.verify.report import CaseResult, located
from pagedkv_lib import merge_state, runtime
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare, compare_lse, first_difference

__all__ = ["merge_grid", "merge_inputs", "merge_case", "NAN_KINDS"]

# What a case plants in a non-empty state of row 0 (head 0; feature 0 for "v").
NAN_KINDS = ("lse", "v", "inf_lse")


def merge_grid(full: bool = False) -> list[dict]:
    """Merge cases: plain merges of 1, 2, 3 and 8 states in each dtype; LSEs 300 apart;
    empty states (NaN ``v``) and all-empty rows; a NaN LSE, a NaN in ``v`` and a
    ``+inf`` LSE in a non-empty state."""
    base = {"dtype": "fp32", "seq_len": 5, "num_states": 2, "num_heads": 2, "head_dim": 64}
    cases = [
        base,
        {**base, "dtype": "fp16", "seq_len": 7, "num_states": 3, "num_heads": 4, "head_dim": 80},
        {**base, "dtype": "bf16", "seq_len": 3, "num_states": 8, "num_heads": 1, "head_dim": 128},
        {**base, "num_states": 1, "head_dim": 80},
        {**base, "dtype": "fp16", "num_states": 4, "spread": 300.0},
        {**base, "num_states": 3, "num_heads": 3, "empty": "some"},
        {**base, "dtype": "bf16", "seq_len": 4, "num_states": 2, "empty": "rows"},
        {**base, "num_states": 3, "nan": "lse", "empty": "some"},
        {**base, "dtype": "fp16", "num_states": 2, "nan": "v"},
        {**base, "num_states": 3, "nan": "inf_lse"},
    ]
    if full:
        cases += [{**base, "seq_len": 33, "num_states": 16, "num_heads": 8, "head_dim": 256, "empty": "some"}]
    return cases


def merge_inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v, s)`` of a merge case on the CPU, ``s`` in base 2: LSEs ``N(0, 4)`` (or spread
    uniformly over ``spread``), then the case's empty states (``s = -inf``, ``v`` NaN:
    ``"some"``: state 1 of even rows and state 0 of row 1; ``"rows"``: every state of
    rows 0 and 2) and its NaN (row 0, head 0, state 0, a non-empty one)."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    n, k, h, d = case["seq_len"], case["num_states"], case["num_heads"], case["head_dim"]
    v = rand((n, k, h, d), DTYPES[case["dtype"]], gen)
    if case.get("spread"):
        s = (torch.rand((n, k, h), generator=gen) - 0.5) * case["spread"]
    else:
        s = torch.randn((n, k, h), generator=gen) * 2.0
    empty = torch.zeros((n, k, h), dtype=torch.bool)
    if case.get("empty") == "some":
        empty[0::2, min(1, k - 1)] = True
        empty[1 % n, 0] = True
    elif case.get("empty") == "rows":
        empty[0::2] = True
    s = s.masked_fill(empty, float("-inf"))
    v = v.masked_fill(empty[..., None], float("nan"))  # never to be multiplied
    nan = case.get("nan")
    if nan == "lse":
        s[0, 0, 0] = float("nan")
    elif nan == "inf_lse":
        s[0, 0, 0] = float("inf")
    elif nan == "v":
        v[0, 0, 0, 0] = float("nan")
    return v, s.float()


def _call(merge_fn, contract: Contract, v, s, guards: Guards, dev):
    """Call ``merge_fn`` in its declared form and base; returns ``(what it returned, the
    inputs it was given, their originals on the CPU, the out= buffer or None)``, or raises."""
    base = contract.lse or "base2"
    originals = {"v": v, "s": (s.double() * math.log(2.0)).float() if base == "natural" else s}
    inputs = {name: guards.place(name, t.to(dev)) for name, t in originals.items()}
    kwargs = {}
    if accepts(merge_fn, "out", named=True):
        kwargs["out"] = guards.place_output("out", (v.shape[0], v.shape[2], v.shape[3]), v.dtype, dev)
    if contract.merge_inputs == "pair":
        got = merge_fn(inputs["v"][:, 0], inputs["s"][:, 0], inputs["v"][:, 1], inputs["s"][:, 1], **kwargs)
    else:
        got = merge_fn(inputs["v"], inputs["s"], **kwargs)
    return got, inputs, originals, kwargs.get("out")


def merge_case(merge_fn, case: dict, contract: Contract | None = None) -> CaseResult:
    """Run one merge case: ``v`` within the tolerance of its dtype and ``s`` within
    :data:`~pagedkv_lib.compare.LSE_TOLERANCES` of the float64 merge (NaN where it is
    NaN, ``-inf`` where every state is empty), the inputs unchanged, nothing written
    next to them or past ``out=``."""
    contract = contract or contract_of(merge_fn)
    reason = contract.outside(case)
    if reason:
        return CaseResult("merge", case, None, outside=reason)
    v, s = merge_inputs(case)
    expected, expected_lse = merge_state.merge_states(v, s)
    expected_lse = lse_in_base(expected_lse, contract.lse or "base2")
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    dev, guards = runtime.device(), Guards()
    try:
        got, inputs, originals, out_buf = _call(merge_fn, contract, v, s, guards, dev)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult("merge", case, False, math.inf, math.inf, atol, raised(err))
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return CaseResult("merge", case, False, math.inf, math.inf, atol,
                          f"returned {type(got).__name__}, not (v, s)")  # fmt: skip
    out, lse = got
    out = out_buf if out is None and out_buf is not None else out
    result = compare(out, expected, atol, rtol)

    def where(idx):
        return f"row {idx[0]}, head {idx[1]}" + (f", feature {idx[2]}" if len(idx) > 2 else "")

    notes = []
    lse_result = compare_lse(lse, expected_lse, *contract.lse_tolerance(case["dtype"]))
    if not lse_result.passed:
        lse_detail = located(lse_result, where, lse, expected_lse) or lse_result.detail
        notes.append(f"lse: {lse_detail} (declared {contract.lse or 'base2'})")
    for name, before in originals.items():
        count, at = first_difference(inputs[name].cpu(), before)
        if count:
            notes.append(f"merge modified its input {name} ({at})")
    notes += guards.corrupted()
    detail = "; ".join(x for x in (located(result, where, out, expected), *notes) if x)
    ok = result.passed and not notes
    return CaseResult("merge", case, ok, result.max_abs, result.max_rel, atol, detail, result.tol_ratio)

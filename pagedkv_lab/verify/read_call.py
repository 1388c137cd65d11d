"""What the decode and prefill families share around the call of a read kernel: the
score modifiers of a case, an output buffer between guards for a kernel that takes
``out=``, the log-sum-exp of a kernel that returns one, and its check.

* **Score modifiers** (``"softcap"``, ``"alibi"``, ``"sinks"`` in a case,
  :mod:`pagedkv_lib.score_mods`): :func:`score_mod_kwargs` draws them from the case's
  seed and passes the same values to the float64 reference and the kernel.
* **Guarded outputs**: a kernel that takes ``out=`` gets a NaN-filled buffer between
  guard bytes (:meth:`~pagedkv_lab.verify.guards.Guards.place_output`), so a write past
  the output, or a row left unwritten, is seen; what it wrote there is what is checked.
* **LSE**: a kernel whose contract says ``lse="base2"`` or ``"natural"`` is called with
  ``return_lse=True`` (when it takes the argument) and must return ``(out, lse)``,
  ``lse [rows, num_q_heads]``; :func:`check_lse` compares it with the reference's
  base-2 LSE converted to that base (:func:`pagedkv_lib.compare.compare_lse`), so a
  kernel that returns a natural-log LSE declared as base 2 (or the reverse) fails.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.contract import Contract
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import accepts
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import located
from pagedkv_lib.compare import compare_lse
from pagedkv_lib.score_mods import SCORE_MODS, alibi_slopes_for

__all__ = ["score_mod_kwargs", "score_mod_cases", "call_read", "check_lse", "lse_in_base"]


def score_mod_kwargs(case: dict, num_q_heads: int) -> dict:
    """The keyword arguments (``logits_soft_cap``, ``alibi_slopes``, ``sinks``) of the
    score modifiers a case names: ``"softcap": c`` the cap, ``"alibi": True`` the ALiBi
    paper's slopes, ``"sinks": True`` sink logits drawn from the case's seed
    (``N(1, 1)``: large enough to take visible mass from short rows)."""
    kwargs = {}
    if case.get("softcap") is not None:
        kwargs["logits_soft_cap"] = float(case["softcap"])
    if case.get("alibi"):
        kwargs["alibi_slopes"] = alibi_slopes_for(num_q_heads)
    if case.get("sinks"):
        gen = torch.Generator().manual_seed(30_011 + case.get("seed", 0))
        kwargs["sinks"] = torch.randn(num_q_heads, generator=gen) + 1.0
    return kwargs


def score_mod_cases(base: list[dict]) -> list[dict]:
    """Cases with score modifiers, one per base case: the soft cap, ALiBi, the sinks, and
    all three on the last (joined to a grid only for a kernel that declares them)."""
    mods = [{"softcap": 2.0}, {"alibi": True}, {"sinks": True}, {"softcap": 2.0, "alibi": True, "sinks": True}]
    return [{**case, **mod} for case, mod in zip(base, mods)]


def lse_in_base(lse_base2: torch.Tensor, base: str) -> torch.Tensor:
    """A float64 base-2 LSE in ``base`` (``"natural"``: times ln 2)."""
    return lse_base2 * math.log(2.0) if base == "natural" else lse_base2


def call_read(fn, args: tuple, kwargs: dict, contract: Contract, out_like: torch.Tensor, guards: Guards):
    """Call read kernel ``fn(*args, **kwargs)``; with ``out=`` (when it takes it) a guarded
    NaN-filled buffer shaped and typed as ``out_like``, with ``return_lse=True`` when the
    contract declares an LSE. Returns ``(out, lse, error)``: ``error`` the failure
    detail when it raised or returned the wrong kind of thing, else ""."""
    kwargs = dict(kwargs)
    if accepts(fn, "out", named=True):
        kwargs["out"] = guards.place_output("out", out_like.shape, out_like.dtype, out_like.device)
    if contract.lse is not None and accepts(fn, "return_lse"):
        kwargs["return_lse"] = True
    try:
        got = fn(*args, **kwargs)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return None, None, raised(err)
    lse = None
    if contract.lse is not None:
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return None, None, f"declares lse={contract.lse!r} but returned {type(got).__name__}, not (out, lse)"
        got, lse = got
    if "out" in kwargs and got is None:
        got = kwargs["out"]  # vLLM's convention: the result is where it was written
    elif "out" in kwargs and isinstance(got, torch.Tensor) and not torch.equal(got.cpu(), kwargs["out"].cpu()):
        if not (got.isnan() & kwargs["out"].isnan()).equal(got.isnan()):
            return None, None, "returned a tensor that differs from what it wrote into out="
    return got, lse, ""


def check_lse(lse, expected_base2: torch.Tensor, contract: Contract, dtype: str, where) -> tuple[bool, str]:
    """``(passed, detail)`` of a kernel's LSE against the reference's base-2 LSE
    ``expected_base2 [rows, heads]`` in the contract's base; ``detail`` prefixed
    ``lse: `` and located by ``where`` (an index tuple to words)."""
    atol, rtol = contract.lse_tolerance(dtype)
    result = compare_lse(lse, lse_in_base(expected_base2, contract.lse), atol, rtol)
    if result.passed:
        return True, ""
    detail = located(result, where, lse, lse_in_base(expected_base2, contract.lse)) or result.detail
    return False, f"lse: {detail} (declared {contract.lse})"


def declared_mods(contract: Contract) -> tuple[str, ...]:
    return tuple(m for m in SCORE_MODS if m in contract.score_mods)

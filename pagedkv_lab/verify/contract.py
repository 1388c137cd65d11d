"""Kernel contracts: what a kernel under test declares it supports.

Few production kernels take every input the suite can build: one supports only
power-of-two head dims, another never sees a sequence of length 0, a third has no ring
window. A :class:`Contract` says so; the harness then reports the cases outside it as
*outside the declared contract* (listed apart, neither passed nor failed), skips a
scenario that needs an undeclared feature with that reason, and draws generated cases
only inside the contract. It also says which cache layout the kernel takes (see
:mod:`pagedkv_lib.cache_layouts`), so each case's pool is built in that layout, and for
a prefill whether the new tokens' K/V are read from the pool or given apart
(``new_tokens``, vLLM's ``context_attention_fwd`` form).

Before a grid case is judged outside, :meth:`Contract.project` moves it inside where an
equivalent case exists: an excluded page size, head dim, GQA group, dtype or layout
becomes the nearest admitted one the suite builds (:data:`SUBSTITUTES`; pages of 1 and
5 become 16 and 32 for a kernel whose tile is one page of at least 16), sequences
shorter than ``min_seq_len`` are dropped from their batch (as padding slots are
dropped), and a ring or linear window is dropped for a kernel without it. The case
records what changed under ``"substituted"``. Only a case with no admitted value to
move to stays outside.

Preconditions real kernels have, each a field (default: none of it):

* ``min_q_len=1``: every prefill request has at least one query (vLLM's
  chunked-prefill-paged-decode maps a request with none onto the next one's row);
  requests with fewer are dropped from their batch;
* ``new_tokens="both"``: the new tokens' K/V are in the pool *and* given apart
  (``k_new=``, ``v_new=``; vLLM's backend writes them, then its prefill reads them from
  ``k``/``v`` while its decode reads the pool);
* ``fp32_dots="tf32"``: fp32 dots run on tf32 tensor cores (Triton's
  ``input_precision``; vLLM's and LightLLM's kernels on a GPU): fp32 cases are judged
  by the tolerance of a 10-bit mantissa, fp16's (:meth:`Contract.tolerance`);
* ``kv_strides="shared"``: K and V are addressed with one set of strides (K's). By
  default (``"any"``) the harness gives a ``"kv_tuple"`` or ``"flat"`` pool's V a longer
  page stride than K's (:func:`pagedkv_lab.verify.guards.Guards.place_pool`), so a
  kernel that needs them shared (or contiguous) fails until it says so;
* ``score_mods``: the score modifiers the kernel takes (:mod:`pagedkv_lib.score_mods`:
  ``"softcap"``, ``"alibi"``, ``"sinks"``, as ``logits_soft_cap=``, ``alibi_slopes=``,
  ``sinks=``); the decode and prefill grids then add cases with them, judged by the
  float64 references, which implement all three;
* ``lse="base2"`` or ``"natural"``: the kernel returns ``(out, lse)`` when called with
  ``return_lse=True`` (or always), ``lse [rows, num_q_heads]`` fp32 in that base
  (FlashInfer's and the suite's base 2; flash-attention's and vLLM's natural log); the
  decode and prefill families then check the LSE too. For a ``merge_fn`` it is the
  base of the LSEs it takes and returns (base 2 when None), and ``merge_inputs``
  says how it takes the states (``"states"``: ``v [seq, num_states, heads, dim], s
  [seq, num_states, heads]``, FlashInfer's ``merge_states``; ``"pair"``: ``v_a, s_a,
  v_b, s_b``, FlashInfer's ``merge_state``).

Declare a contract when wrapping a kernel::

    @verify.contract(cache_layout="flat", head_dims="pow2", windows=False)
    def my_append(k, v, cache, slot_mapping, layout="NHD"):
        k_cache, v_cache = cache
        ...

or pass ``verify.run(..., contracts={"append_fn": Contract(...)})``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pagedkv_lib.cache_layouts import CACHE_LAYOUTS
from pagedkv_lib.checks import NEW_TOKENS, check_int, is_int
from pagedkv_lib.compare import DTYPES, LSE_TOLERANCES, TOLERANCES
from pagedkv_lib.indexing import is_power_of_two
from pagedkv_lib.score_mods import SCORE_MODS

__all__ = ["Contract", "contract", "contract_of", "admits", "FULL", "SUBSTITUTES", "LSE_BASES"]

_DTYPES = ("fp32", "fp16", "bf16")
_LAYOUTS = ("NHD", "HND")
_NEW_TOKENS = (*NEW_TOKENS, "both")
_FP32_DOTS = ("ieee", "tf32x3", "tf32")  # Triton's input_precision values
_KV_STRIDES = ("any", "shared")
LSE_BASES = ("base2", "natural")
_MERGE_INPUTS = ("states", "pair")
# The values the suite builds, by case key, in the order a substitute is looked for:
# an excluded value becomes the smallest admitted one at or above 4x it (a page of 1
# or 5 becomes 16 or 32, not the same page twice), else the largest admitted one.
SUBSTITUTES = {
    "page_size": (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256),
    "head_dim": (16, 32, 48, 64, 80, 96, 128, 256),
    "group": (1, 2, 3, 4, 5, 6, 8, 16),
}
_DOMAIN_OF = {"page_size": "page_sizes", "head_dim": "head_dims", "group": "gqa_groups"}


def _domain(name: str, value) -> None:
    if value is None or value == "pow2":
        return
    if not isinstance(value, tuple) or not all(is_int(v) for v in value):
        raise ValueError(f"{name}={value!r} must be None (any), 'pow2' or a tuple of ints")


def admits(domain, value: int) -> bool:
    """Whether a contract domain (None: any, ``"pow2"``, or a tuple) admits ``value``."""
    if domain is None:
        return True
    if domain == "pow2":
        return is_power_of_two(value)
    return value in domain


@dataclass(frozen=True)
class Contract:
    """What a kernel supports. Every field defaults to "everything the suite builds".

    ``dtypes``: of ``"fp32"``, ``"fp16"``, ``"bf16"``. ``layouts``: ``"NHD"``/``"HND"`` (for
    the ``"paged"`` and ``"kv_tuple"`` cache layouts). ``cache_layout``: one of
    :data:`pagedkv_lib.cache_layouts.CACHE_LAYOUTS`. ``head_dims``, ``page_sizes``,
    ``gqa_groups``: None (any), ``"pow2"`` (powers of two) or a tuple of values.
    ``min_seq_len``: the shortest sequence a decode accepts (1 excludes empty ones).
    ``windows``: ring windows (the ``window=`` argument, a
    :class:`~pagedkv_lib.window.RingWindow`). ``linear_windows``: linear-cache windows
    (``window=`` a :class:`~pagedkv_lib.window.LinearWindow`, FlashInfer's
    ``window_left``); None (the default) follows ``windows``, so a kernel declared
    without windows gets neither. ``padding``: ``-1`` slots in an append.
    ``strided_kv``: non-contiguous K/V inputs. ``new_tokens`` (a prefill's calling
    form): ``"cache"`` (the new tokens' K/V are written into the pool before the call) or
    ``"separate"`` (vLLM's ``context_attention_fwd`` form: the kernel takes them as
    ``k_new=``, ``v_new= [total_q, num_kv_heads, head_dim]`` and the pool's rows for them
    hold NaN; no ring window, no request with more queries than keys) or ``"both"`` (the
    pool holds them too, as in vLLM's backend; the same limits). ``min_q_len``: the
    fewest queries of a prefill request (1 excludes requests without one).
    ``fp32_dots``: ``"ieee"``, ``"tf32x3"`` or ``"tf32"`` (fp32 cases judged by fp16's
    tolerance). ``kv_strides``: ``"any"`` or ``"shared"`` (K's strides address V).
    ``score_mods``: of ``"softcap"``, ``"alibi"``, ``"sinks"``. ``lse``: None,
    ``"base2"`` or ``"natural"``. ``merge_inputs``: ``"states"`` or ``"pair"``. The
    module docstring says what each admits and what the harness then builds.
    """

    dtypes: tuple[str, ...] = _DTYPES
    layouts: tuple[str, ...] = _LAYOUTS
    cache_layout: str = "paged"
    head_dims: tuple[int, ...] | str | None = None
    page_sizes: tuple[int, ...] | str | None = None
    gqa_groups: tuple[int, ...] | str | None = None
    min_seq_len: int = 0
    windows: bool = True
    linear_windows: bool | None = None
    padding: bool = True
    strided_kv: bool = True
    new_tokens: str = "cache"
    min_q_len: int = 0
    fp32_dots: str = "ieee"
    kv_strides: str = "any"
    score_mods: tuple[str, ...] = ()
    lse: str | None = None
    merge_inputs: str = "states"
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name, allowed in (("dtypes", _DTYPES), ("layouts", _LAYOUTS)):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not value or not set(value) <= set(allowed):
                raise ValueError(f"{name}={value!r} must be a non-empty tuple of {allowed}")
        if self.cache_layout not in CACHE_LAYOUTS:
            raise ValueError(f"cache_layout={self.cache_layout!r} must be one of {CACHE_LAYOUTS}")
        for name in ("head_dims", "page_sizes", "gqa_groups"):
            _domain(name, getattr(self, name))
        for name in ("min_seq_len", "min_q_len"):
            check_int(name, getattr(self, name))
        for name, allowed in (("new_tokens", _NEW_TOKENS), ("fp32_dots", _FP32_DOTS), ("kv_strides", _KV_STRIDES),
                              ("merge_inputs", _MERGE_INPUTS)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.lse is not None and self.lse not in LSE_BASES:
            raise ValueError(f"lse={self.lse!r} must be None (no LSE returned) or one of {LSE_BASES}")
        mods = self.score_mods
        if not isinstance(mods, tuple) or not set(mods) <= set(SCORE_MODS):
            raise ValueError(
                f"score_mods={mods!r} must be a tuple of {SCORE_MODS} (the references implement these three; "
                "other score modifiers cannot be checked)"
            )
        if self.linear_windows is None:
            object.__setattr__(self, "linear_windows", self.windows)

    def tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` for an output of a case of ``dtype`` (``"fp32"`` ...): the
        tolerance table's, except fp32 under ``fp32_dots="tf32"``: fp16's (tf32 keeps 10
        mantissa bits of each factor, as fp16 does)."""
        if dtype == "fp32" and self.fp32_dots == "tf32":
            return TOLERANCES[torch.float16]
        return TOLERANCES[DTYPES[dtype]]

    def lse_tolerance(self, dtype: str) -> tuple[float, float]:
        """``(atol, rtol)`` for a log-sum-exp of a case of ``dtype``: fp16's output
        tolerance under ``fp32_dots="tf32"`` (fp32 cases), else :data:`LSE_TOLERANCES`."""
        if dtype == "fp32" and self.fp32_dots == "tf32":
            return TOLERANCES[torch.float16]
        return LSE_TOLERANCES[DTYPES[dtype]]

    def pool_kv_strides(self) -> str:
        """How the harness builds a ``"kv_tuple"`` or ``"flat"`` pool for this kernel:
        ``"distinct"`` K and V strides (V's pages longer), unless it declares
        ``kv_strides="shared"`` (:meth:`pagedkv_lab.verify.guards.Guards.place_pool`)."""
        return "shared" if self.kv_strides == "shared" else "distinct"

    def project(self, case: dict) -> dict:
        """``case`` moved inside this contract where an equivalent case exists (see the
        module docstring): optional features it leaves out switched off (non-contiguous
        K/V made contiguous, padding slots, short sequences and ring windows dropped),
        excluded dims and dtypes replaced by admitted ones. ``out["substituted"]`` lists
        the changes (``"page_size 5->32"``); a case already inside comes back equal."""
        out, changes = dict(case), []

        def change(key, new, label=None):
            changes.append(f"{label or key} {_text(out[key])}->{_text(new)}")
            out[key] = new

        if self.merge_inputs == "pair" and out.get("num_states", 2) != 2:
            change("num_states", 2)  # a merge of two states takes exactly two
        if not self.strided_kv and out.get("noncontiguous"):
            out["noncontiguous"] = False
        if not self.padding and out.get("padding"):
            out["padding"] = 0
        if (not self.windows or self.new_tokens != "cache") and out.get("window"):
            change("window", None)  # a ring: the separate form has none (its cache never holds the new tokens)
        if not self.linear_windows and out.get("window_left") is not None:
            change("window_left", None)
        for key, allowed, universe in (("dtype", self.dtypes, _DTYPES), ("layout", self.layouts, _LAYOUTS)):
            if key in out and out[key] not in allowed and out[key] in universe:
                change(key, allowed[universe.index(out[key]) % len(allowed)])
        for key, values in SUBSTITUTES.items():
            domain = getattr(self, _DOMAIN_OF[key])
            if key in out and not admits(domain, out[key]):
                admitted = [v for v in values if admits(domain, v) and self._fits(key, v, out)]
                if admitted:
                    above = [v for v in admitted if v >= 4 * out[key]]
                    change(key, above[0] if above else admitted[-1])
        if self.min_seq_len and "seq_lens" in out:
            kept = [n for n in out["seq_lens"] if n >= self.min_seq_len] or [self.min_seq_len]
            if kept != list(out["seq_lens"]):
                change("seq_lens", kept)
        if (self.min_seq_len or self.min_q_len) and "requests" in out:

            def keep(r):
                return r[0] >= self.min_seq_len and r[1] >= self.min_q_len

            fewest = max(self.min_seq_len, self.min_q_len)
            kept = tuple(r for r in out["requests"] if keep(r)) or ((fewest, fewest),)
            if kept != tuple(out["requests"]):
                if out.get("tree") is not None:  # each request's draft tree goes with it
                    trees = tuple(t for t, r in zip(out["tree"], out["requests"]) if keep(r))
                    out["tree"] = trees or None
                change("requests", kept)
        if changes:
            out["substituted"] = ", ".join(filter(None, [case.get("substituted", ""), *changes]))
        return out

    def _fits(self, key: str, value: int, case: dict) -> bool:
        """Whether ``value`` for ``key`` meets the layout's own rules (vLLM's x packing)."""
        if key != "head_dim" or self.cache_layout != "vllm_x":
            return True
        return value % (16 // {"fp32": 4, "fp16": 2, "bf16": 2}[case.get("dtype", "fp32")]) == 0

    def outside(self, case: dict) -> str | None:
        """Why ``case`` (a grid, generated or scenario case) lies outside this contract,
        or None when the kernel declared everything it needs."""
        reasons = []
        if case.get("dtype", "fp32") not in self.dtypes:
            reasons.append(f"dtype {case['dtype']}")
        if self.cache_layout in ("paged", "kv_tuple") and case.get("layout", "NHD") not in self.layouts:
            reasons.append(f"layout {case['layout']}")
        for key, domain, label in (
            ("head_dim", self.head_dims, "head_dim"),
            ("page_size", self.page_sizes, "page_size"),
            ("group", self.gqa_groups, "GQA group"),
        ):
            if key in case and not admits(domain, case[key]):
                reasons.append(f"{label} {case[key]}")
        lens = case.get("seq_lens")
        if case.get("requests") is not None:
            lens = [n for n, _ in case["requests"]]
        if lens is not None and len(lens) and min(lens) < self.min_seq_len:
            reasons.append(f"a sequence of length {min(lens)} (< {self.min_seq_len})")
        q_lens = [m for _, m in case.get("requests") or ()]
        if q_lens and min(q_lens) < self.min_q_len:
            reasons.append(f"a request with {min(q_lens)} queries (< {self.min_q_len})")
        if case.get("window") and not self.windows:
            reasons.append("a ring window")
        if self.new_tokens != "cache":
            reasons += _separate_form_reasons(case)
        missing = [m for m in SCORE_MODS if case.get(m) is not None and m not in self.score_mods]
        if missing:
            reasons.append(f"score modifiers {', '.join(missing)}")
        if case.get("window_left") is not None and not self.linear_windows:
            reasons.append("a linear window")
        if case.get("padding", 0) and not self.padding:
            reasons.append("-1 padding slots")
        if case.get("noncontiguous") and not self.strided_kv:
            reasons.append("non-contiguous K/V")
        if self.cache_layout == "vllm_x" and "head_dim" in case:
            x = 16 // {"fp32": 4, "fp16": 2, "bf16": 2}[case.get("dtype", "fp32")]
            if case["head_dim"] % x:
                reasons.append(f"head_dim {case['head_dim']} not a multiple of x={x}")
        return ", ".join(reasons) or None

    def meet(self, other: Contract) -> Contract:
        """The contract of two kernels used together (a scenario's writer and reader)."""
        if self.cache_layout != other.cache_layout:
            raise ValueError(f"cache layouts differ: {self.cache_layout!r} and {other.cache_layout!r}")

        def both(a, b):
            if a is None:
                return b
            if b is None or a == b:
                return a
            if "pow2" in (a, b):
                other_set = b if a == "pow2" else a
                return tuple(v for v in other_set if is_power_of_two(v))
            return tuple(v for v in a if v in b)

        return replace(
            self,
            dtypes=tuple(d for d in self.dtypes if d in other.dtypes) or ("fp32",),
            layouts=tuple(x for x in self.layouts if x in other.layouts) or ("NHD",),
            head_dims=both(self.head_dims, other.head_dims),
            page_sizes=both(self.page_sizes, other.page_sizes),
            gqa_groups=both(self.gqa_groups, other.gqa_groups),
            min_seq_len=max(self.min_seq_len, other.min_seq_len),
            windows=self.windows and other.windows,
            linear_windows=self.linear_windows and other.linear_windows,
            padding=self.padding and other.padding,
            strided_kv=self.strided_kv and other.strided_kv,
            new_tokens=_meet_new_tokens(self.new_tokens, other.new_tokens),
            min_q_len=max(self.min_q_len, other.min_q_len),
            fp32_dots=self.fp32_dots
            if _FP32_DOTS.index(self.fp32_dots) > _FP32_DOTS.index(other.fp32_dots)
            else other.fp32_dots,
            kv_strides="shared" if "shared" in (self.kv_strides, other.kv_strides) else "any",
            score_mods=tuple(m for m in self.score_mods if m in other.score_mods),
        )


FULL = Contract()


def _meet_new_tokens(a: str, b: str) -> str:
    """The calling form two kernels used together need: the pool written and the new
    tokens given apart if either needs both, else apart if either takes them apart."""
    for form in ("both", "separate"):
        if form in (a, b):
            return form
    return "cache"


def _separate_form_reasons(case: dict) -> list[str]:
    """What a case needs that the separate (or both) new-tokens form cannot give: a ring
    window, a request with more queries than keys (its new tokens are keys), or a
    scenario that writes the new tokens into the pool and reads them back from it alone
    (``"new_tokens": "cache"``: it passes no ``k_new``)."""
    reasons = []
    if case.get("window"):
        reasons.append("a ring window with the new tokens given apart")
    if any(m > n for n, m in case.get("requests") or ()):
        reasons.append("a request with more queries than keys (the new tokens given apart are keys)")
    if case.get("new_tokens") == "cache":
        reasons.append("the new tokens' K/V read back from the pool (this kernel takes them apart)")
    return reasons


def _text(value) -> str:
    return "none" if value is None else str(list(value) if isinstance(value, tuple) else value)


def contract(**fields):
    """Decorator: attach a :class:`Contract` to a kernel (read by :func:`contract_of`)."""
    declared = Contract(**fields)

    def attach(fn):
        fn.pagedkv_contract = declared
        return fn

    return attach


def contract_of(fn) -> Contract:
    """The contract a callable declares (:func:`contract`), else the full one."""
    declared = getattr(fn, "pagedkv_contract", None)
    return declared if isinstance(declared, Contract) else FULL

"""Running the harness: :func:`run` for the whole grid and the scenarios, :func:`run_case`
for one case of a report, and the import paths that name the callables under test."""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv_lab import faults as F
from pagedkv_lab import poisoning
from pagedkv_lab.verify.append_checks import append_case, append_grid
from pagedkv_lab.verify.baseline import case_key, diff_against
from pagedkv_lab.verify.contract import SUBSTITUTES, Contract, admits, contract_of
from pagedkv_lab.verify.decode_checks import decode_case, decode_grid, score_mod_decode_cases
from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.generated import generated_cases
from pagedkv_lab.verify.grid import accepts
from pagedkv_lab.verify.indexer_cases import (
    block_copy_case,
    block_copy_grid,
    indexer_scatter_case,
    indexer_scatter_grid,
)
from pagedkv_lab.verify.isolation import can_isolate, run_isolated
from pagedkv_lab.verify.merge_checks import merge_case, merge_grid
from pagedkv_lab.verify.mla_checks import mla_append_case, mla_append_grid, mla_decode_case, mla_decode_grid
from pagedkv_lab.verify.prefill_checks import prefill_case, prefill_grid, score_mod_prefill_cases
from pagedkv_lab.verify.prefill_scenarios import PREFILL_SCENARIO_NEEDS, PREFILL_SCENARIOS
from pagedkv_lab.verify.quant_checks import (
    check_quant_scales,
    quant_append_case,
    quant_append_grid,
    quant_decode_case,
    quant_decode_grid,
)
from pagedkv_lab.verify.report import CaseResult, Report
from pagedkv_lab.verify.rotary_checks import rotary_append_case, rotary_append_grid
from pagedkv_lab.verify.scenarios import SCENARIO_NEEDS, SCENARIOS
from pagedkv_lab.verify.stale import UNUSED_ROWS
from pagedkv_lib import quant_reference, reference
from pagedkv_lib.cache_layouts import CACHE_LAYOUTS
from pagedkv_lib.score_mods import SCORE_MODS

__all__ = ["run", "run_case", "callable_path", "resolve_callable", "Family", "FAMILIES", "CHECKS", "FN_ARGS"]


@dataclass(frozen=True)
class Family:
    """A kind of grid case: the callable it checks (``fn_arg`` of :func:`run`), its grid,
    and how one case runs (``case(fn, case)``, or ``case(fn, case, contract)`` when it
    builds the pool in the kernel's declared cache layout). ``generated``: hypothesis
    draws extra cases of this family. ``cache_layouts``: the contract cache layouts the
    family builds (the MLA and quantized families pass their own pool objects, so only
    the default). ``attributes_nan``: its cases poison unused slots with NaN, and a
    non-finite failure is re-run with finite ones (:mod:`.stale`). ``score_mod_cases``:
    cases with score modifiers, joined to the grid of a kernel that declares them
    (``Contract.score_mods``)."""

    check: str
    fn_arg: str
    grid: Callable[[bool], list[dict]]
    case: Callable[..., CaseResult]
    generated: bool = False
    cache_layouts: tuple[str, ...] = CACHE_LAYOUTS
    attributes_nan: bool = False
    score_mod_cases: Callable[[], list[dict]] | None = None


FAMILIES = {
    f.check: f
    for f in (
        Family("append", "append_fn", append_grid, append_case, generated=True),
        Family("decode", "decode_fn", decode_grid, decode_case, generated=True, attributes_nan=True,
               score_mod_cases=score_mod_decode_cases),
        Family("prefill", "prefill_fn", prefill_grid, prefill_case, attributes_nan=True,
               score_mod_cases=score_mod_prefill_cases),
        Family("mla_append", "mla_append_fn", mla_append_grid, mla_append_case, cache_layouts=("paged",)),
        Family("mla_decode", "mla_decode_fn", mla_decode_grid, mla_decode_case, cache_layouts=("paged",),
               attributes_nan=True),
        Family("quant_append", "quant_append_fn", quant_append_grid, quant_append_case, cache_layouts=("paged",)),
        Family("quant_decode", "quant_decode_fn", quant_decode_grid, quant_decode_case, cache_layouts=("paged",)),
        Family("indexer_scatter", "indexer_scatter_fn", indexer_scatter_grid, indexer_scatter_case,
               cache_layouts=("paged",)),
        Family("block_copy", "block_copy_fn", block_copy_grid, block_copy_case, cache_layouts=("paged",)),
        Family("rotary_append", "rotary_append_fn", rotary_append_grid, rotary_append_case,
               cache_layouts=("paged",)),
        Family("merge", "merge_fn", merge_grid, merge_case, cache_layouts=("paged",)),
    )
}  # fmt: skip
# Scenarios drive a writer and a reader together: the callables under test, or the
# reference for a side that is not given.
ALL_SCENARIOS = {**SCENARIOS, **PREFILL_SCENARIOS, "quant_scales": check_quant_scales}
SCENARIO_SIDES = (
    {name: ("append_fn", "decode_fn") for name in SCENARIOS}
    | {name: ("append_fn", "prefill_fn") for name in PREFILL_SCENARIOS}
    | {"quant_scales": ("quant_append_fn", "quant_decode_fn")}
)
ALL_NEEDS = {**SCENARIO_NEEDS, **PREFILL_SCENARIO_NEEDS}
# Checks of the suite's own arithmetic: they call no kernel, so never count as its pass.
SELF_CHECKS = ("int64_offsets",)
REFERENCES = {
    "append_fn": reference.append_paged_kv,
    "decode_fn": reference.paged_decode_attention,
    "prefill_fn": reference.paged_prefill_attention,
    "quant_append_fn": quant_reference.append_paged_kv_quant,
    "quant_decode_fn": quant_reference.paged_decode_attention_quant,
}
FN_ARGS = tuple(dict.fromkeys(f.fn_arg for f in FAMILIES.values()))
CHECKS = (*FAMILIES, *ALL_SCENARIOS)
# A fault that lives in the callable under test is a wrapper around it.
FAULT_WRAPPERS = {
    "minus_one_as_index": ("append_fn", F.minus_one_as_index),
    "chunk_local_mask": ("prefill_fn", F.chunk_local_mask),
    "tree_mask_ignored": ("prefill_fn", F.tree_mask_ignored),
    "nvfp4_unrounded_scale": ("quant_append_fn", F.unrounded_block_scale),
    "rotary_at_cache_position": ("rotary_append_fn", F.rotary_at_cache_position),
}


def resolve_callable(spec):
    """A callable from ``spec``: the callable itself, or its import path
    ``"package.module:function"`` (``"module:Class.method"`` works too). ValueError names
    a path that does not import or does not name a callable."""
    if spec is None or callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{spec!r} is neither a callable nor an import path 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {spec!r}: {err}") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} names a {type(obj).__name__}, not a callable")
    return obj


def callable_path(fn) -> str | None:
    """The import path ``"module:qualname"`` that resolves back to ``fn``, or None (a
    lambda, a closure, a wrapped or unimportable callable)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not name or "<" in name:
        return None
    path = f"{module}:{name}"
    try:
        return path if resolve_callable(path) is fn else None
    except ValueError:
        return None


def _counting(fn, calls: list, arg: str):
    """``fn`` that records ``arg`` in ``calls`` each time it is called (signature, contract
    and attributes kept: :func:`functools.wraps`)."""

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        calls.append(arg)
        return fn(*args, **kwargs)

    return counted


def _judged_by_calls(result: CaseResult, args, calls: list) -> CaseResult:
    """A verdict reached without calling any of the callables under test ``args`` is a
    check of the suite's own code (``kind="self-check"``), never a pass of the kernel."""
    if result.passed is not None and result.kind == "kernel" and not calls:
        result.kind = "self-check"
        note = f"called none of the callables under test ({', '.join(args)}): a check of the suite's own code"
        result.detail = f"{result.detail}; {note}" if result.detail else note
    return result


def _guarded(name: str, scenario, writer, reader, faults, setting: dict, **case) -> CaseResult:
    """Run a scenario (``setting``: its keyword-only ``cache_layout``, ``poison``,
    ``tolerance``); an exception
    inside it (the callable under test raised or crashed in Python) is a failed check,
    not the end of the run."""
    try:
        return scenario(writer, reader, faults, **case, **setting)
    except Exception as err:
        return CaseResult(name, case, False, math.inf, 0.0, 0.0, raised(err))


def scenario_page_size(contracts: list[Contract]) -> int:
    """The page size a scenario runs with: 4 when every contract admits it, else the
    smallest admitted one from 4 up (16 for a kernel whose tile is one page of >= 16),
    else the largest admitted (4 when none is)."""
    admitted = [p for p in SUBSTITUTES["page_size"] if all(admits(c.page_sizes, p) for c in contracts)]
    return next((p for p in admitted if p >= 4), admitted[-1] if admitted else 4)


class _Session:
    """The callables under test, their contracts, and how each check runs (in a child
    process when isolation is on)."""

    def __init__(self, fns: dict, faults, contracts, isolate, timeout_s):
        self.faults = F.check_faults(faults)
        contracts = dict(contracts or {})
        unknown = set(contracts) - set(FN_ARGS)
        if unknown:
            raise ValueError(f"contracts has keys {sorted(unknown)}; use {', '.join(FN_ARGS)}")
        self.fns: dict = {}  # fn_arg -> callable under test (faults applied)
        self.paths: dict[str, str | None] = {}  # fn_arg -> import path, for repro lines
        self.contracts: dict[str, Contract] = {}
        for arg in FN_ARGS:
            fn = resolve_callable(fns.get(arg))
            if fn is None:
                continue
            self.paths[arg] = callable_path(fn)
            declared = contracts.get(arg, contract_of(fn))
            if not isinstance(declared, Contract):
                raise ValueError(f"contracts[{arg!r}] must be a verify.Contract, got {type(declared).__name__}")
            _check_layout_support(arg, declared)
            self.contracts[arg] = declared
            self.fns[arg] = fn
        for fault, (arg, wrap) in FAULT_WRAPPERS.items():
            if fault in self.faults and arg in self.fns:
                self.fns[arg] = wrap(self.fns[arg])
        self.isolate = can_isolate() if isolate is None else bool(isolate)
        if self.isolate and not can_isolate():
            raise ValueError("isolate=True needs the interpreter backend on a platform with fork")
        self.timeout_s = timeout_s

    def _stamp(self, result: CaseResult, args) -> CaseResult:
        """``result`` with the faults and the import paths of the callables ``args`` it ran."""
        result.faults = tuple(sorted(self.faults))
        result.fns = {arg: self.paths[arg] for arg in args if arg in self.paths}
        return result

    def execute(self, check: str, case: dict, job, args) -> CaseResult:
        return self._stamp(run_isolated(job, check, case, self.timeout_s) if self.isolate else job(), args)

    def project(self, check: str, case: dict) -> dict:
        """``case`` moved inside the contract of family ``check``'s callable."""
        return self.contracts[FAMILIES[check].fn_arg].project(case)

    def case(self, check: str, case: dict) -> CaseResult:
        """One grid (or generated) case of family ``check``; a failure on non-finite
        outputs comes back with its NaN attribution."""
        family = FAMILIES[check]
        case = self.project(check, case)
        result = self._one(check, case)
        if family.attributes_nan and result.passed is False and "non-finite" in result.detail:
            self._attribute(check, case, result)
        return result

    def _one(self, check: str, case: dict) -> CaseResult:
        family = FAMILIES[check]
        fn, declared = self.fns[family.fn_arg], self.contracts[family.fn_arg]
        reason = declared.outside(case)
        if reason:
            return self._stamp(CaseResult(check, case, None, outside=reason), [family.fn_arg])
        arg = family.fn_arg

        def job():
            calls = []
            counted = _counting(fn, calls, arg)
            if accepts(family.case, "contract"):
                return _judged_by_calls(family.case(counted, case, contract=declared), [arg], calls)
            return _judged_by_calls(family.case(counted, case), [arg], calls)

        return self.execute(check, case, job, [arg])

    def _attribute(self, check: str, case: dict, result: CaseResult) -> None:
        """Re-run a grid case that failed on non-finite outputs with finite stale values
        in the unused slots (:func:`attribute_nan`)."""
        if case.get("poison", True) is True:
            attribute_nan(result, lambda mode: self._one(check, {**case, "poison": mode}))

    def scenario(self, name: str, **case) -> CaseResult:
        sides = SCENARIO_SIDES[name]
        given = [arg for arg in sides if arg in self.fns]
        declared = [self.contracts[arg] for arg in given]
        scenario, setting = ALL_SCENARIOS[name], {}
        if accepts(scenario, "cache_layout"):
            layouts = sorted({c.cache_layout for c in declared})
            if len(layouts) > 1:
                reason = f"{' and '.join(given)} declare different cache layouts {layouts}"
                return self._stamp(CaseResult(name, case, None, outside=reason), given)
            setting["cache_layout"] = layouts[0] if layouts else "paged"
        needs = dict(ALL_NEEDS.get(name, {}))
        if accepts(scenario, "page_size"):
            page_size = case.get("page_size", scenario_page_size(declared))
            needs["page_size"] = page_size
            if page_size != 4:
                case = {**case, "page_size": page_size}
        for arg in given:
            reason = self.contracts[arg].outside(needs)
            if reason:
                return self._stamp(CaseResult(name, case, None, outside=f"{arg} does not declare {reason}"), given)

        if accepts(scenario, "tolerance"):  # the widest a kernel declares (fp16's for tf32 dots)
            setting["tolerance"] = max((c.tolerance("fp32") for c in declared), default=None)
        result = self._scenario_once(name, case, setting, given)
        if result.passed is False and "non-finite" in result.detail and accepts(scenario, "poison"):
            attribute_nan(result, lambda mode: self._scenario_once(name, case, {**setting, "poison": mode}, given))
        if name in SELF_CHECKS:
            result.kind = "self-check"
        return result

    def _scenario_once(self, name: str, case: dict, setting: dict, given: list[str]) -> CaseResult:
        """Run scenario ``name`` once (in a child when isolating), counting the calls of
        the callables under test (a verdict without one is no pass of the kernel)."""
        sides, scenario = SCENARIO_SIDES[name], ALL_SCENARIOS[name]

        def job():
            calls = []
            sides_fns = [_counting(self.fns[a], calls, a) if a in self.fns else REFERENCES[a] for a in sides]
            result = _guarded(name, scenario, *sides_fns, self.faults, setting, **case)
            return result if name in SELF_CHECKS else _judged_by_calls(result, given, calls)

        return self.execute(name, case, job, given)

    def generated(self, check: str, examples: int) -> list[CaseResult]:
        arg = FAMILIES[check].fn_arg
        results = generated_cases(
            check, self.fns[arg], examples, self.contracts[arg], lambda kind, case: self.case(kind, case)
        )
        return [self._stamp(r, [arg]) for r in results]


def attribute_nan(result: CaseResult, rerun: Callable[[str], CaseResult]) -> None:
    """Attribute a failure on non-finite outputs (a grid case's or a scenario's) by
    re-running it (``rerun(mode)``) with the stale slots' NaN replaced by finite values
    (:data:`.stale.POISON_MODES`): still failing, it is not (only) a read of unused rows;
    passing, the re-runs with NaN only in the tails or only in the free pages say which
    unused rows the kernel reads. Sets ``result.attribution`` and appends it to the detail."""
    if rerun("none").passed is not True:
        result.attribution = ("with finite stale values in the unused slots it still fails: "
                              "not (only) a read of unused rows")  # fmt: skip
    else:
        read = [what for mode, what in UNUSED_ROWS.items() if rerun(mode).passed is False]
        which = " and ".join(read) if read else "but NaN in the tails or the free pages alone is harmless"
        result.attribution = ("passes with finite stale values in the unused slots: the kernel reads unused pool rows "
                              f"(0 * NaN is NaN), {which}")  # fmt: skip
    result.detail = f"{result.detail}; NaN attribution: {result.attribution}"


def _check_layout_support(arg: str, declared: Contract) -> None:
    """ValueError when ``arg``'s family cannot build the cache layout its contract declares."""
    for family in FAMILIES.values():
        if family.fn_arg == arg and declared.cache_layout not in family.cache_layouts:
            able = [f.check for f in FAMILIES.values() if declared.cache_layout in f.cache_layouts]
            raise ValueError(
                f"{arg} declares cache_layout={declared.cache_layout!r}, which the {family.check} family does not "
                f"build (it passes its own pool object); the families that build it: {', '.join(able)}"
            )


def _nothing_checked(check: str, results: list[CaseResult], arg: str) -> CaseResult | None:
    """A failure when none of ``results`` (a family's) called the kernel and got a verdict."""
    if any(r.passed is not None for r in results):
        return None
    outside = sum(r.status == "outside" for r in results)
    detail = (f"nothing checked: none of the {len(results)} cases ran {arg} ({outside} outside its declared "
              "contract, the others skipped); a family that checks nothing of the kernel fails")  # fmt: skip
    return CaseResult(check, {}, False, detail=detail, kind="nothing")


def _grid(session: _Session, check: str, full: bool) -> list[dict]:
    """The family's grid moved inside the contract (:meth:`Contract.project`), each case
    once; with the cases of the score modifiers the kernel declares."""
    family = FAMILIES[check]
    declared = set(session.contracts[family.fn_arg].score_mods)
    extra = family.score_mod_cases() if declared and family.score_mod_cases else []
    extra = [c for c in extra if {m for m in SCORE_MODS if c.get(m) is not None} <= declared]
    cases = {}
    for case in family.grid(full) + extra:
        projected = session.project(check, case)
        cases.setdefault(case_key(check, projected), projected)
    return list(cases.values())


def run(
    append_fn=None,
    decode_fn=None,
    prefill_fn=None,
    *,
    mla_append_fn=None,
    mla_decode_fn=None,
    quant_append_fn=None,
    quant_decode_fn=None,
    indexer_scatter_fn=None,
    block_copy_fn=None,
    rotary_append_fn=None,
    merge_fn=None,
    faults=(),
    full: bool = False,
    hypothesis_examples: int = 0,
    checks: tuple[str, ...] | None = None,
    contracts: dict[str, Contract] | None = None,
    isolate: bool | None = None,
    timeout_s: float = 300.0,
    poison_masked: bool = True,
    baseline=None,
) -> Report:
    """Run the case grids and the scenarios; return a :class:`Report`.

    The callables under test (each may be None: its grid is skipped), or their import
    paths ``"module:function"``; ``cache`` is the pool in the layout the kernel's
    contract declares (:mod:`pagedkv_lib.cache_layouts`; the append, decode and prefill
    families build every layout, the MLA and quantized ones only their own pools):

    * ``append_fn``: the signature of ``kernels.append_paged_kv`` (``fn(k, v, cache,
      slot_mapping, layout=...)``, optionally ``zero_v_tail=``);
    * ``decode_fn``: that of ``kernels.paged_decode_attention`` (``fn(q, cache,
      block_tables, seq_lens, layout=...)``, optionally ``num_splits=`` and ``window=``);
    * ``prefill_fn``: that of ``kernels.paged_prefill_attention`` (``fn(q, cache,
      qo_indptr, block_tables, seq_lens, layout=...)``, optionally ``window=``, ``k_new=``, ``v_new=``);
    * ``mla_append_fn`` / ``mla_decode_fn``: those of ``kernels.append_paged_mla_kv`` and
      ``kernels.mla_decode_attention`` (:mod:`.mla_checks`);
    * ``quant_append_fn`` / ``quant_decode_fn``: those of ``kernels.append_paged_kv_quant_pool``
      and ``kernels.paged_decode_attention_quant_pool`` (:mod:`.quant_checks`);
    * ``indexer_scatter_fn`` / ``block_copy_fn``: those of ``kernels.indexer_k_cache_scatter``
      and ``kernels.copy_paged_blocks`` (:mod:`.indexer_cases`);
    * ``rotary_append_fn``: that of ``kernels.append_paged_kv_csr`` with ``rope=``, ``q=``,
      ``rope_positions=`` (rotary positions apart from cache positions, :mod:`.rotary_checks`);
    * ``merge_fn``: that of ``kernels.merge_states``, or the base and form its contract
      declares (:mod:`.merge_checks`). A declared ``lse`` is checked (:mod:`.read_call`).

    A scenario runs when one of its two sides is given (``append_fn`` with
    ``decode_fn`` or ``prefill_fn``, or the quantized pair for ``quant_scales``), with
    the reference for the other, in pages the contracts admit.

    ``contracts``: ``{"append_fn": Contract(...), ...}``, overriding what the callables
    declare with :func:`pagedkv_lab.verify.contract`. Grid cases are moved inside a
    contract where an equivalent case exists (:meth:`Contract.project`); the rest are
    reported as outside it, never as passes or failures, and a family in which nothing
    ran fails ("nothing checked"). A case that fails on non-finite outputs is re-run with
    finite stale values (its ``attribution``). ``isolate``: run every check in a child
    process, so that a crash or a hang (past ``timeout_s`` seconds) fails its case and
    the run goes on; the default is on wherever possible (the interpreter, with
    ``fork``). ``faults``: names from :data:`pagedkv_lab.faults.FAULTS` to switch on.
    ``full``: the larger grids. ``hypothesis_examples``: generated append and decode
    cases. ``checks``: a subset of :data:`CHECKS`. ``baseline``: a saved report (a path
    to its JSON, its data, or a :class:`Report`): the report then lists only what
    changed, and fails on new failures and new causes (:mod:`.baseline`).
    ``poison_masked``: in Triton's interpreter, masked ``tl.load`` lanes without
    ``other=`` read NaN (integers: far out of range), as undefined as on a GPU
    (:func:`pagedkv_lab.poisoning.masked_lanes_poisoned`); ``False``: 0.
    """
    fns = {arg: fn for arg, fn in locals().items() if arg in FN_ARGS}  # the callables by argument name
    session = _Session(fns, faults, contracts, isolate, timeout_s)
    wanted = _wanted(checks)
    report = Report()
    with poisoning.masked_lanes_poisoned(poison_masked), _quiet_nan_arithmetic():
        report.results += _run_grids(session, wanted, full, hypothesis_examples)
        report.results += _run_scenarios(session, wanted)
    report.results += _nothing_called(report.results)
    if baseline is not None:
        report.baseline = diff_against(report.results, baseline)
    return report


def _wanted(checks: tuple[str, ...] | None) -> set[str]:
    """The checks a run asked for (all of :data:`CHECKS` by default); ValueError names unknown ones."""
    wanted = set(checks) if checks else set(CHECKS)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"checks={sorted(unknown)} unknown; choose from {', '.join(CHECKS)}")
    return wanted


def _run_grids(session: _Session, wanted: set[str], full: bool, hypothesis_examples: int) -> list[CaseResult]:
    """Every wanted family whose callable was given: its grid, its generated cases, and a
    "nothing checked" failure for a family in which no case ran."""
    out = []
    for check, family in FAMILIES.items():
        if family.fn_arg in session.fns and check in wanted:
            results = [session.case(check, c) for c in _grid(session, check, full)]
            if hypothesis_examples and family.generated:
                results += session.generated(check, hypothesis_examples)
            nothing = _nothing_checked(check, results, family.fn_arg)
            out += results + ([nothing] if nothing else [])
    return out


def _run_scenarios(session: _Session, wanted: set[str]) -> list[CaseResult]:
    """Every wanted scenario one of whose sides was given."""
    return [
        session.scenario(name)
        for name, sides in SCENARIO_SIDES.items()
        if name in wanted and any(arg in session.fns for arg in sides)
    ]


def _nothing_called(results: list[CaseResult]) -> list[CaseResult]:
    """A failure for a run in which no check called a kernel under test and got a verdict
    (none when a family already reported "nothing checked": one is enough)."""
    checked = any(r.passed is not None and r.kind == "kernel" for r in results)
    if checked or any(r.kind == "nothing" for r in results):
        return []
    detail = "nothing checked: no check of this run called a kernel under test and got a verdict"
    return [CaseResult("run", {}, False, detail=detail, kind="nothing")]


@contextlib.contextmanager
def _quiet_nan_arithmetic():
    """The grids fill unused slots with NaN on purpose, and Triton's interpreter computes
    with numpy, which warns each time a NaN meets a division or an exp: noise next to a
    report (and install paths in a notebook's stored output), so those warnings are off."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", r"(invalid value|overflow|divide by zero) encountered", category=RuntimeWarning
        )
        yield


def run_case(
    check: str, case: dict, faults=(), contracts=None, isolate: bool | None = None, poison_masked: bool = True, **fns
) -> CaseResult:
    """Re-run one case of a report (grid, hypothesis or scenario), as its ``repro`` line
    prints it, on the callables given by keyword (``append_fn=``, ``decode_fn=``, ...:
    callables or import paths). A grid case needs its family's callable; a scenario
    uses the reference for a side that is not given. ``poison_masked`` as in :func:`run`."""
    unknown = set(fns) - set(FN_ARGS)
    if unknown:
        raise ValueError(f"run_case got {sorted(unknown)}; the callables are {', '.join(FN_ARGS)}")
    session = _Session(fns, faults, contracts, isolate, 300.0)
    if check in FAMILIES:
        arg = FAMILIES[check].fn_arg
        if arg not in session.fns:
            raise ValueError(f"run_case({check!r}, ...) needs {arg}: a callable or 'module:function'")
        with poisoning.masked_lanes_poisoned(poison_masked), _quiet_nan_arithmetic():
            return session.case(check, case)
    if check in ALL_SCENARIOS:
        with poisoning.masked_lanes_poisoned(poison_masked), _quiet_nan_arithmetic():
            return session.scenario(check, **case)
    raise ValueError(f"check={check!r} unknown; choose from {', '.join(CHECKS)}")

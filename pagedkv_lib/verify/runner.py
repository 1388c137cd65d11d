"""Running the harness: :func:`run` for the whole grid and the scenarios, :func:`run_case`
for one case of a report, and the import paths that name the callables under test."""

from __future__ import annotations

import importlib
import math

from .. import faults as F
from .. import reference
from .append_checks import append_case, append_grid
from .contract import Contract, contract_of
from .decode_checks import decode_case, decode_grid
from .generated import generated_cases
from .isolation import can_isolate, run_isolated
from .report import CaseResult, Report
from .scenarios import SCENARIO_NEEDS, SCENARIOS

__all__ = ["run", "run_case", "callable_path", "resolve_callable", "CHECKS"]

CHECKS = ("append", "decode", *SCENARIOS)


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


def _guarded(name: str, scenario, writer, reader, faults, **case) -> CaseResult:
    """Run a scenario; an exception inside it (the callable under test raised or crashed
    in Python) is a failed check, not the end of the run."""
    try:
        return scenario(writer, reader, faults, **case)
    except Exception as err:
        return CaseResult(name, case, False, math.inf, 0.0, 0.0, f"raised {type(err).__name__}: {err}")


class _Session:
    """The callables under test, their contracts, and how each check runs (in a child
    process when isolation is on)."""

    def __init__(self, append_fn, decode_fn, faults, contracts, isolate, timeout_s):
        append_fn, decode_fn = resolve_callable(append_fn), resolve_callable(decode_fn)
        self.faults = F.check_faults(faults)
        contracts = dict(contracts or {})
        unknown = set(contracts) - {"append_fn", "decode_fn"}
        if unknown:
            raise ValueError(f"contracts has keys {sorted(unknown)}; use 'append_fn' and 'decode_fn'")
        self.fns: dict[str, str | None] = {}
        self.contracts: dict[str, Contract] = {}
        for arg, fn in (("append_fn", append_fn), ("decode_fn", decode_fn)):
            if fn is not None:
                self.fns[arg] = callable_path(fn)
                declared = contracts.get(arg, contract_of(fn))
                if not isinstance(declared, Contract):
                    raise ValueError(f"contracts[{arg!r}] must be a verify.Contract, got {type(declared).__name__}")
                self.contracts[arg] = declared
        if "minus_one_as_index" in self.faults and append_fn is not None:
            append_fn = F.minus_one_as_index(append_fn)
        self.append_fn, self.decode_fn = append_fn, decode_fn
        self.isolate = can_isolate() if isolate is None else bool(isolate)
        if self.isolate and not can_isolate():
            raise ValueError("isolate=True needs the interpreter backend on a platform with fork")
        self.timeout_s = timeout_s

    def _stamp(self, result: CaseResult) -> CaseResult:
        result.faults, result.fns = tuple(sorted(self.faults)), dict(self.fns)
        return result

    def execute(self, check: str, case: dict, job) -> CaseResult:
        return self._stamp(run_isolated(job, check, case, self.timeout_s) if self.isolate else job())

    def append(self, case: dict) -> CaseResult:
        return self.execute("append", case, lambda: append_case(self.append_fn, case, self.contracts["append_fn"]))

    def decode(self, case: dict) -> CaseResult:
        return self.execute("decode", case, lambda: decode_case(self.decode_fn, case, self.contracts["decode_fn"]))

    def scenario(self, name: str, **case) -> CaseResult:
        writer = self.append_fn or reference.append_paged_kv
        reader = self.decode_fn or reference.paged_decode_attention
        needs = SCENARIO_NEEDS.get(name, {})
        for arg, declared in self.contracts.items():
            reason = declared.outside(needs)
            if reason:
                return self._stamp(CaseResult(name, case, None, outside=f"{arg} does not declare {reason}"))
        return self.execute(name, case, lambda: _guarded(name, SCENARIOS[name], writer, reader, self.faults, **case))

    def generated(self, kind: str, examples: int) -> list[CaseResult]:
        fn = self.append_fn if kind == "append" else self.decode_fn
        runner = self.append if kind == "append" else self.decode
        results = generated_cases(kind, fn, examples, self.contracts[f"{kind}_fn"], lambda check, case: runner(case))
        return [self._stamp(r) for r in results]


def run(
    append_fn=None,
    decode_fn=None,
    *,
    faults=(),
    full: bool = False,
    hypothesis_examples: int = 0,
    checks: tuple[str, ...] | None = None,
    contracts: dict[str, Contract] | None = None,
    isolate: bool | None = None,
    timeout_s: float = 300.0,
) -> Report:
    """Run the case grid and the scenarios; return a :class:`Report`.

    ``append_fn`` / ``decode_fn``: callables with the signatures of
    ``kernels.append_paged_kv`` (``fn(k, v, cache, slot_mapping, layout=...)``, optionally
    ``zero_v_tail=``) and ``kernels.paged_decode_attention`` (``fn(q, cache,
    block_tables, seq_lens, layout=...)``, optionally ``num_splits=`` and ``window=``),
    or their import paths ``"module:function"``; ``cache`` is the pool in the layout the
    kernel's contract declares (:mod:`pagedkv_lib.cache_layouts`). Either may be None:
    its grid is skipped and the scenarios use the reference for that side.

    ``contracts``: ``{"append_fn": Contract(...), "decode_fn": ...}``, overriding what the
    callables declare with :func:`pagedkv_lib.verify.contract`; cases outside a contract
    are reported as such, never as passes or failures. ``isolate``: run every check in
    a child process, so that a crash or a hang (past ``timeout_s`` seconds) fails its
    case and the run goes on; the default is on wherever possible (the interpreter,
    with ``fork``). ``faults``: names from :data:`pagedkv_lib.faults.FAULTS` to switch
    on. ``full``: the larger grid. ``hypothesis_examples``: generated cases per
    operation. ``checks``: a subset of :data:`CHECKS`.
    """
    session = _Session(append_fn, decode_fn, faults, contracts, isolate, timeout_s)
    wanted = set(checks) if checks else set(CHECKS)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"checks={sorted(unknown)} unknown; choose from {', '.join(CHECKS)}")
    report = Report()
    if session.append_fn is not None and "append" in wanted:
        report.results += [session.append(c) for c in append_grid(full)]
        if hypothesis_examples:
            report.results += session.generated("append", hypothesis_examples)
    if session.decode_fn is not None and "decode" in wanted:
        report.results += [session.decode(c) for c in decode_grid(full)]
        if hypothesis_examples:
            report.results += session.generated("decode", hypothesis_examples)
    report.results += [session.scenario(name) for name in SCENARIOS if name in wanted]
    return report


def run_case(
    check: str, case: dict, append_fn=None, decode_fn=None, faults=(), contracts=None, isolate: bool | None = None
) -> CaseResult:
    """Re-run one case of a report (grid, hypothesis or scenario), as its ``repro`` line
    prints it, on the callables given (or their import paths). The ``append`` and
    ``decode`` checks need their callable; a scenario uses the reference for a side
    that is not given."""
    session = _Session(append_fn, decode_fn, faults, contracts, isolate, 300.0)
    if check in ("append", "decode"):
        if getattr(session, f"{check}_fn") is None:
            raise ValueError(f"run_case({check!r}, ...) needs {check}_fn: a callable or 'module:function'")
        return session.append(case) if check == "append" else session.decode(case)
    if check in SCENARIOS:
        return session.scenario(check, **case)
    raise ValueError(f"check={check!r} unknown; choose from {', '.join(CHECKS)}")

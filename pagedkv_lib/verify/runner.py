"""Running the harness: :func:`run` for the whole grid and the scenarios, :func:`run_case`
for one case of a report, and the import paths that name the callables under test."""

from __future__ import annotations

import importlib
import math

from .. import faults as F
from .. import reference
from .append_checks import append_case, append_grid
from .decode_checks import decode_case, decode_grid
from .generated import generated_cases
from .mla_checks import mla_append_case, mla_append_grid, mla_decode_case, mla_decode_grid
from .report import CaseResult, Report
from .scenarios import SCENARIOS

__all__ = ["run", "run_case", "callable_path", "resolve_callable", "CHECKS"]

CHECKS = ("append", "decode", *SCENARIOS, "mla_append", "mla_decode")


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


def _prepare(append_fn, decode_fn, faults, mla_fns: dict | None = None):
    append_fn, decode_fn = resolve_callable(append_fn), resolve_callable(decode_fn)
    faults = F.check_faults(faults)
    fns = {}
    if append_fn is not None:
        fns["append_fn"] = callable_path(append_fn)
    if decode_fn is not None:
        fns["decode_fn"] = callable_path(decode_fn)
    for arg, fn in (mla_fns or {}).items():  # resolved in place: the MLA block below runs them
        mla_fns[arg] = fn = resolve_callable(fn)
        if fn is not None:
            fns[arg] = callable_path(fn)
    if "minus_one_as_index" in faults and append_fn is not None:
        append_fn = F.minus_one_as_index(append_fn)
    return append_fn, decode_fn, faults, fns


def run(
    append_fn=None,
    decode_fn=None,
    *,
    faults=(),
    full: bool = False,
    hypothesis_examples: int = 0,
    checks: tuple[str, ...] | None = None,
    mla_append_fn=None,
    mla_decode_fn=None,
) -> Report:
    """Run the case grid and the scenarios; return a :class:`Report`.

    ``append_fn`` / ``decode_fn``: callables with the signatures of
    ``kernels.append_paged_kv`` (``fn(k, v, cache, slot_mapping, layout=...)``, optionally
    ``zero_v_tail=``) and ``kernels.paged_decode_attention`` (``fn(q, cache,
    block_tables, seq_lens, layout=...)``, optionally ``num_splits=`` and ``window=``),
    or their import paths ``"module:function"``. Either may be None: its grid is
    skipped and the scenarios use the reference for that side. ``faults``: names from
    :data:`pagedkv_lib.faults.FAULTS` to switch on. ``full``: the larger grid (head dim
    256, page size 64, 300 tokens). ``hypothesis_examples``: generated cases per
    operation. ``checks``: a subset of :data:`CHECKS`. ``mla_append_fn`` /
    ``mla_decode_fn``: callables with the signatures of ``kernels.append_paged_mla_kv``
    and ``kernels.mla_decode_attention`` (or import paths); each runs its grid of
    :mod:`.mla_checks` (skipped when None).
    """
    mla_fns = {"mla_append_fn": mla_append_fn, "mla_decode_fn": mla_decode_fn}
    append_fn, decode_fn, faults, fns = _prepare(append_fn, decode_fn, faults, mla_fns)
    wanted = set(checks) if checks else set(CHECKS)
    unknown = wanted - set(CHECKS)
    if unknown:
        raise ValueError(f"checks={sorted(unknown)} unknown; choose from {', '.join(CHECKS)}")
    report = Report()
    if append_fn is not None and "append" in wanted:
        report.results += [append_case(append_fn, c) for c in append_grid(full)]
        if hypothesis_examples:
            report.results += generated_cases("append", append_fn, hypothesis_examples)
    if decode_fn is not None and "decode" in wanted:
        report.results += [decode_case(decode_fn, c) for c in decode_grid(full)]
        if hypothesis_examples:
            report.results += generated_cases("decode", decode_fn, hypothesis_examples)
    writer = append_fn or reference.append_paged_kv
    reader = decode_fn or reference.paged_decode_attention
    for name, scenario in SCENARIOS.items():
        if name in wanted:
            report.results.append(_guarded(name, scenario, writer, reader, faults))
    report.results += _run_mla(mla_fns, wanted, full)
    for r in report.results:
        r.faults, r.fns = tuple(sorted(faults)), dict(fns)
    return report


def run_case(
    check: str, case: dict, append_fn=None, decode_fn=None, faults=(), mla_append_fn=None, mla_decode_fn=None
) -> CaseResult:
    """Re-run one case of a report (grid, hypothesis or scenario), as its ``repro`` line
    prints it, on the callables given (or their import paths). The ``append`` and
    ``decode`` checks need their callable (``mla_append`` / ``mla_decode`` theirs); a
    scenario uses the reference for a side that is not given."""
    mla_fns = {"mla_append_fn": mla_append_fn, "mla_decode_fn": mla_decode_fn}
    append_fn, decode_fn, faults, fns = _prepare(append_fn, decode_fn, faults, mla_fns)
    if check in _MLA_CASES:
        fn = mla_fns[f"{check}_fn"]
        if fn is None:
            raise ValueError(f"run_case({check!r}, ...) needs {check}_fn: a callable or 'module:function'")
        result = _MLA_CASES[check](fn, case)
    elif check == "append" or check == "decode":
        fn = append_fn if check == "append" else decode_fn
        if fn is None:
            raise ValueError(f"run_case({check!r}, ...) needs {check}_fn: a callable or 'module:function'")
        result = (append_case if check == "append" else decode_case)(fn, case)
    elif check in SCENARIOS:
        writer = append_fn or reference.append_paged_kv
        reader = decode_fn or reference.paged_decode_attention
        result = _guarded(check, SCENARIOS[check], writer, reader, faults, **case)
    else:
        raise ValueError(f"check={check!r} unknown; choose from {', '.join(CHECKS)}")
    result.faults, result.fns = tuple(sorted(faults)), fns
    return result


# =========================================================================== MLA latent cache
# The MLA grids (.mla_checks) run on their own callables; nothing else in the harness
# changes for them.

_MLA_CASES = {"mla_append": mla_append_case, "mla_decode": mla_decode_case}
_MLA_GRIDS = {"mla_append": mla_append_grid, "mla_decode": mla_decode_grid}


def _run_mla(mla_fns: dict, wanted: set, full: bool) -> list[CaseResult]:
    """The MLA grid of every MLA callable given and wanted."""
    results = []
    for check, run_one in _MLA_CASES.items():
        fn = mla_fns[f"{check}_fn"]
        if fn is not None and check in wanted:
            results += [run_one(fn, c) for c in _MLA_GRIDS[check](full)]
    return results

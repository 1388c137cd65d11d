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
from .quant_checks import QUANT_CHECKS, run_quant, run_quant_case
from .report import CaseResult, Report
from .scenarios import SCENARIOS

__all__ = ["run", "run_case", "callable_path", "resolve_callable", "CHECKS"]

CHECKS = ("append", "decode", *SCENARIOS, *QUANT_CHECKS)


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


def _prepare(append_fn, decode_fn, faults):
    append_fn, decode_fn = resolve_callable(append_fn), resolve_callable(decode_fn)
    faults = F.check_faults(faults)
    fns = {}
    if append_fn is not None:
        fns["append_fn"] = callable_path(append_fn)
    if decode_fn is not None:
        fns["decode_fn"] = callable_path(decode_fn)
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
    quant_append_fn=None,
    quant_decode_fn=None,
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
    operation. ``checks``: a subset of :data:`CHECKS`.

    ``quant_append_fn`` / ``quant_decode_fn``: callables with the signatures of
    ``kernels.append_paged_kv_quant`` and ``kernels.paged_decode_attention_quant`` (or
    their import paths); when either is given the quantized family runs too
    (:mod:`.quant_checks`: ``quant_append``, ``quant_decode``, ``quant_scales``), with
    the faults of :data:`pagedkv_lib.faults.QUANT_FAULTS`.
    """
    append_fn, decode_fn, faults, fns = _prepare(append_fn, decode_fn, faults)
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
    # --- quantized pools (pagedkv_lib/verify/quant_checks.py): only when a quant callable is given
    quant_append_fn, quant_decode_fn = resolve_callable(quant_append_fn), resolve_callable(quant_decode_fn)
    if quant_append_fn is not None or quant_decode_fn is not None:
        report.results += run_quant(quant_append_fn, quant_decode_fn, faults, wanted, full)
        for name, fn in (("quant_append_fn", quant_append_fn), ("quant_decode_fn", quant_decode_fn)):
            if fn is not None:
                fns[name] = callable_path(fn)
    # --- end quantized pools
    for r in report.results:
        r.faults, r.fns = tuple(sorted(faults)), dict(fns)
    return report


def run_case(
    check: str, case: dict, append_fn=None, decode_fn=None, faults=(), quant_append_fn=None, quant_decode_fn=None
) -> CaseResult:
    """Re-run one case of a report (grid, hypothesis or scenario), as its ``repro`` line
    prints it, on the callables given (or their import paths). The ``append`` and
    ``decode`` checks need their callable; a scenario uses the reference for a side
    that is not given."""
    append_fn, decode_fn, faults, fns = _prepare(append_fn, decode_fn, faults)
    if check == "append" or check == "decode":
        fn = append_fn if check == "append" else decode_fn
        if fn is None:
            raise ValueError(f"run_case({check!r}, ...) needs {check}_fn: a callable or 'module:function'")
        result = (append_case if check == "append" else decode_case)(fn, case)
    elif check in SCENARIOS:
        writer = append_fn or reference.append_paged_kv
        reader = decode_fn or reference.paged_decode_attention
        result = _guarded(check, SCENARIOS[check], writer, reader, faults, **case)
    elif check in QUANT_CHECKS:  # --- quantized pools (pagedkv_lib/verify/quant_checks.py)
        quant_append_fn, quant_decode_fn = resolve_callable(quant_append_fn), resolve_callable(quant_decode_fn)
        result = run_quant_case(check, case, quant_append_fn, quant_decode_fn, faults)
        for name, fn in (("quant_append_fn", quant_append_fn), ("quant_decode_fn", quant_decode_fn)):
            if fn is not None:
                fns[name] = callable_path(fn)
    else:
        raise ValueError(f"check={check!r} unknown; choose from {', '.join(CHECKS)}")
    result.faults, result.fns = tuple(sorted(faults)), fns
    return result

"""Auto-checked exercises for a workshop: the checker behind ``exercises/``.

A learner opens ``exercises/NN_name.ipynb``, reads the spec, fills in the stub and runs
the notebook's last cell::

    from pagedkv_lab.exercises import check
    check("slot_mapping", locate, locate_pow2, slot_mapping)

The check runs the learner's functions on cases whose expected values come from the
suite's references (and, for the Triton exercises, on cases of the conformance harness),
stops at the first failing case and says, in plain words, what the case is about, its
inputs, what was expected, what came back, where it first differs and a hint; for the
kernel exercises it also draws the pool rows that were wrong (a PNG, shown inline in a
notebook). Exceptions from the learner's code become such a message too.

The exercises, in the workshop's order (:data:`EXERCISES`): ``kv_bytes``,
``prealloc_cache`` (09), ``gqa_broadcast`` (10), ``slot_mapping``, ``cow_append``,
``ring_window``, ``prefix_cache``, ``append_kernel``, ``merge_kernel``, ``decode_kernel``.
Before class: ``python -m pagedkv_lab.exercises check --solutions`` (every solution
passes) and ``check --stubs`` (every stub fails with a message).

Importing this package never imports triton or ``kernels``: a learner's kernel brings
triton itself, after ``pagedkv_lib`` has chosen the backend.
"""

from __future__ import annotations

from pagedkv_lab.exercises.catalog import EXERCISES, Exercise, get
from pagedkv_lab.exercises.result import CheckResult, Failure

__all__ = ["check", "EXERCISES", "Exercise", "CheckResult", "Failure"]


def check(name: str, *functions, isolate: bool = True, poison_masked: bool = True) -> CheckResult:
    """Check the learner's ``functions`` for exercise ``name`` (see :data:`EXERCISES` for
    each exercise's functions, in order). Returns a :class:`CheckResult`; ``str()`` of it
    (or its display in a notebook) is the message. Raises ValueError for an unknown
    exercise or the wrong number of functions.

    The kernel exercises (06-08) only:

    * ``isolate``: run the cases in a forked child process, so that a kernel that
      corrupts memory or hangs fails its case with a message instead of killing the
      notebook's kernel; ``isolate=False`` runs them in this process (a debugger sees
      them there);
    * ``poison_masked``: run the learner's kernel with masked lanes poisoned (a masked
      ``tl.load`` without ``other=`` reads NaN in Triton's interpreter, as undefined as
      on a GPU); ``False`` lets them read 0."""
    exercise = get(name)
    if len(functions) != len(exercise.functions) or not all(callable(f) for f in functions):
        raise ValueError(
            f'check("{exercise.name}", ...) takes the functions {", ".join(exercise.functions)}, in that order; '
            f"got {len(functions)} argument(s)"
        )
    if exercise.runs_kernels:
        return exercise.checker(*functions, isolate=isolate, poison_masked=poison_masked)
    return exercise.checker(*functions)

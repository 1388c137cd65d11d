"""Poisoned masked lanes and recorded accesses for the lab's runs (the harness, the
exercise checker), without importing Triton where there is none: the ways in to
:func:`pagedkv_kernels.interpreter.masked_lanes_poisoned` and
:func:`pagedkv_kernels.interpreter.accesses_recorded`."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv_lib import runtime


@contextmanager
def masked_lanes_poisoned(on: bool = True) -> Iterator[list]:
    """As :func:`pagedkv_kernels.interpreter.masked_lanes_poisoned`; where kernels are
    compiled for a GPU, or Triton is missing, it does nothing and yields an empty list
    (the kernels are not imported then: notebooks 01-05 run the harness without Triton)."""
    if not (runtime.BACKEND.interpreted and runtime.triton_available()):
        yield []
        return
    interpreter = importlib.import_module("pagedkv_kernels.interpreter")
    with interpreter.masked_lanes_poisoned(on) as seen:
        yield seen


@contextmanager
def accesses_recorded() -> Iterator[list]:
    """As :func:`pagedkv_kernels.interpreter.accesses_recorded`; where kernels are compiled
    for a GPU, or Triton is missing, it records nothing and yields an empty list."""
    if not (runtime.BACKEND.interpreted and runtime.triton_available()):
        yield []
        return
    interpreter = importlib.import_module("pagedkv_kernels.interpreter")
    with interpreter.accesses_recorded() as seen:
        yield seen

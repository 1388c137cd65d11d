"""Recorded memory accesses: every ``tl.load`` and ``tl.store`` a kernel makes in Triton's
interpreter, per program, lane by lane, for a picture of what the kernel touched
(:func:`pagedkv_lab.viz.access_map`).

Inside :func:`recorded`, each load and store of a launch appends an :class:`Access`: the
program id ``(x, y, z)`` that made it, ``"load"`` or ``"store"``, the byte address of
every lane (flattened, ``uint64``), which lanes the mask let through and the element
size in bytes. A masked lane reads and writes nothing; its
address is kept (it says where the lane *would* have gone). Outside :func:`recorded`
nothing is kept and a load or store costs one list test.

The addresses are the interpreter's: pointers into the host copies of the launch's
tensors, which for CPU tensors (the interpreter's usual case, and the exercise checker's)
are the tensors themselves, so ``tensor.data_ptr()`` places them.

The patch wraps ``InterpreterBuilder.create_masked_load(self, ptrs, mask, other, ...)``
and ``create_masked_store(self, ptrs, value, mask, ...)``, which every admitted Triton
(3.6 to 3.9; unmasked loads and stores go through them with an all-true mask) has; it
reads the program id from ``self.grid_idx``, set before each program runs. It wraps
whatever is installed, so it composes with :mod:`.poison` in either order. On the
compiled backend :func:`recorded` does nothing and yields an empty list.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from pagedkv_lib import runtime

__all__ = ["Access", "recorded", "install", "program_id"]


@dataclass(frozen=True, eq=False)
class Access:
    """One ``tl.load`` or ``tl.store`` of one program: ``program`` its id ``(x, y, z)``,
    ``kind`` ``"load"`` or ``"store"``, ``addresses`` the byte address of each lane
    (``uint64 [lanes]``), ``mask`` whether each lane was let through (``bool [lanes]``),
    ``itemsize`` the element size in bytes."""

    program: tuple[int, int, int]
    kind: str
    addresses: np.ndarray
    mask: np.ndarray
    itemsize: int


_state = {"installed": False}
_collectors: list[list[Access]] = []  # one per open `recorded()` block


def program_id(builder) -> tuple[int, int, int]:
    """The id ``(x, y, z)`` of the program the interpreter runs now."""
    return tuple(int(i) for i in builder.grid_idx)


def _keep(builder, kind: str, ptrs, mask) -> None:
    dtype = ptrs.get_element_ty()
    itemsize = max(1, getattr(dtype, "primitive_bitwidth", 8) // 8)
    addresses = np.asarray(ptrs.data, dtype=np.uint64).ravel().copy()
    lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).ravel().copy()
    access = Access(program_id(builder), kind, addresses, lanes, itemsize)
    for seen in _collectors:
        seen.append(access)


def _wrap_load(original):
    @functools.wraps(original)
    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        if _collectors:
            _keep(self, "load", ptrs, mask)
        return original(self, ptrs, mask, other, *args, **kwargs)

    return create_masked_load


def _wrap_store(original):
    @functools.wraps(original)
    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        if _collectors:
            _keep(self, "store", ptrs, mask)
        return original(self, ptrs, value, mask, *args, **kwargs)

    return create_masked_store


def install() -> bool:
    """Wrap the interpreter's masked load and store, once; return whether they are
    wrapped. False on the compiled backend. RuntimeError on an interpreter whose methods
    do not take ``(self, ptrs, mask, other, ...)`` and ``(self, ptrs, value, mask, ...)``."""
    if _state["installed"]:
        return True
    if not runtime.BACKEND.interpreted:
        return False
    import triton
    from triton.runtime.interpreter import InterpreterBuilder

    wanted = {
        "create_masked_load": ["self", "ptrs", "mask", "other"],
        "create_masked_store": ["self", "ptrs", "value", "mask"],
    }
    for name, params in wanted.items():
        found = list(inspect.signature(getattr(InterpreterBuilder, name)).parameters)[:4]
        if found != params:
            raise RuntimeError(
                f"pagedkv_kernels.interpreter.access: Triton {triton.__version__}'s InterpreterBuilder.{name} takes "
                f"({', '.join(found)}, ...), not ({', '.join(params)}, ...): nothing would be recorded"
            )
    InterpreterBuilder.create_masked_load = _wrap_load(InterpreterBuilder.create_masked_load)
    InterpreterBuilder.create_masked_store = _wrap_store(InterpreterBuilder.create_masked_store)
    _state["installed"] = True
    return True


@contextmanager
def recorded() -> Iterator[list[Access]]:
    """Record every load and store of the kernels launched inside the block; yields the
    list of :class:`Access` that fills, in order. On the compiled backend: an empty list."""
    seen: list[Access] = []
    if not install():
        yield seen
        return
    _collectors.append(seen)
    try:
        yield seen
    finally:
        _collectors.remove(seen)

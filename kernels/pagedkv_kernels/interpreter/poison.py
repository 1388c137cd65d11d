"""Poisoned masked lanes: a patch of Triton's interpreter that makes a masked ``tl.load``
without ``other=`` return garbage where its mask is off, as a GPU may.

On a GPU the masked-out lanes of ``tl.load(ptr, mask=m)`` are undefined (whatever the
registers held); Triton's interpreter fills them with 0, so a kernel that forgot
``other=0.0`` and then uses those lanes (``0 * v`` summed into an accumulator, a dot
over padded features) passes every CPU test and is wrong on a GPU. Under this switch the
interpreter fills them with:

* **floating point** (fp16, bf16, fp32, fp64, the FP8 formats): NaN, so anything that
  adds or multiplies a masked lane is NaN (the FP8 formats get their NaN byte: 0x7F
  for ``fp8e4nv``/``fp8e5``, 0x80 for the ``...b8``/``...b16`` ones; 0x7F, all bits but
  the sign, for ``fp8e4b15``). Triton's interpreter casts FP8 to fp32 without its NaN
  codes (measured, 3.9: 0x7F reads as 480.0 in E4M3, 114688.0 in E5M2): large, not NaN;
  the suite's kernels load FP8 as ``uint8`` codes and decode them themselves;
* **8-bit integers**: 0x7F (127), the int8 maximum, which as an FP8 code (the quantized
  pools load codes as ``uint8``) is NaN in E4M3 and E5M2;
* **wider integers and pointers**: the golden-ratio bits truncated to the width
  (``0x9E37``, ``0x9E3779B9``, ``0x9E3779B97F4A7C15``; int32: -1,640,531,527). Used as
  a page number or a row it points far outside any tensor, and it stays far from 0 when
  multiplied by any small stride, even after int32 wraparound (a power of two or the
  dtype's minimum would wrap to 0 and silently read page 0);
* **booleans**: True.

Loads **with** ``other=`` and loads without a mask are unchanged; so are stores.

Turn it on with ``PAGEDKV_POISON_MASKED=1`` (read when ``pagedkv_kernels`` is imported), with
:func:`enable` / :func:`disable`, or for a block with :func:`poisoned`; the harness
(:func:`pagedkv_lab.verify.run`) and the exercise checker turn it on by default. On the
compiled GPU backend every entry point is a no-op: masked lanes there are already what
the hardware leaves. While on, every load whose lanes were poisoned is recorded by its
place in the kernel's source (:class:`PoisonedLoad`), so a failure can name it.

This module imports triton: import it only after :mod:`pagedkv_lib.runtime` has chosen
the backend (``pagedkv_kernels`` does; :func:`pagedkv_lab.poisoning.masked_lanes_poisoned` is the
way in that imports nothing until it is needed).

The patch wraps one method, ``InterpreterBuilder.create_masked_load(self, ptrs, mask,
other, ...)``, whose first three arguments are the same in every admitted Triton (3.6 to
3.9; the arguments after them differ). :func:`enable` refuses, naming the version, any
other Triton or a method of another shape, rather than silently poisoning nothing.
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

from pagedkv_lib import runtime

__all__ = [
    "ADMITTED_TRITON",
    "PoisonedLoad",
    "enable",
    "disable",
    "enabled",
    "enable_from_env",
    "check_patchable",
    "poisoned",
    "poison_value",
]

ADMITTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
"""The Triton releases (major, minor) whose interpreter this patch was checked against."""

# The golden-ratio constant of Fibonacci hashing: its multiples by small integers stay far
# from multiples of 2**32 (and 2**64), so a poisoned index times a stride stays out of range.
_GOLDEN64 = 0x9E3779B97F4A7C15
_FLOAT_NAN = {tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64}
# Formats the interpreter stores as raw bits: (storage dtype, the bits of their NaN).
_BITS_NAN = {
    tl.bfloat16: (np.uint16, 0x7FC0),
    tl.float8e4nv: (np.uint8, 0x7F),
    tl.float8e5: (np.uint8, 0x7F),
    tl.float8e4b8: (np.uint8, 0x80),
    tl.float8e5b16: (np.uint8, 0x80),
    tl.float8e4b15: (np.uint8, 0x7F),
}


@dataclass(frozen=True)
class PoisonedLoad:
    """A masked ``tl.load`` without ``other=`` that read poisoned lanes: ``filename`` and
    ``lineno`` of the call in the kernel's source, ``source`` that line's text."""

    filename: str
    lineno: int
    source: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}, line {self.lineno}: {self.source}"


_state = {"on": False, "installed": False}
_collectors: list[list[PoisonedLoad]] = []  # one per open `poisoned()` block
_TRITON_DIR = os.path.dirname(triton.__file__) + os.sep


def poison_value(dtype) -> tuple[np.dtype, object]:
    """Return ``(numpy storage dtype, fill value)`` of the poison for the Triton element
    type ``dtype`` (``tl.float32``, ``tl.int32``, a ``tl.pointer_type``, ...), as the
    interpreter stores that type. Raises RuntimeError for a type it has no poison for."""
    if isinstance(dtype, tl.pointer_type):
        return np.dtype(np.uint64), np.uint64(_GOLDEN64)
    if dtype in _FLOAT_NAN:
        return np.dtype(_FLOAT_NAN[dtype]), np.nan
    if dtype in _BITS_NAN:
        storage, bits = _BITS_NAN[dtype]
        return np.dtype(storage), storage(bits)
    if dtype == tl.int1:
        return np.dtype(bool), True
    if dtype.is_int():
        width = dtype.int_bitwidth
        bits = np.array(0x7F if width == 8 else _GOLDEN64 >> (64 - width), dtype=f"uint{width}")
        if dtype.is_int_signed():
            bits = bits.view(f"int{width}")
        return bits.dtype, bits[()]
    raise RuntimeError(f"PAGEDKV_POISON_MASKED has no poison value for a tl.load of {dtype}")


def _where_loaded() -> PoisonedLoad:
    """The innermost frame outside triton and the suite's interpreter hooks (this module,
    and the access recording that may wrap the same load): the kernel's ``tl.load`` line."""
    frame = sys._getframe(2)
    hooks = os.path.dirname(__file__)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TRITON_DIR) or os.path.dirname(frame.f_code.co_filename) == hooks
    ):
        frame = frame.f_back
    if frame is None:
        return PoisonedLoad("<unknown>", 0, "")
    name, line = frame.f_code.co_filename, frame.f_lineno
    return PoisonedLoad(name, line, linecache.getline(name, line).strip())


def _wrap(original):
    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        # An unmasked load reaches here too, with an all-true mask: nothing to poison.
        if _state["on"] and other is None and not mask.data.all():
            dtype = ptrs.get_element_ty()
            storage, value = poison_value(dtype)
            other = TensorHandle(np.full(ptrs.data.shape, value, dtype=storage), dtype)
            if _collectors:
                where = _where_loaded()
                for seen in _collectors:
                    if where not in seen:
                        seen.append(where)
        return original(self, ptrs, mask, other, *args, **kwargs)

    create_masked_load.pagedkv_poison = True
    return create_masked_load


def check_patchable(version: str, method) -> None:
    """Raise RuntimeError, naming Triton ``version``, unless it is admitted
    (:data:`ADMITTED_TRITON`) and ``method`` (its ``InterpreterBuilder.create_masked_load``)
    takes ``(self, ptrs, mask, other, ...)``: anything else would poison nothing, silently."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found or tuple(map(int, found.groups())) not in ADMITTED_TRITON:
        admitted = ", ".join(f"{a}.{b}" for a, b in ADMITTED_TRITON)
        raise RuntimeError(
            f"PAGEDKV_POISON_MASKED: Triton {version} is not one whose interpreter this patch was checked "
            f"against ({admitted}); check InterpreterBuilder.create_masked_load in triton/runtime/interpreter.py, "
            "then add the version to pagedkv_kernels.interpreter.poison.ADMITTED_TRITON"
        )
    params = list(inspect.signature(method).parameters)[:4] if callable(method) else []
    if params != ["self", "ptrs", "mask", "other"]:
        raise RuntimeError(
            f"PAGEDKV_POISON_MASKED: Triton {version}'s InterpreterBuilder.create_masked_load takes "
            f"({', '.join(params) or 'nothing'}, ...), not (self, ptrs, mask, other, ...): "
            "the patch would poison nothing"
        )


def _install() -> None:
    """Wrap the interpreter's masked load, once."""
    if _state["installed"]:
        return
    method = getattr(InterpreterBuilder, "create_masked_load", None)
    check_patchable(triton.__version__, method)
    if not getattr(method, "pagedkv_poison", False):
        InterpreterBuilder.create_masked_load = _wrap(method)
    _state["installed"] = True


def enable() -> None:
    """Poison masked lanes from now on (see the module docstring). A no-op on the compiled
    GPU backend. Raises RuntimeError on a Triton the patch was not checked against."""
    if not runtime.BACKEND.interpreted:
        return
    _install()
    _state["on"] = True


def disable() -> None:
    """Masked lanes read 0 again, as the interpreter has them."""
    _state["on"] = False


def enabled() -> bool:
    """Return whether masked lanes are poisoned now (always False on the GPU backend)."""
    return _state["on"]


def enable_from_env() -> bool:
    """Enable when ``PAGEDKV_POISON_MASKED=1`` (``pagedkv_kernels`` calls this at import); return
    whether it is on. ValueError for a value other than ``0``, ``1`` or empty."""
    if runtime.poison_masked_requested():
        enable()
    return enabled()


@contextmanager
def poisoned(on: bool = True) -> Iterator[list[PoisonedLoad]]:
    """Poison masked lanes inside the block (``on=False``: do not, even where the
    environment turned it on); restore the previous state after. Yields a list that
    fills, in order, with each :class:`PoisonedLoad` whose lanes were poisoned in the block."""
    before = _state["on"]
    if on:
        enable()
    else:
        disable()
    seen: list[PoisonedLoad] = []
    _collectors.append(seen)
    try:
        yield seen
    finally:
        _collectors.remove(seen)
        _state["on"] = before

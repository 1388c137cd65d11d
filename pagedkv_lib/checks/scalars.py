"""Scalar argument rules: an int that is not a bool, a number that is not a bool.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds and a
flag passed where a count belongs (``page_size=True``) would be taken as 1. Every
count, size, id and length the suite takes is checked here instead, so that the rule
has one home and one wording:

* :func:`is_int`: a Python ``int`` that is not a ``bool``. NumPy and torch integers are
  not Python ints (``isinstance(np.int64(3), int)`` is False) and are refused: a
  caller converts them with ``int(x)``;
* :func:`is_number`: a Python ``int`` or ``float`` that is not a ``bool`` (a scale, a
  RoPE base);
* :func:`check_int` and :func:`check_positive_int`: the ValueError naming the argument,
  ``"{name}={value!r} must be an int >= {low}"`` and ``"... must be a positive int"``,
  prefixed with ``"{owner}: "`` when the argument belongs to an object
  (``"PagedKVPool: page_size=0 must be a positive int"``).

This module imports nothing, so the modules the other checks are built on (the pools,
the windows, the formats) use it too without an import cycle; callers elsewhere reach it
as :mod:`pagedkv_lib.checks` (``checks.is_int``).
"""

from __future__ import annotations

__all__ = ["is_int", "is_number", "check_int", "check_positive_int"]


def is_int(value) -> bool:
    """Whether ``value`` is a Python int that is not a bool (NumPy and torch integers
    are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether ``value`` is a Python int or float that is not a bool (NumPy and torch
    scalars are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _prefix(owner: str) -> str:
    return f"{owner}: " if owner else ""


def check_int(name: str, value, low: int = 0, owner: str = "") -> int:
    """``value`` (returned) must be an int (:func:`is_int`) ``>= low``; else ValueError
    ``"[owner: ]name=value must be an int >= low"``."""
    if not is_int(value) or value < low:
        raise ValueError(f"{_prefix(owner)}{name}={value!r} must be an int >= {low}")
    return value


def check_positive_int(name: str, value, owner: str = "") -> int:
    """``value`` (returned) must be an int (:func:`is_int`) ``> 0``; else ValueError
    ``"[owner: ]name=value must be a positive int"``."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{_prefix(owner)}{name}={value!r} must be a positive int")
    return value

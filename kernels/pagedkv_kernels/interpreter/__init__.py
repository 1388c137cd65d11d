"""The kernels' runtime in Triton's interpreter: two patches of the interpreter, applied
when :mod:`pagedkv_kernels` is imported on the interpreter backend and named in the
backend line every notebook prints (:func:`pagedkv_lib.runtime.backend_line`).

* :mod:`~pagedkv_kernels.interpreter.calls` (always; speed only): a ``@triton.jit``
  helper's call inside a running launch skips the interpreter's redundant re-patching of
  ``triton.language`` (results bit for bit the same);
* :mod:`~pagedkv_kernels.interpreter.poison` (``PAGEDKV_POISON_MASKED=1``, or a block
  under :func:`masked_lanes_poisoned`): masked ``tl.load`` lanes without ``other=`` read
  NaN or a far out-of-range integer instead of 0, as undefined as on a GPU.

A third, :mod:`~pagedkv_kernels.interpreter.access`, is installed on first use only:
inside :func:`accesses_recorded` every ``tl.load`` and ``tl.store`` is recorded per program
and lane, for the access map the exercise checker draws (:mod:`pagedkv_lab.viz.access_map`).

Both wrap a private function of Triton's interpreter, check its shape first, and refuse
or step aside on any Triton outside 3.6-3.9. On the compiled backend neither does
anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv_lib import runtime

from . import access, calls, poison

__all__ = ["access", "calls", "poison", "install_from_env", "masked_lanes_poisoned", "accesses_recorded"]


def _note() -> str:
    """The backend line's words for what is patched now ('' when nothing is)."""
    patched = []
    if calls.installed():
        patched.append("helper calls patched by pagedkv_kernels.interpreter")
    if poison.enabled():
        patched.append("masked lanes poisoned")
    return ", ".join(patched)


def install_from_env() -> None:
    """Apply the patches the environment asks for (see the module docstring) and name
    them in the backend line. Called once, by ``import pagedkv_kernels``."""
    poison.enable_from_env()
    if runtime.BACKEND.interpreted:
        calls.install()
    runtime.add_backend_note(_note)


@contextmanager
def masked_lanes_poisoned(on: bool = True) -> Iterator[list]:
    """Inside the block, masked ``tl.load`` lanes without ``other=`` read poison in the
    interpreter (``on=False``: read 0, whatever the environment says); yields the list of
    :class:`~pagedkv_kernels.interpreter.poison.PoisonedLoad` poisoned in the block. On
    the compiled backend it does nothing and yields an empty list: a GPU's masked lanes
    are undefined already."""
    if not runtime.BACKEND.interpreted:
        yield []
        return
    with poison.poisoned(on) as seen:
        yield seen


@contextmanager
def accesses_recorded() -> Iterator[list]:
    """Inside the block, every ``tl.load`` and ``tl.store`` of the interpreter is recorded;
    yields the list of :class:`~pagedkv_kernels.interpreter.access.Access` that fills, in
    order. On the compiled backend it records nothing and yields an empty list."""
    with access.recorded() as seen:
        yield seen

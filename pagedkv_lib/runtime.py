"""Backend selection: the one place that decides where Triton kernels run.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, so the
choice must be made before any module that defines kernels is imported. The
``pagedkv_kernels`` package imports this module first; notebooks import ``pagedkv_lib``
(which never imports triton) before ``pagedkv_kernels``.

Choice, in order:

* ``PAGEDKV_BACKEND=interpreter`` forces Triton's interpreter (kernels run on CPU
  through numpy, tensors live on the CPU);
* ``PAGEDKV_BACKEND=gpu`` forces compiled kernels and fails loudly without CUDA;
* ``PAGEDKV_BACKEND=compile-only`` decorates kernels for compilation (``TRITON_INTERPRET=0``)
  on a machine without a GPU, so that :mod:`pagedkv_kernels.tools.compile_check` can compile them for
  GPU targets; nothing can be launched in that mode;
* otherwise (``auto``, the default) compiled kernels when CUDA is available, else
  the interpreter.

Launch plans (tile sizes, ``tl.dot`` modes, split counts) follow the backend, unless
``PAGEDKV_PLAN=gpu``: then the launchers plan as on a GPU with ``PAGEDKV_PLAN_SMS``
streaming multiprocessors (132, an H100/H200, by default) while the kernels still run
in the interpreter, so the CPU tests exercise the configurations a GPU runs (see
:func:`gpu_plans`).

``PAGEDKV_POISON_MASKED=1`` asks the kernels' runtime to make the interpreter fill the
masked-out lanes of a ``tl.load`` without ``other=`` with NaN (floats) or a far
out-of-range value (integers) instead of 0, as undefined as they are on a GPU
(:mod:`pagedkv_kernels.interpreter`, which applies its patches when ``pagedkv_kernels``
is imported and names them here, in :func:`backend_line`, through :func:`add_backend_note`).

This module imports torch only: never triton, the kernels or the lab.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV_VAR = "PAGEDKV_BACKEND"
_CHOICES = ("auto", "gpu", "interpreter", "compile-only")
PLAN_ENV_VAR = "PAGEDKV_PLAN"
PLAN_SMS_ENV_VAR = "PAGEDKV_PLAN_SMS"
DEFAULT_PLAN_SMS = 132  # H100 SXM and H200
POISON_ENV_VAR = "PAGEDKV_POISON_MASKED"


@dataclass(frozen=True)
class Backend:
    """Where kernels run: ``name`` is ``"gpu"``, ``"interpreter"`` or ``"compile-only"``
    (decorated for compilation, never launched); ``device`` is the torch device their
    tensors must live on."""

    name: str
    device: torch.device

    @property
    def interpreted(self) -> bool:
        return self.name == "interpreter"


def _choose() -> Backend:
    requested = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if requested not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={requested!r}: expected one of {', '.join(_CHOICES)}")
    cuda = torch.cuda.is_available()
    if requested == "gpu" and not cuda:
        raise RuntimeError(f"{ENV_VAR}=gpu but torch sees no CUDA device")
    if requested == "compile-only":
        return Backend("compile-only", torch.device("cpu"))
    if requested == "interpreter" or not cuda:
        return Backend("interpreter", torch.device("cpu"))
    return Backend("gpu", torch.device("cuda"))


def _apply(backend: Backend) -> None:
    want = "1" if backend.interpreted else "0"
    if sys.modules.get("triton") is not None and os.environ.get("TRITON_INTERPRET", "0") != want:
        # Kernels already decorated keep the old mode; mixing the two corrupts
        # results silently, so refuse instead.
        raise RuntimeError(
            "triton was imported before pagedkv chose its backend "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, wanted {want!r}); "
            "import pagedkv_lib or kernels before triton"
        )
    os.environ["TRITON_INTERPRET"] = want


BACKEND: Backend = _choose()
_apply(BACKEND)


@dataclass(frozen=True)
class Plans:
    """How launchers plan: ``gpu`` is True where they choose a GPU's tiles, ``tl.dot``
    modes and split counts (compiled, or ``PAGEDKV_PLAN=gpu`` in the interpreter);
    ``sm_count`` is the parallel units the split heuristic assumes in the interpreter
    under GPU plans (a compiled run asks the device instead)."""

    gpu: bool
    sm_count: int


def _choose_plans() -> Plans:
    requested = os.environ.get(PLAN_ENV_VAR, "backend").strip().lower() or "backend"
    if requested not in ("backend", "gpu"):
        raise ValueError(f"{PLAN_ENV_VAR}={requested!r}: expected 'backend' (plan for where kernels run) or 'gpu'")
    raw = os.environ.get(PLAN_SMS_ENV_VAR, str(DEFAULT_PLAN_SMS)).strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{PLAN_SMS_ENV_VAR}={raw!r}: expected a positive SM count (132 for an H100)")
    return Plans(gpu=requested == "gpu" or not BACKEND.interpreted, sm_count=int(raw))


PLANS: Plans = _choose_plans()


def gpu_plans() -> bool:
    """Return whether launchers plan as on a GPU (see :class:`Plans`)."""
    return PLANS.gpu


def device() -> torch.device:
    """Return the torch device kernel inputs must live on (``cuda`` or ``cpu``)."""
    return BACKEND.device


def poison_masked_requested() -> bool:
    """Return whether ``PAGEDKV_POISON_MASKED`` asks for poisoned masked lanes (``1``; ``0``
    or unset: no). ValueError names the variable for any other value."""
    value = os.environ.get(POISON_ENV_VAR, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{POISON_ENV_VAR}={value!r}: expected 1 (poison masked lanes) or 0")
    return value == "1"


_BACKEND_NOTES: list[Callable[[], str]] = []


def add_backend_note(note: Callable[[], str]) -> None:
    """Let a layer above (the kernels' interpreter patches, :mod:`pagedkv_kernels.interpreter`)
    say in :func:`backend_line` what it changed: ``note()`` returns a few words, or ''."""
    if note not in _BACKEND_NOTES:
        _BACKEND_NOTES.append(note)


NO_TRITON = "no Triton: notebooks 06 and later need Linux (WSL, a container or a hosted notebook)"


class TritonMissing(RuntimeError):
    """Raised by :func:`require_triton` where Triton cannot be imported. In a notebook it
    shows as its message alone (no traceback) and stops Run All at that cell."""

    def _render_traceback_(self) -> list[str]:  # IPython prints these lines instead of a traceback
        return [f"\x1b[31m{self}\x1b[0m"]


def triton_available() -> bool:
    """Return whether ``import triton`` can succeed here, without importing it (importing
    it early would fix ``TRITON_INTERPRET`` before the backend is chosen)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return False


def require_triton() -> None:
    """Stop with :data:`NO_TRITON` as the message where Triton is missing; do nothing
    otherwise. The first cell of every notebook that runs kernels calls it before
    ``import pagedkv_kernels as kernels``, so macOS and Windows learners get a sentence, not a traceback.

    Raises :class:`TritonMissing` (a ``RuntimeError``)."""
    if not triton_available():
        raise TritonMissing(f"{NO_TRITON}. Notebooks 01-05 run here without it.")


def backend_line() -> str:
    """Return one line naming the backend and versions; notebooks print it and the
    nbval sanitizer masks it, since it differs between machines."""
    if not triton_available():
        return f"backend: {NO_TRITON}; torch {torch.__version__}"
    try:
        from importlib.metadata import version

        triton_version = version("triton")
    except Exception:  # installed without metadata (a source tree on the path)
        triton_version = "unknown version"
    if BACKEND.name == "gpu":
        where = f"compiled on {torch.cuda.get_device_name()}"
    elif BACKEND.interpreted:
        where = "Triton interpreter on CPU" + (f", GPU plans for {PLANS.sm_count} SMs" if PLANS.gpu else "")
    else:
        where = "compile only, no launches"
    notes = [text for text in (note() for note in _BACKEND_NOTES) if text]
    if notes:
        where += "; " + ", ".join(notes)
    return f"backend: {BACKEND.name} ({where}); torch {torch.__version__}, triton {triton_version}"

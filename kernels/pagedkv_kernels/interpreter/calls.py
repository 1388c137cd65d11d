"""Device-function calls in Triton's interpreter, without patching ``triton.language`` again.

Triton's interpreter runs a kernel by swapping the functions of ``triton.language``
(``tl.load``, ``tl.arange``, the tensor operators, ...) for numpy-backed ones for the
length of the launch (``_patch_lang``, undone when the grid has run). It also calls
``_patch_lang`` on *every* call of a ``@triton.jit`` helper from inside a kernel, and that
call re-patches every builtin of the module, about a millisecond each time. The suite's
kernels call shared device helpers (:mod:`pagedkv_kernels.device.attention_core`,
:mod:`pagedkv_kernels.device.addressing`, ...) once per program and key tile, so a decode or prefill in
the interpreter made tens of thousands of such calls: SmolLM2 served on the Triton path
for the standard batch spent a seventh of its time re-patching what was already patched
(measured: 52.0 s, 44.8 s without it, same tokens and logits).

:func:`install` wraps ``_patch_lang`` so that a helper's call inside a running launch
skips the patching when every ``triton.language`` module the helper sees (``tl``,
``tl.core``) is already patched: by that launch, or by an earlier helper's call, whose
patching upstream never undoes (``tl.core`` for ``tl.sum``, ``tl.max`` and the other
helpers of ``triton.language.standard``: before this, each of their calls scanned the
module again, a fifth of a small decode's time). Anything else goes to the original, and
the launch's own patching and restoring are unchanged. Only speed changes: the functions
a helper calls are the very ones the launch installed. ``pagedkv_kernels`` installs it at import
on the interpreter backend; :func:`uninstall` puts the original back.

The wrapped function is internal to Triton; :func:`install` checks that it exists and
that ``InterpretedFunction.__call__`` and ``GridExecutor.__call__`` call it by name, as
every admitted Triton (3.6 to 3.9) does, and otherwise leaves the interpreter as it is.
"""

from __future__ import annotations

import inspect

from pagedkv_lib import runtime

__all__ = ["install", "uninstall", "installed", "nested_calls_skipped"]

# active: the modules each running launch patched (a stack); kept: the modules a helper's
# call patched for good (upstream never restores a helper's patching, so they stay patched)
_state = {"original": None, "active": [], "kept": frozenset(), "skipped": 0}
_LANGS: dict = {}  # function -> the ids of the triton.language modules its globals hold


class _Restore:
    """A launch's patch scope, whose restore also ends the launch for :func:`_patch_lang_once`."""

    def __init__(self, scope) -> None:
        self.scope = scope

    def restore(self) -> None:
        _state["active"].pop()
        self.scope.restore()


class _Nothing:
    def restore(self) -> None:
        pass


def _lang_modules(fn) -> frozenset[int]:
    """Once per function (it is asked on every helper call): scanning its module's
    globals each time would put that scan back on the path this module shortens."""
    langs = _LANGS.get(fn)
    if langs is None:
        import triton.language as tl

        langs = _LANGS[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
    return langs


def _patch_lang_once(fn):
    """``_patch_lang(fn)``, skipped for a call inside a launch when every
    ``triton.language`` module ``fn`` sees is patched already: by that launch, or for good
    by an earlier helper's call (``triton.language.standard``'s helpers, ``tl.sum`` and
    ``tl.max`` among them, see ``tl.core``, which upstream patches on their first call and
    never restores)."""
    langs, active = _lang_modules(fn), _state["active"]
    if active and langs <= active[-1] | _state["kept"]:
        _state["skipped"] += 1
        return _Nothing()
    scope = _state["original"](fn)
    if active:  # a helper seeing another module: patched as upstream does, never restored
        _state["kept"] |= langs
        return scope
    active.append(langs)
    return _Restore(scope)


def _calls_by_name(interpreter) -> bool:
    """Whether both callers of ``_patch_lang`` look it up by name (so a wrapper is seen)."""
    callers = (interpreter.InterpretedFunction.__call__, interpreter.GridExecutor.__call__)
    try:
        return all("_patch_lang(self.fn)" in inspect.getsource(c) for c in callers)
    except (OSError, TypeError):
        return False


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (see the module docstring), once; return
    whether the wrapper is in place. A no-op (False) on the compiled backend or on a
    Triton whose interpreter is not built as described."""
    if _state["original"] is not None:
        return True
    if not runtime.BACKEND.interpreted:
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not _calls_by_name(interpreter):
        return False
    _state["original"] = original
    interpreter._patch_lang = _patch_lang_once
    return True


def uninstall() -> None:
    """Put the interpreter's own ``_patch_lang`` back (no launch may be running)."""
    if _state["original"] is None:
        return
    from triton.runtime import interpreter

    interpreter._patch_lang = _state["original"]
    _state["original"] = None


def installed() -> bool:
    return _state["original"] is not None


def nested_calls_skipped() -> int:
    """How many helper calls skipped the re-patching since the process started."""
    return _state["skipped"]

"""What a callable under test raised, said so that the reader can find the line.

Triton's interpreter wraps any exception raised inside a kernel as ``InterpreterError(
repr(err))`` and chains the original, so ``str(err)`` names neither the kernel nor the
line: ``raised InterpreterError: ValueError('Shape element 0 must be a power of 2')``.
:func:`raised` walks the exception chain (``__cause__``, ``__context__``) and each
traceback for the frames of ``@triton.jit`` functions (a frame whose function is the
``.fn`` of a global of its module, by name and file, that has a ``.run``: the jit
wrapper the decorator left in the module), and names the innermost one's file, line and source line, and
the kernel it was called from when that is another function. Plain Python errors get
the innermost frame outside the harness, torch and Triton, so a wrong adapter is
located too. Never raises itself: a description is all it adds.
"""

from __future__ import annotations

import linecache
import os
import traceback

__all__ = ["raised", "kernel_frames"]

_MAX_CHAIN = 8  # exception chains longer than this are not walked further


def _is_jit_frame(frame) -> bool:
    # The interpreter may run a rewritten copy of the function (Triton 3.9 rewrites its
    # AST), so the code object is matched by name and file, not by identity.
    name = frame.f_code.co_name
    obj = frame.f_globals.get(name)
    code = getattr(getattr(obj, "fn", None), "__code__", None)
    return code is not None and hasattr(obj, "run") and code.co_filename == frame.f_code.co_filename


def _chain(err: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while err is not None and id(err) not in seen and len(out) < _MAX_CHAIN:
        out.append(err)
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return out


def kernel_frames(err: BaseException) -> list[tuple[str, str, int]]:
    """``(function, file, line)`` of every ``@triton.jit`` frame in ``err``'s chain, outermost
    first (the kernel, then the helpers it called); ``[]`` when none ran."""
    frames = []
    for e in _chain(err):  # the outer exceptions' tracebacks hold the outer frames
        for frame, line in traceback.walk_tb(e.__traceback__):
            if _is_jit_frame(frame):
                entry = (frame.f_code.co_name, frame.f_code.co_filename, line)
                if entry not in frames:
                    frames.append(entry)
    return frames


def _outside_frame(err: BaseException) -> tuple[str, str, int] | None:
    """The innermost frame of the original exception that is not the harness's, torch's,
    Triton's or the standard library's: the caller's adapter or kernel wrapper."""
    skip = ("pagedkv_lab" + os.sep + "verify", os.sep + "torch" + os.sep, os.sep + "triton" + os.sep)
    stdlib = os.path.dirname(os.__file__)
    found = None
    for frame, line in traceback.walk_tb(_chain(err)[-1].__traceback__):
        path = frame.f_code.co_filename
        if not any(s in path for s in skip) and not path.startswith(stdlib) and not path.startswith("<"):
            found = (frame.f_code.co_name, path, line)
    return found


def _where(name: str, path: str, line: int) -> str:
    source = linecache.getline(path, line).strip()
    return f"{name} at {path}:{line}" + (f": `{source}`" if source else "")


def raised(err: BaseException) -> str:
    """``"raised <Type>: <message>"``, then where: ``in the @triton.jit function <name> at
    <file>:<line>: `<source>``` (and ``called from <kernel> at <file>:<line>``), or ``at
    <file>:<line>`` of the innermost frame outside the harness, torch and Triton."""
    text = f"raised {type(err).__name__}: {err}"
    try:
        original = _chain(err)[-1]
        if type(err).__name__ == "InterpreterError" and original is not err:  # its message is repr(original)
            text = f"raised {type(err).__name__}: {type(original).__name__}: {original}"
        jit = kernel_frames(err)
        if jit:
            text += f" in the @triton.jit function {_where(*jit[-1])}"
            if len(jit) > 1:
                text += f", called from {jit[0][0]} at {jit[0][1]}:{jit[0][2]}"
            return text
        outside = _outside_frame(err)
        if outside is not None:
            text += f" in {_where(*outside)}"
    except Exception:  # noqa: BLE001  (a description must never fail the report)
        pass
    return text

"""The learner process: runs a learner's notebook cells, then answers calls of their
functions, one frame in, one frame out (:mod:`.wire`), until the checker says goodbye.

It starts inside the sandbox (``python -m pagedkv_lab.grading.learner``, see
:mod:`.sandbox`) and trusts nothing it runs: whatever the learner's code does here (print
"PASS", rebind ``check``, patch the suite, write to any file descriptor) changes only
what this process answers, and the checker judges the answers.

Requests (dicts): ``{"op": "cells", "cells": [{"id", "source"}, ...]}`` runs the cells in
order in one namespace, each from a file of its own (Triton reads a kernel's source from
its file), and answers after each cell where its output is in the output file (the
checker's, see :class:`_Output`) and its error, then ``{"done": True}``; ``{"op": "call", "name", "args",
"kwargs", "poison"}`` calls the learner's function ``name`` and answers its return value
(``value``) or exception (``error``: type, message, where in the learner's cells), the
arguments as they are after the call (a kernel writes into them), and, with
``poison`` not None, the masked loads that read poison (:mod:`pagedkv_lab.poisoning`);
``{"op": "bye"}`` ends the process.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
import sys
import traceback

from pagedkv_lab.grading.wire import HEAD, pack, unpack

__all__ = ["main", "serve"]

_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Output:
    """The learner's stdout and stderr, both at file-descriptor level, into ``fd``, a
    file the checker opened for them: what a cell printed survives its process. Offsets
    into it say which cell printed what."""

    def __init__(self, fd: int) -> None:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        if fd > 2:
            os.close(fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, errors="replace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="replace")

    def mark(self) -> int:
        """The end of the output so far (flushed)."""
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except Exception:  # a learner may have replaced or closed them
                pass
        try:
            return os.lseek(1, 0, os.SEEK_END)
        except OSError:
            return 0


def _in_cells(filename: str) -> bool:
    return os.path.basename(filename).startswith("cell_")


def _error(err: BaseException) -> dict:
    """An exception as data: its type, message, where in the learner's cells it was
    raised (``where_in_learner_code``'s words) and its traceback through the cells."""
    from pagedkv_lab.exercises.result import where_in_learner_code

    frames = [f for f in traceback.extract_tb(err.__traceback__) if _in_cells(f.filename)]
    lines = ["Traceback (most recent call last):"] + [
        f'  File "{os.path.basename(f.filename)}", line {f.lineno}, in {f.name}\n    {(f.line or "").strip()}'
        for f in frames
    ]
    bases = [c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins" and c.__name__ in _BUILTIN_EXCEPTIONS]
    try:
        message = str(err)
    except Exception:  # a learner's exception whose __str__ raises
        message = ""
    return {
        "type": type(err).__name__,
        "bases": bases,
        "message": message[:2000],
        "where": where_in_learner_code(err),
        "traceback": lines + [f"{type(err).__name__}: {message[:2000]}"],
    }


def _run_cells(cells: list[dict], namespace: dict, output: _Output, answer) -> None:
    """Run ``cells``; after each, answer ``{"id", "start", "end", "error"}`` (its output
    is ``[start, end)`` of the output file), and ``{"done": True}`` after the last."""
    for i, cell in enumerate(cells):
        name = cell["id"] if isinstance(cell["id"], str) and cell["id"].isidentifier() else f"cell_{i:02d}"
        path = os.path.join(os.getcwd(), f"{name}.py")
        with open(path, "w") as f:
            f.write(cell["source"])
        start, error = output.mark(), None
        try:
            exec(compile(cell["source"], path, "exec"), namespace)
        except BaseException as err:  # noqa: BLE001  (a cell's SystemExit or KeyboardInterrupt is its output)
            error = _error(err)
        answer({"id": cell["id"], "start": start, "end": output.mark(), "error": error})
    answer({"done": True})


def _call(request: dict, namespace: dict, output: _Output) -> dict:
    name, args, kwargs = request["name"], request["args"], request["kwargs"]
    fn = namespace.get(name)
    reply: dict = {}
    try:
        if not callable(fn):
            raise NameError(f"your notebook defines no function {name}")
        if request.get("poison") is None:
            reply["value"] = fn(*args, **kwargs)
        else:
            from pagedkv_lab.poisoning import masked_lanes_poisoned

            with masked_lanes_poisoned(bool(request["poison"])) as loads:
                try:
                    reply["value"] = fn(*args, **kwargs)
                finally:
                    reply["loads"] = [{"filename": x.filename, "lineno": x.lineno, "source": x.source} for x in loads]
    except Exception as err:  # the learner's exception is an answer
        reply["error"] = _error(err)
    output.mark()  # what the function printed stays in the output file, after the cells'
    reply.update(args=args, kwargs=kwargs)
    return reply


def _answer(fd: int, reply: dict) -> None:
    try:
        frame = pack(reply)
    except Exception as err:  # a value the wire cannot carry: say so rather than fall silent
        frame = pack({"error": {"type": "TypeError", "message": f"the reply could not be sent: {err}"}})
    _write_all(fd, frame)


def serve(requests: int, answers: int, output: int) -> None:
    """Answer the checker's requests from the pipe ``requests`` on the pipe ``answers``
    until it says goodbye or closes; the learner's stdout and stderr go to ``output``.
    Never returns: the process ends here."""
    out = _Output(output)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past its limit fails the write instead
    import torch

    torch.set_num_threads(1)
    namespace = {"__name__": "__main__", "__builtins__": builtins, "display": print}
    while True:
        try:
            (n,) = HEAD.unpack(_read_exact(requests, HEAD.size))
            request = unpack(_read_exact(requests, n), devices=True)
        except EOFError:
            break
        if request["op"] == "bye":
            break
        if request["op"] == "cells":
            _run_cells(request["cells"], namespace, out, lambda reply: _answer(answers, reply))
        else:
            _answer(answers, _call(request, namespace, out))
    os._exit(0)


def main() -> None:
    """A learner process started on its own (``python -m pagedkv_lab.grading.learner``):
    the checker's pipes are stdin and stdout, the output file ``$PAGEDKV_OUTPUT_FD``."""
    serve(os.dup(0), os.dup(1), int(os.environ.pop("PAGEDKV_OUTPUT_FD")))


if __name__ == "__main__":
    main()

"""Code shown to a learner: the lesson lines of a kernel, never a wall.

A notebook that teaches a kernel shows the lines the lesson is about, with a little
context, the signature folded to one line, and the whole source one click away
(collapsed, an HTML ``<details>``), all read from the module itself (``inspect``), so a
page cannot drift from the code it is about. Formatter and linter pragmas (``# fmt:
skip``, ``# noqa``, ``# isort: ...``) are tooling, not lesson: they are never shown.

:func:`kernel_listing` is the call; :func:`source_code` shows an object whole only where it
fits on a screen (:data:`MAX_SHOWN_LINES`), and otherwise folds it the same way.
``tests/test_notebooks.py`` counts the shown lines of every listing a notebook stores.
"""

from __future__ import annotations

import ast
import html
import inspect
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_SHOWN_LINES", "Listing", "kernel_listing", "source_code", "lesson_lines", "strip_tooling"]

MAX_SHOWN_LINES = 40  # what a learner reads on one screen; the rest is collapsed
_TOOLING = re.compile(r"\s*#\s*(fmt:\s*(skip|off|on)|noqa\b[^#]*|isort:\s*\w+[^#]*|type:\s*ignore[^#]*)\s*$")
_GAP = "⋮"


def strip_tooling(line: str) -> str | None:
    """``line`` without a trailing formatter/linter pragma; None for a line that holds
    nothing else (``# fmt: off``)."""
    stripped = _TOOLING.sub("", line.rstrip("\n"))
    if stripped.strip() == "" and line.strip():
        return None
    return stripped


def _lines(obj) -> tuple[list[tuple[int, str]], str]:
    """``[(file line number, text)]`` of ``obj``'s source without tooling lines, and its name."""
    fn = getattr(obj, "fn", obj)
    raw, start = inspect.getsourcelines(fn)
    kept = [(start + i, text) for i, line in enumerate(raw) if (text := strip_tooling(line)) is not None]
    return kept, getattr(fn, "__name__", type(obj).__name__)


def _folds(lines: list[tuple[int, str]]) -> tuple[set[int], dict[int, str]]:
    """The line numbers a folded view hides (the signature's parameters, the docstring
    after its first line) and the one-line stand-ins shown in their place."""
    source = textwrap.dedent("\n".join(text for _, text in lines))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set(), {}
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
        return set(), {}
    numbers = [n for n, _ in lines]
    at = {i + 1: numbers[i] for i in range(len(numbers))}  # parsed line -> file line
    hidden, stand_in = set(), {}
    body_start = node.body[0].lineno
    sig_first = node.lineno
    if body_start - sig_first > 1 and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        params = len(node.args.args) + len(node.args.kwonlyargs)
        hidden |= {at[i] for i in range(sig_first + 1, body_start) if i in at}
        stand_in[at[sig_first]] = f"def {node.name}(...):  # {params} parameters, in the full source below"
    first = node.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str)
    if is_doc and first.end_lineno > first.lineno:
        hidden |= {at[i] for i in range(first.lineno + 1, first.end_lineno + 1) if i in at}
        summary = first.value.value.strip().splitlines()[0]
        indent = len(lines[first.lineno - 1][1]) - len(lines[first.lineno - 1][1].lstrip())
        stand_in[at[first.lineno]] = " " * indent + f'"""{summary} ..."""'
    return hidden, stand_in


@dataclass(frozen=True, repr=False)
class Listing:
    """Lines of one object's source to show (``shown``: ``(file line, text, is_lesson)``,
    a ``None`` text for a gap), and its whole source (``full``), collapsed."""

    title: str
    shown: tuple[tuple[int | None, str | None, bool], ...]
    full: tuple[str, ...]

    @property
    def shown_lines(self) -> int:
        return len(self.shown)

    def __str__(self) -> str:
        out = [self.title]
        for number, text, lesson in self.shown:
            out.append(f"{'':>4}  {_GAP}" if text is None else f"{number:4d}{'>' if lesson else ' '} {text}")
        return "\n".join(out)

    __repr__ = __str__  # a notebook's text/plain: the shown lines, stable between runs

    def _repr_html_(self) -> str:
        rows = []
        for number, text, lesson in self.shown:
            if text is None:
                rows.append(f'<div style="color:#888">{"":>4}  {_GAP}</div>')
                continue
            style = "background:#fff3c4;color:#111" if lesson else "color:inherit"
            rows.append(f'<div style="{style};white-space:pre">{number:4d}  {html.escape(text)}</div>')
        box = "font-family:monospace;font-size:12px;border:1px solid #999;padding:4px;overflow-x:auto"
        full = html.escape("\n".join(self.full))
        details = (
            f'<details><summary style="cursor:pointer">the whole source ({len(self.full)} lines)</summary>'
            f'<pre style="font-size:11px;white-space:pre;overflow-x:auto">{full}</pre></details>'
        )
        title = f'<div style="font-weight:bold;margin-bottom:2px">{html.escape(self.title)}</div>'
        return f'<div>{title}<div style="{box}">{"".join(rows)}</div>{details}</div>'


def kernel_listing(obj, lessons: Sequence[str] = (), context: int = 2, title: str = "") -> Listing:
    """The lines of ``obj``'s source (a function, class or ``@triton.jit`` kernel) that
    contain one of ``lessons`` (marked), ``context`` lines around each, the signature
    folded to one line and the docstring to its first, gaps shown as ``⋮``, the whole
    source collapsed below. With no ``lessons``, the folded object whole.

    Raises ValueError naming a lesson no line contains (the kernel changed: the notebook's
    call-out must follow), or when more than :data:`MAX_SHOWN_LINES` lines would show."""
    if context < 0:
        raise ValueError(f"context={context}: expected a count of lines >= 0")
    lines, name = _lines(obj)
    hidden, stand_in = _folds(lines)
    missing = [n for n in lessons if not any(n in text for _, text in lines)]
    if missing:
        raise ValueError(f"lessons {missing} are in no line of {name}'s source")
    visible = [(n, stand_in.get(n, text)) for n, text in lines if n not in hidden]
    marked = {i for i, (n, text) in enumerate(visible) if any(k in dict(lines)[n] for k in lessons)}
    if lessons:
        keep = {j for i in marked for j in range(i - context, i + context + 1) if 0 <= j < len(visible)}
        keep |= {0, 1} & set(range(len(visible)))  # the decorator or def line: what this is
    else:
        keep = set(range(len(visible)))
    shown: list[tuple[int | None, str | None, bool]] = []
    for i in sorted(keep):
        if shown and shown[-1][0] is not None and i - 1 not in keep:
            shown.append((None, None, False))
        number, text = visible[i]
        shown.append((number, text, i in marked))
    if len(shown) > MAX_SHOWN_LINES:
        raise ValueError(
            f"{name}: {len(shown)} lines would show (at most {MAX_SHOWN_LINES}): fewer lessons or less context"
        )
    return Listing(title or f"{name} ({getattr(inspect.getmodule(getattr(obj, 'fn', obj)), '__name__', '')})",
                   tuple(shown), tuple(text for _, text in lines))  # fmt: skip


def source_code(obj, title: str = "") -> Listing:
    """``obj``'s source, whole where it fits on a screen (:data:`MAX_SHOWN_LINES`), else
    folded (signature and docstring to a line each) with the whole source collapsed: a
    module's own code, never a copy. Prefer :func:`kernel_listing` with the lesson lines."""
    lines, name = _lines(obj)
    full = tuple(t for _, t in lines)
    if len(lines) <= MAX_SHOWN_LINES:
        return Listing(title or name, tuple((n, text, False) for n, text in lines), full)
    hidden, stand_in = _folds(lines)
    visible = [(n, stand_in.get(n, text)) for n, text in lines if n not in hidden]
    head = next((i for i, (n, _) in enumerate(visible) if n in stand_in and '"""' in stand_in[n]), 2)
    shown = tuple((n, text, False) for n, text in visible[: head + 1]) + ((None, None, False),)
    return Listing(title or name, shown, full)


def lesson_lines(obj, needles: Sequence[str]) -> Listing:
    """Only the lines of ``obj``'s source that contain one of ``needles``, each with its
    file line number (no context, no fold). ValueError naming a needle no line contains."""
    return kernel_listing(obj, needles, context=0, title=f"lesson lines of {_lines(obj)[1]}")

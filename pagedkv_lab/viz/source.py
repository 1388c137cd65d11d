"""A fault's wrong line, shown from the code itself: a diff of the correct and the faulty part.

The sources come from :func:`inspect.getsource` on the registry's own parts
(``Fault.correct(role)`` and ``Fault.part(role)``; for a ``@triton.jit`` kernel, its
``.fn``), so a page that shows a diff cannot drift from the code it is about. The HTML is
self-contained (inline styles, no script, no network), so it reads the same in JupyterLab
and in an offline HTML export.
"""

from __future__ import annotations

import difflib
import html
import inspect
from dataclasses import dataclass

__all__ = ["SourceDiff", "source_diff", "fault_diff", "marked_source", "show_fault"]

# How the faulty copies mark their wrong lines.
MARKERS = ("# the fault", "# the wrong line")

# Background of removed / added lines; dark enough text to read on both, light or dark theme.
_STYLE = {
    "-": "background:#fde0dc;color:#111",
    "+": "background:#d9f2dd;color:#111",
    " ": "color:inherit",
    "@": "color:#56B4E9",
}


def _source(obj) -> str:
    """``obj``'s source text (a jit kernel's Python function, else ``obj`` itself)."""
    return inspect.getsource(getattr(obj, "fn", obj))


def _name(obj) -> str:
    return getattr(getattr(obj, "fn", obj), "__name__", "")


@dataclass(frozen=True, repr=False)
class SourceDiff:
    """A unified diff of two sources, rendered as HTML in a notebook.

    ``lines``: the diff's lines (``"-..."`` removed from the correct source, ``"+..."``
    added by the faulty one, ``" ..."`` context, ``"@@ ..."`` hunk headers), no file
    headers. ``removed`` / ``added``: just the changed lines, without their sign.
    """

    title: str
    lines: tuple[str, ...]

    @property
    def removed(self) -> list[str]:
        return [line[1:] for line in self.lines if line.startswith("-")]

    @property
    def added(self) -> list[str]:
        return [line[1:] for line in self.lines if line.startswith("+")]

    def _repr_html_(self) -> str:
        rows = []
        for line in self.lines:
            style = _STYLE.get(line[:1], _STYLE[" "])
            rows.append(f'<div style="{style};white-space:pre">{html.escape(line) or " "}</div>')
        title = f'<div style="font-weight:bold;margin-bottom:2px">{html.escape(self.title)}</div>'
        body = "".join(rows)
        box = "font-family:monospace;font-size:12px;border:1px solid #999;padding:4px;overflow-x:auto"
        return f'<div>{title}<div style="{box}">{body}</div></div>'

    def __str__(self) -> str:
        return "\n".join([self.title, *self.lines])

    __repr__ = __str__  # the text/plain of a notebook output: the diff itself


def source_diff(correct, faulty, context: int = 3, title: str = "") -> SourceDiff:
    """The unified diff (``context`` lines around each change) from ``correct``'s source to
    ``faulty``'s. The faulty part's name is renamed to the correct one's before diffing, so
    the ``def`` line differs only if the signature does. ValueError if ``context`` < 0."""
    if context < 0:
        raise ValueError(f"context={context} must be >= 0")
    if inspect.isclass(correct) and inspect.isclass(faulty) and issubclass(faulty, correct):
        return _override_diff(correct, faulty, context, title)
    before = _source(correct)
    after = _source(faulty)
    if _name(faulty) and _name(correct):
        after = after.replace(f"def {_name(faulty)}(", f"def {_name(correct)}(", 1)
        after = after.replace(f"class {_name(faulty)}(", f"class {_name(correct)}(", 1)
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), n=context, lineterm="")
    lines = tuple(line for line in diff if not line.startswith(("---", "+++")))
    title = title or f"{_name(correct)}  ->  {_name(faulty)}"
    return SourceDiff(title, lines)


def fault_diff(fault, role: str, context: int = 3) -> SourceDiff:
    """The diff of ``fault``'s ``role`` part against the correct part it replaces
    (:class:`pagedkv_lab.faults.Fault`). ValueError if the fault has no such part or
    no correct part for it (a wrapper, or a fault built by its scenario: show
    ``fault.part(role)`` or ``fault.where`` instead)."""
    if role not in fault.parts or role not in fault.replaces:
        raise ValueError(
            f"role={role!r}: fault {fault.name!r} has parts {sorted(fault.parts)} replacing {sorted(fault.replaces)}"
        )
    title = f"{fault.name} ({role}): {fault.wrong}"
    return source_diff(fault.correct(role), fault.part(role), context=context, title=title)


def _override_diff(base, sub, context: int, title: str) -> SourceDiff:
    """A subclass against its base: each method the subclass overrides, diffed with the
    base's (the rest of the base is unchanged, so it is not shown)."""
    lines: list[str] = []
    for name, member in vars(sub).items():
        if inspect.isfunction(member) and inspect.isfunction(getattr(base, name, None)):
            before = inspect.getsource(getattr(base, name)).splitlines()
            diff = difflib.unified_diff(before, inspect.getsource(member).splitlines(), n=context, lineterm="")
            lines += [line for line in diff if not line.startswith(("---", "+++"))]
    return SourceDiff(title or f"{base.__name__}  ->  {sub.__name__}", tuple(lines))


def marked_source(obj, title: str = "") -> SourceDiff:
    """``obj``'s whole source with its marked lines (a comment from :data:`MARKERS`)
    highlighted as ``+`` lines: for a fault with no correct part to diff against (a
    wrapper, or the scenario function that builds the faulty input)."""
    lines = tuple(("+" if any(m in line for m in MARKERS) else " ") + line for line in _source(obj).splitlines())
    return SourceDiff(title or _name(obj), lines)


def show_fault(fault) -> list[SourceDiff]:
    """What notebook 08 shows for ``fault``: for each of its parts, the diff against the
    part it replaces (:func:`fault_diff`) or, for a wrapper, its marked source; for a fault
    with no parts, the source of the scenario function named in ``fault.where``."""
    from pagedkv_lab.faults import load

    if not fault.parts:
        path = fault.where.split(" ")[0]
        module, _, attr = path.rpartition(".")
        return [marked_source(load(f"{module}:{attr}"), title=f"{fault.name}: {fault.where}")]
    shown = []
    for role in fault.parts:
        if role in fault.replaces:
            shown.append(fault_diff(fault, role))
        else:
            shown.append(marked_source(fault.part(role), title=f"{fault.name} ({role}): {fault.wrong}"))
    return shown

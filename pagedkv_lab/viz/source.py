"""A fault's wrong line, shown from the code itself: a diff of the correct and the faulty part.

The sources come from :func:`inspect.getsource` on the registry's own parts
(``Fault.correct(role)`` and ``Fault.part(role)``; for a ``@triton.jit`` kernel, its
``.fn``), so a page that shows a diff cannot drift from the code it is about. The HTML is
self-contained (inline styles, no script, no network), so it reads the same in JupyterLab
and in an offline HTML export.
"""

from __future__ import annotations

import ast
import difflib
import html
import inspect
import re
import textwrap
from dataclasses import dataclass

__all__ = ["SourceDiff", "source_diff", "fault_diff", "marked_source", "fault_branch", "show_fault"]

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
        elif not name.startswith("__") and name in vars(base) and vars(base)[name] is not member:
            lines += [f"-{_attribute_line(base, name)}", f"+{_attribute_line(sub, name)}"]  # a class attribute
    return SourceDiff(title or f"{base.__name__}  ->  {sub.__name__}", tuple(lines))


def _attribute_line(cls, name: str) -> str:
    """The line of ``cls``'s source that assigns the class attribute ``name``."""
    pattern = re.compile(rf"^\s+{re.escape(name)}\s*(:[^=]*)?=")
    return next(line for line in inspect.getsource(cls).splitlines() if pattern.match(line))


def marked_source(obj, title: str = "", context: int | None = None) -> SourceDiff:
    """``obj``'s source with its marked lines (a comment from :data:`MARKERS`) highlighted
    as ``+`` lines: for a fault with no correct part to diff against (a wrapper). With
    ``context``, only the ``def`` line, a ``⋮`` for each gap, and the lines within
    ``context`` of a marked line. ValueError if ``context`` < 0."""
    if context is not None and context < 0:
        raise ValueError(f"context={context} must be >= 0")
    source = _source(obj).splitlines()
    marked = [i for i, line in enumerate(source) if any(m in line for m in MARKERS)]
    keep = set(range(len(source)))
    if context is not None and marked:
        keep = {0} | {j for i in marked for j in range(i - context, i + context + 1) if 0 <= j < len(source)}
    lines: list[str] = []
    for i, line in enumerate(source):
        if i not in keep:
            if lines and lines[-1] != " ⋮":
                lines.append(" ⋮")
            continue
        lines.append(("+" if i in marked else " ") + line)
    return SourceDiff(title or _name(obj), tuple(lines))


def _is_fault_test(node: ast.AST, name: str) -> bool:
    """``node`` is the test ``"name" in faults``."""
    return (
        isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Constant)
        and node.left.value == name
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.In)
    )


def fault_branch(func, name: str, context: int = 2, title: str = "") -> SourceDiff:
    """Where a scenario plants fault ``name`` itself, as a diff: ``func`` (a harness
    scenario) holds ``if "name" in faults: <wrong> else: <right>``; the ``else`` branch
    is shown as the removed (correct) lines and the ``if`` branch as the added (wrong)
    ones, at the indent of the ``if``, with ``context`` lines of ``func`` around.
    ValueError if ``func`` has no such ``if``/``else`` or ``context`` < 0."""
    if context < 0:
        raise ValueError(f"context={context} must be >= 0")
    source = textwrap.dedent(_source(func))
    lines = source.splitlines()
    found = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.If) and _is_fault_test(n.test, name)]
    if len(found) != 1 or not found[0].orelse:
        raise ValueError(f"name={name!r}: {_name(func)} has no one `if {name!r} in faults: ... else: ...`")
    node = found[0]
    indent = node.col_offset

    def branch(body, sign):
        block = lines[body[0].lineno - 1 : body[-1].end_lineno]
        return [sign + " " * indent + line.strip() for line in block]  # one statement a line

    before = lines[max(node.lineno - 1 - context, 0) : node.lineno - 1]
    after = lines[node.end_lineno : node.end_lineno + context]
    first = inspect.getsourcelines(getattr(func, "fn", func))[1]
    header = f"@@ {func.__module__}.{_name(func)}, line {first + node.lineno - 1} @@"
    shown = [header, *(" " + x for x in before), *branch(node.orelse, "-"), *branch(node.body, "+")]
    shown += [" " + x for x in after]
    return SourceDiff(title or f"{name}: {_name(func)}", tuple(shown))


def show_fault(fault, context: int = 2) -> list[SourceDiff]:
    """What notebook 08 shows for ``fault``: for each of its parts, the diff against the
    part it replaces (:func:`fault_diff`) or, for a wrapper, its marked lines
    (:func:`marked_source`); for a fault with no parts, the ``if``/``else`` of the
    scenario function named in ``fault.where`` (:func:`fault_branch`). Each with
    ``context`` lines around the changed one."""
    from pagedkv_lab.faults import load

    title = f"{fault.name}: {fault.wrong}"
    if not fault.parts:
        path = fault.where.split(" ")[0]
        module, _, attr = path.rpartition(".")
        return [fault_branch(load(f"{module}:{attr}"), fault.name, context=context, title=title)]
    shown = []
    for role in fault.parts:
        if role in fault.replaces:
            shown.append(fault_diff(fault, role, context=context))
        else:
            shown.append(
                marked_source(fault.part(role), title=f"{fault.name} ({role}): {fault.wrong}", context=context)
            )
    return shown

"""An nbgrader course directory written from the exercise sources (``exercises/``).

``python -m pagedkv_lab.exercises nbgrader OUT`` writes::

    OUT/nbgrader_config.py
    OUT/source/<stem>/<stem>.ipynb      one assignment per exercise, e.g. 02_slot_mapping

Each source notebook is the exercise notebook with nbgrader's cell metadata (schema 3):

* the set-up cell and any given code (a launcher) are read-only (``locked``);
* every learner function keeps the stub's signature, docstring and comments; its body
  becomes the reference solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``,
  which ``nbgrader generate_assignment`` replaces with ``raise NotImplementedError()``;
* the ``check(...)`` cell becomes a locked autograder test cell worth ``points``: it
  shows the checker's message and fails (0 points) unless the check passed.

The exercise sources and solutions stay the one source of truth: nothing here is
written by hand, and ``tests/test_nbgrader.py`` grades a class of generated learners.
Writing the course needs no nbgrader; grading it does (``pip install -e '.[dev]'``), and
grading runs no learner's code in nbgrader's kernel (:mod:`pagedkv_lab.grading`).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from pagedkv_lab.exercises.catalog import EXERCISES, Exercise, get
from pagedkv_lab.exercises.files import default_dir, learner_code, notebook_of, parse_percent

__all__ = ["BEGIN", "END", "NBGRADER_CONFIG", "GRADEBOOK_WARNING", "solution_cell", "course_notebook", "write_course"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"

# nbgrader 0.9's gradebook builds a submission's rows before it adds them to its
# SQLAlchemy 2 session, and adds them just after: SQLAlchemy warns of the first step.
GRADEBOOK_WARNING = r"Object of type <\w+> not in session"

NBGRADER_CONFIG = f'''\
"""nbgrader configuration of the pagedkv exercises (written by
python -m pagedkv_lab.exercises nbgrader; regenerate rather than edit).
docs/grading.md says what autograding runs, where, and with what rights."""

import warnings

c = get_config()  # noqa: F821  (nbgrader defines it)
c.CourseDirectory.course_id = "pagedkv"  # run nbgrader from this folder
# `nbgrader autograde` runs no learner's code in nbgrader's own kernel: each submission's
# cells run in a sandboxed process of their own and its check runs here, on what the
# learner's functions return (GradeInSandbox in place of nbgrader's Execute, which would
# run every cell with your rights and take the grade from the learner's own kernel).
c.Autograde.autograde_preprocessors = [
    "pagedkv_lab.grading.autograde.GradeInSandbox",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
# Seconds one learner's notebook may take in all: a kernel exercise's check runs in
# Triton's interpreter on a CPU (about a minute for the decode kernel).
c.GradeInSandbox.timeout = 600
# Feedback whose formulas render offline (MathML instead of MathJax from a CDN).
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    "pagedkv_lab.grading.feedback.MathAsMathML",
]
# release_assignment, collect, release_feedback and the learners' fetch_feedback meet in
# the exchange folder (nbgrader's default /srv/nbgrader/exchange):
# c.Exchange.root = "/srv/nbgrader/exchange"
# nbgrader 0.9's gradebook adds a submission's rows to its SQLAlchemy 2 session just after
# building them; SQLAlchemy warns of the moment between, with nothing for you to do.
warnings.filterwarnings("ignore", message={GRADEBOOK_WARNING!r}, module="nbgrader")
'''


def _docstring_end(node: ast.FunctionDef) -> int | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return None


def _body_span(node: ast.FunctionDef, lines: list[str]) -> tuple[int, int]:
    """0-based ``[start, stop)`` of the body's lines after any docstring; comment lines
    just before the first statement belong to the body."""
    end_doc = _docstring_end(node)
    if end_doc is not None:
        return end_doc, node.end_lineno
    start = node.body[0].lineno - 1
    while start > node.lineno and lines[start - 1].strip().startswith("#"):
        start -= 1
    return start, node.end_lineno


def _functions(code: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)}


def solution_cell(stub: str, solution: str) -> str:
    """The stub cell ``stub`` with the body of every function that ``solution`` (a module's
    code) writes differently replaced by the solution's body between :data:`BEGIN` and
    :data:`END`; the stub's docstring, its leading lines that the solution shares and its
    comments (hints) stay outside the region. Returns ``stub`` unchanged when no function
    differs (given code, such as a launcher)."""
    stub_lines, sol_lines = stub.splitlines(), solution.splitlines()
    answers = _functions(solution)
    # bottom-up, so the line numbers of the functions above stay valid
    for node in sorted(_functions(stub).values(), key=lambda n: n.lineno, reverse=True):
        if node.name not in answers:
            continue
        start, stop = _body_span(node, stub_lines)
        s_start, s_stop = _body_span(answers[node.name], sol_lines)
        mine, theirs = stub_lines[start:stop], sol_lines[s_start:s_stop]
        if [ln.strip() for ln in mine] == [ln.strip() for ln in theirs]:
            continue
        shared = 0
        while shared < min(len(mine), len(theirs)) and mine[shared].strip() == theirs[shared].strip():
            shared += 1
        hints = [ln for ln in mine[shared:] if ln.strip().startswith("#")]
        indent = theirs[shared][: len(theirs[shared]) - len(theirs[shared].lstrip())]
        region = [indent + BEGIN, *theirs[shared:], indent + END]
        stub_lines[start:stop] = mine[:shared] + hints + region
    return "\n".join(stub_lines)


def _meta(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution}
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def _check_cell(exercise: Exercise, source: str) -> str:
    call = source.strip()
    return (
        f"result = {call}\n"
        "display(result)  # the checker's message (and, for a kernel, a picture of the wrong rows)\n"
        f'assert result.passed, "the check of {exercise.name} did not pass: its message is above"'
    )


def course_notebook(exercise: Exercise, folder: Path | None = None, points: int = 1) -> dict:
    """The nbgrader source notebook (an nbformat-4 dict) of ``exercise``, from
    ``<folder>/src/<stem>.py`` and ``<folder>/solutions/<stem>.py``. Raises ValueError if
    the source has no ``check(...)`` cell or no cell the solution answers."""
    folder = folder or default_dir()
    solution = learner_code((folder / "solutions" / f"{exercise.stem}.py").read_text())  # as the stubs read
    cells, answered, checked = [], 0, False
    for i, (kind, text) in enumerate(parse_percent((folder / "src" / f"{exercise.stem}.py").read_text())):
        meta: dict = {}
        if kind == "code" and text.lstrip().startswith("check("):
            text, checked = _check_cell(exercise, text), True
            meta = _meta(f"check_{exercise.name}", grade=True, locked=True, points=points)
        elif kind == "code":
            answer = solution_cell(text, solution)
            if answer != text:
                answered += 1
                text, meta = answer, _meta(f"{exercise.name}_answer_{answered}", solution=True)
            else:
                meta = _meta(f"{exercise.name}_given_{i:02d}", locked=True)
        cell = {"cell_type": kind, "id": f"cell-{i:02d}", "metadata": meta, "source": text.splitlines(keepends=True)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    if not checked or not answered:
        raise ValueError(f"exercise {exercise.stem}: its source needs a check(...) cell and a stub to answer")
    return notebook_of(cells)


def write_course(out: Path, names: list[str] | None = None, folder: Path | None = None, points: int = 1) -> list[Path]:
    """Write the course directory ``out`` (see the module docstring) for the named
    exercises (all by default); returns the notebooks written. Raises ValueError, before
    writing anything, for an unknown exercise or a ``points`` below 1."""
    if points < 1:
        raise ValueError(f"points={points}: each check must be worth at least 1 point")
    exercises = [get(n) for n in names] if names else list(EXERCISES.values())
    notebooks = {e.stem: course_notebook(e, folder, points) for e in exercises}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG)
    written = []
    for stem, nb in notebooks.items():
        path = out / "source" / stem / f"{stem}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(path)
    return written

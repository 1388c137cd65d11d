"""The exercise folder: sources, notebooks, stubs and solutions.

Layout of ``exercises/`` (at the repository root):

* ``src/NN_name.py``: the exercise in jupytext's percent format (``# %%`` code cells,
  ``# %% [markdown]`` cells of ``# ``-prefixed lines), reviewed and edited;
* ``NN_name.ipynb``: the notebook a learner opens, built from the source without outputs
  (``python -m pagedkv_lab.exercises build``), so scrolling shows no answer;
* ``solutions/NN_name.py``: a plain module defining the exercise's functions.

A stub is every code cell of the notebook except the one that calls ``check(``; running
them defines the learner's functions. Code is run from a real file, because
``@triton.jit`` reads its function's source with :mod:`inspect`.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import tempfile
from pathlib import Path

from pagedkv_lab.exercises.catalog import Exercise

__all__ = [
    "default_dir",
    "learner_code",
    "parse_percent",
    "build_notebook",
    "notebook_cells",
    "stub_code",
    "load_stub",
    "load_solution",
]


def default_dir() -> Path:
    """``exercises/`` next to the ``pagedkv_lib`` package (a source checkout)."""
    return Path(__file__).resolve().parents[2] / "exercises"


def learner_code(code: str) -> str:
    """``code`` without formatter and linter pragmas (``# fmt: skip`` kept the sources'
    compact signatures through ``ruff format``; a learner has no use for them), by
    :func:`pagedkv_lab.viz.listing.strip_tooling`'s rule; a line holding nothing else
    (``# fmt: off``) is dropped."""
    from pagedkv_lab.viz.listing import strip_tooling  # drawing code: only the builders need it

    return "\n".join(kept for line in code.splitlines() if (kept := strip_tooling(line)) is not None)


def parse_percent(text: str) -> list[tuple[str, str]]:
    """``[(cell_type, source), ...]`` of a percent-format source; code cells as a learner
    sees them (:func:`learner_code`)."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"text before the first '# %%' marker: {line!r}")
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        source = "\n".join(lines).strip("\n")
        source = learner_code(source) if kind == "code" else source
        if source:
            out.append((kind, source))
    return out


def build_notebook(source: Path) -> dict:
    """An unexecuted nbformat-4 notebook (a dict) from a percent-format exercise source."""
    cells = []
    for i, (kind, text) in enumerate(parse_percent(source.read_text())):
        cell = {"cell_type": kind, "id": f"cell-{i:02d}", "metadata": {}, "source": text.splitlines(keepends=True)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    return notebook_of(cells)


def notebook_of(cells: list[dict]) -> dict:
    """An nbformat-4 notebook (a dict) of ``cells``, with a plain Python 3 kernelspec."""
    return {
        "cells": cells,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def notebook_cells(path: Path) -> list[tuple[str, str]]:
    """``[(cell_type, source), ...]`` of a committed ``.ipynb``."""
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def stub_code(path: Path) -> str:
    """The code a learner's notebook runs before its ``check(...)`` cell, as one module."""
    cells = [src for kind, src in notebook_cells(path) if kind == "code" and not src.lstrip().startswith("check(")]
    return "\n\n".join(cells) + "\n"


def _run_file(code: str, name: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-exercise-"))
    path = folder / f"{name}.py"
    path.write_text(code)
    with contextlib.redirect_stdout(io.StringIO()):  # the set-up cell prints the backend line
        return runpy.run_path(str(path), run_name=name)


def load_stub(exercise: Exercise, folder: Path | None = None) -> dict:
    """Run the stub cells of the exercise's notebook; return their namespace."""
    folder = folder or default_dir()
    return _run_file(stub_code(folder / f"{exercise.stem}.ipynb"), f"stub_{exercise.stem}")


def load_solution(exercise: Exercise, folder: Path | None = None, replace=None) -> dict:
    """Run ``solutions/<stem>.py`` and return its namespace. ``replace=(old, new)``, or a
    list of such pairs, plants a bug first (each text ``old`` must occur): the checker's
    own tests use it."""
    folder = folder or default_dir()
    code = (folder / "solutions" / f"{exercise.stem}.py").read_text()
    for old, new in [replace] if isinstance(replace, tuple) else replace or []:
        if old not in code:
            raise ValueError(f"{old!r} does not occur in the solution of {exercise.name}")
        code = code.replace(old, new)
    return _run_file(code, f"solution_{exercise.stem}")

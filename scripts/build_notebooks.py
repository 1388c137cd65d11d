"""Build the notebooks from their percent-format sources, and execute them.

The sources ``notebooks/src/NN_name.py`` are plain Python in jupytext's "percent"
format (``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell whose lines
start with ``# ``); they are what people review and edit. The committed
``notebooks/NN_name.ipynb`` are built from them and executed, so that nbval has
stored outputs to compare (tests/test_notebooks.py checks the two agree).

    python scripts/build_notebooks.py refresh [NAME ...]   # rebuild + execute in place
    python scripts/build_notebooks.py run [--out build]    # execute copies + HTML into build/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
CELL_TIMEOUT_S = 600


def parse_percent(text: str) -> list[tuple[str, str]]:
    """Split a percent-format source into ``[(cell_type, source), ...]``."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if "[markdown]" in line else "code"
            cells.append((kind, []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"text before the first '# %%' marker: {line!r}")
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        source = "\n".join(lines).strip("\n")
        if source:
            out.append((kind, source))
    return out


def build(source: Path) -> nbformat.NotebookNode:
    """A fresh, unexecuted notebook from one percent-format source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, text in parse_percent(source.read_text()):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        nb.cells.append(make(text))
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids keep diffs small
    return nb


def execute(nb: nbformat.NotebookNode, cwd: Path) -> float:
    """Run every cell in a fresh kernel of this Python; return the wall time in seconds."""
    from nbclient import NotebookClient

    start = time.perf_counter()
    resources = {"metadata": {"path": str(cwd)}}
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources=resources).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # per-run timestamps would churn every diff
    return time.perf_counter() - start


def _selected(names: list[str]) -> list[Path]:
    sources = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if names:
        sources = [s for s in sources if any(n in s.stem for n in names)]
        if not sources:
            sys.exit(f"no notebook source matches {names}")
    return sources


def refresh(names: list[str]) -> None:
    """Rebuild the named notebooks (all by default) and store their executed outputs."""
    for src in _selected(names):
        nb = build(src)
        seconds = execute(nb, NOTEBOOKS)
        nbformat.write(nb, NOTEBOOKS / f"{src.stem}.ipynb")
        print(f"{src.stem}: executed in {seconds:.1f} s")


def run(out: Path) -> None:
    """The main job: execute every notebook into ``out`` as .ipynb and .html."""
    from nbconvert import HTMLExporter

    out.mkdir(parents=True, exist_ok=True)
    for src in _selected([]):
        nb = nbformat.read(NOTEBOOKS / f"{src.stem}.ipynb", as_version=4)
        seconds = execute(nb, NOTEBOOKS)
        nbformat.write(nb, out / f"{src.stem}.ipynb")
        html, _ = HTMLExporter().from_notebook_node(nb)
        (out / f"{src.stem}.html").write_text(html)
        print(f"{src.stem}: executed in {seconds:.1f} s -> {out / src.stem}.{{ipynb,html}}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_refresh = sub.add_parser("refresh", help="rebuild notebooks from notebooks/src and execute them in place")
    p_refresh.add_argument("names", nargs="*", help="substrings of notebook names (default: all)")
    p_run = sub.add_parser("run", help="execute every notebook into --out, with HTML")
    p_run.add_argument("--out", type=Path, default=ROOT / "build")
    args = parser.parse_args()
    if args.command == "refresh":
        refresh(args.names)
    else:
        run(args.out)


if __name__ == "__main__":
    main()

"""The browser test fails broken notebooks: it is run, in a child pytest, over a folder of
four copies of notebook 01, each broken in one way the test promises to catch:

* ``01_cell_error``: a cell raises, so Restart Kernel and Run All leaves an error;
* ``02_rewritten_on_save``: the file is indented as JupyterLab never writes it, so
  opening and saving changes its bytes;
* ``03_frozen_widget``: the explorer is replaced by one whose drawing ignores its
  controls, so moving a slider redraws nothing;
* ``04_stderr``: without its widget (so the browser checks an executed copy instead of
  running it: here one the test makes itself, there being no nbval run), a cell writes a
  warning to stderr.

Each must fail with its own message, and only that one. Needs what the browser test
needs (Chromium and Playwright); skipped or failed the same way when they are missing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
from test_browser import _gate

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "notebooks" / "01_memory_formula.ipynb"

FROZEN_EXPLORER = """\
import ipywidgets
from IPython.display import display

from pagedkv_lab import widgets


def frozen_explorer():
    def draw(layers):
        print("the same picture, whatever the slider says")

    display(ipywidgets.interactive(draw, layers=ipywidgets.IntSlider(4, 1, 8)))


widgets.memory_explorer = frozen_explorer"""


def _code_cell(source: str, cell_id: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.id = cell_id
    return cell


def _mutants(folder: Path) -> dict[str, str]:
    """Write the broken notebooks into ``folder``; return each name's expected failure."""
    base = nbformat.read(BASE, as_version=4)
    first_code = next(i for i, c in enumerate(base.cells) if c.cell_type == "code")
    explorer = next(i for i, c in enumerate(base.cells) if "widgets.memory_explorer()" in c.source)

    error = copy.deepcopy(base)
    error.cells.insert(first_code + 1, _code_cell('raise RuntimeError("a planted error")', "planted-error"))
    nbformat.write(error, folder / "01_cell_error.ipynb")

    (folder / "02_rewritten_on_save.ipynb").write_text(json.dumps(base, indent=2) + "\n")

    frozen = copy.deepcopy(base)
    frozen.cells.insert(explorer, _code_cell(FROZEN_EXPLORER, "planted-frozen-widget"))
    nbformat.write(frozen, folder / "03_frozen_widget.ipynb")

    noisy = copy.deepcopy(base)
    noisy.cells = [c for i, c in enumerate(noisy.cells) if i != explorer]
    noisy.cells.insert(first_code + 1, _code_cell('import sys\nprint("a planted warning", file=sys.stderr)', "planted"))
    nbformat.write(noisy, folder / "04_stderr.ipynb")
    return {
        "01_cell_error": "Restart Kernel and Run All left errors",
        "02_rewritten_on_save": "opening and saving in JupyterLab rewrote",
        "03_frozen_widget": "did not redraw",
        "04_stderr": "printed to stderr",
    }


def test_the_browser_test_fails_each_broken_notebook_with_its_reason(tmp_path):
    _gate()
    folder = tmp_path / "notebooks"
    folder.mkdir()
    (folder / "jupytext.toml").write_text((ROOT / "notebooks" / "jupytext.toml").read_text())
    expected = _mutants(folder)
    env = dict(
        os.environ,
        PAGEDKV_BROWSER="required",
        PAGEDKV_BROWSER_NOTEBOOKS=str(folder),
        PAGEDKV_BROWSER_SHOTS=str(tmp_path / "shots"),
        PAGEDKV_EXECUTED_DIR=str(tmp_path / "no-executed-copies"),
        PAGEDKV_BROWSER_REDRAW_S="5",
        COLUMNS="1000",  # the short summary keeps each failure's whole first line
    )
    browser_test = str(ROOT / "tests" / "test_browser.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", browser_test, "-q", "-rf", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"the browser test should fail (exit 1), got {run.returncode}:\n{out[-3000:]}"
    for name, reason in expected.items():
        lines = [line for line in out.splitlines() if line.startswith("FAILED") and f"[{name}]" in line]
        assert lines, f"{name} was not reported as failed:\n{out[-3000:]}"
        assert reason in lines[0], f"{name} failed, but not because {reason!r}: {lines[0]}"
    assert f"{len(expected)} failed" in out, f"expected exactly {len(expected)} failures:\n{out[-3000:]}"

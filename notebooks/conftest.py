"""nbval settings for the notebooks in this folder, and the executed copies it leaves.

nbval runs every notebook once and compares each cell's fresh outputs with the stored
ones. The fresh outputs are kept: when a notebook's last cell has run, its executed copy
goes to ``build/executed/NN_name.ipynb`` (or ``$PAGEDKV_EXECUTED_DIR``), which the browser
test (``tests/test_browser.py``) opens in JupyterLab to check what a learner would see
(rendering, images, no error, no stderr), so no notebook is executed twice.
"""

import os
from pathlib import Path

import nbformat

import pagedkv_lib  # noqa: F401  (chooses the Triton backend before anything imports triton)

EXECUTED = Path(os.environ.get("PAGEDKV_EXECUTED_DIR") or Path(__file__).resolve().parents[1] / "build" / "executed")


def pytest_collectstart(collector):
    # Widget views hold model ids that change on every run; nbval already skips
    # application/vnd.jupyter.widget-view+json, and HTML mirrors of plots vary too.
    if hasattr(collector, "skip_compare"):
        collector.skip_compare += ("text/html", "application/vnd.jupyter.widget-state+json")


def pytest_runtest_teardown(item, nextitem):
    """After an nbval cell ran: store its fresh outputs in the notebook nbval read, and
    write the executed copy once the notebook's last cell is done (a notebook whose
    cells did not all run, e.g. under ``-k`` or ``-x``, is written as far as it got; a
    cell that did not run keeps its stored outputs)."""
    notebook = getattr(item.parent, "nb", None)
    if notebook is None or not hasattr(item, "cell_num"):
        return
    outputs = getattr(item, "test_outputs", None)
    if outputs is not None:
        item.cell.outputs = outputs
        item.cell.execution_count = item.cell_num + 1
    if nextitem is None or nextitem.parent is not item.parent:
        EXECUTED.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, EXECUTED / Path(str(item.parent.fspath)).name)

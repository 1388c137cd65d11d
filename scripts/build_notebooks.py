"""Build the notebooks from their percent-format sources, execute them, export HTML.

The sources ``notebooks/src/NN_name.py`` are jupytext "percent" scripts (``# %%``
starts a code cell, ``# %% [markdown]`` a markdown cell, ``# %% tags=[...]`` a code
cell with tags); they are what people review and edit. ``notebooks/jupytext.toml``
pairs each with ``notebooks/NN_name.ipynb``, so JupyterLab (with jupytext, in the dev
extra) opens either as the same notebook. The committed ``.ipynb`` are built from the
sources by jupytext and stored executed, so that nbval has outputs to compare and
readers see results without running anything (tests/test_notebooks.py checks the two
agree).

    python scripts/build_notebooks.py refresh [NAME ...]   # rebuild + execute in place
    python scripts/build_notebooks.py run [--out build]    # execute copies + offline HTML into build/
    python scripts/build_notebooks.py rerun [NAME ...]     # run every cell twice in one kernel

What ``refresh`` writes is exactly what JupyterLab 4 would save for the same notebook
(kernelspec, language_info, cell ids ``cell-00``.., tags only), so opening a notebook
and letting it autosave changes no byte (tests/test_browser.py checks it in Chromium).
Widget state is stored, so widgets show their last view before any kernel runs.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import html
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat

from pagedkv_lab.offline_math import markdown_with_mathml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
TEMPLATES = Path(__file__).resolve().parent / "templates"
# A cell that runs longer than this fails the build with its notebook and cell named.
# The slowest cell measured (notebook 08's full harness in the interpreter) takes ~5 s.
CELL_TIMEOUT_S = 180
# What JupyterLab 4 writes for the ipykernel "python3" kernel; anything else is rewritten
# (and autosaved) the moment a learner opens the notebook.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class NotebookFailed(RuntimeError):
    """A notebook cell raised or timed out; the message names the notebook and the cell."""


# --------------------------------------------------------------------------- building


def build(source: Path) -> nbformat.NotebookNode:
    """A fresh, unexecuted notebook from one percent-format source, as JupyterLab saves it."""
    import jupytext

    nb = jupytext.read(source, fmt="py:percent")
    nb.metadata = nbformat.NotebookNode(
        jupytext=_jupytext_filters(), kernelspec=dict(KERNELSPEC), language_info={"name": "python"}
    )
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids keep diffs small
        # Cell metadata exactly as jupytext reads it: tags, plus its own round-trip notes
        # (``lines_to_next_cell``), which it writes back into the .ipynb on every save.
    nbformat.validate(nb)
    return nb


def _jupytext_filters() -> dict:
    """The metadata filters of notebooks/jupytext.toml, which jupytext's contents manager
    copies into a paired notebook's metadata whenever JupyterLab saves it."""
    import tomllib

    config = tomllib.loads((NOTEBOOKS / "jupytext.toml").read_text())
    return {k: config[k] for k in ("cell_metadata_filter", "notebook_metadata_filter") if k in config}


def source_cells(source: Path) -> list[tuple[str, str, dict]]:
    """``[(cell_type, source, metadata), ...]`` of a percent-format source, as jupytext reads it."""
    return [(c["cell_type"], c["source"], dict(c["metadata"])) for c in build(source).cells]


# --------------------------------------------------------------------------- executing


def _kernel_config():
    """Kernel manager settings: encrypted transport where ipykernel and pyzmq support it
    (ipykernel 7 otherwise logs a 'running over TCP without encryption' warning per kernel)."""
    import zmq
    from traitlets.config import Config

    config = Config()
    if zmq.has("curve"):
        config.KernelManager.transport_encryption = "auto"
    return config


def _client(nb: nbformat.NotebookNode, cwd: Path):
    from nbclient import NotebookClient

    return NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        store_widget_state=True,
        record_timing=False,  # per-run timestamps would churn every diff
        config=_kernel_config(),
    )


def _cell_name(nb: nbformat.NotebookNode, index: int) -> str:
    cell = nb.cells[index]
    first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
    return f"cell {index} ({cell.get('id', '?')}: {first[:60]!r})"


def _failure(name: str, nb: nbformat.NotebookNode, index: int, err: Exception) -> NotebookFailed:
    from nbclient.exceptions import CellTimeoutError

    if isinstance(err, CellTimeoutError):
        return NotebookFailed(f"{name}: {_cell_name(nb, index)} ran longer than {CELL_TIMEOUT_S} s")
    detail = str(err).strip().splitlines()
    return NotebookFailed(f"{name}: {_cell_name(nb, index)} failed: {detail[-1] if detail else type(err).__name__}")


def execute(nb: nbformat.NotebookNode, cwd: Path, name: str = "notebook", passes: int = 1) -> float:
    """Run every cell in a fresh kernel of this Python, ``passes`` times in the same kernel;
    return the wall time in seconds. Raises :class:`NotebookFailed` naming the cell."""
    client = _client(nb, cwd)
    start = time.perf_counter()
    with client.setup_kernel():
        info = client.wait_for_reply(client.kc.kernel_info())
        nb.metadata["language_info"] = info["content"]["language_info"]  # what JupyterLab writes too
        for _ in range(passes):
            for index, cell in enumerate(nb.cells):
                try:
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                except Exception as err:
                    raise _failure(name, nb, index, err) from None
        client.set_widgets_metadata()
    _stabilise_widget_ids(nb, name)
    return time.perf_counter() - start


def _stabilise_widget_ids(nb: nbformat.NotebookNode, name: str) -> None:
    """Replace the random widget model ids of a run by ids derived from the notebook's
    name and the order the models were created in, so re-executing changes no id."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    if not state:
        return
    mapping = {old: hashlib.sha1(f"{name}/{i}".encode()).hexdigest()[:32] for i, old in enumerate(state)}
    text = json.dumps({"cells": nb.cells, "widgets": nb.metadata["widgets"]})
    text = re.sub("|".join(map(re.escape, mapping)), lambda m: mapping[m.group(0)], text)
    fixed = json.loads(text)
    nb.cells = [nbformat.from_dict(c) for c in fixed["cells"]]
    nb.metadata["widgets"] = nbformat.from_dict(fixed["widgets"])


def write(nb: nbformat.NotebookNode, path: Path, source: Path | None = None) -> None:
    """Write ``nb`` as JupyterLab's server saves it (nbformat, 1-space indent)."""
    nbformat.validate(nb)
    nbformat.write(nb, path)
    if source is not None:
        # jupytext takes the inputs of a paired notebook from the newer file; keep the
        # source at least as new as the notebook built from it.
        now = time.time()
        os.utime(source, (now, now))


# --------------------------------------------------------------------------- offline HTML


def _widget_snapshot(model_id: str, state: dict) -> str:
    """Static HTML for one stored widget view: its controls, disabled, at their last
    values, and the last output it drew. Needs no script and no network."""
    parts: list[str] = []

    def control(mid: str) -> None:
        model = state.get(mid, {})
        kind, s = model.get("model_name", ""), model.get("state", {})
        label = html.escape(s.get("description", ""))
        if kind.endswith("SliderModel"):
            parts.append(
                f'<label class="pk-control">{label} <input type="range" disabled min="{s.get("min", 0)}" '
                f'max="{s.get("max", 100)}" step="{s.get("step", 1)}" value="{s.get("value", 0)}"> '
                f"<output>{html.escape(str(s.get('value', '')))}</output></label>"
            )
        elif kind == "DropdownModel":
            labels, index = s.get("_options_labels", []), s.get("index")
            selected = [" selected" if i == index else "" for i in range(len(labels))]
            options = "".join(f"<option{sel}>{html.escape(str(o))}</option>" for sel, o in zip(selected, labels))
            parts.append(f'<label class="pk-control">{label} <select disabled>{options}</select></label>')
        elif kind == "OutputModel":
            parts.append('<div class="pk-output">')
            for out in s.get("outputs", []):
                data = out.get("data", {})
                if "image/png" in data:
                    parts.append(f'<img alt="widget output" src="data:image/png;base64,{data["image/png"].strip()}">')
                elif out.get("output_type") == "stream" or "text/plain" in data:
                    text = out.get("text") or data.get("text/plain", "")
                    parts.append(f"<pre>{html.escape(''.join(text))}</pre>")
            parts.append("</div>")
        for child in s.get("children", []):
            control(child.removeprefix("IPY_MODEL_"))

    control(model_id)
    note = "widget snapshot: open the notebook in JupyterLab and run it to move the controls"
    return f'<div class="pk-widget"><p class="pk-note">{note}</p>{"".join(parts)}</div>'


_LINK = re.compile(r"\]\((\d\d[a-z]?_\w+)\.ipynb\)")


def offline_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` whose HTML needs no script: formulas as MathML (rendered by the
    browser itself), widget views as static snapshots of their stored state."""
    nb = copy.deepcopy(nb)
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = markdown_with_mathml(cell.source)
            cell.source = _LINK.sub(r"](\1.html)", cell.source)  # links between notebooks, to their HTML
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view and view.get("model_id") in state:
                out["data"] = {"text/html": _widget_snapshot(view["model_id"], state)}
    nb.metadata.pop("widgets", None)
    return nb


def export_html(nb: nbformat.NotebookNode) -> str:
    """Self-contained HTML of an executed notebook that renders offline: no CDN scripts
    (require.js, MathJax, the widget manager), images embedded, math as MathML."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", extra_template_paths=[str(TEMPLATES)])
    exporter.template_file = "offline.html.j2"
    body, _ = exporter.from_notebook_node(offline_notebook(nb))
    return body


# --------------------------------------------------------------------------- commands


def _selected(names: list[str]) -> list[Path]:
    sources = sorted(SOURCES.glob("[0-9][0-9]*_*.py"))
    if names:
        sources = [s for s in sources if any(n in s.stem for n in names)]
        if not sources:
            sys.exit(f"no notebook source matches {names}")
    return sources


def refresh(names: list[str]) -> None:
    """Rebuild the named notebooks (all by default) and store their executed outputs."""
    for src in _selected(names):
        nb = build(src)
        seconds = execute(nb, NOTEBOOKS, src.stem)
        write(nb, NOTEBOOKS / f"{src.stem}.ipynb", src)
        print(f"{src.stem}: executed in {seconds:.1f} s")


def run(out: Path) -> None:
    """The main job: execute every notebook into ``out`` as .ipynb and offline .html."""
    out.mkdir(parents=True, exist_ok=True)
    for src in _selected([]):
        nb = nbformat.read(NOTEBOOKS / f"{src.stem}.ipynb", as_version=4)
        seconds = execute(nb, NOTEBOOKS, src.stem)
        write(nb, out / f"{src.stem}.ipynb")
        (out / f"{src.stem}.html").write_text(export_html(nb))
        print(f"{src.stem}: executed in {seconds:.1f} s -> {out / src.stem}.{{ipynb,html}}")


def rerun(names: list[str]) -> None:
    """Execute every cell of each notebook twice in one kernel: each cell must be re-runnable."""
    for src in _selected(names):
        nb = nbformat.read(NOTEBOOKS / f"{src.stem}.ipynb", as_version=4)
        seconds = execute(nb, NOTEBOOKS, src.stem, passes=2)
        print(f"{src.stem}: ran twice in one kernel in {seconds:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_refresh = sub.add_parser("refresh", help="rebuild notebooks from notebooks/src and execute them in place")
    p_refresh.add_argument("names", nargs="*", help="substrings of notebook names (default: all)")
    p_run = sub.add_parser("run", help="execute every notebook into --out, with offline HTML")
    p_run.add_argument("--out", type=Path, default=ROOT / "build")
    p_rerun = sub.add_parser("rerun", help="execute each notebook twice in one kernel")
    p_rerun.add_argument("names", nargs="*", help="substrings of notebook names (default: all)")
    args = parser.parse_args()
    try:
        if args.command == "refresh":
            refresh(args.names)
        elif args.command == "rerun":
            rerun(args.names)
        else:
            run(args.out)
    except NotebookFailed as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()

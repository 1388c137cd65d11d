"""Notebook run times: measured once, written into every place that states them.

``notebooks/run_times.toml`` is the one source. Each notebook's entry holds the fastest and
slowest measured wall times of cold runs (a fresh kernel, every cell in order: what JupyterLab's "Restart
Kernel and Run All Cells" does), the minutes to read it, and for notebook 12 the extra
time of a first run that converts the model's weights. The header line ``**Time:** ...``
of every notebook source and the table in ``notebooks/README.md`` are rendered from it,
and ``tests/test_notebooks.py`` fails if either disagrees.

    python scripts/notebook_times.py measure [NAME ...]   # time cold runs, update the toml
    python scripts/notebook_times.py apply                # rewrite headers and README from it
    python scripts/notebook_times.py check                # exit 1 where they disagree

``measure`` rebuilds each notebook from its source, times two cold runs (``--runs``), stores the
executed notebook (as ``build_notebooks.py refresh`` does); run it on a quiet machine (nothing else running)
and say which machine in ``machine``. ``apply`` edits the header's markdown cell in the
source and in the stored ``.ipynb`` alike (a markdown change needs no re-execution).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_notebooks as bn  # noqa: E402

TIMES = bn.NOTEBOOKS / "run_times.toml"
README = bn.NOTEBOOKS / "README.md"
HEADER = re.compile(r"^# \*\*Time:\*\* .*$", re.M)  # in a percent-format source
README_CELL = re.compile(r"\| ([^|]*) \|\s*$")  # the last column of a table row


def rounded_seconds(seconds: float) -> int:
    """What a reader is told: whole seconds under 10, else the nearest 5 (under 60) or 10."""
    if seconds < 10:
        return max(1, round(seconds))
    step = 5 if seconds < 60 else 10
    return int(step * round(seconds / step))


def run_range(entry: dict) -> str:
    """The measured range of a notebook's cold runs, as a reader is told it: ``"10-15 s"``
    (``run_s`` is ``[fastest, slowest]``; one figure when they round alike)."""
    low, high = (rounded_seconds(s) for s in entry["run_s"])
    return f"{low} s" if low == high else f"{low}-{high} s"


def header_line(entry: dict) -> str:
    """The ``**Time:**`` line of a notebook's first cell, from its toml entry."""
    how = "Restart and Run All, 2 CPU cores"
    if "first_run_extra_s" in entry:
        how += f"; +{rounded_seconds(entry['first_run_extra_s'])} s once, converting weights"
    return f"# **Time:** {run_range(entry)} to run ({how}), {entry['read_min']} minutes to read."


def readme_cell(entry: dict) -> str:
    """The last column of a notebook's row in ``notebooks/README.md``."""
    run = run_range(entry)
    if "first_run_extra_s" in entry:
        run += f" (+{rounded_seconds(entry['first_run_extra_s'])} s the first time)"
    return f"{run} / {entry['read_min']} min"


def load() -> dict:
    """The toml: ``{"machine": str, "measured": date, "notebooks": {stem: entry}}``."""
    if not TIMES.exists():
        return {"machine": "", "measured": "", "notebooks": {}}
    return tomllib.loads(TIMES.read_text())


def _write_toml(data: dict) -> None:
    lines = [
        "# Written by `python scripts/notebook_times.py measure`; rendered into each notebook's",
        "# **Time:** line and notebooks/README.md by `apply`. run_s: the fastest and slowest",
        "# of the cold runs (fresh kernel, all cells), seconds; read_min: minutes to read;",
        "# first_run_extra_s: weight conversion.",
        f'machine = "{data["machine"]}"',
        f'measured = "{data["measured"]}"',
        "",
        "[notebooks]",
    ]
    for stem, entry in sorted(data["notebooks"].items()):
        fields = ", ".join(f"{k} = {_toml_value(v)}" for k, v in entry.items())
        lines.append(f'"{stem}" = {{ {fields} }}')
    TIMES.write_text("\n".join(lines) + "\n")


def _toml_value(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(round(v, 1) if isinstance(v, float) else v)


def measure(names: list[str], machine: str | None, runs: int = 2) -> None:
    """Time ``runs`` cold runs of each named notebook (all by default), store the first
    run's outputs and update the toml with the fastest and slowest (``run_s``)."""
    data = load()
    for src in bn._selected(names):
        nb = bn.build(src)  # what "Restart Kernel and Run All Cells" runs, stored as refresh does
        entry = data["notebooks"].setdefault(src.stem, {"read_min": _stated_read_minutes(src)})
        times = [bn.execute(nb, bn.NOTEBOOKS, src.stem)]
        bn.write(nb, bn.NOTEBOOKS / f"{src.stem}.ipynb", src)
        times += [bn.execute(bn.build(src), bn.NOTEBOOKS, src.stem) for _ in range(runs - 1)]
        entry["run_s"] = [min(times), max(times)]
        if "first_run_extra_s" in entry:
            entry["first_run_extra_s"] = _first_run_extra(src.stem, min(times))
        print(f"{src.stem}: {run_range(entry)} ({', '.join(f'{t:.1f}' for t in times)} s)")
    data["measured"] = time.strftime("%Y-%m-%d")
    if machine:
        data["machine"] = machine
    _write_toml(data)


def _stated_read_minutes(src: Path) -> int:
    """The minutes to read that a notebook's header states today (a first measurement)."""
    found = re.search(r"\*\*Time:\*\*.*?(\d+) minutes to read", src.read_text(), re.S)
    return int(found.group(1)) if found else 20


def _first_run_extra(stem: str, warm_s: float) -> float:
    """Seconds a run with an empty weight cache takes beyond ``warm_s``."""
    nb = nbformat.read(bn.NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    with tempfile.TemporaryDirectory() as empty:
        old = os.environ.get("PAGEDKV_CACHE_DIR")
        os.environ["PAGEDKV_CACHE_DIR"] = empty  # the kernel inherits it
        try:
            cold = bn.execute(nb, bn.NOTEBOOKS, stem)
        finally:
            os.environ.pop("PAGEDKV_CACHE_DIR") if old is None else os.environ.update(PAGEDKV_CACHE_DIR=old)
    return max(cold - warm_s, 0.0)


def disagreements() -> list[str]:
    """Every header or README cell that does not say what the toml says."""
    data, problems = load()["notebooks"], []
    readme = README.read_text()
    for src in bn._selected([]):
        entry = data.get(src.stem)
        if entry is None:
            problems.append(f"{src.stem}: no entry in {TIMES.name}")
            continue
        found = HEADER.findall(src.read_text())
        if found != [header_line(entry)]:
            problems.append(f"{src.stem}: header says {found}, {TIMES.name} says {header_line(entry)!r}")
        row = next((line for line in readme.splitlines() if f"({src.stem}.ipynb)" in line), "")
        cell = README_CELL.search(row)
        if cell is None or cell.group(1).strip() != readme_cell(entry):
            problems.append(f"{src.stem}: README says {cell and cell.group(1)!r}, expected {readme_cell(entry)!r}")
    return problems


def apply() -> None:
    """Rewrite each header line and each README row's time from the toml. The stored
    notebook takes its markdown cells from the rebuilt source (outputs untouched)."""
    data = load()["notebooks"]
    readme = README.read_text().splitlines()
    for src in bn._selected([]):
        entry, line = data[src.stem], header_line(data[src.stem])
        text = src.read_text()
        if HEADER.findall(text) != [line]:
            src.write_text(HEADER.sub(line, text, count=1))
            _sync_markdown(src)
        readme = [README_CELL.sub(f"| {readme_cell(entry)} |", r) if f"({src.stem}.ipynb)" in r else r for r in readme]
    README.write_text("\n".join(readme) + "\n")


def _sync_markdown(src: Path) -> None:
    """Copy the markdown cells of the notebook built from ``src`` into the stored one."""
    path = bn.NOTEBOOKS / f"{src.stem}.ipynb"
    stored, built = nbformat.read(path, as_version=4), bn.build(src)
    if [c.cell_type for c in stored.cells] != [c.cell_type for c in built.cells]:
        raise SystemExit(f"{src.stem}: cells differ from the source; run build_notebooks.py refresh first")
    for mine, fresh in zip(stored.cells, built.cells):
        if mine.cell_type == "markdown":
            mine.source = fresh.source
    bn.write(stored, path, src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_measure = sub.add_parser("measure", help="time cold runs and update the toml")
    p_measure.add_argument("names", nargs="*", help="substrings of notebook names (default: all)")
    p_measure.add_argument("--machine", help="what the machine is, for the toml")
    p_measure.add_argument("--runs", type=int, default=2, help="cold runs per notebook (default 2)")
    sub.add_parser("apply", help="rewrite headers and README from the toml")
    sub.add_parser("check", help="exit 1 where headers or README disagree with the toml")
    args = parser.parse_args()
    if args.command == "measure":
        measure(args.names, args.machine, args.runs)
    elif args.command == "apply":
        apply()
    else:
        problems = disagreements()
        print("\n".join(problems) or "headers and README agree with the toml")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

"""Every notebook's first cell, in a kernel whose Python lacks pagedkv (or torch), stops
with one sentence saying how to install it, not a bare ModuleNotFoundError."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import SOURCES, source_cells  # noqa: E402

NAMES = sorted(p.stem for p in SOURCES.glob("[0-9][0-9]_*.py"))
HINT_END = ") from None\n"


def _first_code(name: str) -> str:
    return next(src for kind, src, _ in source_cells(SOURCES / f"{name}.py") if kind == "code")


def test_every_notebook_opens_with_the_same_library_free_install_hint():
    hints = {name: _first_code(name).split(HINT_END)[0] + HINT_END for name in NAMES}
    first = hints[NAMES[0]]
    assert first.startswith("import importlib\n") and "pagedkv_lib" in first
    assert all(h == first for h in hints.values()), [n for n, h in hints.items() if h != first]


def test_without_pagedkv_the_first_cell_says_how_to_install_it():
    for hidden in ("pagedkv_lib", "torch"):  # the suite, or the torch it imports
        code = f"import sys\nsys.modules[{hidden!r}] = None\n{_first_code(NAMES[0])}"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "notebooks")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-800:]
        assert (
            run.stderr.startswith("pagedkv is not installed in this kernel's Python (") and "make setup" in run.stderr
        )

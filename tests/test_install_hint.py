"""Every notebook's first cell is the same library call behind the same guard: in a kernel
whose Python lacks pagedkv (or torch), it stops with one sentence saying how to install
it, not a bare ModuleNotFoundError; no notebook carries a set-up block of its own."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import SOURCES, source_cells  # noqa: E402

NAMES = sorted(p.stem for p in SOURCES.glob("[0-9][0-9]*_*.py"))
GUARD = """try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
"""


def _first_code(name: str) -> str:
    return next(src for kind, src, _ in source_cells(SOURCES / f"{name}.py") if kind == "code")


def test_every_notebook_opens_with_the_guard_and_one_set_up_call():
    for name in NAMES:
        first = _first_code(name)
        assert first.startswith(GUARD), f"{name}: the first cell is not the shared guard"
        call = first.removeprefix(GUARD).strip()
        assert call.count("\n") == 0 and "setup(" in call, f"{name}: after the guard, one set-up call: {call!r}"


def test_without_pagedkv_the_first_cell_says_how_to_install_it():
    for hidden in ("pagedkv_lab", "torch"):  # the suite, or the torch it imports
        code = f"import sys\nsys.modules[{hidden!r}] = None\n{_first_code(NAMES[0])}"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "notebooks")
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-800:]
        assert run.stderr.startswith("pagedkv is not installed in this kernel's Python (")
        assert "make setup" in run.stderr and "docs/setup.md" in run.stderr

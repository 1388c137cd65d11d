"""The committed notebooks are built from their sources and stored executed."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_notebooks import SOURCES, parse_percent  # noqa: E402

NAMES = sorted(p.stem for p in SOURCES.glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_a_source_and_back():
    built = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert built == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_matches_its_source_and_was_executed(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    cells = [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]
    assert cells == parse_percent((SOURCES / f"{name}.py").read_text()), f"run `make refresh NAMES={name}`"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "stored outputs are stale: re-execute"
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"], "a stored output is an error"
    assert any("image/png" in o.get("data", {}) for o in outputs), "no stored plot"
    assert "assert " in "".join(src for kind, src in cells if kind == "code"), "no assert cross-check"
    first = "".join(code[0]["source"])
    assert "runtime.backend_line()" in first, "the first code cell must print the backend line"

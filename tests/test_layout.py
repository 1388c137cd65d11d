"""The code layout's promises (CONTRIBUTING.md, "Code layout"), checked on the source:
every module named in its package's docstring, no private name imported across modules,
no kernel module over 600 lines, no Python function over 80 lines outside Triton kernels."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "pagedkv_lib", "pagedkv_engine")
MAX_KERNEL_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from .x import _y`` (or ``from pkg.x import _y``) naming another module's private name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path.relative_to(root)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def _long_functions(path: Path, limit: int, root: Path = ROOT) -> list[str]:
    """Functions longer than ``limit`` lines that are not ``@triton.jit`` device code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
            length = node.end_lineno - node.lineno + 1
            if length > limit and not jit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_kernels_docstring_names_every_module():
    doc = ast.get_docstring(ast.parse((ROOT / "kernels" / "__init__.py").read_text()))
    named = set(re.findall(r":mod:`kernels\.(\w+)`", doc))
    modules = {p.stem for p in _modules("kernels") if p.stem != "__init__"}
    assert modules - named == set(), f"kernels/__init__.py's docstring does not name {sorted(modules - named)}"
    assert named - modules == set(), f"kernels/__init__.py's docstring names missing modules {sorted(named - modules)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_name_is_imported_from_another_module(package):
    found = [hit for path in _modules(package) for hit in _private_imports(path)]
    assert found == [], f"give these shared helpers public names: {found}"


def test_no_kernel_module_is_over_600_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in _modules("kernels")}
    over = {name: n for name, n in sizes.items() if n > MAX_KERNEL_MODULE_LINES}
    assert over == {}, f"split these kernel modules by family: {over}"


@pytest.mark.parametrize("package", PACKAGES + ("benchmarks", "scripts"))
def test_no_python_function_outside_triton_kernels_is_over_80_lines(package):
    found = [hit for path in _modules(package) for hit in _long_functions(path, MAX_FUNCTION_LINES)]
    assert found == [], f"split these functions into named steps: {found}"


def test_the_checks_can_fail(tmp_path):
    """Each check above finds what it looks for in a small bad module."""
    bad = tmp_path / "bad.py"
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    bad.write_text(f"from .write import _hidden\n\n\ndef long():\n{body}\n")
    assert _private_imports(bad, tmp_path) == ["bad.py:1 _hidden"]
    assert _long_functions(bad, MAX_FUNCTION_LINES, tmp_path) == ["bad.py:4 long (81 lines)"]

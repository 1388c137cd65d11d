"""Set-up files agree with each other."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!;~\[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_runtime_dependencies_of_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_start = lines.index("  - pip:")
    pip_reqs = [ln.strip()[2:] for ln in lines[pip_start + 1 :] if ln.strip().startswith("- ")]
    conda_channels = [ln.strip() for ln in lines if ln.strip() == "- conda-forge"]
    assert conda_channels, "environment.yml must use the conda-forge channel"
    assert any(ln.strip().startswith("- python") for ln in lines[:pip_start])
    runtime = [r for r in pip_reqs if not r.startswith("-e")]
    assert sorted(map(str.strip, runtime)) == sorted(deps), "environment.yml and pyproject.toml disagree"
    assert any(r.startswith("-e .") for r in pip_reqs), "environment.yml must install the suite itself"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set "))]
    assert ci == ["make test"]
    assert "make test" in readme


def test_both_packages_import_and_lib_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, pagedkv_lib, pagedkv_lib.viz; assert 'triton' not in sys.modules; import kernels"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")

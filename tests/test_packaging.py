"""Set-up files agree with each other."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!;~\[]", requirement.strip(), maxsplit=1)[0].lower()


def _makefile_var(name: str) -> str:
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if re.match(rf"{name}\s*[:?]?=", ln))
    return line.split("=", 1)[1].strip()


def test_environment_yml_names_the_runtime_dependencies_of_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_start = lines.index("  - pip:")
    pip_reqs = [ln.strip()[2:] for ln in lines[pip_start + 1 :] if ln.strip().startswith("- ")]
    conda_channels = [ln.strip() for ln in lines if ln.strip() == "- conda-forge"]
    assert conda_channels, "environment.yml must use the conda-forge channel"
    assert any(ln.strip().startswith("- python") for ln in lines[:pip_start])
    assert "  - make" in lines[:pip_start], "the README's make commands must work inside the environment"
    runtime = [r for r in pip_reqs if not r.startswith("-")]
    assert sorted(map(_name, runtime)) == sorted(map(_name, deps)), "environment.yml and pyproject.toml disagree"
    others = sorted(r.strip() for r in runtime if _name(r) != "torch")
    assert others == sorted(d for d in deps if _name(d) != "torch"), "same pins as pyproject.toml, torch aside"
    # torch exactly as the Makefile pins it, from PyTorch's CPU index (conda-forge's own
    # builds do not follow pip's pins; a CUDA build from PyPI is several GB)
    assert [r for r in runtime if _name(r) == "torch"] == [_makefile_var("TORCH_SPEC")]
    assert f"--extra-index-url {_makefile_var('TORCH_CPU_INDEX')}" in pip_reqs
    assert pip_reqs.index(f"--extra-index-url {_makefile_var('TORCH_CPU_INDEX')}") == 0, "index options come first"
    assert any(r.startswith("-e .") for r in pip_reqs), "environment.yml must install the suite itself"


def test_makefile_uses_the_conda_environment_instead_of_building_venv():
    makefile = (ROOT / "Makefile").read_text()
    assert "ifeq ($(CONDA_DEFAULT_ENV),pagedkv)" in makefile
    name = next(ln for ln in (ROOT / "environment.yml").read_text().splitlines() if ln.startswith("name:"))
    assert name == "name: pagedkv"


def test_ci_installs_the_browser_then_runs_the_readme_test_command():
    """.ci/run: the browser test must not skip in CI, nor the grader's sandbox (CI runs as
    root: namespaces and a user of its own), chromium comes from the project's own Makefile
    (apt-get as root), and the last command is the README's test command."""
    readme = (ROOT / "README.md").read_text()
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set "))]
    required = ["export PAGEDKV_BROWSER=required", "export PAGEDKV_GRADER_SANDBOX=required"]
    assert ci == [*required, "make browser-deps", "make test"]
    commands = [ln.strip() for ln in readme.splitlines() if ln.startswith("    ")]
    assert "make test" in commands, "the README must show CI's test command, `make test`, as a command line"
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nbrowser-deps:", 1)[1].split("\n\n", 1)[0]
    assert "apt-get install -y -q chromium" in recipe, "browser-deps must install Debian's chromium"


def test_torch_is_cpu_by_default_without_an_nvidia_gpu():
    assert _makefile_var("TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    assert "nvidia-smi" in _makefile_var("HAVE_NVIDIA_GPU")
    assert _makefile_var("TORCH_SPEC") == "torch==2.13.0"


def test_the_packages_import_and_the_ground_floor_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, pagedkv_lib, pagedkv_lab.viz; assert 'triton' not in sys.modules; import pagedkv_kernels"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


# Run from the checkout's root, where a folder named kernels/ would shadow an installed
# package of that name if it were a package itself.
BOTH_KERNELS = """
import torch
import kernels, pagedkv_kernels
from pagedkv_lib import reference

# Hugging Face's: a layer marked for the hub keeps its own forward until kernelized (offline)
@kernels.use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(torch.nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

x = torch.randn(3, 8)
assert torch.equal(SiluAndMul()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
assert kernels.__file__.endswith("site-packages/kernels/__init__.py"), kernels.__file__
from transformers.utils.import_utils import is_kernels_available  # transformers finds its kernels
assert is_kernels_available()

# the suite's: a decode step against the float64 reference
torch.manual_seed(0)
cache = torch.randn(6, 2, 4, 1, 8)
q, table, lens = torch.randn(2, 2, 8), torch.tensor([[0, 3], [5, -1]]), torch.tensor([7, 2])
out = pagedkv_kernels.paged_decode_attention(q, cache, table, lens)
want = reference.paged_decode_attention(q, cache, table, lens, precision="fp64")
assert (out - want).abs().max() < 1e-5, (out - want).abs().max()
print("both kernels packages work")
"""


def test_hugging_faces_kernels_imports_beside_the_suites_kernels():
    """transformers (5.25 and later) depends on Hugging Face's ``kernels``; the suite's
    import name is ``pagedkv_kernels``, so both load in one process, even from the root
    of the checkout (where the folder ``kernels/`` sits), and both compute."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", BOTH_KERNELS], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "both kernels packages work" in run.stdout, run.stderr[-2000:]


def test_transformers_is_not_pinned_below_a_release():
    engine = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    (spec,) = [r for r in engine if _name(r) == "transformers"]
    assert "<" not in spec, f"{spec}: the suite owns its import names; no upper bound on transformers"

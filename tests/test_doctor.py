"""The pre-class check (scripts/doctor.py): on the suite's own environment every group
is ready within the 10 s it promises; a missing or out-of-range package is named with the
range pyproject.toml asks for and how to fix it."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

DOCTOR = Path(__file__).resolve().parents[1] / "scripts" / "doctor.py"


def _doctor():
    spec = importlib.util.spec_from_file_location("doctor", DOCTOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctor_finds_this_environment_ready_for_every_notebook_in_under_10_s():
    start = time.perf_counter()
    run = subprocess.run([sys.executable, str(DOCTOR)], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("READY: ") == 3 and "NOT READY" not in run.stdout and "FIX" not in run.stdout
    assert "Triton's interpreter runs a kernel correctly" in run.stdout
    assert seconds < 10, f"the pre-class check took {seconds:.1f} s"


def test_doctor_names_an_out_of_range_or_missing_package_and_the_fix(monkeypatch):
    doctor = _doctor()
    specs = doctor._requirements()
    assert specs["triton"] == ">=3.6,<3.10" and specs["torch"] == ">=2.4"  # read from pyproject.toml
    monkeypatch.setattr(doctor.metadata, "version", lambda name: "3.10.1")
    ok, line, fix = doctor.check_package("triton", specs)
    assert not ok and line == "triton 3.10.1 is installed but triton>=3.6,<3.10 is needed" and "make setup" in fix

    def missing(name):
        raise doctor.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(doctor.metadata, "version", missing)
    monkeypatch.setattr(doctor, "check_triton_interpreter", lambda: (False, "no torch", "make setup"))  # 2.7 s saved
    ok, line, fix = doctor.check_package("torch", specs)
    assert not ok and line == "torch>=2.4 is not installed"
    results = doctor.groups(specs)
    assert [all(ok for ok, _, _ in checks) for _, checks in results] == [False, False, False]


def test_doctor_says_where_the_model_cache_lacks_room(monkeypatch, tmp_path):
    doctor = _doctor()
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "not" / "yet"))
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: type("U", (), {"free": 2**29})())
    ok, line, fix = doctor.check_model_cache()
    assert not ok and line.startswith("0.5 GiB free for the model cache at") and "PAGEDKV_CACHE_DIR" in fix

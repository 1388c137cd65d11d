"""The workshop exercises: every solution passes, every stub fails with the checker's
message, planted bugs are reported with their case and a hint, and the notebooks a
learner opens are built from their sources, without outputs."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedkv_lab.exercises import EXERCISES, check
from pagedkv_lab.exercises.cli import main
from pagedkv_lab.exercises.files import build_notebook, default_dir, load_solution, notebook_cells, parse_percent
from pagedkv_lab.exercises.mistakes import MISTAKES, load_with_mistake

FOLDER = default_dir()


def test_instructor_command_every_solution_passes(capsys):
    assert main(["check", "--solutions"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count("[ok]") == len(EXERCISES) and "PASS decode_kernel" in out


def test_instructor_command_every_stub_fails_with_the_checkers_message_not_a_traceback():
    # A fresh process, as an instructor runs it; it also shows that importing the checker
    # brings in neither triton nor kernels (a learner's kernel imports triton itself).
    code = (
        "import sys, pagedkv_lab.exercises; assert not {'triton', 'pagedkv_kernels'} & set(sys.modules); "
        "from pagedkv_lab.exercises.cli import main; sys.exit(main(['check', '--stubs']))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=FOLDER.parent)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    assert out.count("[ok]") == len(EXERCISES) and "Traceback" not in out + run.stderr
    for e in EXERCISES.values():
        assert f"FAIL {e.name}, case 1 of " in out, f"the stub of {e.stem} must fail on its first case"
    assert out.count("the stub is not filled in yet") == 7  # the seven Python stubs raise NotImplementedError
    assert "your kernel wrote nothing" in out and out.count("your kernel stored nothing") == 2  # the three kernels


def test_planted_offset_bug_in_slot_mapping_is_reported_with_its_case_and_a_hint():
    space = load_solution(EXERCISES["slot_mapping"], replace=("pos % page_size", "pos // page_size"))
    result = check("slot_mapping", space["locate"], space["locate_pow2"], space["slot_mapping"])
    assert not result.passed
    message = str(result)
    assert "case 1 of 11: locate with pages of 16" in message
    assert "positions = [0, 1, 15, 16, 35, 1000]" in message and "page_size = 16" in message
    assert "expected: [(0, 0), (0, 1), (0, 15)" in message and "got: [(0, 0), (0, 0), (0, 0)" in message
    assert "first wrong: position 1: expected (0, 1), got (0, 0)" in message
    assert "hint: the offset inside a page is the remainder pos % page_size" in message


def test_planted_offset_bug_in_the_append_kernel_is_reported_with_a_picture_of_the_wrong_rows():
    space = load_solution(EXERCISES["append_kernel"], replace=("slot % page_size", "slot // page_size"))
    result = check("append_kernel", space["append"])
    assert not result.passed and result.failure.case == 1
    message = str(result)
    assert "slot_mapping = [5, 0, 13, 2]" in message
    assert "token 1 has slot 0 = page 0 x 4 + row 0; that K row holds token 3's K" in message
    assert "hint: the row inside the page is slot % page_size" in message
    picture = result.failure.picture
    assert picture is not None and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(picture) in message


# Mistakes learners make, planted in the solutions (pagedkv_lab.exercises.mistakes, a
# table): the check must fail and its message must name the mistake. Kernels cost ~1 s.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: the planted overflow, 0 * NaN
@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m.exercise}-{i}" for i, m in enumerate(MISTAKES)])
def test_a_planted_mistake_fails_the_check_with_a_message_that_names_it(mistake):
    result = check(mistake.exercise, *load_with_mistake(mistake))
    assert not result.passed, f"the check of {mistake.exercise} let a mistake through: {mistake.what}"
    assert mistake.message in result.message, result.message


def _mistake(exercise: str, what: str):
    return next(m for m in MISTAKES if m.exercise == exercise and m.what.startswith(what))


def test_exercise_06_without_the_padding_guard_gives_a_message_and_the_notebook_kernel_survives():
    """As a learner's notebook runs it, in a Jupyter kernel of its own: the kernel used to
    write before the pool in the notebook's process (heap corrupted, `free(): invalid
    size`, the Jupyter kernel dead and the learner's state lost, no message)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    mistake = _mistake("append_kernel", "no padding guard")
    solution = (FOLDER / "solutions" / "06_append_kernel.py").read_text().replace(mistake.old, mistake.new)
    cells = [
        solution,
        'from pagedkv_lab.exercises import check\nresult = check("append_kernel", append)\nprint(result)',
        'print("the kernel lives on:", result.passed)',
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(FOLDER)}}
    ).execute()
    out = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    assert "FAIL append_kernel, case 2 of" in out[1] and mistake.message in out[1], out[1]
    assert "mask it out" in out[1]
    assert out[2].strip() == "the kernel lives on: False"


def test_a_kernel_that_crashes_the_process_fails_its_case_with_how_it_ended():
    """A write far outside any guard kills the check's child process, not this one."""
    space = load_solution(
        EXERCISES["append_kernel"],
        replace=("page = (slot // page_size).to(tl.int64)", "page = (slot // page_size).to(tl.int64) + 2**40"),
    )
    result = check("append_kernel", space["append"])
    assert not result.passed and result.failure.case == 1, result.message
    assert "the kernel crashed the process (SIG" in result.message and "your notebook lives on" in result.message


def _hanging_append(k, v, cache, slot_mapping, layout="NHD"):
    """A learner's append that never returns (a while loop whose bound never comes); it
    writes its process id to ``$HANG_PID_FILE`` first, if set."""
    if pid_file := os.environ.get("HANG_PID_FILE"):
        Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def _wait_for_pid(pid_file: Path, timeout_s: float = 120.0) -> int | None:
    """The process id the hanging append wrote, once it runs (None after ``timeout_s``)."""
    for _ in range(int(timeout_s * 10)):
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.1)
    return None


def test_a_hanging_kernel_fails_its_case_within_the_case_timeout_with_a_hang_hint(monkeypatch):
    """The learner used to wait 900 s with no output, then read that the process died.
    About 3 s (a 2 s case timeout)."""
    from pagedkv_lab.exercises import cases

    monkeypatch.setattr(cases, "CASE_TIMEOUT_S", 2.0)
    start = time.perf_counter()
    result = check("append_kernel", _hanging_append)
    assert time.perf_counter() - start < 15
    assert not result.passed and result.failure.case == 1, result.message
    assert "no answer within 2 s" in result.message and "did not finish this case" in result.message
    assert "died" not in result.message, result.message


def test_an_interrupted_check_leaves_no_child_running(tmp_path, monkeypatch):
    """A stop button (SIGINT) while a hanging kernel runs in the check's child: the
    KeyboardInterrupt reaches the learner and the child is gone, not left at 100 % CPU
    until the notebook's kernel exits. About 3 s."""
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("HANG_PID_FILE", str(pid_file))
    parent = os.getpid()
    threading.Thread(target=lambda: _wait_for_pid(pid_file) and os.kill(parent, signal.SIGINT), daemon=True).start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            check("append_kernel", _hanging_append)
        child = int(pid_file.read_text())
        assert not _running(child), "the check's child outlived the interrupted check"
    finally:
        signal.signal(signal.SIGINT, previous)
        for child in multiprocessing.active_children():
            child.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_checks_child_dies_with_the_process_that_started_it(tmp_path):
    """A notebook kernel killed outright (SIGKILL: no exception, no cleanup) while its
    check's child hangs: the child must die too. About 10 s (a fresh Python process)."""
    pid_file = tmp_path / "child.pid"
    code = "from test_exercises import _hanging_append, check; check('append_kernel', _hanging_append)"
    env = {**os.environ, "HANG_PID_FILE": str(pid_file), "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=FOLDER.parent, env=env)
    child = None
    try:
        child = _wait_for_pid(pid_file)
        assert child is not None, "the check never called the learner's function"
        parent.kill()
        parent.wait()
        for _ in range(50):
            if not _running(child):
                break
            time.sleep(0.1)
        assert not _running(child), "the check's child outlived the process that started it"
    finally:
        parent.kill()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_the_in_process_path_stays_an_explicit_option(monkeypatch):
    from pagedkv_lab.exercises import cases

    monkeypatch.setattr(cases, "run_isolated", lambda *a: pytest.fail("isolate=False forked a child"))
    result = check("merge_kernel", *load_with_mistake(_mistake("merge_kernel", "a missing other=")), isolate=False)
    assert not result.passed and 'other=float("-inf")' in result.message


def test_every_exercise_has_a_source_a_notebook_and_a_solution():
    for e in EXERCISES.values():
        assert (FOLDER / "src" / f"{e.stem}.py").is_file(), e.stem
        assert (FOLDER / f"{e.stem}.ipynb").is_file(), e.stem
        assert (FOLDER / "solutions" / f"{e.stem}.py").is_file(), e.stem
    assert sorted(p.stem for p in (FOLDER / "src").glob("*.py")) == sorted(e.stem for e in EXERCISES.values())


@pytest.mark.parametrize("stem", [e.stem for e in EXERCISES.values()])
def test_exercise_notebook_matches_its_source_and_shows_no_answer(stem):
    nb = json.loads((FOLDER / f"{stem}.ipynb").read_text())
    assert nb == build_notebook(FOLDER / "src" / f"{stem}.py"), "run `python -m pagedkv_lab.exercises build`"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code), "commit exercises without outputs"


@pytest.mark.parametrize("exercise", list(EXERCISES.values()), ids=list(EXERCISES))
def test_exercise_notebook_ends_with_the_one_call_that_checks_it(exercise):
    code = [src for kind, src in notebook_cells(FOLDER / f"{exercise.stem}.ipynb") if kind == "code"]
    assert code[-1].strip() == f'check("{exercise.name}", {", ".join(exercise.functions)})'
    assert sum("check(" in src for src in code[:-1]) == 0, "exactly one check call"
    solution = parse_percent("# %%\n" + (FOLDER / "solutions" / f"{exercise.stem}.py").read_text())[0][1]
    for name in exercise.functions:
        assert f"def {name}(" in solution, f"the solution of {exercise.stem} defines no {name}"


def test_check_refuses_an_unknown_exercise_and_the_wrong_functions():
    with pytest.raises(ValueError, match="no exercise 'slots'"):
        check("slots", print)
    with pytest.raises(ValueError, match="takes the functions locate, locate_pow2, slot_mapping"):
        check("slot_mapping", print)


def test_an_exception_in_the_learners_code_becomes_a_message_with_where_it_was_raised():
    def fragmentation(seq_lens, page_size):
        return 1 - sum(seq_lens) / sum(-(-n // page_size) * page_size for n in seq_lens)  # 0 / 0 when empty

    def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
        return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes

    result = check("kv_bytes", bytes_per_token, fragmentation)
    assert not result.passed and result.failure.label == "fragmentation of an empty batch allocates nothing"
    assert "fragmentation raised ZeroDivisionError" in result.message
    assert "raised at: test_exercises.py, line" in result.message and "do not divide by zero" in result.message


def test_a_decode_numerics_failure_comes_without_the_rows_to_read_picture():
    # a scale without log2(e) reads the right rows: the picture of them would mislead
    space = load_solution(
        EXERCISES["decode_kernel"], replace=("q = q * qk_scale", "q = q * qk_scale * 0.6931471805599453")
    )
    result = check("decode_kernel", *[space[name] for name in EXERCISES["decode_kernel"].functions])
    assert not result.passed and "use qk_scale as given" in result.message, result.message
    assert result.failure.picture is None and "picture" not in result.message


def test_an_infinite_decode_output_is_not_blamed_on_nan_from_unused_rows():
    """A running sum that never grows, divided by without a guard: +-inf, no NaN. The hint
    used to say NaN from the pool's unused rows got in."""
    no_sum = ("l_i = l_i * alpha + tl.sum(p, axis=0)", "l_i = l_i * alpha")
    space = load_solution(EXERCISES["decode_kernel"], replace=[no_sum, ("tl.where(l_i > 0, l_i, 1.0)", "l_i")])
    result = check("decode_kernel", *[space[name] for name in EXERCISES["decode_kernel"].functions])
    assert not result.passed and "the output is infinite (no NaN)" in result.message, result.message
    assert "unused rows" not in result.message, result.message


def test_locate_pow2_with_a_wrong_shift_gets_the_shift_and_mask_hint():
    space = load_solution(
        EXERCISES["slot_mapping"], replace=("shift = page_size.bit_length() - 1", "shift = page_size")
    )
    result = check("slot_mapping", space["locate"], space["locate_pow2"], space["slot_mapping"])
    assert not result.passed
    assert "hint: shift by log2 P and mask with P - 1: with P = 16, block = pos >> 4 and offset = pos & 15" in (
        result.message.replace("\n", " ").replace("  ", " ")
    ), result.message


def test_a_case_hint_does_not_repeat_what_the_diagnosis_says():
    space = load_solution(EXERCISES["append_kernel"], replace=("slot % page_size", "slot // page_size"))
    message = " ".join(str(check("append_kernel", space["append"])).split())
    # the diagnosis says "the row inside the page is slot % page_size; slot // page_size is
    # the page": the case hint keeps its lead-in, not the same formulas again
    assert "hint: the row inside the page is slot % page_size" in message
    assert "Each program copies one token's [heads, head_dim] block." in message
    assert "page = slot // page_size" not in message, message

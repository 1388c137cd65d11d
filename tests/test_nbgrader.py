"""The nbgrader course written from the exercise sources grades a class through the
documented loop (generate_assignment, the sandboxed autograde, export, generate_feedback,
release_feedback through an exchange), and a learner cannot get a grade without the work.

The class does exercise 01 (the cheapest check, and formulas for the feedback). ada and
zoe answer right and bob makes a typical mistake; six learners attack the grader, each
with one submission whose answer cells are the stubs plus a cell of their own:

* fay forges the score: rebinds ``check``, patches the package's and the checker's
  ``check``, makes every ``CheckResult`` pass, prints "PASS", writes "PASS" to every file
  descriptor from inside her function;
* rex reads the solutions: the instructor's ``source/`` notebook (relative, as nbgrader's
  working folder would reach it, and absolute), ``exercises/solutions/01_kv_bytes.py``
  through the library's own path (``files.default_dir``, ``load_solution``) and directly,
  the instructor notes, the planted mistakes, the gradebook, another learner's notebook,
  and a server on the grader's loopback that hands out the solution; he would ``exec``
  whatever solution he found;
* wes writes ``nbgrader_config.py`` (as the issue did, relative and absolute), the source
  notebook, the gradebook and the suite's own code, and tries to leave the root (chroot);
* kim kills: ``os.kill`` of her parent, of process 1, of every process (-1), then of her
  own process group;
* hal hangs inside his function (graded on his own with a 5 s budget);
* fox forks processes until the machine says no.

Each gets 0 with a message, the course is unchanged, and ada, bob and zoe (graded after
every attack) get what they deserve. Where this machine allows less than
namespaces (``sandbox.probe``), the attacks that need them are not submitted and their
tests skip; ``PAGEDKV_GRADER_SANDBOX=required`` (CI) makes that a failure.

Cost: the learners' processes are forked from one warm Python (the zygote, whose torch
import the first learner waits for), so a learner costs about 0.5 s; creating the
gradebook (nbgrader, 5-13 s), the first learner (3-6 s) and hal's 5 s are most of the
module fixture (29-34 s on a busy 2-core machine, load 5-8; the file 41-48 s). ``-m slow`` adds a run of
nbgrader's own command line (which runs the course's ``nbgrader_config.py``) and two
kernel exercises graded in the sandbox.
"""

import copy
import csv
import hashlib
import html
import json
import os
import re
import socket
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from nbgrader.api import Gradebook
from nbgrader.plugins.export import CsvExportPlugin
from nbgrader.utils import notebook_hash
from traitlets.utils.importstring import import_item

import pagedkv_lab
from pagedkv_lab.exercises import EXERCISES
from pagedkv_lab.exercises.catalog import get
from pagedkv_lab.exercises.files import default_dir
from pagedkv_lab.exercises.mistakes import MISTAKES
from pagedkv_lab.exercises.nbgrader_course import BEGIN, END, NBGRADER_CONFIG, course_notebook, write_course
from pagedkv_lab.grading import sandbox
from pagedkv_lab.grading.autograde import sandboxed_preprocessors
from pagedkv_lab.grading.class_grading import grade_class, grading_config, nbgrader_api
from pagedkv_lab.grading.feedback import feedback_preprocessors
from pagedkv_lab.grading.remote import LearnerProcess

# nbgrader's API misspells `authenticator` when it releases feedback (its command line does not)
pytestmark = pytest.mark.filterwarnings(r"ignore:Passing unrecognized arguments to super\(ExchangeReleaseFeedback\)")

ASSIGNMENT = "01_kv_bytes"
WRONG = next(m for m in MISTAKES if m.exercise == "kv_bytes" and m.what.startswith("counts K only"))
ISOLATION = sandbox.probe()
ISOLATED = ISOLATION.level in ("full", "namespaces")
needs_isolation = pytest.mark.skipif(not ISOLATED, reason=f"this machine allows no namespaces: {ISOLATION.allowed}")
HANG_TIMEOUT_S = 5
TIMEOUT_S = 120  # a busy 2-core machine starts a learner's process (torch) in up to 9 s


@dataclass(frozen=True)
class Submission:
    """What a learner hands in: the release's answer cells filled with the solution
    (``solved``; ``mistake`` planted) or left as stubs, and ``extra`` (a cell of the
    learner's own after them, formatted with the course's paths), or None."""

    solved: bool = True
    mistake: object = None
    extra: str | None = None


FORGE = """
import os
import pagedkv_lab.exercises as exercises
import pagedkv_lab.exercises.bookkeeping as bookkeeping
from pagedkv_lab.exercises.result import CheckResult

forged = CheckResult("kv_bytes", True, 10, 0.0, None, "forged")
check = lambda *args, **kwargs: forged          # what the notebook's check cell calls
exercises.check = check                         # the package's check
bookkeeping.check_kv_bytes = lambda *args, **kwargs: forged  # the checker itself
CheckResult.passed = property(lambda self: True)
print("PASS kv_bytes: forged")


def bytes_per_token(*args):
    for fd in range(64):  # "PASS" on every descriptor: the checker's pipe among them
        try:
            os.write(fd, b"PASS kv_bytes")
        except OSError:
            pass
    return 0
"""

READ = """
from pathlib import Path
from pagedkv_lab.exercises.catalog import get
from pagedkv_lab.exercises.files import default_dir, load_solution

targets = {{
    "source notebook, relative": "../../../source/01_kv_bytes/01_kv_bytes.ipynb",
    "source notebook": "{course}/source/01_kv_bytes/01_kv_bytes.ipynb",
    "solutions file": "{solutions}/01_kv_bytes.py",
    "solutions file, library path": str(default_dir() / "solutions" / "01_kv_bytes.py"),
    "instructor notes": "{exercises}/INSTRUCTOR.md",
    "gradebook": "{course}/gradebook.db",
    "another learner": "{course}/submitted/ada/01_kv_bytes/01_kv_bytes.ipynb",
}}
stolen = None
for what, path in targets.items():
    try:
        text = Path(path).read_text(errors="replace")
        print(what, "READ", len(text))
        stolen = stolen or (text if "def bytes_per_token" in text else None)
    except OSError as err:
        print(what, "refused:", type(err).__name__)
print("planted mistakes: READ", len(Path("{mistakes}").read_text()))
import socket
try:  # the grader's machine serves the solution on its loopback
    with socket.create_connection(("127.0.0.1", {port}), timeout=5) as served:
        stolen = served.recv(1 << 16).decode()
        print("network READ", len(stolen))
except OSError as err:
    print("network refused:", type(err).__name__)
try:
    space = load_solution(get("01"))
    bytes_per_token, fragmentation = space["bytes_per_token"], space["fragmentation"]
    print("load_solution READ")
except OSError as err:
    print("load_solution refused:", type(err).__name__)
if stolen:
    exec(stolen)
"""

WRITE = """
targets = {{
    "config, relative": "../../../nbgrader_config.py",
    "config": "{course}/nbgrader_config.py",
    "source notebook": "{course}/source/01_kv_bytes/01_kv_bytes.ipynb",
    "gradebook": "{course}/gradebook.db",
    "the suite": "{suite}/exercises/catalog.py",
}}
for what, path in targets.items():
    try:
        with open(path, "a") as f:
            f.write("\\nc.Autograde.autograde_preprocessors = []  # run my notebook as the instructor\\n")
        print(what, "WRITTEN")
    except OSError as err:
        print(what, "refused:", type(err).__name__)
import os
try:  # out of the sandbox's root, as root could
    os.chroot("/tmp")
    print("chroot WRITTEN")
except OSError as err:
    print("chroot refused:", type(err).__name__)
"""

KILL = """
import os
import signal

for target in (os.getppid(), 1, -1):
    try:
        os.kill(target, signal.SIGKILL)
        print("kill", target, "sent")
    except OSError as err:
        print("kill", target, "refused:", type(err).__name__)
os.kill(0, signal.SIGKILL)  # my own process group
"""

FORK = """
import os
import time

children = 0
try:
    while children < 200:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        children += 1
except OSError as err:
    print("fork refused after", children, "children:", type(err).__name__)
"""

HANG = """
def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    while True:
        pass
"""

CLASS = {
    "ada": Submission(),
    "bob": Submission(mistake=WRONG),
    "fay": Submission(solved=False, extra=FORGE),
    "zoe": Submission(),
}
if ISOLATED:  # where learners run with the grader's rights these would hit the grader itself
    CLASS |= {
        "fox": Submission(solved=False, extra=FORK),
        "kim": Submission(solved=False, extra=KILL),
        "rex": Submission(solved=False, extra=READ),
        "wes": Submission(solved=False, extra=WRITE),
    }
CLASS["hal"] = Submission(solved=False, extra=HANG)


def _grade_cells(nb: dict) -> dict:
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in nb["cells"] if "nbgrader" in c["metadata"]}


def _printed(cell: dict) -> str:
    return "".join("".join(o["text"]) for o in cell.get("outputs", []) if o["output_type"] == "stream")


def _tree_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return digest.hexdigest()


def _submit(course: Path, source: Path, learner: str, sub: Submission, paths: dict) -> None:
    """The released notebook as ``learner`` hands it in (with ``timestamp.txt`` and
    ``submission_secret.txt``, as ``nbgrader collect`` leaves them)."""
    answers = _grade_cells(json.loads(source.read_text()))
    nb = copy.deepcopy(json.loads((course / "release" / ASSIGNMENT / source.name).read_text()))
    planted = 0
    for cell in nb["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution") and sub.solved:
            lines = "".join(answers[meta["grade_id"]]["source"]).splitlines()
            cell["source"] = "\n".join(ln for ln in lines if ln.strip() not in (BEGIN, END))
            if sub.mistake is not None and sub.mistake.old in cell["source"]:
                cell["source"] = cell["source"].replace(sub.mistake.old, sub.mistake.new)
                planted += 1
    assert sub.mistake is None or planted == 1, sub.mistake
    if sub.extra is not None:
        at = max(i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("solution")) + 1
        mine = {"cell_type": "code", "id": "mine", "metadata": {}, "execution_count": None, "outputs": []}
        nb["cells"].insert(at, mine | {"source": sub.extra.format(**paths)})
    folder = course / "submitted" / learner / ASSIGNMENT
    folder.mkdir(parents=True)
    (folder / source.name).write_text(json.dumps(nb))
    (folder / "timestamp.txt").write_text("2026-01-15 10:00:00.000000 UTC")
    (folder / "submission_secret.txt").write_text(hashlib.sha256(learner.encode()).hexdigest())


def _serve_solution(server: socket.socket) -> None:
    solution = (default_dir() / "solutions" / f"{ASSIGNMENT}.py").read_bytes()
    with server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(solution)


def _nbgrader_cli(course: Path, *args: str) -> subprocess.CompletedProcess:
    """nbgrader's own command line, in the course (it runs the course's nbgrader_config.py)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    nbgrader = Path(sys.executable).parent / "nbgrader"
    return subprocess.run([str(nbgrader), *args], cwd=course, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class of the module docstring, graded and exported, its feedback generated
    and released. Returns a namespace of what the tests look at."""
    course, exchange = tmp_path_factory.mktemp("course"), tmp_path_factory.mktemp("exchange")
    exchange.chmod(0o777)  # nbgrader's exchange is writable by everyone
    (source,) = write_course(course, ["01"])
    api = nbgrader_api(grading_config(course, TIMEOUT_S, exchange))
    released = api.generate_assignment(ASSIGNMENT)
    assert released["success"], released.get("error")
    paths = {
        "course": course,
        "exercises": default_dir(),
        "solutions": default_dir() / "solutions",
        "mistakes": Path(pagedkv_lab.__file__).parent / "exercises" / "mistakes.py",
        "suite": Path(pagedkv_lab.__file__).parent,
    }
    server = socket.create_server(("127.0.0.1", 0))  # serves the solution to whoever connects
    paths["port"] = server.getsockname()[1]
    threading.Thread(target=_serve_solution, args=(server,), daemon=True).start()
    for learner, sub in CLASS.items():
        _submit(course, source, learner, sub, paths)
    before = {"config": (course / "nbgrader_config.py").read_bytes(), "source": _tree_digest(course / "source")}
    before["suite"] = (paths["suite"] / "exercises" / "catalog.py").read_bytes()
    report, seconds = [], {}
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for learners, timeout in ((sorted(set(CLASS) - {"hal", "zoe"}), TIMEOUT_S), (["hal"], HANG_TIMEOUT_S)):
            for g in grade_class(course, ASSIGNMENT, learners, timeout, out=_Lines(report)):
                seconds[g.learner] = g.seconds
        (g,) = grade_class(course, ASSIGNMENT, ["zoe"], TIMEOUT_S, out=_Lines(report))  # after every attack
        seconds["zoe"] = g.seconds
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        CsvExportPlugin(to=str(course / "grades.csv")).export(gradebook)
    scores = {}
    with open(course / "grades.csv") as f:
        for row in csv.DictReader(f):
            assert float(row["max_score"]) == 1.0, row
            scores[row["student_id"]] = float(row["score"])
    feedback = api.generate_feedback(ASSIGNMENT)
    assert feedback["success"], feedback.get("error")
    shipped = api.release_feedback(ASSIGNMENT)
    assert shipped["success"], shipped.get("error")
    after = {"config": (course / "nbgrader_config.py").read_bytes(), "source": _tree_digest(course / "source")}
    after["suite"] = (paths["suite"] / "exercises" / "catalog.py").read_bytes()
    return dict(
        course=course,
        exchange=exchange,
        scores=scores,
        report=report,
        warned=[str(w.message) for w in warned],
        source=source,
        paths=paths,
        before=before,
        after=after,
        seconds=seconds,
    )


class _Lines:
    """A file-like ``out`` that keeps the lines written to it."""

    def __init__(self, lines: list) -> None:
        self.lines = lines

    def write(self, text: str) -> None:
        self.lines += [ln for ln in text.splitlines() if ln]

    def flush(self) -> None:
        pass


def _autograded(graded: dict, learner: str) -> dict:
    return json.loads((graded["course"] / "autograded" / learner / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())


def _check_message(graded: dict, learner: str) -> str:
    """The check cell's message, its lines joined (messages wrap at 100 characters)."""
    return " ".join(_printed(_grade_cells(_autograded(graded, learner))["check_kv_bytes"]).split())


def _my_cell(graded: dict, learner: str) -> str:
    (cell,) = [c for c in _autograded(graded, learner)["cells"] if c.get("id") == "mine"]
    return _printed(cell) + "".join("".join(o.get("traceback", [])) for o in cell["outputs"])


# --------------------------------------------------------------------------- the class


def test_the_grader_isolates_as_well_as_this_machine_allows():
    if ISOLATION.level != "full" and os.environ.get("PAGEDKV_GRADER_SANDBOX") == "required":
        pytest.fail(f"PAGEDKV_GRADER_SANDBOX=required but {ISOLATION.summary}")
    if ISOLATION.level != "full":
        pytest.skip(ISOLATION.summary)
    assert ISOLATION.warning == "" and "user id" in ISOLATION.allowed


def test_honest_learners_get_their_grades_and_every_attacker_gets_zero(graded):
    expected = {learner: 0.0 for learner in CLASS} | {"ada": 1.0, "zoe": 1.0}
    assert graded["scores"] == expected, graded["report"]


def test_a_wrong_answer_is_graded_with_the_hint_that_names_it(graded):
    assert WRONG.message in _check_message(graded, "bob")


def test_a_forged_check_prints_fail_and_scores_zero(graded):
    shown = _check_message(graded, "fay")
    assert shown.startswith("FAIL kv_bytes, case 1 of 10"), shown
    assert "PASS kv_bytes: forged" in _my_cell(graded, "fay")  # what the learner's own cell printed


@needs_isolation
def test_no_solution_and_nothing_of_the_course_can_be_read(graded):
    printed = _my_cell(graded, "rex")
    for what in (
        "source notebook, relative",
        "source notebook",
        "solutions file",
        "solutions file, library path",
        "instructor notes",
        "gradebook",
        "another learner",
        "load_solution",
    ):
        assert re.search(rf"^{what} refused: (FileNotFoundError|PermissionError)$", printed, re.M), (what, printed)
    assert re.search(r"^network refused: OSError$", printed, re.M), printed  # no interface: unreachable
    assert "planted mistakes: READ 0" in printed, printed  # the module is there, empty
    assert graded["scores"]["rex"] == 0.0


@needs_isolation
def test_a_submission_cannot_change_the_config_the_source_or_the_suite(graded):
    printed = _my_cell(graded, "wes")
    for what in ("config, relative", "config", "source notebook", "gradebook", "the suite", "chroot"):
        assert re.search(rf"^{what} refused: \w+Error$", printed, re.M), (what, printed)
    assert graded["after"] == graded["before"]


@needs_isolation
def test_a_learner_who_kills_ends_only_their_own_process(graded):
    shown = _check_message(graded, "kim")
    assert "the process running your notebook was killed by SIGKILL" in shown, shown
    assert "kill -1 sent" in _my_cell(graded, "kim") or "kill -1 refused" in _my_cell(graded, "kim")


@needs_isolation
def test_a_learner_who_forks_without_end_is_stopped_and_leaves_nothing_behind(graded):
    printed = _my_cell(graded, "fox")
    found = re.search(r"fork refused after (\d+) children: BlockingIOError", printed)
    assert found and int(found.group(1)) < sandbox.LIMITS["RLIMIT_NPROC"], printed
    assert _check_message(graded, "fox").startswith("FAIL kv_bytes"), _check_message(graded, "fox")
    left = [pid for pid, (uid, _) in _descendants(os.getpid()).items() if uid == sandbox.LEARNER_UID]
    assert left == [], f"processes of the learners' user still running: {left}"


def _descendants(root: int) -> dict[int, tuple[int, int]]:
    """``{pid: (uid, ppid)}`` of every process below ``root`` (this test's, not another
    session's grading on the same machine)."""
    procs = {}
    for proc in Path("/proc").iterdir():
        try:
            status = (proc / "status").read_text()
        except OSError:
            continue
        if proc.name.isdigit():
            uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
            procs[int(proc.name)] = (uid, int(re.search(r"^PPid:\s+(\d+)", status, re.M).group(1)))
    below, grew = {root}, True
    while grew:
        grew = False
        for pid, (_, ppid) in procs.items():
            if ppid in below and pid not in below:
                below.add(pid)
                grew = True
    return {pid: procs[pid] for pid in below - {root} if pid in procs}


def test_a_hang_costs_its_budget_and_a_zero(graded):
    shown = _check_message(graded, "hal")
    assert f"did not finish within {HANG_TIMEOUT_S} s" in shown, shown
    assert graded["seconds"]["hal"] < HANG_TIMEOUT_S + 30, graded["seconds"]


def test_grading_prints_no_warning_for_anyone_to_ignore(graded):
    assert not any("SAWarning" in w or "not in session" in w for w in graded["warned"]), graded["warned"]
    assert _check_message(graded, "zoe").startswith("PASS kv_bytes")  # graded after every attack


@pytest.mark.slow
def test_nbgrader_autograde_runs_the_sandbox_from_the_course_config_without_warnings(graded):
    # nbgrader's own command line runs the course's nbgrader_config.py (5-9 s to start it)
    _submit(graded["course"], graded["source"], "zed", Submission(solved=False, extra=FORGE), graded["paths"])
    cli = _nbgrader_cli(graded["course"], "autograde", ASSIGNMENT, "--student", "zed")
    assert cli.returncode == 0 and "GradeInSandbox" not in cli.stderr, cli.stderr  # no traceback of ours
    assert not re.search(r"warn", cli.stderr, re.I), cli.stderr
    assert "zed/01_kv_bytes: the check failed at case 1 of 10" in cli.stderr, cli.stderr
    assert _check_message(graded, "zed").startswith("FAIL kv_bytes, case 1 of 10")


def test_feedback_names_the_checkers_message_and_renders_its_formulas_offline(graded):
    page = (graded["course"] / "feedback" / "bob" / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()
    assert html.escape(WRONG.message, quote=False) in " ".join(page.split())
    # the spec's two formulas as MathML; no TeX left outside the scripts (MathJax's own
    # configuration, which nbgrader's template always writes, names its delimiters)
    outside_scripts = re.sub(r"<script.*?</script>", "", page, flags=re.S)
    assert "$$" not in outside_scripts and outside_scripts.count('<math display="block"') == 2
    released = sorted((graded["exchange"] / "pagedkv" / "feedback").glob("*.html"))
    assert len(released) == len(CLASS)
    secret = hashlib.sha256(b"bob").hexdigest()
    bobs = graded["exchange"] / "pagedkv" / "feedback" / f"{notebook_hash(secret=secret, notebook_id=ASSIGNMENT)}.html"
    assert bobs.read_text() == page


def test_release_strips_every_solution_and_names_no_solution_file(graded):
    released = json.loads((graded["course"] / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").read_text())
    text = json.dumps(released)
    assert "2 * num_layers" not in text and BEGIN not in text and "raise NotImplementedError()" in text
    assert "solutions/" not in text and "Solution" not in text
    check = _grade_cells(released)["check_kv_bytes"]
    assert check["metadata"]["nbgrader"]["locked"] and check["metadata"]["nbgrader"]["points"] == 1


@pytest.mark.parametrize("name", list(EXERCISES))
def test_no_exercise_notebook_names_a_solution_file(name):
    exercise = get(name)
    for text in (
        json.dumps(course_notebook(exercise)),
        (default_dir() / f"{exercise.stem}.ipynb").read_text(),
    ):
        markdown = text.replace("### BEGIN SOLUTION", "")
        assert "solutions/" not in markdown and "Solution:" not in markdown, exercise.stem


# --------------------------------------------------------------------------- without namespaces


def test_without_namespaces_the_grade_still_comes_from_the_checker(monkeypatch):
    # the degraded path a machine without root or user namespaces takes: a plain process
    monkeypatch.setenv("PAGEDKV_GRADER_ISOLATION", "none")
    sandbox.probe.cache_clear()
    try:
        isolation = sandbox.probe()
        assert isolation.level == "none" and "grade in a container" in isolation.warning
        with LearnerProcess(TIMEOUT_S, isolation) as process:
            (run,) = process.run_cells([("cell_01", "check = lambda *a: 'PASS'\nprint('PASS kv_bytes')")])
            result = get("01").checker(process.function("bytes_per_token"), process.function("fragmentation"))
    finally:
        sandbox.probe.cache_clear()
    assert run.output == "PASS kv_bytes\n" and not result.passed
    assert "your notebook defines no function bytes_per_token" in " ".join(result.message.split()), result.message


# --------------------------------------------------------------------------- tensors and views on the wire


def test_the_cache_exercises_grade_in_the_learner_process_as_in_the_notebook():
    # 09's functions write into the checker's pool through the wire; 10's returns a view of
    # its argument, which must come back as a view (the checker compares storage pointers),
    # and its planted copy as a copy. One learner process for all four runs (about 1 s warm).
    from pagedkv_lab.exercises.files import load_solution

    slips = {"prealloc_cache": "writes a decode token one row past", "gqa_broadcast": "copies the KV heads"}
    with LearnerProcess(TIMEOUT_S) as process:
        for i, (name, slip) in enumerate(slips.items()):
            spec = get(name)
            mistake = next(m for m in MISTAKES if m.exercise == name and m.what.startswith(slip))
            solution = (default_dir() / "solutions" / f"{spec.stem}.py").read_text()
            for j, planted in enumerate((None, mistake)):
                code = solution if planted is None else solution.replace(mistake.old, mistake.new)
                (run,) = process.run_cells([(f"cell_{i}{j}", code)])
                remote = spec.checker(*(process.function(f) for f in spec.functions))
                space = load_solution(spec, replace=None if planted is None else (mistake.old, mistake.new))
                here = spec.checker(*(space[f] for f in spec.functions))
                assert run.error is None and remote.passed == here.passed == (planted is None), remote.message
                flat = " ".join(remote.message.split())
                assert planted is None or (planted.message in flat and flat == " ".join(here.message.split())), flat


# --------------------------------------------------------------------------- the course files


def test_course_generator_refuses_bad_points_and_unknown_exercises_before_writing(tmp_path):
    with pytest.raises(ValueError, match="points=0"):
        write_course(tmp_path / "a", ["01"], points=0)
    with pytest.raises(ValueError, match="no exercise 'slots'"):
        write_course(tmp_path / "b", ["01", "slots"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("number", ["01", "09", "10", "02", "03", "04", "05"])
def test_every_generated_assignment_passes_its_own_autograder_cell(tmp_path, number):
    # The source notebook's cells run in order as one module, solution markers and all
    # (they are comments); its autograder cell asserts the check passed. display() is
    # IPython's, so it is given here.
    (notebook,) = write_course(tmp_path, [number])
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    assert "grade" in _grade_cells({"cells": cells[-1:]})[f"check_{notebook.stem[3:]}"]["metadata"]["nbgrader"]
    shown = []
    exec(compile("\n\n".join("".join(c["source"]) for c in cells), str(notebook), "exec"), {"display": shown.append})
    assert len(shown) == 1 and shown[0].passed, shown


def test_the_course_config_names_the_sandboxed_autograde(tmp_path):
    from pagedkv_lab.exercises.cli import main

    assert main(["nbgrader", str(tmp_path / "course"), "01", "06"]) == 0
    assert (tmp_path / "course" / "nbgrader_config.py").read_text() == NBGRADER_CONFIG
    assert sorted(p.name for p in (tmp_path / "course" / "source").iterdir()) == ["01_kv_bytes", "06_append_kernel"]
    config = {"c": _Recorder()}
    exec(NBGRADER_CONFIG, {"get_config": lambda: config["c"]})
    named = config["c"].values["Autograde.autograde_preprocessors"]
    assert [import_item(name) for name in named] == sandboxed_preprocessors()
    named = config["c"].values["GenerateFeedback.preprocessors"]
    assert [import_item(name) for name in named] == feedback_preprocessors()
    assert config["c"].values["GradeInSandbox.timeout"] == 600


def test_instructor_command_refuses_bad_points(tmp_path, capsys):
    from pagedkv_lab.exercises.cli import main

    with pytest.raises(SystemExit):
        main(["nbgrader", str(tmp_path / "other"), "--points", "0"])
    assert "points=0" in capsys.readouterr().err and not (tmp_path / "other").exists()


class _Recorder:
    """A stand-in for traitlets' config object: records ``c.Section.name = value``."""

    def __init__(self, prefix: str = "", values: dict | None = None) -> None:
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "values", {} if values is None else values)

    def __getattr__(self, name: str):
        return _Recorder(f"{self.prefix}{name}.", self.values)

    def __setattr__(self, name: str, value) -> None:
        self.values[f"{self.prefix}{name}"] = value


# --------------------------------------------------------------------------- a kernel exercise (slow)


@pytest.mark.slow
@pytest.mark.parametrize("exercise, slip", [("append_kernel", "// for %"), ("merge_kernel", "a missing other=")])
def test_a_kernel_exercise_is_graded_in_the_sandbox_as_in_the_learners_notebook(exercise, slip):
    # 06's slip writes rows in the wrong place (a picture of the pool), 07's reads poison
    # (the masked loads are named): the sandbox's message is the in-process checker's
    from pagedkv_lab.exercises.files import load_solution
    from pagedkv_lab.grading.autograde import KERNEL_PRELOAD, check_outputs

    spec = get(exercise)
    mistake = next(m for m in MISTAKES if m.exercise == exercise and m.what.startswith(slip))
    solution = (default_dir() / "solutions" / f"{spec.stem}.py").read_text()
    for code, planted in ((solution, None), (solution.replace(mistake.old, mistake.new), mistake)):
        with LearnerProcess(600, preload=KERNEL_PRELOAD) as process:
            (run,) = process.run_cells([("cell_02", code)])
            remote = spec.checker(*(process.function(f) for f in spec.functions), isolate=False)
        space = load_solution(spec, replace=(mistake.old, mistake.new) if planted else None)
        here = spec.checker(*(space[f] for f in spec.functions))
        assert run.error is None and remote.passed == here.passed == (planted is None), remote.message
        if planted:
            flat = " ".join(remote.message.split())
            assert planted.message in flat and re.sub(r"\S+\.(py|png)", "F", flat) == re.sub(
                r"\S+\.(py|png)", "F", " ".join(here.message.split())
            )
            pictures = [o for o in check_outputs(remote) if o["output_type"] == "display_data"]
            assert len(pictures) == (remote.failure.picture is not None)

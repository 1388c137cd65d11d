"""The nbgrader course written from the exercise sources grades a class: three learners'
submissions of exercise 03 (one correct, one with a typical wrong answer, one whose code
raises inside the check) are autograded and exported with the expected scores, and each
failing learner gets the checker's message in the graded notebook. Each graded notebook
starts a Jupyter kernel that imports torch (2.5 s on an idle 2-core machine, twice that
on a busy one), so the class grades one assignment; that every generated assignment's own
solution passes its autograder cell is checked in-process, for 01-05."""

import copy
import csv
import json
import os
import sys
from pathlib import Path

import pytest
from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from nbgrader.coursedir import CourseDirectory
from nbgrader.plugins.export import CsvExportPlugin
from traitlets.config import Config

from pagedkv_lab.exercises.mistakes import MISTAKES
from pagedkv_lab.exercises.nbgrader_course import BEGIN, END, write_course

# nbgrader's own gradebook code warns of a session flush (SQLAlchemy 2): not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")

GRADED = ["03"]  # three kernels: three learners, one assignment


def _mistake(exercise: str, what: str):
    (found,) = [m for m in MISTAKES if m.exercise == exercise and m.what.startswith(what)]
    return found


# who submits what: an assignment missing from a learner's dict gets the reference answer
WRONG = _mistake("cow_append", "copies but keeps its reference")
RAISES = _mistake("cow_append", "never allocates a page")  # IndexError inside the check
CLASS = {"ada": {}, "ben": {"03_cow_append": WRONG}, "cy": {"03_cow_append": RAISES}}


def _printed(cell: dict) -> str:
    """What the cell printed (its stream outputs; nbformat stores text as a str or lines)."""
    return "".join("".join(o["text"]) for o in cell["outputs"] if o["output_type"] == "stream")


def _grade_cells(nb: dict) -> dict:
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in nb["cells"] if "nbgrader" in c["metadata"]}


def _submit(course, notebook, learner: str, mistake) -> None:
    """The released notebook with every answer cell filled in from the source's solution
    region (markers dropped), with ``mistake`` planted if given."""
    assignment = notebook.parent.name
    source = _grade_cells(json.loads(notebook.read_text()))
    submission = copy.deepcopy(json.loads((course / "release" / assignment / notebook.name).read_text()))
    for cell in submission["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            lines = "".join(source[meta["grade_id"]]["source"]).splitlines()
            answer = "\n".join(ln for ln in lines if ln.strip() not in (BEGIN, END))
            if mistake is not None:
                assert mistake.old in answer, mistake
                answer = answer.replace(mistake.old, mistake.new)
            cell["source"] = answer
    path = course / "submitted" / learner / assignment / notebook.name
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(submission))


def _grade(course, notebooks, api) -> None:
    """Release every assignment, submit it for each learner of CLASS, autograde each."""
    for nb in notebooks:
        released = api.generate_assignment(nb.parent.name)
        assert released["success"], released.get("error")
        for learner, mistakes in CLASS.items():
            _submit(course, nb, learner, mistakes.get(nb.parent.name))
    for nb in notebooks:
        for learner in CLASS:
            graded = api.autograde(nb.parent.name, learner)
            assert graded["success"], f"{learner}/{nb.parent.name}: {graded.get('error')}"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A course of exercise 03: released, submitted by CLASS, autograded and exported;
    returns (course folder, {learner: {assignment: score}}); every check is worth 1 point."""
    course = tmp_path_factory.mktemp("course")
    notebooks = write_course(course, GRADED)
    config = Config()
    config.CourseDirectory.root = str(course)
    config.Execute.timeout = 120
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    with pytest.MonkeyPatch.context() as env:
        # nbgrader runs `alembic` (the gradebook's migrations) from PATH: this Python's
        env.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        _grade(course, notebooks, api)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        CsvExportPlugin(to=str(course / "grades.csv")).export(gradebook)
    scores: dict = {}
    with open(course / "grades.csv") as f:
        for row in csv.DictReader(f):
            scores.setdefault(row["student_id"], {})[row["assignment"]] = float(row["score"])
            assert float(row["max_score"]) == 1.0, row
    return course, scores


def test_release_strips_every_solution_and_keeps_the_locked_check(graded):
    course, _ = graded
    released = json.loads((course / "release" / "03_cow_append" / "03_cow_append.ipynb").read_text())
    text = json.dumps(released)
    assert "allocator.decref(shared)" not in text and BEGIN not in text and "raise NotImplementedError()" in text
    check = _grade_cells(released)["check_cow_append"]
    assert check["metadata"]["nbgrader"]["locked"] and check["metadata"]["nbgrader"]["points"] == 1
    assert 'check("cow_append", append_slots)' in "".join(check["source"])


def test_a_class_of_three_is_graded_with_the_expected_scores(graded):
    _, scores = graded
    assert scores == {"ada": {"03_cow_append": 1.0}, "ben": {"03_cow_append": 0.0}, "cy": {"03_cow_append": 0.0}}


def test_a_submission_whose_code_raises_is_graded_with_the_checkers_message(graded):
    course, _ = graded
    nb = json.loads((course / "autograded" / "cy" / "03_cow_append" / "03_cow_append.ipynb").read_text())
    cell = _grade_cells(nb)["check_cow_append"]
    shown = _printed(cell)
    assert "FAIL cow_append, case 1 of 7" in shown and RAISES.message in shown, shown
    assert [o["ename"] for o in cell["outputs"] if o["output_type"] == "error"] == ["AssertionError"]


def test_a_wrong_answer_is_graded_with_the_hint_that_names_it(graded):
    course, _ = graded
    nb = json.loads((course / "autograded" / "ben" / "03_cow_append" / "03_cow_append.ipynb").read_text())
    shown = _printed(_grade_cells(nb)["check_cow_append"])
    assert WRONG.message in shown, shown


def test_course_generator_refuses_bad_points_and_unknown_exercises_before_writing(tmp_path):
    with pytest.raises(ValueError, match="points=0"):
        write_course(tmp_path / "a", ["01"], points=0)
    with pytest.raises(ValueError, match="no exercise 'slots'"):
        write_course(tmp_path / "b", ["01", "slots"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("number", ["01", "02", "03", "04", "05"])
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


def test_instructor_command_writes_the_course_and_refuses_bad_points(tmp_path, capsys):
    from pagedkv_lab.exercises.cli import main

    assert main(["nbgrader", str(tmp_path / "course"), "01", "06"]) == 0
    assert (tmp_path / "course" / "nbgrader_config.py").read_text().count("c.Execute.timeout = 600") == 1
    assert sorted(p.name for p in (tmp_path / "course" / "source").iterdir()) == ["01_kv_bytes", "06_append_kernel"]
    with pytest.raises(SystemExit):
        main(["nbgrader", str(tmp_path / "other"), "--points", "0"])
    assert "points=0" in capsys.readouterr().err and not (tmp_path / "other").exists()

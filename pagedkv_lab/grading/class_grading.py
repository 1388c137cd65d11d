"""``python -m pagedkv_lab.exercises grade COURSE ASSIGNMENT``: autograde a class, each
learner's notebook in a sandboxed process of its own, and say how each went.

It runs nbgrader's autograde (the gradebook, late penalties and feedback stay
nbgrader's) with :func:`grading_config`, built here, not read from the course: the
course's ``nbgrader_config.py`` is never executed by this command, so even an edited one
cannot turn the sandbox off. One line per learner: score, seconds, and the first line
of the checker's message; the isolation this machine allows is printed first (with a
warning where it is less than ``full``).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.apps import NbGraderAPI
from nbgrader.coursedir import CourseDirectory
from traitlets.config import Config

from pagedkv_lab.exercises.nbgrader_course import GRADEBOOK_WARNING
from pagedkv_lab.grading import sandbox
from pagedkv_lab.grading.autograde import sandboxed_preprocessors
from pagedkv_lab.grading.feedback import feedback_preprocessors

__all__ = ["COURSE_ID", "grading_config", "nbgrader_api", "quiet_gradebook", "Graded", "grade_class"]

COURSE_ID = "pagedkv"


def grading_config(course: Path, timeout_s: float = 600, exchange: Path | None = None) -> Config:
    """nbgrader's configuration for ``course``: the sandboxed autograde (a learner may
    take ``timeout_s`` seconds in all), offline formulas in the feedback, and
    ``exchange`` as the exchange folder (release and collect, feedback) if given."""
    config = Config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.course_id = COURSE_ID
    config.Autograde.autograde_preprocessors = sandboxed_preprocessors()
    config.GradeInSandbox.timeout = int(timeout_s)
    config.GenerateFeedback.preprocessors = feedback_preprocessors()
    if exchange is not None:
        config.Exchange.root = str(exchange)
    return config


def nbgrader_api(config: Config) -> NbGraderAPI:
    """nbgrader's API on ``config``. nbgrader runs ``alembic`` (the gradebook's
    migrations) from PATH: this Python's scripts go first."""
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    return NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)


@contextmanager
def quiet_gradebook():
    """Without nbgrader's gradebook warning of a SQLAlchemy 2 session detail
    (:data:`~pagedkv_lab.exercises.nbgrader_course.GRADEBOOK_WARNING`), nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=GRADEBOOK_WARNING, module="nbgrader")
        yield


@dataclass
class Graded:
    """One learner's autograde: ``score`` of ``max_score`` (None if nbgrader failed,
    ``error`` then says why), ``seconds`` of wall time, ``message`` the check's first line."""

    learner: str
    score: float | None
    max_score: float
    seconds: float
    message: str = ""
    error: str = ""


def _learners(course: Path, assignment: str) -> list[str]:
    submitted = course / "submitted"
    return sorted(p.name for p in submitted.iterdir() if (p / assignment).is_dir()) if submitted.is_dir() else []


def _first_message_line(course: Path, learner: str, assignment: str) -> str:
    import json

    folder = course / "autograded" / learner / assignment
    for path in sorted(folder.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "").startswith("check_"):
                text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if "text" in o)
                return text.strip().splitlines()[0] if text.strip() else ""
    return ""


def grade_class(
    course: Path,
    assignment: str,
    learners: list[str] | None = None,
    timeout_s: float = 600,
    out=None,
) -> list[Graded]:
    """Autograde ``assignment`` for ``learners`` (default: everyone in ``submitted/``),
    one after the other; returns one :class:`Graded` each and prints a line each to
    ``out`` (default stdout). Raises ValueError for a course without a gradebook entry
    for ``assignment`` (run ``nbgrader generate_assignment`` first)."""
    out = out or sys.stdout
    course = Path(course).resolve()
    api = nbgrader_api(grading_config(course, timeout_s))
    with Gradebook(api.coursedir.db_url, COURSE_ID) as gradebook:
        try:
            gradebook.find_assignment(assignment)
        except MissingEntry:
            raise ValueError(
                f"no assignment {assignment!r} in {course}: run nbgrader generate_assignment first"
            ) from None
    print(sandbox.probe().summary, file=out)
    done = []
    for learner in learners or _learners(course, assignment):
        start = time.perf_counter()
        with quiet_gradebook():
            reply = api.autograde(assignment, learner, force=True, create=True)
        seconds = time.perf_counter() - start
        score, max_score, message = None, 0.0, ""
        if reply["success"]:
            with Gradebook(api.coursedir.db_url, COURSE_ID) as gradebook:
                submission = gradebook.find_submission(assignment, learner)
                score, max_score = submission.score, submission.max_score
            message = _first_message_line(course, learner, assignment)
        error = "" if reply["success"] else (reply.get("error") or "").strip().splitlines()[-1:]
        done.append(Graded(learner, score, max_score, seconds, message, " ".join(error)))
        shown = f"{score:g}/{max_score:g}" if score is not None else f"NOT GRADED ({' '.join(error)})"
        print(f"{learner}: {shown} ({seconds:.1f} s) {message}", file=out)
    return done

"""``python -m pagedkv_lab.exercises``: what an instructor runs before class.

* ``check --solutions``: every solution passes its check (exit 0), else exit 1;
* ``check --stubs``: every stub, as committed, fails its check with the checker's
  message, not a traceback (exit 0), else exit 1;
* ``list``: the exercises in order;
* ``build``: rebuild ``exercises/NN_name.ipynb`` from ``exercises/src`` (developers);
* ``nbgrader OUT``: write an nbgrader course directory (:mod:`.nbgrader_course`);
* ``grade COURSE ASSIGNMENT``: autograde a class, each learner's notebook in a sandboxed
  process of its own (:mod:`pagedkv_lab.grading.class_grading`, ``docs/grading.md``);
* ``notes``: rewrite ``exercises/INSTRUCTOR.md`` (:mod:`.instructor_notes`), measuring
  each check's time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from pagedkv_lab.exercises import check
from pagedkv_lab.exercises.catalog import EXERCISES, get
from pagedkv_lab.exercises.files import build_notebook, default_dir, load_solution, load_stub
from pagedkv_lab.exercises.nbgrader_course import write_course
from pagedkv_lib import runtime

__all__ = ["main", "check_folder"]


def _functions(exercise, namespace: dict) -> list:
    missing = [n for n in exercise.functions if not callable(namespace.get(n))]
    if missing:
        raise ValueError(f"{exercise.stem} defines no {', '.join(missing)}")
    return [namespace[n] for n in exercise.functions]


def check_folder(
    which: str, names: list[str] | None = None, folder: Path | None = None, out=None, poison_masked: bool = True
) -> bool:
    """Check every solution (``which="solutions"``) or stub (``"stubs"``) of the named
    exercises (all by default), printing one block per exercise; True when every
    solution passed, or every stub failed with a checker message. ``poison_masked`` as
    in :func:`pagedkv_lab.exercises.check`."""
    folder, out = folder or default_dir(), out or sys.stdout
    exercises = [get(n) for n in names] if names else list(EXERCISES.values())
    ok = True
    for exercise in exercises:
        start = time.perf_counter()
        try:
            space = load_solution(exercise, folder) if which == "solutions" else load_stub(exercise, folder)
            result = check(exercise.name, *_functions(exercise, space), poison_masked=poison_masked)
        except Exception:  # a traceback here is what --stubs promises never to show a learner
            ok = False
            print(f"ERROR {exercise.stem}: the check itself raised\n{traceback.format_exc()}", file=out)
            continue
        seconds = time.perf_counter() - start
        good = result.passed if which == "solutions" else (not result.passed and result.failure is not None)
        ok &= good
        verdict = "ok" if good else ("SHOULD PASS" if which == "solutions" else "SHOULD FAIL")
        print(f"[{verdict}] {exercise.stem} ({which[:-1]}), {seconds:.1f} s\n{result.message}\n", file=out)
    return ok


def _build(folder: Path) -> None:
    for source in sorted((folder / "src").glob("[0-9][0-9]_*.py")):
        target = folder / f"{source.stem}.ipynb"
        target.write_text(json.dumps(build_notebook(source), indent=1, ensure_ascii=False) + "\n")
        print(f"built {target}")


def _grade(parser: argparse.ArgumentParser, args) -> int:
    from pagedkv_lab.grading.class_grading import grade_class

    try:
        graded = grade_class(args.course, args.assignment, args.learners, args.timeout)
    except ValueError as err:
        parser.error(str(err))
    failed = [g.learner for g in graded if g.score is None]
    print(f"graded {len(graded) - len(failed)} of {len(graded)} learner(s)", end="")
    print(f"; NOT graded: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_lab.exercises",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", type=Path, default=None, help="the exercises folder (default: the checkout's)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="check the solutions or the stubs")
    group = p_check.add_mutually_exclusive_group(required=True)
    group.add_argument("--solutions", action="store_true", help="every solution must pass")
    group.add_argument("--stubs", action="store_true", help="every stub must fail with the checker's message")
    p_check.add_argument("names", nargs="*", help="exercise names or numbers (default: all)")
    p_check.add_argument(
        "--no-poison-masked",
        action="store_true",
        help="kernel exercises: masked tl.load lanes without other= read 0 (default: NaN, undefined as on a GPU)",
    )
    sub.add_parser("list", help="list the exercises")
    sub.add_parser("build", help="rebuild the exercise notebooks from exercises/src")
    p_grade = sub.add_parser("nbgrader", help="write an nbgrader course directory (source/ and nbgrader_config.py)")
    p_grade.add_argument("out", type=Path, help="the course directory to write")
    p_grade.add_argument("names", nargs="*", help="exercise names or numbers (default: all)")
    p_grade.add_argument("--points", type=int, default=1, help="points of each exercise's check (default: 1)")
    sub.add_parser("notes", help="rewrite exercises/INSTRUCTOR.md from planted mistakes, timing each check")
    p_class = sub.add_parser("grade", help="autograde a class, each learner sandboxed (docs/grading.md)")
    p_class.add_argument("course", type=Path, help="the course directory (after nbgrader generate_assignment)")
    p_class.add_argument("assignment", help="the assignment, e.g. 03_cow_append")
    p_class.add_argument("--learner", action="append", dest="learners", help="only this learner (repeatable)")
    p_class.add_argument("--timeout", type=float, default=600, help="seconds each learner may take (default: 600)")
    args = parser.parse_args(argv)
    if args.command == "grade":
        return _grade(parser, args)
    folder = args.dir or default_dir()
    if args.command != "list" and not (folder / "src").is_dir():
        parser.error(f"no exercises folder at {folder} (it lives in a source checkout); give it with --dir")
    if args.command == "list":
        for e in EXERCISES.values():
            print(f"{e.stem:<18} {e.title}: {e.teaches}")
        return 0
    if args.command == "build":
        _build(folder)
        return 0
    if args.command == "notes":
        from pagedkv_lab.exercises.instructor_notes import write_notes  # instructor-only: not in a learner's wheel

        print(f"wrote {write_notes(folder=folder)}")
        return 0
    if args.command == "nbgrader":
        try:
            written = write_course(args.out, args.names, folder, args.points)
        except ValueError as err:
            parser.error(str(err))
        print(f"wrote {args.out}/nbgrader_config.py and {len(written)} assignment(s) under {args.out}/source/")
        print(
            f"then: cd {args.out} && nbgrader generate_assignment <stem>, release_assignment, collect; "
            "python -m pagedkv_lab.exercises grade . <stem>; nbgrader generate_feedback, release_feedback, export"
        )
        return 0
    try:
        names = [get(n).name for n in args.names]
    except ValueError as err:
        parser.error(str(err))
    print(runtime.backend_line() + "\n")
    ok = check_folder(
        "solutions" if args.solutions else "stubs", names, folder, poison_masked=not args.no_poison_masked
    )
    print("all as expected" if ok else "NOT as expected: see above")
    return 0 if ok else 1

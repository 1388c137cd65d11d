"""Autograding: seconds per submission, nbgrader's kernel against the sandboxed grader.

    python benchmarks/bench_grading.py [EXERCISE ...] [--learners 3] [--out benchmarks/results]

For each exercise (default: 03, the cheapest bookkeeping check, and 06, a Triton kernel
run in the interpreter) it writes a course, releases the assignment, hands in the
reference solution for ``--learners`` learners and autogrades each of them twice, in
the same run:

* ``nbgrader``: nbgrader's own ``Execute`` (the baseline; what the course did before):
  every cell, the check cell included, runs in a Jupyter kernel with the grader's rights;
* ``sandbox``: :class:`pagedkv_lab.grading.autograde.GradeInSandbox`: the cells in a
  sandboxed learner process, the check in the grader (at the isolation this machine
  allows, printed first).

It prints, per exercise and route, the seconds of each submission (nbgrader's whole
``autograde`` of one learner: copying, the gradebook, executing, saving), their mean,
the ratio of the means, and each submission's score (a fraction of full marks): every
one must score full marks in the sandbox. In nbgrader's kernel a check cell that writes
to stderr scores 0 whatever it says, and exercise 08's reference solution does (a NumPy
warning): the baseline's score is reported, not required.
Results go to ``<out>/bench_grading.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbgrader.api import Gradebook  # noqa: E402

from pagedkv_lab.exercises.catalog import get  # noqa: E402
from pagedkv_lab.exercises.nbgrader_course import BEGIN, END, write_course  # noqa: E402
from pagedkv_lab.grading import sandbox  # noqa: E402
from pagedkv_lab.grading.class_grading import COURSE_ID, grading_config, nbgrader_api, quiet_gradebook  # noqa: E402

ROUTES = ("nbgrader", "sandbox")


def _hand_in(course: Path, source: Path, learner: str) -> None:
    stem = source.parent.name
    answers = {
        c["metadata"]["nbgrader"]["grade_id"]: c for c in json.loads(source.read_text())["cells"] if c["metadata"]
    }
    nb = copy.deepcopy(json.loads((course / "release" / stem / source.name).read_text()))
    for cell in nb["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            lines = "".join(answers[meta["grade_id"]]["source"]).splitlines()
            cell["source"] = "\n".join(ln for ln in lines if ln.strip() not in (BEGIN, END))
    folder = course / "submitted" / learner / stem
    folder.mkdir(parents=True)
    (folder / source.name).write_text(json.dumps(nb))


def _route_config(course: Path, route: str):
    config = grading_config(course, timeout_s=600)
    if route == "nbgrader":
        del config.Autograde["autograde_preprocessors"]  # nbgrader's default: Execute
        config.Execute.timeout = 600
    return config


def bench(exercise: str, learners: int, work: Path) -> dict:
    """Seconds per submission of ``exercise`` for each route (see the module docstring)."""
    stem = get(exercise).stem
    out: dict = {"exercise": stem, "learners": learners}
    for route in ROUTES:
        course = work / f"{stem}-{route}"
        (source,) = write_course(course, [exercise])
        api = nbgrader_api(_route_config(course, route))
        assert api.generate_assignment(stem)["success"]
        names = [f"learner{i}" for i in range(learners)]
        for name in names:
            _hand_in(course, source, name)
        seconds, scores = [], []
        for name in names:
            start = time.perf_counter()
            with quiet_gradebook():
                reply = api.autograde(stem, name, force=True, create=True)
            seconds.append(time.perf_counter() - start)
            assert reply["success"], reply.get("error")
            with Gradebook(api.coursedir.db_url, COURSE_ID) as gradebook:
                submission = gradebook.find_submission(stem, name)
                scores.append(submission.score / submission.max_score)
        out[route] = {"seconds": [round(s, 2) for s in seconds], "mean_s": round(statistics.mean(seconds), 2)}
        out[route]["scores"] = scores
        shown = ", ".join(f"{s:.1f}" for s in seconds)
        print(f"{stem} {route:>8}: {shown} s (mean {statistics.mean(seconds):.1f} s); scores {scores}")
        if route == "sandbox" and scores != [1.0] * learners:
            raise AssertionError(f"the reference solution of {stem} did not score full marks in the sandbox: {scores}")
    out["ratio_sandbox_to_nbgrader"] = round(out["sandbox"]["mean_s"] / out["nbgrader"]["mean_s"], 2)
    print(f"{stem}: sandbox / nbgrader = {out['ratio_sandbox_to_nbgrader']:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercises", nargs="*", default=["03", "06"])
    parser.add_argument("--learners", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    isolation = sandbox.probe()
    print(isolation.summary)
    with tempfile.TemporaryDirectory(prefix="bench-grading-") as work:
        results = [bench(e, args.learners, Path(work)) for e in args.exercises]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"isolation": isolation.level, "results": results}
    (args.out / "bench_grading.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out / 'bench_grading.json'}")


if __name__ == "__main__":
    main()

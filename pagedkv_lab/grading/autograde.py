"""``nbgrader autograde`` without running a learner's notebook in nbgrader's kernel.

:class:`GradeInSandbox` takes the place of nbgrader's ``Execute`` preprocessor (the
course's ``nbgrader_config.py`` names it, see
:data:`pagedkv_lab.exercises.nbgrader_course.NBGRADER_CONFIG`). For each submitted
notebook, after nbgrader has put the locked cells back as the instructor wrote them:

1. every code cell but the check cell runs, in order, in a learner process of its own
   (:class:`~pagedkv_lab.grading.remote.LearnerProcess`: sandboxed, with a deadline);
   each cell gets what it printed, or its error, as its output;
2. the exercise's check runs here, in nbgrader's process, with stand-ins for the
   learner's functions; the check cell gets the checker's message (and picture) as its
   output, and an ``AssertionError`` when the check failed, which nbgrader scores 0.

So the check cell's code never runs where the learner's code does: rebinding ``check``,
patching the checker or printing "PASS" changes nothing, and a learner process that
hangs, dies or forks without end costs its own grade only.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

from nbformat import NotebookNode
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Integer

from pagedkv_lab.exercises.catalog import get
from pagedkv_lab.exercises.result import CheckResult
from pagedkv_lab.grading import sandbox
from pagedkv_lab.grading.remote import LearnerProcess

__all__ = ["GradeInSandbox", "check_outputs", "sandboxed_preprocessors", "KERNEL_PRELOAD"]

# What a kernel exercise's set-up cell imports beyond the suite (the backend is chosen first).
KERNEL_PRELOAD = ("pagedkv_lab.poisoning", "triton", "triton.language", "pagedkv_kernels.interpreter")


def _stream(text: str, name: str = "stdout") -> NotebookNode:
    return NotebookNode(output_type="stream", name=name, text=text)


def check_outputs(result: CheckResult) -> list[NotebookNode]:
    """The check cell's outputs for ``result``: the message, the picture of a failed
    kernel check (embedded), and an error output when it failed (nbgrader gives 0)."""
    message = result.message
    picture = result.failure.picture if result.failure is not None else None
    if picture is not None:
        message = message.replace(str(picture), "shown below")
    outputs = [_stream(message + "\n")]
    if picture is not None and Path(picture).is_file():
        png = base64.b64encode(Path(picture).read_bytes()).decode()
        outputs.append(
            NotebookNode(
                output_type="display_data", data={"image/png": png, "text/plain": "<the pool rows>"}, metadata={}
            )
        )
    if not result.passed:
        evalue = f"the check of {result.exercise} did not pass: its message is above"
        traceback = [f"AssertionError: {evalue}"]
        outputs.append(NotebookNode(output_type="error", ename="AssertionError", evalue=evalue, traceback=traceback))
    return outputs


def _cell_outputs(run) -> list[NotebookNode]:
    outputs = [_stream(run.output)] if run.output else []
    if run.error:
        outputs.append(
            NotebookNode(
                output_type="error",
                ename=str(run.error.get("type", run.error.get("ename", "Error"))),
                evalue=str(run.error.get("message", run.error.get("evalue", ""))),
                traceback=[str(line) for line in run.error.get("traceback", [])],
            )
        )
    return outputs


class GradeInSandbox(NbGraderPreprocessor):
    """nbgrader's ``Execute``, done as the module docstring says."""

    timeout = Integer(
        600, help="Seconds one learner's notebook may take in all: its cells, then every call of the check."
    ).tag(config=True)

    _warned = False

    def preprocess(self, nb: NotebookNode, resources: dict):
        isolation = sandbox.probe()
        if isolation.warning and not GradeInSandbox._warned:
            self.log.warning(isolation.summary)
            GradeInSandbox._warned = True
        exercise = get(resources["nbgrader"]["notebook"])
        check_id = f"check_{exercise.name}"
        code = [c for c in nb.cells if c.cell_type == "code"]
        is_check = [c.metadata.get("nbgrader", {}).get("grade_id") == check_id for c in code]
        checks = [c for c, check in zip(code, is_check) if check]
        # the learner's cells run in files named by their place among the code cells ("In [n]")
        learner = [(f"cell_{n:02d}", c) for n, (c, check) in enumerate(zip(code, is_check), 1) if not check]
        start = time.perf_counter()
        preload = KERNEL_PRELOAD if exercise.runs_kernels else ()
        with LearnerProcess(self.timeout, isolation, preload) as process:
            runs = process.run_cells([(name, c.source) for name, c in learner])
            for (_, cell), run in zip(learner, runs):
                cell.outputs = _cell_outputs(run)
            functions = [process.function(name) for name in exercise.functions]
            if exercise.runs_kernels:
                result = exercise.checker(*functions, isolate=False)
            else:
                result = exercise.checker(*functions)
        for cell in checks:
            cell.outputs = check_outputs(result)
        for count, cell in enumerate(code, 1):
            cell.execution_count = count
        verdict = "passed" if result.passed else f"failed at case {result.failure.case} of {result.failure.total}"
        self.log.info(
            "%s/%s: the check %s (%.1f s, isolation %s)",
            resources["nbgrader"]["student"],
            exercise.stem,
            verdict,
            time.perf_counter() - start,
            isolation.level,
        )
        return nb, resources


def sandboxed_preprocessors() -> list:
    """nbgrader's autograde preprocessors with :class:`GradeInSandbox` for ``Execute``
    (for ``c.Autograde.autograde_preprocessors``)."""
    default = Autograde.class_traits()["autograde_preprocessors"].default()
    if Execute not in default:
        raise RuntimeError(f"nbgrader's autograde no longer runs Execute ({default}): GradeInSandbox needs a new place")
    return [GradeInSandbox if p is Execute else p for p in default]

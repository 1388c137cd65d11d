"""exercises/INSTRUCTOR.md is generated from planted mistakes run through the checker:
regenerated here (without timing), it must equal the committed file, so every message in
it is what the checker prints today."""

import pytest

from pagedkv_lib.exercises import EXERCISES
from pagedkv_lib.exercises.bookkeeping_mistakes import BOOKKEEPING_MISTAKES, Mistake
from pagedkv_lib.exercises.files import default_dir
from pagedkv_lib.exercises.instructor_notes import mistake_result, render_notes, without_times

NOTES = default_dir() / "INSTRUCTOR.md"


def test_instructor_notes_are_what_the_checker_prints_today():
    fresh = render_notes(measure=False)
    assert without_times(NOTES.read_text()) == without_times(fresh), "run `python -m pagedkv_lib.exercises notes`"


def test_instructor_notes_give_every_exercise_a_section_and_every_mistake_its_message():
    text = NOTES.read_text()
    for e in EXERCISES.values():
        assert f"(`{e.stem}`)" in text, e.stem
    for m in BOOKKEEPING_MISTAKES:
        assert f"What a learner who {m.what} reads:" in text and m.names in text, m.what
    assert "## When a learner's kernel dies" in text


@pytest.mark.parametrize(
    "mistake", BOOKKEEPING_MISTAKES, ids=[f"{m.exercise}-{i}" for i, m in enumerate(BOOKKEEPING_MISTAKES)]
)
def test_every_planted_bookkeeping_mistake_fails_its_check_with_the_words_that_name_it(mistake):
    result = mistake_result(mistake)
    assert not result.passed and mistake.names in result.message, result.message


def test_notes_refuse_a_planted_mistake_the_checker_no_longer_names():
    harmless = Mistake("ring_window", "edits a comment", "# sinks stay where they were written", "# sinks", "anything")
    with pytest.raises(ValueError, match="planted mistake 'edits a comment' of ring_window"):
        render_notes([harmless], measure=False)

"""exercises/INSTRUCTOR.md is generated from planted mistakes run through the checker:
regenerated here (without timing), it must equal the committed file, so every message in
it is what the checker prints today."""

import pytest

from pagedkv_lab.exercises import EXERCISES
from pagedkv_lab.exercises.files import default_dir
from pagedkv_lab.exercises.instructor_notes import render_notes, without_times
from pagedkv_lab.exercises.mistakes import MISTAKES, Mistake

NOTES = default_dir() / "INSTRUCTOR.md"


def test_instructor_notes_are_what_the_checker_prints_today():
    fresh = render_notes(measure=False)
    assert without_times(NOTES.read_text()) == without_times(fresh), "run `python -m pagedkv_lab.exercises notes`"


def test_instructor_notes_give_every_exercise_a_section_and_every_mistake_its_message():
    text = NOTES.read_text()
    for e in EXERCISES.values():
        assert f"(`{e.stem}`)" in text, e.stem
    for m in MISTAKES:
        assert f"What a learner who {m.what} reads:" in text and m.message in text, m.what
    assert "## When a learner's kernel dies" in text


# Each planted mistake failing its check with its words: tests/test_exercises.py
# (test_a_planted_mistake_fails_the_check_with_a_message_that_names_it).


def test_notes_refuse_a_planted_mistake_the_checker_no_longer_names():
    harmless = Mistake("ring_window", "edits a comment", "# sinks stay where they were written", "# sinks", "anything")
    with pytest.raises(ValueError, match="planted mistake 'edits a comment' of ring_window"):
        render_notes([harmless], measure=False)

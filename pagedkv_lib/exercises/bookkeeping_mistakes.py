"""Planted learner mistakes of exercises 01-05 (the bookkeeping ones): data, not tests.

Each :class:`Mistake` is a textual edit of the reference solution
(``exercises/solutions/<stem>.py``) that turns it into an answer a learner is likely to
write. The instructor notes (:mod:`.instructor_notes`) run every one through the checker
and print the message it gives; the tests run them too, so the notes cannot drift from
what the checker says. The Triton exercises (06-08) keep their own table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mistake", "BOOKKEEPING_MISTAKES"]


@dataclass(frozen=True)
class Mistake:
    """``exercise`` (a name in :data:`~pagedkv_lib.exercises.EXERCISES`); ``what`` the
    learner did, in one phrase; the solution's text ``old`` becomes ``new``; ``names`` a
    words that the checker's message must contain (the hint that names the mistake)."""

    exercise: str
    what: str
    old: str
    new: str
    names: str


BOOKKEEPING_MISTAKES: tuple[Mistake, ...] = (
    Mistake("kv_bytes", "counts K only, not K and V", "2 * num_layers", "num_layers", "K and V are both cached"),
    Mistake(
        "kv_bytes",
        "rounds sequences down to whole pages",
        "-(-n // page_size) * page_size",
        "n // page_size * page_size",
        "round each sequence *up*",
    ),
    Mistake(
        "kv_bytes",
        "divides by zero on an empty batch",
        "    if allocated == 0:\n        return 0.0\n",
        "",
        "do not divide by zero",
    ),
    Mistake(
        "slot_mapping",
        "takes the offset as pos // page_size",
        "pos % page_size",
        "pos // page_size",
        "the offset inside a page is the remainder",
    ),
    Mistake(
        "slot_mapping",
        "looks up padding (-1) in the block table",
        "if pos == -1:",
        "if pos == -2:",
        "position -1 marks padding",
    ),
    Mistake(
        "cow_append",
        "writes into a shared page without copying it",
        "and allocator.refcount(block_table[-1]) > 1",
        "and False",
        "Copy-on-write: allocate a page",
    ),
    Mistake(
        "cow_append",
        "copies but keeps its reference to the shared page",
        "allocator.decref(shared)",
        "pass",
        "decref it",
    ),
    Mistake(
        "cow_append",
        "never allocates a page for tokens past the table (IndexError)",
        "        if block == len(block_table):\n            block_table.append(allocator.allocate())\n",
        "",
        "append_slots raised IndexError",
    ),
    Mistake(
        "ring_window",
        "forgets the bubble after the sinks",
        "sink_tokens + bubble +",
        "sink_tokens +",
        "leave the bubble empty",
    ),
    Mistake(
        "prefix_cache",
        "hashes each block alone, not chained to its parent",
        "parent = block_hash(parent,",
        "parent = block_hash(None,",
        "with its parent's hash",
    ),
    Mistake(
        "prefix_cache",
        "serves a full hit without computing a token",
        "hits -= 1",
        "pass",
        "at least one token must be computed",
    ),
)

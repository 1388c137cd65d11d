"""Checks of exercises 01, 02 and 04: the memory formula, slot mapping and the ring
window (03 and 05, copy-on-write and the prefix hash chain, are in :mod:`.sharing`).
Expected values come from the library (``memory``, ``indexing``, ``formats``,
``RingWindow``); the learner's
functions are only ever called, never used to compute an expectation.

Each check is a table of cases (one small frozen dataclass per case, at module level,
in the order the learner meets them) and one runner per kind of case, which calls the
learner's function on the spec, compares with the library and diagnoses a mismatch,
as Triton-Puzzles pairs a spec with its test."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from pagedkv_lab.exercises.cases import Case, Mismatch, as_ints, first_wrong_index, run_cases
from pagedkv_lab.exercises.result import LearnerError, call, show
from pagedkv_lib.checks import is_number
from pagedkv_lib.formats import pad_block_tables, slot_mapping
from pagedkv_lib.indexing import is_power_of_two, locate, locate_pow2
from pagedkv_lib.memory import ModelSpec, kv_bytes_per_token, padded_tokens
from pagedkv_lib.window import RingWindow

__all__ = ["check_kv_bytes", "check_slot_mapping", "check_ring_window"]


# --------------------------------------------------------------------------- 01 kv_bytes

_DTYPE_OF_BYTES = {1: "fp8", 2: "fp16", 4: "fp32"}
BYTES_HINT = "bytes = 2 (K and V) x layers x KV heads x head_dim x bytes per value."


@dataclass(frozen=True)
class ModelCase:
    """``bytes_per_token(layers, heads, dim, nbytes)`` of one model."""

    label: str
    layers: int
    heads: int
    dim: int
    nbytes: int


@dataclass(frozen=True)
class BatchCase:
    """``fragmentation(lens, page_size)`` of one batch."""

    label: str
    lens: tuple[int, ...]
    page_size: int
    hint: str = ""


KV_MODELS = (
    ModelCase("Llama-3-8B (GQA, 8 KV heads), fp16", 32, 8, 128, 2),
    ModelCase("Llama-2-7B (MHA, 32 KV heads), fp16", 32, 32, 128, 2),
    ModelCase("Falcon-7B (MQA, 1 KV head of 64), bf16", 32, 1, 64, 2),
    ModelCase("Llama-3-70B, fp8 (1 byte per value)", 80, 8, 128, 1),
    ModelCase("a toy model: 2 layers, 3 KV heads of 10, fp32", 2, 3, 10, 4),
)
FRAGMENTATION_BATCHES = (
    BatchCase("lengths 1, 16, 17 in pages of 16", (1, 16, 17), 16),
    BatchCase("one sequence of 100 tokens in pages of 64", (100,), 64),
    BatchCase("pages of 1 token never waste a slot", (5, 7), 1),
    BatchCase("a mixed batch in pages of 32", (33, 64, 65, 1), 32),
    BatchCase(
        "an empty batch allocates nothing",
        (0, 0),
        16,
        "A batch with no tokens allocates no slot: its fragmentation is 0.0 (do not divide by zero).",
    ),
)


def _run_bytes_per_token(m: ModelCase, bytes_per_token) -> Mismatch | None:
    want = kv_bytes_per_token(ModelSpec("m", m.layers, m.heads, m.heads, m.dim), _DTYPE_OF_BYTES[m.nbytes])
    got = call("bytes_per_token", bytes_per_token, m.layers, m.heads, m.dim, m.nbytes)
    if is_number(got) and got == want:
        return None
    hint = ""
    if isinstance(got, (int, float)) and got:
        factors = (
            (2, "K and V are both cached (a factor 2)"),
            (m.layers, "every layer has its own cache (times num_layers)"),
            (m.nbytes, "count bytes, not elements (times dtype_bytes)"),
        )
        reasons = [why for factor, why in factors if factor > 1 and math.isclose(got * factor, want)]
        if reasons:
            hint = f"you are short by a factor {round(want / got)}: " + ", or ".join(reasons) + "."
    return Mismatch(f"{want:,} bytes", f"{show(got)}", hint=hint)


def _fragmentation_hint(got, lens: list[int], page_size: int, padded: int) -> str:
    """What a wrong fragmentation ``got`` of a batch that allocates ``padded`` slots computed."""
    if not isinstance(got, (int, float)) or not padded:
        return ""
    floor = sum(n // page_size * page_size for n in lens)
    pooled = -(-sum(lens) // page_size) * page_size
    if math.isclose(got, sum(lens) / padded):
        return "you returned the used fraction; fragmentation is the unused one, 1 - used."
    if got == padded - sum(lens):
        return "you returned the number of empty slots; divide it by the slots allocated."
    if floor and math.isclose(got, 1 - sum(lens) / floor):
        return "round each sequence *up* to whole pages: ceil(n / page_size) pages."
    if math.isclose(got, 1 - sum(lens) / pooled):
        return "round each sequence up on its own: sequences never share a page."
    return ""


def _run_fragmentation(c: BatchCase, fragmentation) -> Mismatch | None:
    lens = list(c.lens)
    padded = padded_tokens(lens, c.page_size)
    want = 1 - sum(lens) / padded if padded else 0.0
    got = call("fragmentation", fragmentation, list(lens), c.page_size)
    if is_number(got) and math.isclose(got, want, abs_tol=1e-12):
        return None
    hint = _fragmentation_hint(got, lens, c.page_size, padded)
    return Mismatch(f"{want:.6f} ({padded - sum(lens)} empty of {padded} slots)", show(got), hint=hint)


def check_kv_bytes(bytes_per_token, fragmentation):
    """Exercise 01: ``bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)`` and
    ``fragmentation(seq_lens, page_size)``."""
    cases = [
        Case(
            f"bytes_per_token of {m.label}",
            partial(_run_bytes_per_token, m, bytes_per_token),
            [
                ("num_layers", str(m.layers)),
                ("num_kv_heads", str(m.heads)),
                ("head_dim", str(m.dim)),
                ("dtype_bytes", str(m.nbytes)),
            ],
            BYTES_HINT,
        )
        for m in KV_MODELS
    ]
    cases += [
        Case(
            f"fragmentation of {c.label}",
            partial(_run_fragmentation, c, fragmentation),
            [("seq_lens", str(list(c.lens))), ("page_size", str(c.page_size))],
            c.hint,
        )
        for c in FRAGMENTATION_BATCHES
    ]
    return run_cases("kv_bytes", cases, "bytes per token of 5 models, fragmentation of 5 batches")


# --------------------------------------------------------------------------- 02 slot_mapping

_LOCATE_REFERENCES = {"locate": locate, "locate_pow2": locate_pow2}
LOCATE_CASES = (
    ("locate", 16),
    ("locate", 5),
    ("locate", 1),
    ("locate_pow2", 16),
    ("locate_pow2", 1),
    ("locate_pow2", 64),
)
REFUSAL_HINT = (
    "with page_size 12 a shift and a mask give wrong "
    "answers (37 >> 3 = 4, but 37 // 12 = 3): refuse it with ValueError."
)


@dataclass(frozen=True)
class SlotCase:
    """``slot_mapping(table, positions, page_size)`` of one sequence (-1: padding)."""

    label: str
    table: tuple[int, ...]
    positions: tuple[int, ...]
    page_size: int
    hint: str = ""


SLOT_TABLES = (
    SlotCase("a sequence on pages 3, 0, 7 of 16 tokens", (3, 0, 7), (0, 1, 15, 16, 33), 16),
    SlotCase("pages of 5 tokens (not a power of two)", (7, 2, 9), (0, 4, 5, 9, 13), 5),
    SlotCase("padding: position -1 marks a token to skip", (4, 1), (2, -1, 5, -1), 4),
    SlotCase("pages of 1 token", (6, 2, 9, 0), (3, 0, 2), 1),
)


def _pairs(name, fn, positions, page_size):
    out = []
    for p in positions:
        got = call(name, fn, p, page_size)
        try:
            out.append(tuple(int(x) for x in got))
        except (TypeError, ValueError):
            raise LearnerError(name, TypeError(f"returned {show(got)}, not a (block, offset) pair")) from None
    return out


def _locate_positions(page_size: int) -> list[int]:
    return [0, 1, page_size - 1, page_size, 2 * page_size + 3, 1000]


def _run_locate(name: str, page_size: int, fn) -> Mismatch | None:
    positions = _locate_positions(page_size)
    want = [tuple(_LOCATE_REFERENCES[name](p, page_size)) for p in positions]
    got = _pairs(name, fn, positions, page_size)
    i = first_wrong_index(got, want)
    if i is None:
        return None
    p, (gb, go) = positions[i], got[i]
    hint = ""
    if (gb, go) == (p // page_size, p // page_size):
        hint = "the offset inside a page is the remainder pos % page_size; pos // page_size is the block."
    elif (gb, go) == (p % page_size, p // page_size):
        hint = "block and offset are swapped: return (block, offset)."
    elif (gb, go) == (p, 0) or (gb, go) == (0, p):
        hint = "divide by page_size: the block is pos // page_size."
    if name == "locate_pow2" and page_size > 1 and "swapped" not in hint:
        # a wrong shift or mask is this function's own mistake, not a wrong divmod
        hint = (
            f"shift by log2 P and mask with P - 1: with P = {page_size}, block = pos >> "
            f"{page_size.bit_length() - 1} and offset = pos & {page_size - 1}."
        )
    return Mismatch(show(want), show(got), f"position {p}: expected {want[i]}, got {got[i]}", hint)


def _locate_case(name: str, page_size: int, fn) -> Case:
    kind = "a power of two" if is_power_of_two(page_size) else "not a power of two"
    return Case(
        f"{name} with pages of {page_size} ({kind})",
        partial(_run_locate, name, page_size, fn),
        [("positions", str(_locate_positions(page_size))), ("page_size", str(page_size))],
    )


def _run_refusal(locate_pow2_fn) -> Mismatch | None:
    try:
        got = locate_pow2_fn(37, 12)
    except ValueError:
        return None
    except Exception as err:  # anything else is the learner's bug, reported as such
        raise LearnerError("locate_pow2", err) from err
    return Mismatch("ValueError", f"returned {show(got)}", hint=REFUSAL_HINT)


def _slot_hint(c: SlotCase, p: int, g: int) -> str:
    """What a wrong slot ``g`` of position ``p`` computed."""
    table, page_size = c.table, c.page_size
    if p < 0:
        return (
            "position -1 marks padding and maps to slot -1. (Used as an index, -1 is the *last* "
            "entry of block_table: a silent bug.)"
        )
    block, row = divmod(p, page_size)
    if g == table[block] * page_size + block:
        return "the row inside a page is pos % page_size; pos // page_size is the logical block."
    if g == p:
        return "you returned the position itself: look the page up, page = block_table[pos // page_size]."
    if g == table[block] + row:
        return "multiply the page id by page_size: slot = page * page_size + row."
    if row < len(table) and g == table[row] * page_size + block:
        return "block and row are swapped."
    return ""


def _run_slot_mapping(c: SlotCase, slot_mapping_fn) -> Mismatch | None:
    positions, page_size = list(c.positions), c.page_size
    want = slot_mapping(
        pad_block_tables([list(c.table)]), [0 if p >= 0 else -1 for p in positions], positions, page_size
    )
    want = want.tolist()
    got = as_ints("slot_mapping", call("slot_mapping", slot_mapping_fn, list(c.table), list(positions), page_size))
    if isinstance(got, Mismatch):
        return got
    if len(got) != len(want):
        return Mismatch(show(want), show(got), f"{len(got)} slots for {len(positions)} positions")
    i = first_wrong_index(got, want)
    if i is None:
        return None
    p, g = positions[i], got[i]
    detail = f"positions[{i}] = {p}: expected slot {want[i]}, got {g}"
    if p >= 0:
        block, row = divmod(p, page_size)
        page = c.table[block]
        detail += f" (block {block} is page {page}, row {row}: {page} * {page_size} + {row})"
    return Mismatch(show(want), show(got), detail, _slot_hint(c, p, g))


def check_slot_mapping(locate_fn, locate_pow2_fn, slot_mapping_fn):
    """Exercise 02: ``locate(pos, page_size)``, ``locate_pow2(pos, page_size)`` and
    ``slot_mapping(block_table, positions, page_size)``."""
    learner = {"locate": locate_fn, "locate_pow2": locate_pow2_fn}
    cases = [_locate_case(name, ps, learner[name]) for name, ps in LOCATE_CASES]
    cases.append(
        Case(
            "locate_pow2 must refuse a page size that is not a power of two",
            partial(_run_refusal, locate_pow2_fn),
            [("pos", "37"), ("page_size", "12")],
        )
    )
    cases += [
        Case(
            f"slot_mapping: {c.label}",
            partial(_run_slot_mapping, c, slot_mapping_fn),
            [
                ("block_table", str(list(c.table))),
                ("positions", str(list(c.positions))),
                ("page_size", str(c.page_size)),
            ],
            c.hint,
        )
        for c in SLOT_TABLES
    ]
    return run_cases("slot_mapping", cases, "locate, locate_pow2 (and its refusal) and slot_mapping on 11 cases")


# --------------------------------------------------------------------------- 04 ring_window


@dataclass(frozen=True)
class RingCase:
    """``kv_token_idx(t, window, sinks, tokens_per_block)`` for ``t`` in ``0 .. steps - 1``."""

    label: str
    window: int
    sinks: int
    tokens_per_block: int
    steps: int


RING_WINDOWS = (
    RingCase("no sinks: a plain ring of 8 rows", 8, 0, 4, 20),
    RingCase("2 sinks in pages of 4: a bubble of 2 rows after them", 6, 2, 4, 20),
    RingCase("4 sinks fill a whole page: no bubble", 10, 4, 4, 24),
    RingCase("3 sinks in pages of 2: a bubble of 1 row", 7, 3, 2, 20),
    RingCase("pages of 1 row: never a bubble", 5, 2, 1, 12),
    RingCase("5 sinks of a 6-token window: a ring of 1 row", 6, 5, 4, 10),
)


def _ring_guesses(c: RingCase, bubble: int) -> dict:
    """Hint -> the rows a kernel with that bug computes, per ``t``."""
    window, sinks, tpb = c.window, c.sinks, c.tokens_per_block
    cyc = window - sinks
    return {
        "a sink (t < sink_tokens) stays at its own row t.": lambda t: sinks + bubble + (t - sinks) % cyc,
        "leave the bubble empty: the ring starts at sinks + bubble, on a page boundary.": lambda t: (
            t if t < sinks else sinks + (t - sinks) % cyc
        ),
        "the ring has window - sinks rows, not window.": lambda t: (
            t if t < sinks else sinks + bubble + (t - sinks) % window
        ),
        "the bubble pads the sinks to a whole page: (tokens_per_block - sinks % tokens_per_block) % "
        "tokens_per_block rows.": lambda t: t if t < sinks else sinks + sinks % tpb + (t - sinks) % cyc,
        "sinks never move: only the tokens after them cycle through the ring.": lambda t: t % window,
    }


def _run_ring(c: RingCase, kv_token_idx) -> Mismatch | None:
    ring = RingWindow(c.window, c.sinks, c.tokens_per_block)
    want = [ring.kv_token_idx(t) for t in range(c.steps)]
    got = [call("kv_token_idx", kv_token_idx, t, c.window, c.sinks, c.tokens_per_block) for t in range(c.steps)]
    got = as_ints("kv_token_idx", got)
    if isinstance(got, Mismatch):
        return got
    i = first_wrong_index(got, want)
    if i is None:
        return None
    bubble = ring.bubble_len
    guesses = _ring_guesses(c, bubble)
    hint = next((h for h, f in guesses.items() if [f(t) for t in range(c.steps)] == got), "")
    detail = (
        f"t = {i}: expected row {want[i]}, got {got[i]} (sinks {c.sinks}, bubble {bubble}, ring of "
        f"{c.window - c.sinks} rows from row {c.sinks + bubble})"
    )
    return Mismatch(show(want), show(got), detail, hint)


def check_ring_window(kv_token_idx):
    """Exercise 04: ``kv_token_idx(t, max_attention_window, sink_tokens, tokens_per_block)``."""
    cases = [
        Case(
            c.label,
            partial(_run_ring, c, kv_token_idx),
            [
                ("t", f"0 .. {c.steps - 1}"),
                ("max_attention_window", str(c.window)),
                ("sink_tokens", str(c.sinks)),
                ("tokens_per_block", str(c.tokens_per_block)),
            ],
        )
        for c in RING_WINDOWS
    ]
    return run_cases("ring_window", cases, "6 windows: no sinks, bubbles of 0-2 rows, pages of 1, a ring of 1 row")

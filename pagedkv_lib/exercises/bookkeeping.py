"""Checks of exercises 01-05: the memory formula, slot mapping, copy-on-write, the ring
window and the prefix hash chain. Expected values come from the library (``memory``,
``indexing``, ``formats``, ``KVCacheManager``, ``RingWindow``, ``sharing``); the learner's
functions are only ever called, never used to compute an expectation."""

from __future__ import annotations

import math

from ..allocator import BlockAllocator
from ..formats import pad_block_tables, slot_mapping
from ..indexing import is_power_of_two, locate, locate_pow2
from ..manager import KVCacheManager
from ..memory import ModelSpec, kv_bytes_per_token, padded_tokens
from ..sharing import block_hash
from ..window import RingWindow
from .cases import Case, Mismatch, first_wrong_index, run_cases
from .result import LearnerError, call, show

__all__ = ["check_kv_bytes", "check_slot_mapping", "check_cow_append", "check_ring_window", "check_prefix_cache"]


def _ints(name: str, value) -> list[int] | Mismatch:
    """``value`` as a list of Python ints, or a Mismatch saying what came back instead."""
    try:
        values = value.tolist() if hasattr(value, "tolist") else list(value)
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return Mismatch("a list of ints", f"{name} returned {show(value)} ({type(value).__name__})")


# --------------------------------------------------------------------------- 01 kv_bytes

_DTYPE_OF_BYTES = {1: "fp8", 2: "fp16", 4: "fp32"}


def check_kv_bytes(bytes_per_token, fragmentation):
    """Exercise 01: ``bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)`` and
    ``fragmentation(seq_lens, page_size)``."""
    cases = []
    models = [
        ("Llama-3-8B (GQA, 8 KV heads), fp16", 32, 8, 128, 2),
        ("Llama-2-7B (MHA, 32 KV heads), fp16", 32, 32, 128, 2),
        ("Falcon-7B (MQA, 1 KV head of 64), bf16", 32, 1, 64, 2),
        ("Llama-3-70B, fp8 (1 byte per value)", 80, 8, 128, 1),
        ("a toy model: 2 layers, 3 KV heads of 10, fp32", 2, 3, 10, 4),
    ]
    for label, layers, heads, dim, nbytes in models:

        def run(layers=layers, heads=heads, dim=dim, nbytes=nbytes):
            want = kv_bytes_per_token(ModelSpec("m", layers, heads, heads, dim), _DTYPE_OF_BYTES[nbytes])
            got = call("bytes_per_token", bytes_per_token, layers, heads, dim, nbytes)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or got != want:
                hint = ""
                if isinstance(got, (int, float)) and got:
                    reasons = [
                        why
                        for factor, why in (
                            (2, "K and V are both cached (a factor 2)"),
                            (layers, "every layer has its own cache (times num_layers)"),
                            (nbytes, "count bytes, not elements (times dtype_bytes)"),
                        )
                        if factor > 1 and math.isclose(got * factor, want)
                    ]
                    if reasons:
                        hint = f"you are short by a factor {round(want / got)}: " + ", or ".join(reasons) + "."
                return Mismatch(f"{want:,} bytes", f"{show(got)}", hint=hint)
            return None

        inputs = [
            ("num_layers", str(layers)),
            ("num_kv_heads", str(heads)),
            ("head_dim", str(dim)),
            ("dtype_bytes", str(nbytes)),
        ]
        cases.append(
            Case(
                f"bytes_per_token of {label}",
                run,
                inputs,
                "bytes = 2 (K and V) x layers x KV heads x head_dim x bytes per value.",
            )
        )
    batches = [
        ("lengths 1, 16, 17 in pages of 16", [1, 16, 17], 16, ""),
        ("one sequence of 100 tokens in pages of 64", [100], 64, ""),
        ("pages of 1 token never waste a slot", [5, 7], 1, ""),
        ("a mixed batch in pages of 32", [33, 64, 65, 1], 32, ""),
        (
            "an empty batch allocates nothing",
            [0, 0],
            16,
            "A batch with no tokens allocates no slot: its fragmentation is 0.0 (do not divide by zero).",
        ),
    ]
    for label, lens, page_size, case_hint in batches:

        def run(lens=lens, page_size=page_size):
            padded = padded_tokens(lens, page_size)
            want = 1 - sum(lens) / padded if padded else 0.0
            got = call("fragmentation", fragmentation, list(lens), page_size)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want, abs_tol=1e-12):
                hint = ""
                if isinstance(got, (int, float)) and padded:
                    floor = sum(n // page_size * page_size for n in lens)
                    pooled = -(-sum(lens) // page_size) * page_size
                    if math.isclose(got, sum(lens) / padded):
                        hint = "you returned the used fraction; fragmentation is the unused one, 1 - used."
                    elif got == padded - sum(lens):
                        hint = "you returned the number of empty slots; divide it by the slots allocated."
                    elif floor and math.isclose(got, 1 - sum(lens) / floor):
                        hint = "round each sequence *up* to whole pages: ceil(n / page_size) pages."
                    elif math.isclose(got, 1 - sum(lens) / pooled):
                        hint = "round each sequence up on its own: sequences never share a page."
                return Mismatch(f"{want:.6f} ({padded - sum(lens)} empty of {padded} slots)", show(got), hint=hint)
            return None

        cases.append(
            Case(f"fragmentation of {label}", run, [("seq_lens", str(lens)), ("page_size", str(page_size))], case_hint)
        )
    return run_cases("kv_bytes", cases, "bytes per token of 5 models, fragmentation of 5 batches")


# --------------------------------------------------------------------------- 02 slot_mapping


def _pairs(name, fn, positions, page_size):
    out = []
    for p in positions:
        got = call(name, fn, p, page_size)
        try:
            out.append(tuple(int(x) for x in got))
        except (TypeError, ValueError):
            raise LearnerError(name, TypeError(f"returned {show(got)}, not a (block, offset) pair")) from None
    return out


def _locate_case(name, fn, want_fn, page_size):
    positions = [0, 1, page_size - 1, page_size, 2 * page_size + 3, 1000]

    def run():
        want = [tuple(want_fn(p, page_size)) for p in positions]
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
        return Mismatch(show(want), show(got), f"position {p}: expected {want[i]}, got {got[i]}", hint)

    kind = "a power of two" if is_power_of_two(page_size) else "not a power of two"
    return Case(
        f"{name} with pages of {page_size} ({kind})",
        run,
        [("positions", str(positions)), ("page_size", str(page_size))],
    )


def check_slot_mapping(locate_fn, locate_pow2_fn, slot_mapping_fn):
    """Exercise 02: ``locate(pos, page_size)``, ``locate_pow2(pos, page_size)`` and
    ``slot_mapping(block_table, positions, page_size)``."""
    cases = [_locate_case("locate", locate_fn, locate, ps) for ps in (16, 5, 1)]
    cases += [_locate_case("locate_pow2", locate_pow2_fn, locate_pow2, ps) for ps in (16, 1, 64)]

    def refuses_12():
        try:
            got = locate_pow2_fn(37, 12)
        except ValueError:
            return None
        except Exception as err:  # anything else is the learner's bug, reported as such
            raise LearnerError("locate_pow2", err) from err
        return Mismatch(
            "ValueError",
            f"returned {show(got)}",
            hint="with page_size 12 a shift and a mask give wrong "
            "answers (37 >> 3 = 4, but 37 // 12 = 3): refuse it with ValueError.",
        )

    cases.append(
        Case(
            "locate_pow2 must refuse a page size that is not a power of two",
            refuses_12,
            [("pos", "37"), ("page_size", "12")],
        )
    )
    tables = [
        ("a sequence on pages 3, 0, 7 of 16 tokens", [3, 0, 7], [0, 1, 15, 16, 33], 16, ""),
        ("pages of 5 tokens (not a power of two)", [7, 2, 9], [0, 4, 5, 9, 13], 5, ""),
        ("padding: position -1 marks a token to skip", [4, 1], [2, -1, 5, -1], 4, "Padding maps to slot -1."),
        ("pages of 1 token", [6, 2, 9, 0], [3, 0, 2], 1, ""),
    ]
    for label, table, positions, page_size, case_hint in tables:

        def run(table=table, positions=positions, page_size=page_size):
            want = slot_mapping(
                pad_block_tables([table]), [0 if p >= 0 else -1 for p in positions], positions, page_size
            ).tolist()
            got = _ints("slot_mapping", call("slot_mapping", slot_mapping_fn, list(table), list(positions), page_size))
            if isinstance(got, Mismatch):
                return got
            if len(got) != len(want):
                return Mismatch(show(want), show(got), f"{len(got)} slots for {len(positions)} positions")
            i = first_wrong_index(got, want)
            if i is None:
                return None
            p, g = positions[i], got[i]
            hint = ""
            if p < 0:
                hint = (
                    "position -1 marks padding and maps to slot -1. (Used as an index, -1 is the *last* "
                    "entry of block_table: a silent bug.)"
                )
            else:
                block, row = divmod(p, page_size)
                if g == table[block] * page_size + block:
                    hint = "the row inside a page is pos % page_size; pos // page_size is the logical block."
                elif g == p:
                    hint = "you returned the position itself: look the page up, page = block_table[pos // page_size]."
                elif g == table[block] + row:
                    hint = "multiply the page id by page_size: slot = page * page_size + row."
                elif row < len(table) and g == table[row] * page_size + block:
                    hint = "block and row are swapped."
            detail = f"positions[{i}] = {p}: expected slot {want[i]}, got {g}"
            if p >= 0:
                block, row = divmod(p, page_size)
                detail += f" (block {block} is page {table[block]}, row {row}: {table[block]} * {page_size} + {row})"
            return Mismatch(show(want), show(got), detail, hint)

        inputs = [("block_table", str(table)), ("positions", str(positions)), ("page_size", str(page_size))]
        cases.append(Case(f"slot_mapping: {label}", run, inputs, case_hint))
    return run_cases("slot_mapping", cases, "locate, locate_pow2 (and its refusal) and slot_mapping on 11 cases")


# --------------------------------------------------------------------------- 03 cow_append


def _cow_case(label, page_size, parent_tokens, fork, n, append_slots):
    def run():
        manager = KVCacheManager(16, page_size)
        manager.add_sequence("parent")
        manager.append_tokens("parent", parent_tokens)
        seq = "parent"
        if fork:
            manager.fork("parent", "child")
            seq = "child"
        original = manager.block_table(seq)
        allocator = BlockAllocator(16)  # the learner's copy of the same state
        if allocator.allocate_many(len(original)) != original:
            raise AssertionError("checker: the allocator no longer hands out 0, 1, 2, ... first")
        for page in original if fork else ():
            allocator.incref(page)
        table = list(original)
        want_slots = manager.append_tokens(seq, n)
        want_copies, want_table = manager.pop_copies(), manager.block_table(seq)
        result = call("append_slots", append_slots, allocator, table, parent_tokens, n, page_size)
        if not isinstance(result, tuple) or len(result) != 2:
            return Mismatch("(slots, copies)", f"append_slots returned {show(result)}")
        slots = _ints("append_slots (slots)", result[0])
        if isinstance(slots, Mismatch):
            return slots
        try:
            copies = [tuple(int(x) for x in c) for c in result[1]]
        except (TypeError, ValueError):
            return Mismatch("copies as a list of (src, dst, num_rows)", show(result[1]))
        filled = parent_tokens - (len(original) - 1) * page_size if original else 0
        return _compare_cow(
            original,
            table,
            slots,
            copies,
            allocator,
            want_table,
            want_slots,
            want_copies,
            manager,
            page_size,
            filled,
            fork,
        )

    shared = "shared with a fork (refcount 2)" if fork else "private (refcount 1)"
    inputs = [
        ("block_table", str(list(range(-(-parent_tokens // page_size))))),
        ("num_tokens", str(parent_tokens)),
        ("n", str(n)),
        ("page_size", str(page_size)),
        ("its pages", shared),
    ]
    return Case(label, run, inputs)


def _compare_cow(
    original, table, slots, copies, allocator, want_table, want_slots, want_copies, manager, ps, filled, fork
):
    rows_needed = f"{len(want_table)} pages of {ps} rows"
    if len(table) != len(want_table):
        return Mismatch(
            f"block_table with {rows_needed}",
            f"block_table = {table}",
            "the new length needs exactly as many pages as it fills; update block_table in place",
        )
    fresh_of = {}  # the learner's fresh page -> the reference's fresh page
    for j, (g, w) in enumerate(zip(table, want_table)):
        if w in original:
            if g != w:
                return Mismatch(
                    f"block_table[{j}] = {w} (kept)",
                    f"block_table[{j}] = {g}",
                    hint=f"page {w} needs no copy: only a page that is shared *and* about to be written is copied.",
                )
        elif g in original:
            hint = (
                f"page {g} is shared with another sequence (refcount 2) and holds {filled} of {ps} rows: writing "
                f"the new tokens there would change what the other sequence reads. Copy-on-write: allocate a "
                f"page, record the copy ({g}, new_page, {filled}), decref page {g}, and write into the new page."
            )
            return Mismatch(
                f"block_table[{j}] = a new page (copy of page {g})",
                f"block_table[{j}] = {g}",
                f"your block_table is {table}",
                hint,
            )
        elif g in fresh_of:
            return Mismatch(f"distinct pages, e.g. {want_table}", f"block_table = {table}", f"page {g} appears twice")
        else:
            fresh_of[g] = w
    renamed = {g: fresh_of.get(g, g) for g in table}
    got_slots = [renamed.get(s // ps, -1) * ps + s % ps for s in slots]
    if got_slots != want_slots:
        i = first_wrong_index(got_slots, want_slots) if len(got_slots) == len(want_slots) else None
        where = f"; first at new token {i}" if i is not None else f"; {len(slots)} slots for n = {len(want_slots)}"
        return Mismatch(
            show(want_slots),
            show(slots),
            f"slots must be page * page_size + row of the new positions, "
            f"in the pages of your block_table {table}{where}",
        )
    got_copies = sorted((src, fresh_of.get(dst, dst), rows) for src, dst, rows in copies)
    if got_copies != sorted(want_copies):
        hint = ""
        if not copies and want_copies:
            hint = "the new page is empty: record the copy of the filled rows, (src, dst, num_rows)."
        elif copies and not want_copies:
            hint = (
                "no page needs a copy here: copy only a page that another sequence shares *and* that the new "
                "tokens write into (a full shared page is never written again)."
            )
        elif len(copies) == len(want_copies) and copies[0][2] != want_copies[0][2]:
            hint = f"copy only the filled rows: {want_copies[0][2]} of {ps}."
        shown = [(s, "new", r) for s, _, r in want_copies]
        return Mismatch(f"copies = {shown}", f"copies = {copies}", hint=hint)
    # Refcounts: the pages the sequence held before must agree with the reference; every
    # fresh page has exactly one owner. (Fresh ids may differ; the free count says the rest.)
    wanted = [(page, manager.refcount(page)) for page in sorted(set(original))] + [(g, 1) for g in fresh_of]
    for page, want in wanted:
        mine = allocator.refcount(page)
        if mine != want:
            hint = ""
            if page in original and fork and mine == 2 and want == 1:
                hint = f"after moving to a copy of page {page}, decref it: the other sequence is its only reader."
            elif page in fresh_of and mine == 0:
                hint = "take new pages with allocator.allocate()."
            return Mismatch(f"refcount({page}) = {want}", f"refcount({page}) = {mine}", hint=hint)
    try:
        allocator.check_integrity()
    except AssertionError as err:
        return Mismatch("a consistent allocator", f"check_integrity() failed: {err}")
    if allocator.num_free != manager.num_free:
        return Mismatch(
            f"{manager.num_free} free pages",
            f"{allocator.num_free} free pages",
            hint="allocate only the pages you use, and free none of the pages still in a table.",
        )
    return None


def check_cow_append(append_slots):
    """Exercise 03: ``append_slots(allocator, block_table, num_tokens, n, page_size) -> (slots,
    copies)``, with copy-on-write of a shared, partly filled last page."""
    cases = [
        _cow_case(
            "a private sequence whose last page is partly filled: fill it, no copy", 4, 6, False, 3, append_slots
        ),
        _cow_case(
            "a fork shares a partly filled last page: copy it before writing (copy-on-write)",
            4,
            6,
            True,
            1,
            append_slots,
        ),
        _cow_case(
            "a fork, a shared partly filled last page, and more tokens than fit in it", 4, 6, True, 7, append_slots
        ),
        _cow_case("a fork whose shared last page is full: no copy, a new page", 4, 8, True, 2, append_slots),
        _cow_case("n = 0 on a shared page: nothing written, nothing copied", 4, 6, True, 0, append_slots),
        _cow_case("an empty sequence: pages are allocated as tokens arrive", 4, 0, False, 5, append_slots),
        _cow_case("pages of 1 token, shared: never a partly filled page, never a copy", 1, 3, True, 2, append_slots),
    ]
    return run_cases("cow_append", cases, "7 appends: private, shared partial (copy), shared full, n = 0, empty")


# --------------------------------------------------------------------------- 04 ring_window


def check_ring_window(kv_token_idx):
    """Exercise 04: ``kv_token_idx(t, max_attention_window, sink_tokens, tokens_per_block)``."""
    windows = [
        ("no sinks: a plain ring of 8 rows", 8, 0, 4, 20),
        ("2 sinks in pages of 4: a bubble of 2 rows after them", 6, 2, 4, 20),
        ("4 sinks fill a whole page: no bubble", 10, 4, 4, 24),
        ("3 sinks in pages of 2: a bubble of 1 row", 7, 3, 2, 20),
        ("pages of 1 row: never a bubble", 5, 2, 1, 12),
        ("5 sinks of a 6-token window: a ring of 1 row", 6, 5, 4, 10),
    ]
    cases = []
    for label, window, sinks, tpb, steps in windows:

        def run(window=window, sinks=sinks, tpb=tpb, steps=steps):
            ring = RingWindow(window, sinks, tpb)
            want = [ring.kv_token_idx(t) for t in range(steps)]
            got = [call("kv_token_idx", kv_token_idx, t, window, sinks, tpb) for t in range(steps)]
            got = _ints("kv_token_idx", got)
            if isinstance(got, Mismatch):
                return got
            i = first_wrong_index(got, want)
            if i is None:
                return None
            cyc, bubble = window - sinks, ring.bubble_len
            guesses = {
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
            hint = next((h for h, f in guesses.items() if [f(t) for t in range(steps)] == got), "")
            detail = (
                f"t = {i}: expected row {want[i]}, got {got[i]} (sinks {sinks}, bubble {bubble}, ring of "
                f"{cyc} rows from row {sinks + bubble})"
            )
            return Mismatch(show(want), show(got), detail, hint)

        inputs = [
            ("t", f"0 .. {steps - 1}"),
            ("max_attention_window", str(window)),
            ("sink_tokens", str(sinks)),
            ("tokens_per_block", str(tpb)),
        ]
        cases.append(Case(label, run, inputs))
    return run_cases("ring_window", cases, "6 windows: no sinks, bubbles of 0-2 rows, pages of 1, a ring of 1 row")


# --------------------------------------------------------------------------- 05 prefix_cache


def _chain(tokens: list[int], page_size: int) -> list[int]:
    hashes, parent = [], None
    for j in range(len(tokens) // page_size):
        parent = block_hash(parent, tokens[j * page_size : (j + 1) * page_size])
        hashes.append(parent)
    return hashes


def _cached_tokens(cached_prompts, prompt, page_size) -> int:
    """The reference: admit the cached prompts and commit them (as if their K/V were
    written), then admit the new one, in a KVCacheManager."""
    manager = KVCacheManager(64, page_size, prefix_cache=True)
    for i, p in enumerate(cached_prompts):
        manager.admit(f"cached-{i}", p)
        manager.commit(f"cached-{i}")
    return manager.admit("new", prompt).num_cached_tokens


def check_prefix_cache(block_hashes, num_cached_tokens):
    """Exercise 05: ``block_hashes(token_ids, page_size)`` and ``num_cached_tokens(prompt,
    cached, page_size)``."""
    ps = 4
    cases = []
    for label, tokens in (
        ("10 tokens in pages of 4: two full blocks; the partial third is not hashed", list(range(10))),
        ("the chain: block 1 hashes its parent's hash with its tokens", [9, 9, 9, 9, 1, 2, 3, 4]),
        ("3 tokens: no full block, no hash", [5, 6, 7]),
    ):

        def run(tokens=tokens):
            want = _chain(tokens, ps)
            got = _ints("block_hashes", call("block_hashes", block_hashes, list(tokens), ps))
            if isinstance(got, Mismatch):
                return got
            if got == want:
                return None
            hint = ""
            alone = [block_hash(None, tokens[j * ps : (j + 1) * ps]) for j in range(len(tokens) // ps)]
            if got == alone:
                hint = "hash each block with its parent's hash (None for block 0), so equal hashes mean equal prefixes."
            elif len(got) != len(want):
                hint = f"hash the full blocks only: {len(tokens)} tokens make {len(want)} full blocks of {ps}."
            return Mismatch(show(want), show(got), hint=hint)

        cases.append(Case(f"block_hashes: {label}", run, [("token_ids", str(tokens)), ("page_size", str(ps))]))
    a = list(range(100, 112))  # a cached prompt of 3 full blocks
    scenarios = [
        ("a prompt that shares its first two blocks with a cached one", [a], a[:8] + [90, 91, 92, 93, 94], ""),
        (
            "the very same 12-token prompt again",
            [a],
            a,
            "The model needs the logits of the last prompt token, so at least that token is computed.",
        ),
        ("a cached prompt plus 2 more tokens", [a], a + [50, 51], ""),
        ("block 1 matches but block 0 does not: no hit at all", [a], [7, 7, 7, 7] + a[4:8] + [1], ""),
        ("nothing cached yet", [], a, ""),
        ("a prompt shorter than one block", [a], a[:3], ""),
    ]
    for label, cached_prompts, prompt, case_hint in scenarios:

        def run(cached_prompts=cached_prompts, prompt=prompt):
            cached = {h for p in cached_prompts for h in _chain(p, ps)}
            want = _cached_tokens(cached_prompts, prompt, ps)
            got = call("num_cached_tokens", num_cached_tokens, list(prompt), set(cached), ps)
            if isinstance(got, bool) or not isinstance(got, int) or got != want:
                hint = ""
                hits = 0
                for h in _chain(prompt, ps):
                    if h not in cached:
                        break
                    hits += 1
                if isinstance(got, int) and got == hits * ps and hits * ps >= len(prompt):
                    hint = "at least one token must be computed: when every block hits, recompute the last block."
                elif isinstance(got, int) and got % ps:
                    hint = f"cached tokens come in whole blocks of {ps}."
                return Mismatch(f"{want} tokens from the cache", show(got), hint=hint)
            return None

        inputs = [
            ("prompt", str(prompt)),
            ("cached", f"the {sum(len(p) // ps for p in cached_prompts)} block hashes of {cached_prompts}"),
            ("page_size", str(ps)),
        ]
        cases.append(Case(f"num_cached_tokens: {label}", run, inputs, case_hint))
    return run_cases("prefix_cache", cases, "3 hash chains and 6 cache lookups (hit, full hit, miss by the chain)")

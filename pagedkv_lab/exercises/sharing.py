"""Checks of exercises 03 and 05: append with copy-on-write and the prefix hash chain,
the two exercises about pages that sequences share. Expected values come from the
library (``KVCacheManager``, ``sharing.block_hash``); the learner's functions are only
ever called, never used to compute an expectation.

As in :mod:`.bookkeeping`: a module-level table of cases (a frozen dataclass per case)
and one runner per kind of case."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from pagedkv_lab.exercises.cases import Case, Mismatch, as_ints, first_wrong_index, run_cases
from pagedkv_lab.exercises.result import call, show
from pagedkv_lib.allocator import BlockAllocator
from pagedkv_lib.checks import is_int
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.sharing import block_hash

__all__ = ["check_cow_append", "check_prefix_cache"]


# --------------------------------------------------------------------------- 03 cow_append


@dataclass(frozen=True)
class CowCase:
    """``append_slots`` of ``n`` tokens to a sequence of ``parent_tokens`` tokens in pages
    of ``page_size``, whose pages a fork shares (``fork``) or not."""

    label: str
    page_size: int
    parent_tokens: int
    fork: bool
    n: int


COW_CASES = (
    CowCase("a private sequence whose last page is partly filled: fill it, no copy", 4, 6, False, 3),
    CowCase("a fork shares a partly filled last page: copy it before writing (copy-on-write)", 4, 6, True, 1),
    CowCase("a fork, a shared partly filled last page, and more tokens than fit in it", 4, 6, True, 7),
    CowCase("a fork whose shared last page is full: no copy, a new page", 4, 8, True, 2),
    CowCase("n = 0 on a shared page: nothing written, nothing copied", 4, 6, True, 0),
    CowCase("an empty sequence: pages are allocated as tokens arrive", 4, 0, False, 5),
    CowCase("pages of 1 token, shared: never a partly filled page, never a copy", 1, 3, True, 2),
)


@dataclass
class _CowOutcome:
    """One append, the learner's and the reference's: ``original`` the table before,
    ``table``/``slots``/``copies``/``allocator`` the learner's result and state,
    ``want_*`` and ``manager`` the reference's; ``filled`` rows of the last page before."""

    spec: CowCase
    original: list[int]
    table: list[int]
    slots: list[int]
    copies: list[tuple[int, ...]]
    allocator: BlockAllocator
    want_table: list[int]
    want_slots: list[int]
    want_copies: list[tuple[int, int, int]]
    manager: KVCacheManager
    filled: int


def _run_cow(c: CowCase, append_slots) -> Mismatch | None:
    manager = KVCacheManager(16, c.page_size)
    manager.add_sequence("parent")
    manager.append_tokens("parent", c.parent_tokens)
    seq = "parent"
    if c.fork:
        manager.fork("parent", "child")
        seq = "child"
    original = manager.block_table(seq)
    allocator = BlockAllocator(16)  # the learner's copy of the same state
    if allocator.allocate_many(len(original)) != original:
        raise AssertionError("checker: the allocator no longer hands out 0, 1, 2, ... first")
    for page in original if c.fork else ():
        allocator.incref(page)
    table = list(original)
    want_slots = manager.append_tokens(seq, c.n)
    want_copies, want_table = manager.pop_copies(), manager.block_table(seq)
    result = call("append_slots", append_slots, allocator, table, c.parent_tokens, c.n, c.page_size)
    if not isinstance(result, tuple) or len(result) != 2:
        return Mismatch("(slots, copies)", f"append_slots returned {show(result)}")
    slots = as_ints("append_slots (slots)", result[0])
    if isinstance(slots, Mismatch):
        return slots
    try:
        copies = [tuple(int(x) for x in cp) for cp in result[1]]
    except (TypeError, ValueError):
        return Mismatch("copies as a list of (src, dst, num_rows)", show(result[1]))
    filled = c.parent_tokens - (len(original) - 1) * c.page_size if original else 0
    outcome = _CowOutcome(
        c, original, table, slots, copies, allocator, want_table, want_slots, want_copies, manager, filled
    )
    return _compare_cow(outcome)


def _cow_table(o: _CowOutcome) -> tuple[Mismatch | None, dict[int, int]]:
    """The learner's table against the reference's; returns the mismatch (or None) and the
    map of the learner's fresh pages to the reference's."""
    ps, table, want_table = o.spec.page_size, o.table, o.want_table
    if len(table) != len(want_table):
        return Mismatch(
            f"block_table with {len(want_table)} pages of {ps} rows",
            f"block_table = {table}",
            "the new length needs exactly as many pages as it fills; update block_table in place",
        ), {}
    fresh_of = {}  # the learner's fresh page -> the reference's fresh page
    for j, (g, w) in enumerate(zip(table, want_table)):
        if w in o.original:
            if g != w:
                return Mismatch(
                    f"block_table[{j}] = {w} (kept)",
                    f"block_table[{j}] = {g}",
                    hint=f"page {w} needs no copy: only a page that is shared *and* about to be written is copied.",
                ), fresh_of
        elif g in o.original:
            hint = (
                f"page {g} is shared with another sequence (refcount 2) and holds {o.filled} of {ps} rows: writing "
                f"the new tokens there would change what the other sequence reads. Copy-on-write: allocate a "
                f"page, record the copy ({g}, new_page, {o.filled}), decref page {g}, and write into the new page."
            )
            return Mismatch(
                f"block_table[{j}] = a new page (copy of page {g})",
                f"block_table[{j}] = {g}",
                f"your block_table is {table}",
                hint,
            ), fresh_of
        elif g in fresh_of:
            return Mismatch(
                f"distinct pages, e.g. {want_table}", f"block_table = {table}", f"page {g} appears twice"
            ), fresh_of
        else:
            fresh_of[g] = w
    return None, fresh_of


def _cow_slots_and_copies(o: _CowOutcome, fresh_of: dict[int, int]) -> Mismatch | None:
    ps, slots, copies, want_copies = o.spec.page_size, o.slots, o.copies, o.want_copies
    renamed = {g: fresh_of.get(g, g) for g in o.table}
    got_slots = [renamed.get(s // ps, -1) * ps + s % ps for s in slots]
    if got_slots != o.want_slots:
        i = first_wrong_index(got_slots, o.want_slots) if len(got_slots) == len(o.want_slots) else None
        where = f"; first at new token {i}" if i is not None else f"; {len(slots)} slots for n = {len(o.want_slots)}"
        return Mismatch(
            show(o.want_slots),
            show(slots),
            f"slots must be page * page_size + row of the new positions, "
            f"in the pages of your block_table {o.table}{where}",
        )
    got_copies = sorted((src, fresh_of.get(dst, dst), rows) for src, dst, rows in copies)
    if got_copies == sorted(want_copies):
        return None
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


def _cow_refcounts(o: _CowOutcome, fresh_of: dict[int, int]) -> Mismatch | None:
    # The pages the sequence held before must agree with the reference; every fresh page
    # has exactly one owner. (Fresh ids may differ; the free count says the rest.)
    wanted = [(page, o.manager.refcount(page)) for page in sorted(set(o.original))] + [(g, 1) for g in fresh_of]
    for page, want in wanted:
        mine = o.allocator.refcount(page)
        if mine != want:
            hint = ""
            if page in o.original and o.spec.fork and mine == 2 and want == 1:
                hint = f"after moving to a copy of page {page}, decref it: the other sequence is its only reader."
            elif page in fresh_of and mine == 0:
                hint = "take new pages with allocator.allocate()."
            return Mismatch(f"refcount({page}) = {want}", f"refcount({page}) = {mine}", hint=hint)
    try:
        o.allocator.check_integrity()
    except AssertionError as err:
        return Mismatch("a consistent allocator", f"check_integrity() failed: {err}")
    if o.allocator.num_free != o.manager.num_free:
        return Mismatch(
            f"{o.manager.num_free} free pages",
            f"{o.allocator.num_free} free pages",
            hint="allocate only the pages you use, and free none of the pages still in a table.",
        )
    return None


def _compare_cow(o: _CowOutcome) -> Mismatch | None:
    """The learner's append against the reference's: table, then slots and copies, then
    refcounts and free pages (the first that differs is reported)."""
    mismatch, fresh_of = _cow_table(o)
    return mismatch or _cow_slots_and_copies(o, fresh_of) or _cow_refcounts(o, fresh_of)


def _cow_inputs(c: CowCase) -> list[tuple[str, str]]:
    return [
        ("block_table", str(list(range(-(-c.parent_tokens // c.page_size))))),
        ("num_tokens", str(c.parent_tokens)),
        ("n", str(c.n)),
        ("page_size", str(c.page_size)),
        ("its pages", "shared with a fork (refcount 2)" if c.fork else "private (refcount 1)"),
    ]


def check_cow_append(append_slots):
    """Exercise 03: ``append_slots(allocator, block_table, num_tokens, n, page_size) -> (slots,
    copies)``, with copy-on-write of a shared, partly filled last page."""
    cases = [Case(c.label, partial(_run_cow, c, append_slots), _cow_inputs(c)) for c in COW_CASES]
    return run_cases("cow_append", cases, "7 appends: private, shared partial (copy), shared full, n = 0, empty")


# --------------------------------------------------------------------------- 05 prefix_cache

PREFIX_PAGE_SIZE = 4
_CACHED_PROMPT = tuple(range(100, 112))  # a cached prompt of 3 full blocks


@dataclass(frozen=True)
class LookupCase:
    """``num_cached_tokens(prompt, cached, page_size)`` with the hashes of ``cached_prompts`` cached."""

    label: str
    cached_prompts: tuple[tuple[int, ...], ...]
    prompt: tuple[int, ...]
    hint: str = ""


HASH_CASES = (
    ("10 tokens in pages of 4: two full blocks; the partial third is not hashed", tuple(range(10))),
    ("the chain: block 1 hashes its parent's hash with its tokens", (9, 9, 9, 9, 1, 2, 3, 4)),
    ("3 tokens: no full block, no hash", (5, 6, 7)),
)
_A = _CACHED_PROMPT
LOOKUP_CASES = (
    LookupCase("a prompt that shares its first two blocks with a cached one", (_A,), _A[:8] + (90, 91, 92, 93, 94)),
    LookupCase(
        "the very same 12-token prompt again",
        (_A,),
        _A,
        "The model needs the logits of the last prompt token, so at least that token is computed.",
    ),
    LookupCase("a cached prompt plus 2 more tokens", (_A,), _A + (50, 51)),
    LookupCase("block 1 matches but block 0 does not: no hit at all", (_A,), (7, 7, 7, 7) + _A[4:8] + (1,)),
    LookupCase("nothing cached yet", (), _A),
    LookupCase("a prompt shorter than one block", (_A,), _A[:3]),
)


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


def _run_hashes(tokens: list[int], block_hashes) -> Mismatch | None:
    ps = PREFIX_PAGE_SIZE
    want = _chain(tokens, ps)
    got = as_ints("block_hashes", call("block_hashes", block_hashes, list(tokens), ps))
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


def _run_lookup(c: LookupCase, num_cached_tokens) -> Mismatch | None:
    ps = PREFIX_PAGE_SIZE
    cached_prompts, prompt = [list(p) for p in c.cached_prompts], list(c.prompt)
    cached = {h for p in cached_prompts for h in _chain(p, ps)}
    want = _cached_tokens(cached_prompts, prompt, ps)
    got = call("num_cached_tokens", num_cached_tokens, list(prompt), set(cached), ps)
    if is_int(got) and got == want:
        return None
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


def _lookup_inputs(c: LookupCase) -> list[tuple[str, str]]:
    cached_prompts = [list(p) for p in c.cached_prompts]
    blocks = sum(len(p) // PREFIX_PAGE_SIZE for p in cached_prompts)
    return [
        ("prompt", str(list(c.prompt))),
        ("cached", f"the {blocks} block hashes of {cached_prompts}"),
        ("page_size", str(PREFIX_PAGE_SIZE)),
    ]


def check_prefix_cache(block_hashes, num_cached_tokens):
    """Exercise 05: ``block_hashes(token_ids, page_size)`` and ``num_cached_tokens(prompt,
    cached, page_size)``."""
    cases = [
        Case(
            f"block_hashes: {label}",
            partial(_run_hashes, list(tokens), block_hashes),
            [("token_ids", str(list(tokens))), ("page_size", str(PREFIX_PAGE_SIZE))],
        )
        for label, tokens in HASH_CASES
    ]
    cases += [
        Case(f"num_cached_tokens: {c.label}", partial(_run_lookup, c, num_cached_tokens), _lookup_inputs(c), c.hint)
        for c in LOOKUP_CASES
    ]
    return run_cases("prefix_cache", cases, "3 hash chains and 6 cache lookups (hit, full hit, miss by the chain)")

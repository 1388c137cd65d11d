"""Checks of exercises 09 and 10, the caches before paging: prefill and decode writes into
a preallocated pool, and GQA's broadcast read. Expected values come from the library
(:mod:`pagedkv_lib.contiguous_cache`: ``prefill_write``, ``decode_write``,
``broadcast_kv_for_gqa``); the learner's functions are only ever called, never used to
compute an expectation.

As in :mod:`.bookkeeping`: a module-level table of cases (a frozen dataclass per case)
and one runner per kind of case. Every value a case writes names its token (K of token
``t`` is ``1000 t + 10 h + d + 1`` at head ``h``, dim ``d``; V is minus K), so a row in the
wrong place is told by the token it holds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from pagedkv_lab.exercises.cases import Case, Mismatch, run_cases
from pagedkv_lab.exercises.result import LearnerError, call, show, where_in_learner_code
from pagedkv_lib.contiguous_cache import broadcast_kv_for_gqa, decode_write, prefill_write

__all__ = ["check_prealloc_cache", "check_gqa_broadcast"]

# --------------------------------------------------------------------------- 09 prealloc_cache

MAX_BATCH, MAX_SEQ_LEN, HEADS, DIM = 4, 8, 2, 3
ROW_HINT = "Rows 0 .. seq_lens[slot] - 1 of a slot hold its sequence: the next token goes to row seq_lens[slot]."


def token_rows(first: int, n: int) -> torch.Tensor:
    """K of tokens ``first .. first + n - 1``, ``[n, HEADS, DIM]`` float32 (V is minus it)."""
    t = torch.arange(first, first + n, dtype=torch.float32)[:, None, None] * 1000
    return t + torch.arange(HEADS, dtype=torch.float32)[None, :, None] * 10 + torch.arange(DIM) + 1


@dataclass(frozen=True)
class PoolCase:
    """Operations on a pool ``[MAX_BATCH, MAX_SEQ_LEN, HEADS, DIM]`` whose unwritten rows are
    NaN: ``setup`` done by the library, then ``ops`` by the learner's functions. An
    operation is ``("prefill", slot, n, first_token)`` or ``("decode", slots,
    first_token)`` (token ``first_token + i`` for ``slots[i]``). ``refuse``: the last
    operation must raise ValueError and write nothing."""

    label: str
    setup: tuple
    ops: tuple
    hint: str = ""
    refuse: bool = False


_HELD = (("prefill", 1, 5, 0), ("prefill", 3, 2, 10))  # slot 1 holds tokens 0-4, slot 3 tokens 10-11
POOL_CASES = (
    PoolCase("prefill a 5-token prompt into slot 1 of an empty pool", (), (("prefill", 1, 5, 0),)),
    PoolCase("prefill slot 3 while slot 1 holds a sequence", _HELD[:1], (("prefill", 3, 2, 10),)),
    PoolCase("one decode step for slots [3, 1]", _HELD, (("decode", (3, 1), 20),), ROW_HINT),
    PoolCase(
        "three decode steps for slots [0, 3, 1] (slot 0 starts empty)",
        _HELD,
        (("decode", (0, 3, 1), 30), ("decode", (0, 3, 1), 40), ("decode", (0, 3, 1), 50)),
        "Each step writes one row further: seq_lens[slot] grows by 1 for every token written.",
    ),
    PoolCase(
        "prefill a reused slot: slot 1 held 7 tokens, the new prompt has 3",
        (("prefill", 1, 7, 0),),
        (("prefill", 1, 3, 60),),
        "A freed slot is reused: its old rows are stale, and seq_lens[slot] must say 3, not 10.",
    ),
    PoolCase(
        "decode into the last free row: slot 2 holds 7 of 8 rows",
        (("prefill", 2, 7, 0), ("prefill", 0, 1, 10)),
        (("decode", (0, 2), 70),),
    ),
    PoolCase(
        "refuse a decode step into a full slot: slots [0, 2], slot 2 holds 8 of 8 rows",
        (("prefill", 2, 8, 0), ("prefill", 0, 1, 10)),
        (("decode", (0, 2), 80),),
        "A full slot has no free row: raise ValueError before writing anything, for any slot of the step.",
        refuse=True,
    ),
)


def _empty_pool() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.full((MAX_BATCH, MAX_SEQ_LEN, HEADS, DIM), float("nan"))
    return k, k.clone(), torch.zeros(MAX_BATCH, dtype=torch.int64)


def _apply(op: tuple, pool, prefill, decode) -> None:
    if op[0] == "prefill":
        _, slot, n, first = op
        prefill(*pool, slot, token_rows(first, n), -token_rows(first, n))
    else:
        _, slots, first = op
        decode(*pool, list(slots), token_rows(first, len(slots)), -token_rows(first, len(slots)))


def _who(row: torch.Tensor) -> str:
    """Which token's K (or V) a pool row ``[HEADS, DIM]`` holds, in words."""
    if row.isnan().all():
        return "nothing (never written)"
    first = float(row[0, 0])
    token = round((abs(first) - 1) / 1000)
    if torch.equal(row, token_rows(token, 1)[0]):
        return f"token {token}'s K"
    if torch.equal(row, -token_rows(token, 1)[0]):
        return f"token {token}'s V"
    return f"{show(row)}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _first_wrong(got, want) -> tuple[str, int, int] | None:
    """``(which pool, slot, row)`` of the first row that differs, K before V."""
    for name, g, w in (("k_cache", got[0], want[0]), ("v_cache", got[1], want[1])):
        for slot in range(MAX_BATCH):
            for row in range(MAX_SEQ_LEN):
                if not _same(g[slot, row], w[slot, row]):
                    return name, slot, row
    return None


def _where_is(pool: torch.Tensor, row: torch.Tensor) -> tuple[int, int] | None:
    """``(slot, row)`` of the first row of ``pool`` equal to ``row`` (None if none is)."""
    for s in range(MAX_BATCH):
        for r in range(MAX_SEQ_LEN):
            if _same(pool[s, r], row):
                return s, r
    return None


def _placement_hint(got: torch.Tensor, want: torch.Tensor, slot: int, row: int) -> str:
    """Where the token at the first wrong row went (or came from), in words."""
    if not want[slot, row].isnan().all():  # a token is missing here: where did the learner put it?
        right, placed = (slot, row), _where_is(got, want[slot, row])
    else:  # a token is here that belongs elsewhere
        right, placed = _where_is(want, got[slot, row]), (slot, row)
    if right is None or placed is None:
        return ""
    if placed[0] != right[0]:
        return "k[i] and v[i] go to slot slots[i] (the slot of the batch's i-th sequence), not to slot i."
    if placed[1] == right[1] + 1:
        return "one row too far: the next token goes to row seq_lens[slot], the first free row."
    if placed[1] == right[1] - 1:
        return "one row too early: row seq_lens[slot] - 1 holds the sequence's last token; write at seq_lens[slot]."
    return ""


def _pool_hint(case: PoolCase, before, got, want, wrong) -> str:
    """A diagnosis of the learner's pool ``got`` against ``want`` (``before``: the state
    the learner's operations started from)."""
    decoded = [s for op in case.ops if op[0] == "decode" for s in op[1]]
    if decoded and all(int(got[2][s]) == int(before[2][s]) for s in decoded):
        return "advance seq_lens[slot] by 1 for every token written: the next step's token goes one row further."
    for op in case.ops:
        if op[0] == "prefill" and int(got[2][op[1]]) == int(before[2][op[1]]) + op[2] != int(want[2][op[1]]):
            return "prefill starts a new sequence: set seq_lens[slot] = n, whatever the slot held before."
    if wrong is None:
        return ""
    name, slot, row = wrong
    mine, theirs = (got[0], want[0]) if name == "k_cache" else (got[1], want[1])
    held = _who(mine[slot, row])
    if held.endswith(("'s V", "'s K")) and held[-1] != name[0].upper():
        return "K and V are swapped: k goes into k_cache, v into v_cache."
    return _placement_hint(mine, theirs, slot, row)


def _run_pool(case: PoolCase, prefill_fn, decode_fn) -> Mismatch | None:
    lib = _empty_pool()
    for op in case.setup:
        _apply(op, lib, prefill_write, decode_write)
    before = tuple(t.clone() for t in lib)
    mine = tuple(t.clone() for t in lib)
    learner = (partial(call, "prefill_write", prefill_fn), partial(call, "decode_write", decode_fn))
    if case.refuse:
        return _run_refusal(case, mine, before, learner)
    for op in case.ops:
        _apply(op, lib, prefill_write, decode_write)
        _apply(op, mine, *learner)
    wrong = _first_wrong(mine, lib)
    if wrong is None and torch.equal(mine[2], lib[2]):
        return None
    detail = ""
    if wrong is not None:
        name, slot, row = wrong
        pools = {"k_cache": (mine[0], lib[0]), "v_cache": (mine[1], lib[1])}[name]
        detail = f"{name}[{slot}, {row}] holds {_who(pools[0][slot, row])}; expected {_who(pools[1][slot, row])}"
    return Mismatch(
        f"seq_lens = {lib[2].tolist()}, and the rows written as the spec says",
        f"seq_lens = {mine[2].tolist()}",
        detail or "every row is right: only seq_lens differs",
        _pool_hint(case, before, mine, lib, wrong),
    )


def _run_refusal(case: PoolCase, mine, before, learner) -> Mismatch | None:
    try:
        for op in case.ops:
            _apply(op, mine, *learner)
    except LearnerError as err:
        if not isinstance(err.error, ValueError):
            got = f"{err.name} raised {type(err.error).__name__}: {str(err.error).strip()[:200]}"
            where = where_in_learner_code(err.error)
            return Mismatch("ValueError, and the pool as it was", got, where, detail_head="raised at")
        if _first_wrong(mine, before) is None and torch.equal(mine[2], before[2]):
            return None
        return Mismatch(
            "ValueError, and the pool as it was",
            "ValueError, after writing",
            f"seq_lens = {mine[2].tolist()} (it was {before[2].tolist()})",
            "check every slot of the step before the first write: a refused step must change nothing.",
        )
    return Mismatch("ValueError (slot 2 is full)", f"no error; seq_lens = {mine[2].tolist()}")


def check_prealloc_cache(prefill_write_fn, decode_write_fn):
    """Exercise 09: ``prefill_write(k_cache, v_cache, seq_lens, slot, k, v)`` and
    ``decode_write(k_cache, v_cache, seq_lens, slots, k, v)``."""
    cases = [
        Case(
            c.label,
            partial(_run_pool, c, prefill_write_fn, decode_write_fn),
            [
                (
                    "pool",
                    f"k_cache, v_cache [{MAX_BATCH}, {MAX_SEQ_LEN}, {HEADS}, {DIM}], NaN where nothing was written",
                ),
                ("before", _describe(c.setup) or "an empty pool, seq_lens = [0, 0, 0, 0]"),
                ("then", _describe(c.ops)),
            ],
            c.hint,
        )
        for c in POOL_CASES
    ]
    return run_cases(
        "prealloc_cache", cases, "7 cases: prompts, a reused slot, decode steps, the last row, a full slot"
    )


def _tokens(first: int, n: int) -> str:
    return f"token {first}" if n == 1 else f"tokens {first}..{first + n - 1}"


def _describe(ops: tuple) -> str:
    words = []
    for op in ops:
        if op[0] == "prefill":
            words.append(f"prefill_write(slot={op[1]}, {_tokens(op[3], op[2])})")
        else:
            words.append(f"decode_write(slots={list(op[1])}, {_tokens(op[2], len(op[1]))})")
    return "; ".join(words)


# --------------------------------------------------------------------------- 10 gqa_broadcast


@dataclass(frozen=True)
class BroadcastCase:
    """``broadcast_kv_for_gqa(kv, num_q_heads)`` of ``kv [seq_len, num_kv_heads, DIM]``, read
    from ``source``: ``"tensor"`` (its own), ``"pool"`` (rows of a slot of an NHD pool: an
    offset into a larger storage) or ``"hnd"`` (a transposed slice of an HND pool: not
    contiguous). ``refuse``: ``num_q_heads`` is no multiple of ``num_kv_heads``."""

    label: str
    num_q_heads: int
    num_kv_heads: int
    seq_len: int
    source: str = "tensor"
    refuse: bool = False


BROADCAST_CASES = (
    BroadcastCase("GQA: 8 query heads share 2 KV heads (groups of 4)", 8, 2, 5),
    BroadcastCase("MQA: 6 query heads share 1 KV head", 6, 1, 4),
    BroadcastCase("MHA: 4 query heads, 4 KV heads (groups of 1)", 4, 4, 3),
    BroadcastCase("a read from a preallocated pool: rows 0..5 of slot 2 (an offset into its storage)", 8, 2, 6, "pool"),
    BroadcastCase("a read from an HND pool [slot, heads, rows, dim], transposed: not contiguous", 6, 3, 5, "hnd"),
    BroadcastCase("6 query heads over 4 KV heads is no grouping: refuse it", 6, 4, 2, refuse=True),
)
SOURCES = {"tensor": "a tensor of its own", "pool": "a view of an NHD pool", "hnd": "a view of an HND pool"}
VIEW_HINT = (
    "expand makes the group dimension with stride 0 and copies nothing; repeat, repeat_interleave, clone, "
    "contiguous (and a reshape that cannot view) copy group x the cached bytes, at every layer of every step."
)


def _kv(c: BroadcastCase) -> torch.Tensor:
    """``kv [seq_len, num_kv_heads, DIM]`` with distinct values, as ``c.source`` reads it."""
    values = torch.arange(c.seq_len * c.num_kv_heads * DIM, dtype=torch.float32) + 1
    if c.source == "tensor":
        return values.view(c.seq_len, c.num_kv_heads, DIM)
    if c.source == "pool":
        pool = torch.zeros(4, 8, c.num_kv_heads, DIM)
        pool[2, : c.seq_len] = values.view(c.seq_len, c.num_kv_heads, DIM)
        return pool[2, : c.seq_len]
    pool = torch.zeros(3, c.num_kv_heads, 7, DIM)
    pool[1, :, : c.seq_len] = values.view(c.seq_len, c.num_kv_heads, DIM).transpose(0, 1)
    return pool[1, :, : c.seq_len].transpose(0, 1)


def _shape_hint(got_shape: tuple, c: BroadcastCase) -> str:
    group = c.num_q_heads // c.num_kv_heads
    if got_shape == (c.seq_len, c.num_q_heads, DIM):
        return (
            "keep the group as a dimension of its own, [seq_len, num_kv_heads, group, head_dim]: flattened to "
            "num_q_heads it cannot be a view (a stride-0 dimension does not merge with its neighbour: reshape copies)."
        )
    if got_shape == (c.seq_len, group, c.num_kv_heads, DIM):
        return "the group goes after the KV heads: [seq_len, num_kv_heads, group, head_dim]."
    return ""


def _run_broadcast(c: BroadcastCase, fn) -> Mismatch | None:
    kv = _kv(c)
    if c.refuse:
        return _run_gqa_refusal(c, kv, fn)
    want = broadcast_kv_for_gqa(kv, c.num_q_heads)
    got = call("broadcast_kv_for_gqa", fn, kv, c.num_q_heads)
    if not isinstance(got, torch.Tensor):
        return Mismatch(f"a tensor of shape {tuple(want.shape)}", f"{show(got)} ({type(got).__name__})")
    if got.shape != want.shape:
        return Mismatch(
            f"shape {tuple(want.shape)}", f"shape {tuple(got.shape)}", hint=_shape_hint(tuple(got.shape), c)
        )
    group = c.num_q_heads // c.num_kv_heads
    for h in range(c.num_q_heads):
        read = got[:, h // group, h % group]
        if not torch.equal(read, kv[:, h // group]):
            reads = [j for j in range(c.num_kv_heads) if torch.equal(read, kv[:, j])]
            what = f"KV head {reads[0]}" if reads else "values of no KV head"
            hint = ""
            if reads and reads[0] == h % c.num_kv_heads:
                hint = "heads are grouped, not interleaved: query heads 0 .. group-1 share KV head 0 (h // group)."
            detail = f"query head {h} (out[:, {h // group}, {h % group}]) reads {what}; expected KV head {h // group}"
            return Mismatch("query head h reads KV head h // group", f"query head {h} reads {what}", detail, hint)
    if got.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr():
        return Mismatch(
            "a view of kv: its storage, no byte copied",
            f"a tensor with a storage of its own ({got.untyped_storage().nbytes()} bytes copied from {kv.nbytes})",
            f"out.untyped_storage().data_ptr() differs from kv's; stride {got.stride()}",
            VIEW_HINT,
        )
    return None


def _run_gqa_refusal(c: BroadcastCase, kv: torch.Tensor, fn) -> Mismatch | None:
    try:
        got = call("broadcast_kv_for_gqa", fn, kv, c.num_q_heads)
    except LearnerError as err:
        if isinstance(err.error, ValueError):
            return None
        raise
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else show(got)
    return Mismatch(
        "ValueError",
        f"returned {shape}",
        hint=f"refuse with ValueError: {c.num_q_heads} query heads cannot share {c.num_kv_heads} KV heads evenly.",
    )


def check_gqa_broadcast(broadcast_fn):
    """Exercise 10: ``broadcast_kv_for_gqa(kv, num_q_heads)``."""
    cases = [
        Case(
            c.label,
            partial(_run_broadcast, c, broadcast_fn),
            [
                ("kv", f"[{c.seq_len}, {c.num_kv_heads}, {DIM}], {SOURCES[c.source]}"),
                ("num_q_heads", str(c.num_q_heads)),
            ],
        )
        for c in BROADCAST_CASES
    ]
    return run_cases("gqa_broadcast", cases, "GQA, MQA, MHA, reads from two pools (views, no copy), and a refusal")

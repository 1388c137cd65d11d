"""Mistakes learners make, planted in the solutions: each is a small source edit of an
exercise's solution and the words the check's message must contain when it meets it.

The checker's tests run every one (the check must fail and say what went wrong), and
instructor notes can be made from the same table (what each exercise's typical bug is,
and what the learner will read). Cases are data: add a row, not a test.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv_lab.exercises.catalog import get
from pagedkv_lab.exercises.files import load_solution

__all__ = ["Mistake", "MISTAKES", "load_with_mistake"]


@dataclass(frozen=True)
class Mistake:
    """``old`` -> ``new`` in ``exercises/solutions/<stem>.py`` of ``exercise`` (``old`` must
    occur there); ``what`` says the mistake in an instructor's words; the failed check's
    message must contain ``message``."""

    exercise: str
    what: str
    old: str
    new: str
    message: str


MISTAKES: tuple[Mistake, ...] = (
    # 01-05, the bookkeeping exercises
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
    # 09-10, the caches before paging (they come right after 01 in the workshop)
    Mistake(
        "prealloc_cache",
        "writes a decode token one row past the first free row",
        "row = seq_lens[slot]  # the first free row",
        "row = seq_lens[slot] + 1",
        "one row too far",
    ),
    Mistake(
        "prealloc_cache",
        "never advances seq_lens after a decode write",
        "        seq_lens[slot] += 1\n",
        "",
        "advance seq_lens[slot] by 1",
    ),
    Mistake(
        "prealloc_cache",
        "adds the prompt to a reused slot's old length",
        "seq_lens[slot] = n",
        "seq_lens[slot] += n",
        "set seq_lens[slot] = n",
    ),
    Mistake(
        "prealloc_cache",
        "writes token i into slot i instead of slots[i]",
        "k_cache[slot, row] = k[i]",
        "k_cache[i, row] = k[i]",
        "go to slot slots[i]",
    ),
    Mistake(
        "prealloc_cache",
        "never checks for a full slot (IndexError past the last row)",
        "    for slot in slots:  # every slot checked before the first write\n"
        "        if seq_lens[slot] >= max_seq_len:\n"
        '            raise ValueError(f"slot {slot} is full: it holds max_seq_len={max_seq_len} tokens")\n',
        "",
        "raise ValueError before writing anything",
    ),
    Mistake(
        "gqa_broadcast",
        "copies the KV heads (a broadcast that is no view)",
        "kv.unsqueeze(2).expand(shape)",
        "kv.unsqueeze(2).expand(shape).contiguous()",
        "expand makes the group dimension with stride 0",
    ),
    Mistake(
        "gqa_broadcast",
        "interleaves the heads (query head h reads KV head h % num_kv_heads)",
        "kv.unsqueeze(2).expand(shape)",
        "kv.repeat(1, group, 1).view(shape)",
        "heads are grouped, not interleaved",
    ),
    Mistake(
        "gqa_broadcast",
        "flattens the group into num_q_heads (reshape copies)",
        "kv.unsqueeze(2).expand(shape)",
        "kv.unsqueeze(2).expand(shape).reshape(kv.shape[0], num_q_heads, kv.shape[2])",
        "keep the group as a dimension of its own",
    ),
    Mistake(
        "gqa_broadcast",
        "does not refuse a head count that does not divide",
        "    if num_q_heads % num_kv_heads:\n"
        '        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")\n',
        "",
        "refuse with ValueError",
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
    # 06: the padding guard is the mistake the spec warns about most; without it a slot
    # of -1 addresses the row before page 0 (Triton divides and takes remainders toward
    # zero), so the kernel writes before the pool: a corrupted heap outside the check.
    Mistake("append_kernel", "no padding guard: slot -1 writes",
            "mask = (h < tl.where(slot >= 0, num_heads, 0)) & (d < head_dim)",
            "mask = (h < num_heads) & (d < head_dim)", "(padding, slot -1) wrote 64 bytes before the pool"),
    Mistake("append_kernel", "// for %: the row is the page number", "row = (slot % page_size)",
            "row = (slot // page_size)", "the row inside the page is slot % page_size"),
    Mistake("merge_kernel", "exp2 of the raw lse (overflow)", 'tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))',
            "tl.exp2(lse)", "subtract the largest"),
    Mistake("merge_kernel", "an empty split's NaN partial gets in", "part = tl.where(w[:, None] > 0, part, 0.0)",
            "pass", "0 * NaN = NaN"),
    Mistake("merge_kernel", "a missing other=: masked lse lanes load 0, not -inf",
            'mask=s < num_splits, other=float("-inf"))', "mask=s < num_splits)", 'other=float("-inf")'),
    Mistake("decode_kernel", "no online-softmax rescale", "alpha = tl.exp2(m_i - m_new)", "alpha = 1.0",
            "rescale l and acc"),
    Mistake("decode_kernel", "lanes past seq_len keep their scores",
            's = tl.where(valid, tl.sum(q[None, :] * k, axis=1), float("-inf"))', "s = tl.sum(q[None, :] * k, axis=1)",
            "set their scores to -inf"),
)  # fmt: skip


def load_with_mistake(mistake: Mistake) -> list:
    """The functions of ``mistake.exercise`` (in the order ``check`` takes them) from its
    solution with the mistake planted. Raises ValueError if ``mistake.old`` no longer
    occurs in the solution."""
    exercise = get(mistake.exercise)
    space = load_solution(exercise, replace=(mistake.old, mistake.new))
    return [space[name] for name in exercise.functions]

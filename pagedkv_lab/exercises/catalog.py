"""The exercises, in the workshop's order (09 and 10 come right after 01; their numbers
leave the others' as they were): what each asks for and which check judges it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv_lab.exercises import bookkeeping, caches, check_append, check_decode, check_merge, sharing

__all__ = ["Exercise", "EXERCISES", "get"]


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``stem`` names its notebook (``exercises/<stem>.ipynb``) and solution
    (``exercises/solutions/<stem>.py``); ``functions`` are the names the learner writes,
    in the order :func:`pagedkv_lab.exercises.check` takes them."""

    number: int
    name: str
    title: str
    functions: tuple[str, ...]
    checker: Callable
    teaches: str
    runs_kernels: bool = False  # its checker takes ``isolate=`` (a learner's kernel may crash the process)

    @property
    def stem(self) -> str:
        return f"{self.number:02d}_{self.name}"


EXERCISES: dict[str, Exercise] = {
    e.name: e
    for e in (
        Exercise(
            1,
            "kv_bytes",
            "KV bytes per token and fragmentation",
            ("bytes_per_token", "fragmentation"),
            bookkeeping.check_kv_bytes,
            "the memory formula; pages round every sequence up",
        ),
        Exercise(
            9,
            "prealloc_cache",
            "Prefill and decode writes into a preallocated cache",
            ("prefill_write", "decode_write"),
            caches.check_prealloc_cache,
            "slots and the first free row, seq_lens[slot]; a reused slot; refusing a full one before any write",
        ),
        Exercise(
            10,
            "gqa_broadcast",
            "GQA's read through a view",
            ("broadcast_kv_for_gqa",),
            caches.check_gqa_broadcast,
            "query head h reads KV head h // group; expand (stride 0) is a view, repeat is a copy",
        ),
        Exercise(
            2,
            "slot_mapping",
            "locate and slot mapping",
            ("locate", "locate_pow2", "slot_mapping"),
            bookkeeping.check_slot_mapping,
            "divmod, its shift-and-mask fast path, page * page_size + row, -1",
        ),
        Exercise(
            3,
            "cow_append",
            "Append with copy-on-write",
            ("append_slots",),
            sharing.check_cow_append,
            "refcounts, and copying a shared, partly filled last page before writing it",
        ),
        Exercise(
            4,
            "ring_window",
            "The ring window's kv_token_idx",
            ("kv_token_idx",),
            bookkeeping.check_ring_window,
            "sinks, the bubble and the ring (TensorRT-LLM's KVBlockArray)",
        ),
        Exercise(
            5,
            "prefix_cache",
            "The prefix hash chain",
            ("block_hashes", "num_cached_tokens"),
            sharing.check_prefix_cache,
            "chained block hashes; a full hit still computes one token",
        ),
        Exercise(
            6,
            "append_kernel",
            "A Triton append kernel (slot mapping)",
            ("append",),
            check_append.check_append_kernel,
            "a Triton kernel: program ids, masks, strides, a bit-exact copy",
            runs_kernels=True,
        ),
        Exercise(
            7,
            "merge_kernel",
            "A Triton split-KV merge",
            ("merge",),
            check_merge.check_merge_kernel,
            "log-sum-exp weights, base 2, empty splits, overflow",
            runs_kernels=True,
        ),
        Exercise(
            8,
            "decode_kernel",
            "A Triton paged decode kernel",
            ("decode",),
            check_decode.check_decode_kernel,
            "a block-table walk with an online softmax, GQA, NaN guards",
            runs_kernels=True,
        ),
    )
}


def get(name: str) -> Exercise:
    """The exercise called ``name`` (or numbered ``name``, e.g. ``"06"``); ValueError lists them."""
    for e in EXERCISES.values():
        if name in (e.name, e.stem, f"{e.number:02d}", str(e.number)):
            return e
    raise ValueError(f"no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")

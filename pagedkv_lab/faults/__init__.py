"""Named, switchable faults: the silent bugs of paged KV caches, made reproducible.

The one registry of planted bugs, for the library, the engine and the kernels.
:data:`REGISTRY` holds one :class:`Fault` per bug: its name, its family, the wrong
line in one sentence, and the replacement part(s) it swaps in (a function, class,
kernel or wrapper, by import path, loaded only when asked for: a kernel fault imports
triton, the registry does not). Production code holds no fault: a caller that wants
one asks the registry for the part and passes it where the correct part would go.

Who switches faults on, by name:

* the conformance harness (:mod:`pagedkv_lab.verify`, ``faults={"past_len_zero",
  ...}``; families ``harness`` and ``quantized``, names in :data:`FAULTS`): it swaps
  the one component the fault is about or wraps the callable under test, for one case;
* the engine (``pagedkv_engine.Engine(..., faults={...})``, ``python -m pagedkv_engine
  --fault``; family ``engine``, :data:`ENGINE_FAULTS`): :func:`engine_parts` gives
  the replacement parts of :class:`pagedkv_engine.parts.EngineParts`;
* notebook 08 and the harness tests, for kernels written to other engines'
  conventions (family ``peer kernel``, :data:`PEER_KERNEL_FAULTS`): faulty copies of
  :mod:`pagedkv_lab.peer_kernels`' kernels;
* notebook 01b and ``tests/test_caches_before_paging.py``, for the caches before paging
  (family ``caches``, :data:`CACHE_FAULTS`): the exercise set's sketches, each as the
  correct part of :mod:`pagedkv_lib.contiguous_cache` with its wrong line;
* the page-pointer route's tests (family ``read route``): faulty host parts of
  :mod:`pagedkv_kernels.decode_page_pointers`, swapped in where the correct part is
  looked up;
* the thread stress test, its rate script and notebook 02, for bookkeeping shared between
  threads (family ``concurrency``): a manager or allocator whose lock is a no-op.

Nothing is patched globally, so a fault never leaks into the next cell or test.

Modules: :mod:`~pagedkv_lab.faults.harness` (the harness's parts and wrappers),
:mod:`~pagedkv_lab.faults.quantized` (quantized pools), :mod:`~pagedkv_lab.faults.engine`
(engine parts), :mod:`~pagedkv_lab.faults.caches` (the caches before paging),
:mod:`~pagedkv_lab.faults.concurrency` (locks that exclude nobody),
:mod:`~pagedkv_lab.faults.peer_kernels` (faulty Triton kernels; imports triton and
:mod:`pagedkv_kernels`, so nothing here imports it),
:mod:`~pagedkv_lab.faults.read_routes` (the page-pointer route's host parts).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from pagedkv_lab.faults.concurrency import NoLock, UnlockedManager
from pagedkv_lab.faults.harness import (
    AbsolutePositionWindow,
    NoCopyOnWriteManager,
    chunk_local_mask,
    chunk_positions,
    chunk_positions_from_zero,
    element_offset_int32,
    minus_one_as_index,
    rotary_at_cache_position,
    tree_mask_ignored,
    whole_page_decode,
)
from pagedkv_lab.faults.quantized import nvfp4_quantize_unrounded_scale, shared_kv_scale, unrounded_block_scale

__all__ = [
    # the registry
    "Fault",
    "FAMILIES",
    "REGISTRY",
    "FAULTS",
    "ENGINE_FAULTS",
    "PEER_KERNEL_FAULTS",
    "CACHE_FAULTS",
    "READ_ROUTE_FAULTS",
    "faults_of",
    "check_faults",
    "engine_parts",
    # the harness's parts and wrappers
    "chunk_positions",
    "chunk_positions_from_zero",
    "AbsolutePositionWindow",
    "NoCopyOnWriteManager",
    "minus_one_as_index",
    "element_offset_int32",
    "whole_page_decode",
    "chunk_local_mask",
    "rotary_at_cache_position",
    "tree_mask_ignored",
    # locks that exclude nobody
    "NoLock",
    "UnlockedManager",
    # quantized pools
    "nvfp4_quantize_unrounded_scale",
    "unrounded_block_scale",
    "shared_kv_scale",
]

FAMILIES = ("harness", "quantized", "engine", "peer kernel", "caches", "read route", "concurrency")


def load(path: str):
    """The object at ``"module:attribute"`` (imported now)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Fault:
    """One planted bug.

    ``parts`` maps a role (the name of the component it replaces: ``"manager"``,
    ``"positions"``, ``"kernel"``, ...) to the import path (``"module:attribute"``) of
    the faulty part; a role ending in ``_fn`` names a *wrapper* around that callable
    of the harness. ``replaces`` maps a role to the correct part it stands in for
    (absent for a wrapper, or where the correct part is the identity). ``parts`` is
    empty where the harness's scenario builds the faulty input itself (``where``).
    """

    name: str
    family: str
    wrong: str
    parts: dict[str, str] = field(default_factory=dict)
    replaces: dict[str, str] = field(default_factory=dict)
    where: str = ""

    def part(self, role: str):
        """The faulty part for ``role`` (imported now)."""
        return load(self.parts[role])

    def correct(self, role: str):
        """The correct part that ``part(role)`` replaces (imported now)."""
        return load(self.replaces[role])


_H = "pagedkv_lab.faults.harness:"
_Q = "pagedkv_lab.faults.quantized:"
_E = "pagedkv_lab.faults.engine:"
_K = "pagedkv_lab.faults.peer_kernels:"
_T = "pagedkv_lab.faults.concurrency:"  # threads
_PEER = "pagedkv_lab.peer_kernels:"
_R = "pagedkv_lab.faults.read_routes:"
_MANAGER = {"manager": "pagedkv_lib.manager:KVCacheManager"}
_SCENARIOS = "pagedkv_lab.verify.scenarios"
_C = "pagedkv_lab.faults.caches:"
_LIB = "pagedkv_lib.contiguous_cache:"


def _peer(name: str, family_fn: str, kernel: str, wrong: str) -> Fault:
    """A peer-kernel fault: a faulty copy of ``kernel`` and the entry point launching it."""
    return Fault(
        name,
        "peer kernel",
        wrong,
        parts={family_fn: f"{_K}{family_fn}_{name}", "kernel": f"{_K}{kernel}_{name}"},
        replaces={family_fn: f"{_PEER}{family_fn}", "kernel": f"{_PEER}{kernel}"},
    )


REGISTRY: tuple[Fault, ...] = (
    Fault(
        "past_len_zero",
        "harness",
        "chunked prefill writes every chunk from position 0 instead of past_len = cache_len - chunk_len",
        parts={"positions": f"{_H}chunk_positions_from_zero"},
        replaces={"positions": "pagedkv_lib.formats:get_batch_indices_positions"},
    ),
    Fault(
        "window_write_only",
        "harness",
        "the ring mapping is used when writing, but the reader is not given the window",
        where=f"{_SCENARIOS}.check_ring_window (the reader gets the unrolled table, no window)",
    ),
    Fault(
        "v_tail_not_zeroed",
        "harness",
        "prefill leaves the unused V rows of each last page as they were (NaN in a poisoned pool)",
        where=f"{_SCENARIOS}.check_v_tail (the append is not given the CSR tail)",
    ),
    Fault(
        "no_copy_on_write",
        "harness",
        "a fork shares pages, but a write into a shared page is not preceded by a copy",
        parts={"manager": f"{_H}NoCopyOnWriteManager"},
        replaces=_MANAGER,
    ),
    Fault(
        "minus_one_as_index",
        "harness",
        "a padding slot -1 is used as an index, so the token lands in the pool's last row",
        parts={"append_fn": f"{_H}minus_one_as_index"},
    ),
    Fault(
        "stale_block_table",
        "harness",
        "a reader keeps a block table from before its pages were freed and reused",
        where=f"{_SCENARIOS}.check_reused_page (the reader is handed the freed table)",
    ),
    Fault(
        "int32_offset",
        "harness",
        "element offsets are computed in int32 and wrap on a pool of more than 2**31 elements",
        parts={"offset": f"{_H}element_offset_int32"},
        replaces={"offset": "pagedkv_lib.indexing:element_offset"},
    ),
    Fault(
        "chunk_local_mask",
        "harness",
        "prefill's causal mask compares keys with the query's index in its chunk, not its position",
        parts={"prefill_fn": f"{_H}chunk_local_mask"},
    ),
    Fault(
        "tree_mask_ignored",
        "harness",
        "prefill ignores the draft tree's mask (speculative verification): every draft sees all earlier drafts, "
        "its siblings and cousins included, as plain causal attention does",
        parts={"prefill_fn": f"{_H}tree_mask_ignored"},
    ),
    Fault(
        "rotary_at_cache_position",
        "harness",
        "the write kernel rotates K and Q by the cache position, ignoring rope_positions (speculative-decoding "
        "offsets, M-RoPE deltas, a Helix position table); an inactive rank's Q is left unrotated",
        parts={"rotary_append_fn": f"{_H}rotary_at_cache_position"},
    ),
    Fault(
        "nvfp4_unrounded_scale",
        "quantized",
        "NVFP4 codes are computed from the unrounded block scale sf, but fp8(sf) is stored "
        "and read: writer and reader disagree by sf8 / sf (up to 6 %)",
        parts={"quantizer": f"{_Q}nvfp4_quantize_unrounded_scale", "quant_append_fn": f"{_Q}unrounded_block_scale"},
        replaces={"quantizer": "pagedkv_lib.quant:nvfp4_quantize"},
    ),
    Fault(
        "shared_kv_scale",
        "quantized",
        "one global scale for K and V (V's): K, whose range is wider after RoPE, saturates at the "
        "format's largest value",
        parts={"scales": f"{_Q}shared_kv_scale"},
    ),
    Fault(
        "decode_rope_off_by_one",
        "engine",
        "decode steps pass position seq_len instead of seq_len - 1 to the write kernel's RoPE",
        parts={"positions": f"{_E}decode_positions_off_by_one"},
        replaces={"positions": "pagedkv_engine.parts:token_positions"},
    ),
    Fault(
        "no_copy_on_write",
        "engine",
        "forks share pages but a write into a shared page is not preceded by a copy; two samples then write "
        "one row in the same step, which the suite's writes refuse (duplicate slot) and a GPU races on: "
        "the race is emulated, the later sample's K/V win",
        parts={"manager": f"{_H}NoCopyOnWriteManager", "attention": f"{_E}LastWriterWins"},
        replaces={**_MANAGER, "attention": "pagedkv_engine.parts:same_backend"},
    ),
    Fault(
        "rollback_keeps_drafts",
        "engine",
        "speculative decoding's rollback keeps the rejected drafts: the next token is written after them, and "
        "attention reads the first rejected draft's stale K/V at that token's position (with speculative > 0)",
        parts={"manager": f"{_E}RollbackKeepsDrafts"},
        replaces=_MANAGER,
    ),
    Fault(
        "no_lock",
        "concurrency",
        "the block manager's lock is a no-op: its operations' check-then-act steps (room, lookup, take, "
        "refcount) interleave between threads, and blocks are lost, handed out twice or freed while in use",
        parts={"manager": f"{_T}UnlockedManager", "lock": f"{_T}NoLock"},
        replaces={**_MANAGER, "lock": "threading:RLock"},
    ),
    _peer(
        "no_minus_one_guard",
        "store_kvcache_flat",
        "store_flat_kernel",
        "store: a -1 slot is not skipped, so the token is written before the cache's first row",
    ),
    _peer(
        "unguarded_v_store",
        "store_kvcache_flat",
        "store_flat_kernel",
        "store: V is stored without the head_dim mask, spilling into the next slot's row",
    ),
    _peer(
        "off_by_one_block",
        "decode_kv_tuple",
        "decode_tuple_kernel",
        "decode: block i of a sequence is read from table entry i + 1",
    ),
    _peer(
        "whole_page_loads",
        "decode_kv_tuple",
        "decode_tuple_kernel",
        "decode: whole pages are loaded, masked by head_dim only, so NaN in the unwritten tail "
        "of a last page poisons the output (0 * NaN), as vLLM's Triton attention once did",
    ),
    Fault(
        "slot_by_count",
        "caches",
        "a new sequence takes slot len(seq_to_slot), the number of live sequences: after a free that is a live "
        "sequence's slot, and the newcomer's prefill overwrites its K/V",
        parts={"cache": f"{_C}CountedSlotPreallocKVCache"},
        replaces={"cache": f"{_LIB}PreallocKVCache"},
    ),
    Fault(
        "shared_length",
        "caches",
        "one length per sequence for all layers, advanced by every layer's write: each layer after the first "
        "appends one row further than the one before, past an unwritten row",
        parts={"cache": f"{_C}SharedLengthPreallocKVCache"},
        replaces={"cache": f"{_LIB}PreallocKVCache"},
    ),
    Fault(
        "one_row_append",
        "caches",
        "the pool grows one row per call: a prompt chunk or speculative drafts (several tokens) cannot be appended",
        parts={"append": f"{_C}append_write_one_row"},
        replaces={"append": f"{_LIB}append_write"},
    ),
    Fault(
        "read_before_write",
        "caches",
        "a step reads the cache before writing its own K/V: a token attends to the history but not to itself "
        "(a prompt's first token to nothing)",
        parts={"attention": f"{_C}ReadBeforeWriteMHA"},
        replaces={"attention": f"{_LIB}MHAWithCache"},
    ),
    Fault(
        "gqa_repeat_copy",
        "caches",
        "GQA's read repeats every KV head group times (repeat_interleave): a copy of group x the cached bytes "
        "at every step, where a broadcast view copies nothing",
        parts={"broadcast": f"{_C}broadcast_kv_by_repeat"},
        replaces={"broadcast": f"{_LIB}broadcast_kv_for_gqa"},
    ),
    Fault(
        "page_pointers_element_stride",
        "read route",
        "page-pointer route: the host steps from page to page by the page stride in elements, not bytes, "
        "so every page after page 0 is read from inside an earlier one",
        parts={"builder": f"{_R}build_page_pointers_element_stride"},
        replaces={"builder": "pagedkv_kernels.decode_page_pointers:build_page_pointers"},
    ),
    Fault(
        "page_pointers_any_pool",
        "read route",
        "page-pointer route: a plan's pool is compared with the launch's by shape and dtype only, so a plan "
        "runs on another pool of the same shape and reads the pool its addresses were built from",
        parts={"placement_check": f"{_R}check_layout_only"},
        replaces={"placement_check": "pagedkv_kernels.host.validate:check_same_placement"},
    ),
)


def faults_of(*families: str) -> dict[str, Fault]:
    """The registry's faults of ``families`` by name, in registry order."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"families={unknown} unknown; known: {list(FAMILIES)}")
    return {f.name: f for f in REGISTRY if f.family in families}


# The names each caller takes, with the wrong line of each.
FAULTS: dict[str, str] = {n: f.wrong for n, f in faults_of("harness", "quantized").items()}
ENGINE_FAULTS: dict[str, str] = {n: f.wrong for n, f in faults_of("engine").items()}
PEER_KERNEL_FAULTS: dict[str, str] = {n: f.wrong for n, f in faults_of("peer kernel").items()}
CACHE_FAULTS: dict[str, str] = {n: f.wrong for n, f in faults_of("caches").items()}
READ_ROUTE_FAULTS: dict[str, str] = {n: f.wrong for n, f in faults_of("read route").items()}


def _check_names(faults, known: dict) -> frozenset[str]:
    faults = frozenset(faults or ())
    unknown = sorted(faults - known.keys())
    if unknown:
        raise ValueError(f"faults={unknown} unknown; known faults: {sorted(known)}")
    return faults


def check_faults(faults) -> frozenset[str]:
    """Return ``faults`` (names from :data:`FAULTS`, the harness's) as a frozenset;
    ValueError names any unknown fault."""
    return _check_names(faults, FAULTS)


def engine_parts(faults):
    """The :class:`pagedkv_engine.parts.EngineParts` that plant the engine ``faults``
    (names from :data:`ENGINE_FAULTS`; the other parts correct), for
    ``Engine(..., parts=engine_parts({...}))``. ValueError for an unknown name or for two
    faults that replace the same part differently."""
    from pagedkv_engine.parts import EngineParts  # the engine imports torch models: only when asked

    chosen = faults_of("engine")
    parts: dict[str, object] = {}
    for name in sorted(_check_names(faults, ENGINE_FAULTS)):
        for role in chosen[name].parts:
            part = chosen[name].part(role)
            if parts.setdefault(role, part) is not part:
                raise ValueError(f"faults={sorted(faults)}: two faults replace the engine's {role}")
    return EngineParts(**parts)

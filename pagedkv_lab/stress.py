"""Many threads of seeded random operations on one shared block manager, then every book checked.

:func:`stress` runs ``threads`` workers against one
:class:`~pagedkv_lib.manager.KVCacheManager` (or a replacement part, such as the fault
``no_lock``'s manager) with ``sys.setswitchinterval`` set very small, so CPython switches
threads every few bytecodes. Each worker owns its sequences (as a server's request
handler does) and does ``ops`` operations drawn from its own seeded generator: admit a
prompt that shares a prefix with other workers' prompts (prefix hits, restores from the
secondary pool), add and append (with and without token ids), fork, commit, roll back
uncommitted drafts, evict, free. Blocks are shared between workers through the prefix
cache, the secondary pool, the free lists and the evictions.

The pools hold token ids instead of K/V: a worker writes each token's id into its slot
(as a step writes K/V after the manager hands the slot out), and ``copy_fn`` copies the
rows (copy-on-write, offload, restore), failing on a seeded few calls after poisoning its
destination (an interrupted copy). So the content is checkable: every token of every
live sequence must read back as the id its owner wrote, every cached block must hold
its entry's ids, in both levels. A worker checks its sequence after each operation; when
all are joined the report adds the manager's ``check_integrity()``, every refcount against
its owners counted here (tables, cache), free + used against the total, and, once every
sequence is freed and every cached block evicted, a pool that is all free.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from pagedkv_lib.allocator import OutOfBlocksError
from pagedkv_lib.manager import KVCacheManager

__all__ = ["CopyFailed", "StressReport", "stress", "OPS"]

OPS = ("admit", "add", "append", "fork", "commit", "rollback", "evict", "free")
WEIGHTS = (4, 1, 6, 1, 3, 2, 1, 2)  # admissions and appends dominate, as in a server
POISON = -1  # what an interrupted copy leaves in its destination rows


class CopyFailed(RuntimeError):
    """The stress test's copy function failed on purpose (its destination is poisoned)."""


@dataclass
class StressReport:
    """What :func:`stress` saw: ``failures`` (empty when every check held), operations done
    by kind (``ops``, plus ``refused`` for OutOfBlocksError and ``copy_failed``), the
    manager's counters and the wall time."""

    failures: list[str] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)
    counters: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


class _Pools:
    """The primary and secondary pools as rows of token ids, and the manager's copy function."""

    def __init__(self, num_blocks: int, secondary_blocks: int, page_size: int, failure_rate: float, seed: int):
        self.primary = [[None] * page_size for _ in range(num_blocks)]
        self.secondary = [[None] * page_size for _ in range(secondary_blocks)]
        self.failure_rate, self.seed = failure_rate, seed
        self.local = threading.local()  # each worker's own generator for failures (copy_fn runs in the caller)
        self.counts = Counter()

    def copy(self, kind: str, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
        source = self.secondary if kind == "restore" else self.primary
        target = self.secondary if kind == "offload" else self.primary
        rng = getattr(self.local, "rng", None)
        if rng is not None and rng.random() < self.failure_rate:
            for d in dst:
                target[d][:] = [POISON] * len(target[d])
            self.counts["copy_failed"] += 1
            raise CopyFailed(f"{kind} {src} -> {dst}")
        for s, d, n in zip(src, dst, num_tokens):
            rows = len(source[s]) if n <= 0 else n
            target[d][:rows] = source[s][:rows]
        self.counts[kind] += 1


class _Worker:
    """One thread's sequences, their expected token ids, and its random operations."""

    def __init__(self, index: int, mgr, pools: _Pools, prompts: list[list[int]], seed: int, stop: threading.Event):
        self.name, self.mgr, self.pools, self.prompts = f"t{index}", mgr, pools, prompts
        self.rng = random.Random(seed * 1000 + index)
        self.tokens: dict[str, list[int]] = {}  # seq id -> the id written at every position
        self.ops, self.stop, self.error, self.serial = Counter(), stop, None, 0

    def run(self, num_ops: int) -> None:
        self.pools.local.rng = random.Random(self.rng.random())
        try:
            for _ in range(num_ops):
                if self.stop.is_set():
                    return
                op = self.rng.choices(OPS, WEIGHTS)[0]
                try:
                    seq = getattr(self, op)()
                    self.ops[op] += 1
                except OutOfBlocksError:
                    self.ops["refused"] += 1
                    continue
                except CopyFailed:
                    self.ops["copy_failed"] += 1
                    continue
                if seq is not None:
                    self.check(seq)
        except BaseException:  # noqa: BLE001 (any exception in a worker is a finding)
            self.error = f"{self.name}: {traceback.format_exc(limit=-2).strip()}"
            self.stop.set()

    def new_id(self) -> str:
        self.serial += 1
        return f"{self.name}.{self.serial}"

    def pick(self) -> str | None:
        return self.rng.choice(sorted(self.tokens)) if self.tokens else None

    def write(self, seq: str, slots: list[int], ids: list[int]) -> None:
        ps = self.mgr.page_size
        for slot, token in zip(slots, ids):
            self.pools.primary[slot // ps][slot % ps] = token
        self.tokens[seq] += ids

    def check(self, seq: str) -> None:
        """Every token of ``seq`` reads back as written (shared pages are never written)."""
        table, ps, want = self.mgr.block_table(seq), self.mgr.page_size, self.tokens[seq]
        got = [self.pools.primary[table[i // ps]][i % ps] for i in range(len(want))]
        assert len(table) == -(-len(want) // ps) and got == want, f"{seq} reads {got}, wrote {want} (table {table})"

    # ---------------------------------------------------------------- the operations

    def admit(self) -> str | None:
        if len(self.tokens) >= 3:
            return self.free()
        prompt = self.rng.choice(self.prompts) + [self.rng.randrange(100, 200) for _ in range(self.rng.randrange(3))]
        seq = self.new_id()
        adm = self.mgr.admit(seq, prompt)
        self.tokens[seq] = prompt[: adm.num_cached_tokens]
        self.write(seq, adm.slots, prompt[adm.num_cached_tokens :])
        if self.rng.random() < 0.7:
            self.mgr.commit(seq)
        return seq

    def add(self) -> str | None:
        if len(self.tokens) >= 3:
            return self.free()
        seq, n = self.new_id(), self.rng.randrange(1, 5)
        ids = [self.rng.randrange(100, 200) for _ in range(n)]
        self.mgr.add_sequence(seq)
        self.tokens[seq] = []
        self.write(seq, self.mgr.append_tokens(seq, n, ids if self.rng.random() < 0.8 else None), ids)
        return seq

    def append(self) -> str | None:
        seq = self.pick()
        if seq is None or len(self.tokens[seq]) > 14:
            return self.free() if seq else None
        n = self.rng.randrange(1, 4)
        ids = [self.rng.randrange(100, 200) for _ in range(n)]
        self.write(seq, self.mgr.append_tokens(seq, n, ids if self.rng.random() < 0.9 else None), ids)
        return seq

    def fork(self) -> str | None:
        parent = self.pick()
        if parent is None or len(self.tokens) >= 3:
            return None
        child = self.new_id()
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        return child

    def commit(self) -> str | None:
        seq = self.pick()
        if seq is not None:
            self.mgr.commit(seq)
        return seq

    def rollback(self) -> str | None:
        seq = self.pick()
        if seq is None:
            return None
        k = self.rng.randrange(self.mgr.seq_len(seq) - self.mgr.committed_len(seq) + 1)
        self.mgr.rollback(seq, k)
        del self.tokens[seq][len(self.tokens[seq]) - k :]
        return seq

    def evict(self) -> None:
        self.mgr.evict(self.rng.randrange(1, 4))

    def free(self) -> None:
        seq = self.pick()
        if seq is not None:
            self.mgr.free_sequence(seq)
            del self.tokens[seq]


def _books(mgr, pools: _Pools) -> list[str]:
    """Checks of the joined run: integrity, owners, free + used, cached contents."""
    failures = []
    try:
        mgr.check_integrity()
    except AssertionError as err:
        failures.append(f"check_integrity: {err}")
    cache, sec = mgr.prefix_cache, mgr.secondary
    owners = Counter(b for s in mgr.sequences for b in mgr.block_table(s))
    for b in range(mgr.num_blocks):
        entry = cache.entry_of(b)
        want = owners[b] + (entry is not None)
        if mgr.refcount(b) != want:
            failures.append(f"block {b}: refcount {mgr.refcount(b)}, owners {want}")
        if entry is not None and pools.primary[b] != list(entry[1]):
            failures.append(f"cached block {b} holds {pools.primary[b]}, not its ids {list(entry[1])}")
    used = sum(1 for b in range(mgr.num_blocks) if mgr.refcount(b) > 0)
    if mgr.num_free + used != mgr.num_blocks:
        failures.append(f"{mgr.num_free} free + {used} used != {mgr.num_blocks} blocks")
    for slot, _, tokens in sec.entries():
        if pools.secondary[slot] != list(tokens):
            failures.append(f"secondary block {slot} holds {pools.secondary[slot]}, not its ids {list(tokens)}")
    return failures


def _drain(mgr) -> list[str]:
    """Free every sequence and evict every cached block: the pool must be all free."""
    for seq in mgr.sequences:
        mgr.free_sequence(seq)
    mgr.evict(mgr.num_blocks)
    busy = [b for b in range(mgr.num_blocks) if mgr.refcount(b)]
    failures = (
        [] if mgr.num_free == mgr.num_blocks and not busy else [f"after freeing all: {mgr.num_free} free, held {busy}"]
    )
    sec = mgr.secondary
    if sec.num_free + len(sec) != sec.num_blocks:
        failures.append(f"secondary: {sec.num_free} free + {len(sec)} used != {sec.num_blocks}")
    return failures


def stress(
    manager_type=KVCacheManager,
    *,
    seed: int = 0,
    threads: int = 8,
    ops: int = 2000,
    switch_interval: float = 1e-6,
    num_blocks: int = 48,
    secondary_blocks: int = 12,
    page_size: int = 2,
    copy_failure_rate: float = 0.02,
    timeout: float = 120.0,
) -> StressReport:
    """Run the workload of the module docstring; return its :class:`StressReport`.

    ``manager_type(num_blocks, page_size, prefix_cache=True, copy_fn=..., secondary_blocks=...)``
    builds the manager. Workers stop at the first exception one of them meets (other than
    OutOfBlocksError and :class:`CopyFailed`, which the workload expects); a worker still
    running after ``timeout`` seconds is reported as hung. The switch interval is restored."""
    pools = _Pools(num_blocks, secondary_blocks, page_size, copy_failure_rate, seed)
    mgr = manager_type(num_blocks, page_size, prefix_cache=True, copy_fn=pools.copy, secondary_blocks=secondary_blocks)
    shared = random.Random(seed)
    # Six prompts of 2 to 4 blocks, pairs of them sharing their first blocks: hits across workers.
    stems = [[shared.randrange(100) for _ in range(2 * page_size)] for _ in range(3)]
    prompts = [
        stem + [shared.randrange(100) for _ in range(shared.randrange(1, 5))] for stem in stems for _ in range(2)
    ]
    stop = threading.Event()
    workers = [_Worker(i, mgr, pools, prompts, seed, stop) for i in range(threads)]
    report, previous = StressReport(), sys.getswitchinterval()
    start = time.perf_counter()
    sys.setswitchinterval(switch_interval)
    try:
        running = [threading.Thread(target=w.run, args=(ops,), daemon=True) for w in workers]
        for t in running:
            t.start()
        for t in running:
            t.join(max(timeout - (time.perf_counter() - start), 0.0))
    finally:
        sys.setswitchinterval(previous)
    report.seconds = time.perf_counter() - start
    report.failures = [w.error for w in workers if w.error]
    if any(t.is_alive() for t in running):
        stop.set()
        report.failures.append(f"hung: {sum(t.is_alive() for t in running)} workers still running after {timeout} s")
        return report
    for w in workers:
        report.ops += w.ops
    report.counters = dict(pools.counts) | {"hit_rate": mgr.prefix_cache.hit_rate()}
    report.failures += _books(mgr, pools)
    if not report.failures:
        report.failures += _drain(mgr)
    return report

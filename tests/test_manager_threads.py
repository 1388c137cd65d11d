"""The block manager shared between threads (:mod:`pagedkv_lib.locking`): the stress test
of :mod:`pagedkv_lab.stress` holds every book with the lock and is caught without it
(the fault ``no_lock``), ``copy_fn`` runs with the lock released while the sequence it
changes is busy, a deep copy gets a lock of its own, and the exercise set's
``GlobalKVCacheManager`` keeps every token when threads write one sequence at once.

Cost: about 7 s on 2 busy cores (two locked stress runs of 8 threads x 2000 operations,
1.4 s each; twenty unlocked runs, 3.8 s together, most failing within 0.1 s; the race
timeline and the rest are milliseconds)."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch

from pagedkv_lab import faults
from pagedkv_lab.race import two_threads_allocating
from pagedkv_lab.stress import stress
from pagedkv_lib import GlobalKVCacheManager, KVCacheManager, OutOfBlocksError

NO_LOCK = faults.faults_of("concurrency")["no_lock"]


@pytest.mark.parametrize("seed", [0, 1])
def test_eight_threads_of_random_operations_keep_every_book(seed):
    report = stress(seed=seed, threads=8, ops=2000)
    assert report.ok, "\n".join(report.failures)
    # The workload did what it claims: every operation, prefix hits, restores, failed copies.
    assert all(report.ops[op] > 100 for op in ("admit", "append", "fork", "commit", "rollback", "evict", "free"))
    assert report.ops["copy_failed"] > 0 and report.counters["restore"] > 0 and report.counters["cow"] > 0
    assert report.counters["hit_rate"] > 0.2


def test_planted_no_lock_is_caught_by_the_stress_test():
    manager = NO_LOCK.part("manager")
    caught = [not stress(manager, seed=seed, threads=8, ops=2000).ok for seed in range(20)]
    assert sum(caught) >= 19, f"the unlocked manager passed {caught.count(False)} of 20 seeded runs"


def _pools_copy(pool: torch.Tensor, entered: threading.Event, release: threading.Event):
    def copy_fn(kind, src, dst, num_tokens):
        entered.set()
        assert release.wait(10), "the test never released the copy"
        pool[dst] = pool[src]

    return copy_fn


def test_copy_fn_runs_with_the_lock_released_and_its_sequence_busy():
    pool = torch.arange(8.0)
    entered, release = threading.Event(), threading.Event()
    mgr = KVCacheManager(8, 2, copy_fn=_pools_copy(pool, entered, release))
    mgr.add_sequence("a")
    mgr.append_tokens("a", 3)
    mgr.fork("a", "b")
    result = {}
    writer = threading.Thread(target=lambda: result.setdefault("slots", mgr.append_tokens("b", 1)))
    writer.start()
    try:
        assert entered.wait(10), "the copy-on-write never ran"
        # Another thread gets the lock while the copy runs: not a callback under the lock.
        got = {}
        other = threading.Thread(target=lambda: got.setdefault("free", mgr.num_allocatable))
        other.start()
        other.join(5)
        assert got.get("free") == 5, f"another thread could not read the manager during the copy: {got}"
        for call in (lambda: mgr.append_tokens("b", 1), lambda: mgr.block_table("b")):
            with pytest.raises(ValueError, match="busy"):
                call()
        mgr.add_sequence("c")  # other sequences go on meanwhile
        assert len(mgr.append_tokens("c", 2)) == 2 and len(mgr.block_table("a")) == 2
        mgr.check_integrity()  # the copy's held block counts as an owner
    finally:
        release.set()
        writer.join(10)
    assert result["slots"] == [mgr.block_table("b")[1] * 2 + 1]
    assert mgr.block_table("b")[1] != mgr.block_table("a")[1]
    mgr.check_integrity()


def test_a_deep_copy_gets_its_own_lock_shared_by_its_parts():
    mgr = KVCacheManager(8, 2, prefix_cache=True, copy_fn=lambda *a: None, secondary_blocks=2)
    clone = copy.deepcopy(mgr)
    assert clone._lock is not mgr._lock
    assert clone.allocator._lock is clone.prefix_cache._lock is clone.secondary._lock is clone._lock
    assert type(mgr._lock) is type(NO_LOCK.correct("lock")()) is type(clone._lock)


def test_global_manager_operations_and_a_short_pool():
    g = GlobalKVCacheManager(total_blocks=4, block_size=2, num_heads=1, head_dim=2)
    assert len(g.allocate_blocks("a", 2)) == 2
    with pytest.raises(OutOfBlocksError):
        g.allocate_blocks("b", 3)
    assert g.manager.num_free == 2 and g.manager.sequences == ["a"]  # nothing changed
    assert len(g.allocate_blocks("a", 4)) == 4  # a reused id counts its old blocks as room
    g.free_seq("a")
    g.allocate_blocks("c", 0)
    g.ensure_capacity("c", 3)
    assert g.manager.seq_len("c") == 4 and g.seq_len("c") == 0
    with pytest.raises(KeyError):
        g.ensure_capacity("nobody", 1)
    with pytest.raises(ValueError, match="num_blocks"):
        g.allocate_blocks("d", -1)
    g.free_seq("c")
    assert g.manager.num_free == 4


def test_global_manager_keeps_every_token_of_threads_writing_one_sequence():
    g = GlobalKVCacheManager(total_blocks=64, block_size=4, num_heads=1, head_dim=1, dtype=torch.float32)
    g.allocate_blocks("s", 1)
    threads, per = 8, 25
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [
            threading.Thread(
                target=lambda t=t: [
                    g.write_token("s", torch.full((1, 1), 100.0 * t + i), torch.zeros(1, 1)) for i in range(per)
                ]
            )
            for t in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
    finally:
        sys.setswitchinterval(previous)
    k, _ = g.read("s")
    want = sorted(100.0 * t + i for t in range(threads) for i in range(per))
    assert g.seq_len("s") == threads * per and sorted(k.flatten().tolist()) == want
    g.manager.check_integrity()


def test_two_threads_allocating_lose_a_block_without_the_lock_and_not_with_it():
    unlocked = two_threads_allocating(NO_LOCK.part("lock")())
    reads = [text for _, text in unlocked.events if text.startswith("reads")]
    assert reads == ["reads len(free) = 3"] * 2, "both threads read the free list before either took a block"
    assert unlocked.got == {"t0": [0, 2], "t1": "IndexError"} and unlocked.lost == [1]
    assert unlocked.integrity is not None
    locked = two_threads_allocating(NO_LOCK.correct("lock")())
    assert ("t1", "waits for the lock") in locked.events
    assert locked.got == {"t0": [0, 1], "t1": "OutOfBlocksError"} and not locked.lost and locked.integrity is None

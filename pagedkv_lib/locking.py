"""The lock discipline of the block bookkeeping: one lock per manager, never held across a callback.

Inference servers call the block manager from several threads (an API thread admits
requests, the scheduler's thread appends and frees, a swap thread offloads). The rules,
in one place (the modules it names point here):

* **One lock guards one manager's books.** A :class:`~pagedkv_lib.manager.KVCacheManager`
  makes one lock (``KVCacheManager.lock_type()``, a :class:`threading.RLock`) and hands
  it to its :class:`~pagedkv_lib.allocator.BlockAllocator`,
  :class:`~pagedkv_lib.sharing.PrefixCache` and
  :class:`~pagedkv_lib.offload.SecondaryPool`. It guards everything they keep: the free
  list and refcounts, the prefix cache's maps, LRU order and counters, the secondary
  pool's maps, free list, held blocks and counters, the block tables, the pending copies
  and the operations in flight. Each of those objects built alone makes its own RLock.
* **Whole operations, not single steps.** Every public method takes the lock once, for
  all of its work: an ``admit`` that looks blocks up, counts room and takes them is one
  critical section, so no other thread can evict a block between its lookup and its use.
  A lock on each allocator call alone (the exercise set's ``ThreadSafeBlockAllocator``)
  would not do: the manager's check-then-act sequences would still interleave.
* **Order.** There is one lock per manager, so no order among its parts. A layer above
  that keeps its own lock (:class:`~pagedkv_lib.global_manager.GlobalKVCacheManager`)
  takes it *before* the manager's and never calls out under it; nothing in the library
  takes the manager's lock and then another.
* **No callback runs under the lock.** The manager's ``copy_fn`` (copy-on-write, offload,
  restore: :data:`~pagedkv_lib.offload.COPY_KINDS`) is the caller's code; it may launch
  kernels, wait on a device, or call the manager itself. An operation that copies
  therefore runs in three steps (:mod:`pagedkv_lib.flight`): under the lock it *plans*
  and *reserves* (the blocks and secondary slots its copies write leave the free lists,
  the entries they read leave the maps, its sequence is marked busy); with the lock
  released it runs the copies; under the lock again it *publishes* everything at once,
  or, if a copy raised, undoes its own reservations. Other threads meanwhile see only
  states a serial run could show: fewer free blocks, fewer cache entries (a miss, never
  a half-copied hit), a busy sequence they may not touch (``ValueError``).
* **Reentrant, for one reason.** The lock is an RLock because the manager's methods call
  its parts' methods, which take the same lock again. The manager releases it exactly
  once around its copies, so do not call an operation that may copy while holding the
  lock yourself (nothing outside the library needs to).

Cost: a CPython RLock round trip is tens of nanoseconds; the engine's step pays under
2 % (``benchmarks/bench_engine.py --lock-turns``). A replacement part with a no-op lock
(the fault ``no_lock`` of :mod:`pagedkv_lab.faults`) shows what the lock is for.
"""

from __future__ import annotations

import copy
import functools
import threading

__all__ = ["new_lock", "locked", "deepcopy_locked"]


def new_lock():
    """A fresh lock for a standalone allocator, prefix cache or secondary pool (an RLock)."""
    return threading.RLock()


def locked(method):
    """Run ``method`` holding ``self._lock`` (the object's lock, shared with its manager)."""

    @functools.wraps(method)
    def run_locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run_locked


def deepcopy_locked(obj, memo: dict, make_lock=new_lock):
    """A deep copy of ``obj`` (which keeps its lock in ``obj._lock``) made while holding
    that lock, for ``__deepcopy__``. A lock cannot be copied: the copy gets a new one
    from ``make_lock``, and every part copied with it that shared ``obj``'s lock shares
    the new one (a copied manager's allocator, prefix cache and secondary pool)."""
    with obj._lock:
        memo.setdefault(id(obj._lock), make_lock())
        clone = object.__new__(type(obj))
        memo[id(obj)] = clone
        vars(clone).update(copy.deepcopy(vars(obj), memo))
    return clone

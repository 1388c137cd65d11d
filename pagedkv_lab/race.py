"""Two threads allocating from one :class:`~pagedkv_lib.allocator.BlockAllocator`, their
steps interleaved in a chosen order, for notebook 02's timeline of a lost block.

:func:`two_threads_allocating` runs ``allocate_many(2)`` on two threads over a pool
of 3 free blocks. Every step that touches the allocator's lock or its free list is a
*turn*: the thread announces it and waits until :class:`Turnstile` lets it go, in the
order of ``schedule`` (a thread waiting for the lock, or finished, is skipped), so the
interleaving, and the picture, are the same on every run. Without the lock (the fault
``no_lock``'s :class:`~pagedkv_lab.faults.concurrency.NoLock`) both threads read 3
free blocks, both start taking, and the second pops an empty list: the block it took
first is lost (off the free list, refcount 0, in no thread's hands). With the lock the
second thread waits, then reads 1 free block and is refused cleanly.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from matplotlib.patches import Rectangle

from pagedkv_lib.allocator import BlockAllocator

__all__ = ["Turnstile", "RaceTrace", "two_threads_allocating", "draw_timeline"]


class Turnstile:
    """Lets threads take their turns in ``schedule`` order (a list of thread names,
    repeated), skipping a thread that waits for a lock or has finished; records each
    turn as ``(thread, text)`` in :attr:`events`."""

    def __init__(self, schedule: list[str]) -> None:
        self.schedule, self.events = schedule, []
        self._cond = threading.Condition()
        self._state = dict.fromkeys(schedule, "running")  # running, waiting, blocked, done
        self._turn, self._next = None, 0

    def turn(self, name: str) -> None:
        """Wait for ``name``'s turn (called by the thread itself; a thread not in the
        schedule, such as the one checking the allocator afterwards, goes at once)."""
        if name not in self._state:
            return
        with self._cond:
            self._state[name] = "waiting"
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == name, timeout=30)
            self._turn, self._state[name] = None, "running"
            self._cond.notify_all()

    def record(self, name: str, text: str) -> None:
        if name not in self._state:
            return
        with self._cond:
            self.events.append((name, text))

    def set_state(self, name: str, state: str) -> None:
        if name not in self._state:
            return
        with self._cond:
            self._state[name] = state
            self._cond.notify_all()

    def run(self) -> None:
        """Grant turns until every thread is done (called by the thread that started them)."""
        names = list(dict.fromkeys(self.schedule))
        with self._cond:
            while any(self._state[n] != "done" for n in names):
                want = self.schedule[self._next % len(self.schedule)]
                if self._state[want] in ("blocked", "done"):
                    want = next((n for n in names if self._state[n] == "waiting"), None)
                if want is None or self._state[want] != "waiting" or self._turn is not None:
                    assert self._cond.wait(timeout=30), f"no thread moved: {self._state}"
                    continue
                self._turn, self._next = want, self._next + 1
                self._cond.notify_all()


class _TracedFreeList(deque):
    """A free list whose reads and takes are turns."""

    def __init__(self, blocks, gate: Turnstile) -> None:
        super().__init__(blocks)
        self.gate = gate

    def __len__(self) -> int:
        name = threading.current_thread().name
        self.gate.turn(name)
        n = super().__len__()
        self.gate.record(name, f"reads len(free) = {n}")
        return n

    def popleft(self) -> int:
        name = threading.current_thread().name
        self.gate.turn(name)
        try:
            block = super().popleft()
        except IndexError:
            self.gate.record(name, "popleft(): empty list, IndexError")
            raise
        self.gate.record(name, f"takes block {block}")
        return block


class _TracedLock:
    """A lock whose acquisitions are turns; a thread that has to wait is marked blocked."""

    def __init__(self, lock, gate: Turnstile) -> None:
        self.lock, self.gate = lock, gate

    def __enter__(self):
        name = threading.current_thread().name
        self.gate.turn(name)
        self.gate.set_state(name, "blocked")
        if not self.lock.acquire(blocking=False):
            self.gate.record(name, "waits for the lock")
            self.lock.acquire()
        self.gate.set_state(name, "running")
        self.gate.record(name, "acquire() returns")
        return self

    def __exit__(self, *exc) -> None:
        self.gate.record(threading.current_thread().name, "release()")
        self.lock.release()


class _TracedAllocator(BlockAllocator):
    """A :class:`BlockAllocator` whose free list and lock take turns at a :class:`Turnstile`."""

    def __init__(self, num_blocks: int, lock, gate: Turnstile) -> None:
        super().__init__(num_blocks, _TracedLock(lock, gate))
        self._free = _TracedFreeList(self._free, gate)

    def blocks_at_refcount_zero_not_free(self) -> list[int]:
        """Blocks nobody holds that are not on the free list either: lost."""
        free = set(deque.__iter__(self._free))
        return [b for b in range(self.num_blocks) if self._refcount[b] == 0 and b not in free]


@dataclass
class RaceTrace:
    """What :func:`two_threads_allocating` saw: the turns ``(thread, text)`` in order,
    what each thread got (its blocks, or the exception's name), the lost blocks and
    ``check_integrity``'s verdict (None when it held)."""

    events: list[tuple[str, str]]
    got: dict[str, object] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    integrity: str | None = None


def two_threads_allocating(lock, schedule=("t0", "t1")) -> RaceTrace:
    """Threads ``t0`` and ``t1`` each call ``allocate_many(2)`` on a 3-block allocator
    guarded by ``lock`` (a :class:`threading.RLock`, or a no-op lock), taking turns in
    ``schedule`` order (module docstring)."""
    gate = Turnstile(list(schedule))
    alloc = _TracedAllocator(3, lock, gate)
    got = {}

    def work(name: str) -> None:
        try:
            got[name] = alloc.allocate_many(2)
        except Exception as err:  # noqa: BLE001 (what a thread got is the finding)
            got[name] = type(err).__name__
        finally:
            gate.set_state(name, "done")

    threads = [threading.Thread(target=work, args=(n,), name=n) for n in dict.fromkeys(schedule)]
    for t in threads:
        t.start()
    gate.run()
    for t in threads:
        t.join(30)
    trace = RaceTrace(gate.events, got, alloc.blocks_at_refcount_zero_not_free())
    try:
        alloc.check_integrity()
    except AssertionError as err:
        trace.integrity = str(err) or "AssertionError"
    return trace


def draw_timeline(trace: RaceTrace, ax, title: str) -> None:
    """One row per thread, one box per turn (left to right in the order they ran)."""
    rows = {name: i for i, name in enumerate(sorted({n for n, _ in trace.events}))}
    colors = {"takes": "#4c72b0", "reads": "#55a868", "IndexError": "#c44e52", "waits": "#dd8452"}
    for x, (name, text) in enumerate(trace.events):
        color = next((c for key, c in colors.items() if key in text), "#8c8c8c")
        y = rows[name]
        if text.startswith("waits"):  # the wait lasts until the thread's next turn
            until = next(i for i in range(x + 1, len(trace.events)) if trace.events[i][0] == name)
            ax.add_patch(Rectangle((x, y - 0.15), until - x, 0.3, color=color, alpha=0.35))
        ax.add_patch(Rectangle((x, y - 0.4), 0.95, 0.8, color=color, alpha=0.85))
        label = text.replace(": ", ":\n").replace(", ", ",\n").replace(" = ", "\n= ")
        ax.text(x + 0.47, y, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(trace.events))
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("turn (order in which the threads touched the allocator)")
    ax.set_title(title)
    ax.invert_yaxis()

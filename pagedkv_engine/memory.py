"""Why paging: the same requests under the caches that come before it, measured.

The engine records, for every step, how many tokens each live sequence holds and
which pages its block table names (:class:`pagedkv_engine.engine.StepRecord`).
:func:`compare_caches` replays that run under three ways of storing K/V:

* ``cat``: one tensor per sequence, grown by ``torch.cat`` every step (what a first
  implementation does; HF's ``DynamicCache`` works this way). Nothing is reserved
  ahead, but every step copies the whole history into a new tensor;
* ``contiguous``: one buffer of ``max_batch x max_len`` token rows allocated up front,
  a row of ``max_len`` per sequence slot (a static cache: the suite's
  :class:`pagedkv_lib.PreallocKVCache`, whose slot rule it uses). ``max_batch`` and
  ``max_len`` are the smallest that serve this run (most concurrent sequences,
  longest prompt + ``max_new_tokens``): a real server must choose them in advance;
* ``paged``: the engine's own pool; a sequence holds the pages its table names, the
  free pages serve anyone, and shared pages (prefix cache, forks) are stored once.

For each strategy and step: ``reserved`` (bytes set aside for the live sequences),
``used`` (bytes of rows holding a live token, a shared row counted once where the
strategy shares) and ``waste = reserved - used``. Sizes come from tensors: the two
pre-paging caches are allocated for real on PyTorch's ``meta`` device (shapes and
byte counts without memory), the paged one from the engine's pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv_lib.contiguous_cache import PreallocKVCache

__all__ = ["MemorySeries", "CatCache", "ContiguousCache", "compare_caches", "paged_waste_bound"]


@dataclass
class MemorySeries:
    """Bytes per step of one strategy: ``reserved``, ``used``; ``copied`` is the bytes a
    strategy moved to grow (``torch.cat`` reallocation), summed over the run."""

    name: str
    reserved: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    copied: int = 0

    @property
    def waste(self) -> list[int]:
        return [r - u for r, u in zip(self.reserved, self.used)]

    @property
    def peak_reserved(self) -> int:
        return max(self.reserved, default=0)

    @property
    def waste_fraction(self) -> float:
        """Waste over the run as a fraction of what was reserved (byte-steps)."""
        total = sum(self.reserved)
        return sum(self.waste) / total if total else 0.0


class CatCache:
    """Per-sequence K/V tensors ``[num_layers, 2, len, num_kv_heads, head_dim]`` grown with
    ``torch.cat`` (on ``device``, ``meta`` by default: sizes without memory)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype=torch.float32, device="meta") -> None:
        self.shape = (num_layers, 2, 0, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.tensors: dict[str, torch.Tensor] = {}
        self.copied = 0

    def grow_to(self, seq_id: str, length: int) -> None:
        """Make ``seq_id`` hold ``length`` tokens (a new tensor, the old one copied in)."""
        old = self.tensors.get(seq_id)
        if old is None:
            old = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        new_rows = length - old.shape[2]
        if new_rows < 0:  # recomputed after preemption from scratch: start again
            old, new_rows = torch.empty(self.shape, dtype=self.dtype, device=self.device), length
        if new_rows:
            extra = torch.empty((*self.shape[:2], new_rows, *self.shape[3:]), dtype=self.dtype, device=self.device)
            self.copied += old.nbytes
            self.tensors[seq_id] = torch.cat([old, extra], dim=2)

    def free(self, seq_id: str) -> None:
        self.tensors.pop(seq_id, None)

    @property
    def reserved_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class ContiguousCache(PreallocKVCache):
    """:class:`pagedkv_lib.PreallocKVCache` (``k, v [num_layers, max_batch, max_len,
    num_kv_heads, head_dim]``, on ``meta`` by default) placed by length, as a replay knows
    its sequences: each takes the lowest free batch slot for its lifetime."""

    def __init__(
        self, max_batch, max_len, num_layers, num_kv_heads, head_dim, dtype=torch.float32, device="meta"
    ) -> None:
        super().__init__(num_layers, max_batch, max_len, num_kv_heads, head_dim, dtype, device)
        self.max_len = max_len

    def place(self, seq_id: str, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"{seq_id} holds {length} tokens, more than max_len={self.max_len}")
        if seq_id not in self.slot_of:
            self.add_sequence(seq_id)

    def free(self, seq_id: str) -> None:
        if seq_id in self.slot_of:
            self.free_sequence(seq_id)

    @property
    def reserved_bytes(self) -> int:
        return self.nbytes


def _paged_used_rows(tables: dict[str, list[int]], lens: dict[str, int], page_size: int) -> int:
    """Distinct (page, row) pairs holding a live token: a shared page counts once."""
    rows: dict[int, int] = {}
    for seq_id, table in tables.items():
        for j, page in enumerate(table):
            rows[page] = max(rows.get(page, 0), min(page_size, lens[seq_id] - j * page_size))
    return sum(rows.values())


def paged_waste_bound(record, page_size: int) -> int:
    """Most token rows paging can waste at one step: a partial last page per live sequence."""
    return len(record.tables) * (page_size - 1)


def compare_caches(engine) -> dict[str, MemorySeries]:
    """Replay ``engine``'s run (its :attr:`history`) under ``cat``, ``contiguous`` and
    ``paged``; return their per-step series, keyed by strategy name."""
    model = engine.model
    dims = (model.num_layers, model.num_kv_heads, model.head_dim)
    token_bytes = model.kv_bytes_per_token
    history = engine.history
    max_batch = max((len(r.tables) for r in history), default=1) or 1
    max_len = max(s.prompt_len + s.params.max_new_tokens for s in engine.sequences.values())
    cat, contiguous = CatCache(*dims, dtype=model.dtype), ContiguousCache(max_batch, max_len, *dims, dtype=model.dtype)
    series = {name: MemorySeries(name) for name in ("cat", "contiguous", "paged")}
    page_bytes = engine.page_bytes
    live: set[str] = set()
    for record in history:
        for seq_id in live - record.lens.keys():  # finished or preempted
            cat.free(seq_id)
            contiguous.free(seq_id)
        live = set(record.lens)
        for seq_id, n in record.lens.items():
            cat.grow_to(seq_id, n)
            contiguous.place(seq_id, n)
        logical = sum(record.lens.values()) * token_bytes
        series["cat"].reserved.append(cat.reserved_bytes)
        series["cat"].used.append(logical)
        series["contiguous"].reserved.append(contiguous.reserved_bytes)
        series["contiguous"].used.append(logical)
        held = len({p for t in record.tables.values() for p in t})
        series["paged"].reserved.append(held * page_bytes)
        series["paged"].used.append(_paged_used_rows(record.tables, record.lens, engine.page_size) * token_bytes)
    series["cat"].copied = cat.copied
    return series


def summary_rows(series: dict[str, MemorySeries], pool_bytes: int | None = None) -> list[str]:
    """One line per strategy: peak reserved, peak used, waste over the run."""
    mib = 2**20
    out = []
    for s in series.values():
        line = (
            f"{s.name:>10}: peak reserved {s.peak_reserved / mib:7.2f} MiB, peak used {max(s.used) / mib:6.2f} MiB, "
            f"waste {100 * s.waste_fraction:5.1f}% of reserved byte-steps"
        )
        if s.copied:
            line += f", {s.copied / mib:.0f} MiB copied by torch.cat"
        out.append(line)
    if pool_bytes is not None:
        out.append(f"{'':>10}  (the paged pool itself is {pool_bytes / mib:.2f} MiB; free pages serve any request)")
    return out

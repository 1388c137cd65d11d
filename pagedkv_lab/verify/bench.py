"""The scenarios' test bench: a writer and readers sharing pools in the cache layout the
kernels declare, every tensor a kernel receives between guard bytes, and failure
details that name the request, step, page and first wrong element.

A scenario passes each kernel its native cache object and reads the suite's view back
to compare. When one side is the Python reference, it reaches the other side's layout
through an exact conversion (a copy inside the *reference's* call, never the
kernel's).
"""

from __future__ import annotations

import torch

from pagedkv_lab.verify.contract import contract_of
from pagedkv_lab.verify.guards import Guards
from pagedkv_lib import reference, runtime
from pagedkv_lib.cache_layouts import native_tensors, to_native, to_paged
from pagedkv_lib.compare import compare
from pagedkv_lib.pool import PagedKVPool

__all__ = ["REFERENCES", "Bench", "BenchPool", "locate_output"]

# The references a scenario uses for a side that is not given: they take the suite's pool.
REFERENCES = (reference.append_paged_kv, reference.paged_decode_attention, reference.paged_prefill_attention)


class BenchPool:
    """A pool in a cache layout: ``native`` is the object the kernels receive (guarded,
    on the kernels' device); :meth:`paged` reads it back as the suite's 5-D NHD pool."""

    def __init__(self, bench: Bench, num_pages: int, page_size: int, heads: int, dim: int, fill: float = 0.0):
        self.bench, self.dims = bench, (num_pages, page_size, heads, dim)
        paged = torch.full((num_pages, 2, page_size, heads, dim), fill, dtype=torch.float32)
        self.native = bench.guards.place_pool(paged, bench.cache_layout, "NHD", runtime.device())

    def paged(self) -> torch.Tensor:
        return to_paged(self.native, self.bench.cache_layout, "NHD", *self.dims).cpu()

    def store(self, paged: torch.Tensor) -> None:
        """Make the native pool hold ``paged`` (in place: the kernels keep its tensors)."""
        native = to_native(paged, self.bench.cache_layout, "NHD")
        for dst, src in zip(native_tensors(self.native).values(), native_tensors(native).values()):
            dst.copy_(src)

    def copy_blocks(self, pairs) -> None:
        """The manager's copy-on-write page copies, applied by the engine (not a kernel)."""
        pairs = list(pairs)
        if pairs:
            pool = PagedKVPool(*self.dims, torch.float32)
            pool.cache.copy_(self.paged())
            pool.copy_blocks(pairs)
            self.store(pool.cache)


class Bench:
    """A scenario's writer and reader (``decode_fn`` or ``prefill_fn``), sharing pools in
    ``cache_layout`` (None: the one the kernels' own contracts declare)."""

    def __init__(self, append_fn, read_fn, cache_layout: str | None = None):
        if cache_layout is None:
            kernels = [fn for fn in (append_fn, read_fn) if fn not in REFERENCES]
            layouts = {contract_of(fn).cache_layout for fn in kernels}
            if len(layouts) > 1:
                raise ValueError(f"the writer and the reader declare different cache layouts {sorted(layouts)}")
            cache_layout = layouts.pop() if layouts else "paged"
        self.cache_layout = cache_layout
        self.append_fn, self.read_fn = append_fn, read_fn
        self.guards = Guards()

    def pool(self, num_pages, page_size, heads, dim, fill: float = 0.0) -> BenchPool:
        return BenchPool(self, num_pages, page_size, heads, dim, fill)

    def _foreign(self, fn) -> bool:
        return fn in REFERENCES and self.cache_layout != "paged"

    def _place(self, names: str, *tensors):
        dev = runtime.device()
        return [self.guards.place(n, torch.as_tensor(t).to(dev)) for n, t in zip(names.split(), tensors)]

    def append(self, k, v, pool: BenchPool, slots, **kwargs) -> None:
        if self._foreign(self.append_fn):
            paged = pool.paged()
            self.append_fn(k.cpu(), v.cpu(), paged, slots.cpu(), **kwargs)
            pool.store(paged)
        else:
            k, v, slots = self._place("k v slot_mapping", k, v, slots)
            self.append_fn(k, v, pool.native, slots, **kwargs)

    def decode(self, q, pool: BenchPool, block_tables, seq_lens, **kwargs):
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
        if self._foreign(self.read_fn):
            return self.read_fn(q.cpu(), pool.paged(), block_tables.cpu(), seq_lens, **kwargs)
        q, block_tables, seq_lens = self._place("q block_tables seq_lens", q, block_tables, seq_lens)
        return self.read_fn(q, pool.native, block_tables, seq_lens, **kwargs)

    def prefill(self, q, pool: BenchPool, qo_indptr, block_tables, seq_lens, **kwargs):
        qo_indptr, seq_lens = (torch.as_tensor(t, dtype=torch.int32) for t in (qo_indptr, seq_lens))
        if self._foreign(self.read_fn):
            return self.read_fn(q.cpu(), pool.paged(), qo_indptr, block_tables.cpu(), seq_lens, **kwargs)
        q, qo_indptr, block_tables, seq_lens = self._place(
            "q qo_indptr block_tables seq_lens", q, qo_indptr, block_tables, seq_lens
        )
        return self.read_fn(q, pool.native, qo_indptr, block_tables, seq_lens, **kwargs)

    def guard_notes(self) -> str:
        return "; ".join(self.guards.corrupted())


def locate_output(out, expected: torch.Tensor, atol: float, rows: list[str], rtol: float = 0.0):
    """``(passed, max_abs, detail)`` of an output ``[rows, heads, dim]`` against the float64
    oracle; a failure's detail names the first wrong element: its row (``rows[i]``
    describes row ``i``: request, step, position, pages), head, feature and both
    values, or where the first non-finite output is."""
    c = compare(out, expected, atol, rtol)
    if c.passed or c.worst is None:
        return c.passed, c.max_abs, c.detail
    row, head, feat = c.worst
    got = float(torch.as_tensor(out).detach().cpu()[row, head, feat])
    at = f"{rows[row]}, head {head}, feature {feat}: {got:.6g} instead of {float(expected[row, head, feat]):.6g}"
    if c.detail:  # non-finite outputs
        return False, c.max_abs, f"{c.detail}, the first at {at}"
    return False, c.max_abs, f"first wrong element at {at} ({c.tol_ratio:.3g} x the tolerance)"

"""The scenarios' test bench: a writer and readers sharing pools in the cache layout the
kernels declare, every tensor a kernel receives between guard bytes, and failure
details that name the request, step, page and first wrong element.

A scenario passes each kernel its native cache object and reads the suite's view back
to compare. When one side is the Python reference, it reaches the other side's layout
through an exact conversion (a copy inside the *reference's* call, never the
kernel's).

Every pool starts with NaN in every slot (``poison=True``), as the grids' pools do, so a
kernel that lets an unwritten row into its sum returns NaN. For the NaN attribution of
a failure (:mod:`.stale`) the runner re-runs the scenario with ``poison`` one of
:data:`~pagedkv_lab.verify.stale.POISON_MODES`: ``"none"`` starts every pool finite;
``"tail"`` and ``"free"`` keep the NaN only in the unwritten rows of pages a read's
block table names, or only in the pages it does not name (applied before each read).
``tolerance``: the ``(atol, rtol)`` of the scenario's outputs (fp32's by default; the
runner passes fp16's for a kernel declaring ``fp32_dots="tf32"``).
"""

from __future__ import annotations

import torch

from pagedkv_lab.verify.contract import contract_of
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import located
from pagedkv_lab.verify.stale import restrict_poison
from pagedkv_lib import reference, runtime
from pagedkv_lib.cache_layouts import native_tensors, to_native, to_paged
from pagedkv_lib.compare import FP32_ATOL, compare
from pagedkv_lib.pool import PagedKVPool

__all__ = ["REFERENCES", "Bench", "BenchPool", "locate_output"]

# The references a scenario uses for a side that is not given: they take the suite's pool.
REFERENCES = (reference.append_paged_kv, reference.paged_decode_attention, reference.paged_prefill_attention)


def _is_reference(fn) -> bool:
    """Whether ``fn`` is one of :data:`REFERENCES`, or a wrapper of one (the runner counts
    the calls of what it was given through :func:`functools.wraps` wrappers)."""
    while fn is not None:
        if fn in REFERENCES:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


class BenchPool:
    """A pool in a cache layout: ``native`` is the object the kernels receive (guarded,
    on the kernels' device); :meth:`paged` reads it back as the suite's 5-D NHD pool."""

    def __init__(self, bench: Bench, num_pages: int, page_size: int, heads: int, dim: int):
        self.bench, self.dims = bench, (num_pages, page_size, heads, dim)
        paged = torch.full((num_pages, 2, page_size, heads, dim), float("nan"), dtype=torch.float32)
        if bench.poison == "none":  # finite stale values: the attribution's first re-run
            restrict_poison([paged], torch.zeros((0, 0), dtype=torch.long), "none", bench.seed)
        self.native = bench.guards.place_pool(paged, bench.cache_layout, "NHD", runtime.device())

    def restrict(self, block_tables) -> None:
        """Before a read under ``poison`` ``"tail"`` or ``"free"``: the NaN of the pages
        ``block_tables`` names (or of the others) replaced by finite values."""
        if self.bench.poison in ("tail", "free"):
            paged = self.paged()
            restrict_poison([paged], torch.as_tensor(block_tables).cpu(), self.bench.poison, self.bench.seed)
            self.store(paged)

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

    def __init__(self, append_fn, read_fn, cache_layout: str | None = None, poison=True, tolerance=None, seed=0):
        if cache_layout is None:
            kernels = [fn for fn in (append_fn, read_fn) if not _is_reference(fn)]
            layouts = {contract_of(fn).cache_layout for fn in kernels}
            if len(layouts) > 1:
                raise ValueError(f"the writer and the reader declare different cache layouts {sorted(layouts)}")
            cache_layout = layouts.pop() if layouts else "paged"
        self.cache_layout = cache_layout
        self.append_fn, self.read_fn = append_fn, read_fn
        self.guards = Guards()
        self.poison, self.seed = poison, seed
        self.atol, self.rtol = tolerance or (FP32_ATOL, 0.0)

    def pool(self, num_pages, page_size, heads, dim) -> BenchPool:
        """A pool of NaN (finite values under ``poison="none"``) in the bench's layout."""
        return BenchPool(self, num_pages, page_size, heads, dim)

    def compare(self, out, expected, rows: list[str]):
        """:func:`locate_output` by the bench's tolerance."""
        return locate_output(out, expected, self.atol, rows, self.rtol)

    def _foreign(self, fn) -> bool:
        return _is_reference(fn) and self.cache_layout != "paged"

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
        pool.restrict(block_tables)
        if self._foreign(self.read_fn):
            return self.read_fn(q.cpu(), pool.paged(), block_tables.cpu(), seq_lens, **kwargs)
        q, block_tables, seq_lens = self._place("q block_tables seq_lens", q, block_tables, seq_lens)
        return self.read_fn(q, pool.native, block_tables, seq_lens, **kwargs)

    def prefill(self, q, pool: BenchPool, qo_indptr, block_tables, seq_lens, **kwargs):
        qo_indptr, seq_lens = (torch.as_tensor(t, dtype=torch.int32) for t in (qo_indptr, seq_lens))
        pool.restrict(block_tables)
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
    oracle; a failure's detail names the first element beyond tolerance and the worst
    (:func:`.report.located`): its row (``rows[i]`` describes row ``i``: request, step,
    position, pages), head, feature and both values, or where the first non-finite
    output is."""
    c = compare(out, expected, atol, rtol)
    return c.passed, c.max_abs, located(c, lambda i: f"{rows[i[0]]}, head {i[1]}, feature {i[2]}", out, expected)

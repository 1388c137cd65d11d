"""Scenarios: the library's bookkeeping driven through the callables under test.

Each scenario plays one situation where paged KV caches go silently wrong (chunked
prefill, a ring window, V tails in a NaN-poisoned pool, a copy-on-write fork, a freed
and reused page, offsets past 2**31) and compares with a contiguous float64 oracle.
Each fault of :mod:`pagedkv_lib.faults` breaks one of them; the harness catches an
exception raised inside a scenario and reports it as a failed check.

The pools live in the cache layout the kernels declare (their contracts): a scenario
passes each kernel its native cache object and reads the suite's view back to compare.
When one side is the Python reference, it reaches the other side's layout through an
exact conversion (a copy inside the *reference's* call, never the kernel's). What each
scenario needs of a kernel is :data:`SCENARIO_NEEDS`, checked against the contracts.
"""

from __future__ import annotations

import math

import torch

from .. import faults as F
from .. import reference, runtime
from ..cache_layouts import native_tensors, to_native, to_paged
from ..formats import block_table_to_csr, pad_block_tables, slot_mapping
from ..indexing import element_offset
from ..manager import KVCacheManager
from ..pool import PagedKVPool
from ..window import RingWindow
from .compare import TOLERANCES, bit_compare, compare, rand
from .contract import contract_of
from .grid import accepts
from .guards import Guards
from .report import CaseResult

__all__ = [
    "SCENARIOS",
    "SCENARIO_NEEDS",
    "attention_oracle",
    "check_chunked_prefill",
    "check_ring_window",
    "check_v_tail",
    "check_fork",
    "check_reused_page",
    "check_int64_offsets",
    "check_large_pool",
]


def attention_oracle(q, k, v, visible):
    """float64 softmax attention of ``q [Hq, D]`` over the rows ``visible`` of contiguous
    ``k, v [T, Hk, D]`` (GQA by repeat)."""
    group = q.shape[0] // k.shape[1]
    k = k[visible].double().repeat_interleave(group, 1)
    v = v[visible].double().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) / q.shape[-1] ** 0.5, dim=-1)
    return torch.einsum("ht,thd->hd", probs, v)


def _check_out(out, expected, atol: float, rtol: float = 0.0):
    """``(passed, max_abs, max_rel, detail)`` of an output against the oracle."""
    c = compare(out, expected, atol, rtol)
    return c.passed, c.max_abs, c.max_rel, c.detail


def _scenario(name: str, passed: bool, detail: str = "", max_abs: float = 0.0, atol: float = 0.0, **case):
    return CaseResult(name, case, passed, max_abs, 0.0, atol, detail)


_REFERENCES = (reference.append_paged_kv, reference.paged_decode_attention)


class _Pool:
    """A pool in a cache layout: ``native`` is the object the kernels receive (guarded,
    on the kernels' device); :meth:`paged` reads it back as the suite's pool (a copy)."""

    def __init__(self, bench: _Bench, num_pages: int, page_size: int, heads: int, dim: int, fill: float = 0.0):
        self.bench, self.dims = bench, (num_pages, page_size, heads, dim)
        paged = torch.full((num_pages, 2, page_size, heads, dim), fill, dtype=torch.float32)
        native = to_native(paged, bench.cache_layout, "NHD")
        page_bytes = paged[0].numel() * paged.element_size()
        dev = runtime.device()
        if isinstance(native, torch.Tensor):
            self.native = bench.guards.place("cache", native.to(dev), page_bytes)
        else:
            self.native = tuple(
                bench.guards.place(name, t.to(dev), page_bytes) for name, t in native_tensors(native).items()
            )

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


class _Bench:
    """The scenario's writer and reader, sharing pools in their declared cache layout."""

    def __init__(self, append_fn, decode_fn):
        kernels = [fn for fn in (append_fn, decode_fn) if fn not in _REFERENCES]
        layouts = {contract_of(fn).cache_layout for fn in kernels}
        if len(layouts) > 1:
            raise ValueError(f"append_fn and decode_fn declare different cache layouts {sorted(layouts)}")
        self.cache_layout = layouts.pop() if layouts else "paged"
        self.append_fn, self.decode_fn = append_fn, decode_fn
        self.guards = Guards()

    def pool(self, num_pages, page_size, heads, dim, fill: float = 0.0) -> _Pool:
        return _Pool(self, num_pages, page_size, heads, dim, fill)

    def _foreign(self, fn) -> bool:
        return fn in _REFERENCES and self.cache_layout != "paged"

    def append(self, k, v, pool: _Pool, slots, **kwargs) -> None:
        dev = runtime.device()
        k, v, slots = (t.to(dev) for t in (k, v, slots))
        if self._foreign(self.append_fn):
            paged = pool.paged()
            self.append_fn(k.cpu(), v.cpu(), paged, slots.cpu(), **kwargs)
            pool.store(paged)
        else:
            self.append_fn(k, v, pool.native, slots, **kwargs)

    def decode(self, q, pool: _Pool, block_tables, seq_lens, **kwargs):
        dev = runtime.device()
        q, block_tables, seq_lens = (t.to(dev) for t in (q, block_tables, torch.as_tensor(seq_lens, dtype=torch.int32)))
        if self._foreign(self.decode_fn):
            return self.decode_fn(q.cpu(), pool.paged(), block_tables.cpu(), seq_lens.cpu(), **kwargs)
        return self.decode_fn(q, pool.native, block_tables, seq_lens, **kwargs)

    def guard_notes(self) -> str:
        return "; ".join(self.guards.corrupted())


def _finish(name: str, bench: _Bench, ok: bool, detail: str, max_abs: float, **case) -> CaseResult:
    """A scenario's result, failed too when a kernel wrote next to a pool or input."""
    guards = bench.guard_notes()
    if guards:
        ok, detail = False, f"{detail}; {guards}" if detail else guards
    return _scenario(name, ok, detail, max_abs, 1e-5, **case)


def check_chunked_prefill(append_fn, decode_fn, faults, prompt_len: int = 29, chunk: int = 8) -> CaseResult:
    """A prompt written in chunks (each at ``past_len = cache_len - chunk_len``) gives the
    same pool as one write, and decode over it matches the contiguous oracle."""
    bench, gen = _Bench(append_fn, decode_fn), torch.Generator().manual_seed(1)
    n, ps, hk, d = prompt_len, 4, 2, 32
    k, v, q = (
        rand((n, hk, d), torch.float32, gen),
        rand((n, hk, d), torch.float32, gen),
        rand((1, 4, d), torch.float32, gen),
    )
    num_pages = -(-n // ps) + 2
    tables = pad_block_tables([torch.randperm(num_pages, generator=gen)[: -(-n // ps)].tolist()])
    expected = PagedKVPool(num_pages, ps, hk, d, torch.float32)
    pool = bench.pool(num_pages, ps, hk, d)
    reference.append_paged_kv(
        k, v, expected.cache, slot_mapping(tables, torch.zeros(n, dtype=torch.long), torch.arange(n), ps)
    )
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        b, p = F.chunk_positions(torch.tensor([0, end - start]), torch.tensor([end]), "past_len_zero" in faults)
        bench.append(k[start:end], v[start:end], pool, slot_mapping(tables, b, p, ps))
    same, _, detail = bit_compare(pool.paged(), expected.cache)
    out = bench.decode(q, pool, tables, [n])
    ok, max_abs, _, d2 = _check_out(out, attention_oracle(q[0], k, v, list(range(n)))[None], 1e-5)
    return _finish("chunked_prefill", bench, same and ok, detail or d2, max_abs, prompt_len=n, chunk=chunk)


def check_ring_window(append_fn, decode_fn, faults, seq_lens: tuple[int, ...] = (57, 9)) -> CaseResult:
    """Decode through a ring cache (sinks, bubble, several wraps) equals attention over
    the sinks + last ``window - sinks`` tokens of a contiguous copy."""
    bench, gen = _Bench(append_fn, decode_fn), torch.Generator().manual_seed(2)
    window = RingWindow(max_attention_window=14, sink_tokens=3, tokens_per_block=4)
    lens, hk, d = list(seq_lens), 2, 32
    blocks = [window.num_blocks(n) for n in lens]
    tables = pad_block_tables([list(range(sum(blocks[:b]), sum(blocks[: b + 1]))) for b in range(len(lens))])
    pool = bench.pool(sum(blocks), 4, hk, d)
    ks, vs = (
        [rand((n, hk, d), torch.float32, gen) for n in lens],
        [rand((n, hk, d), torch.float32, gen) for n in lens],
    )
    for t in range(max(lens)):  # one token per step: a plain ring takes one token per write
        live = [b for b, n in enumerate(lens) if t < n]
        slots = slot_mapping(tables, torch.tensor(live), torch.full((len(live),), t), 4, window)
        bench.append(torch.stack([ks[b][t] for b in live]), torch.stack([vs[b][t] for b in live]), pool, slots)
    q = rand((len(lens), 4, d), torch.float32, gen)
    if "window_write_only" in faults:
        # The reader was not given the window: it reads the cache as linear, logical
        # block j landing on the ring's page j % num_blocks.
        unrolled = [[tables[b, j % blocks[b]].item() for j in range(-(-n // 4))] for b, n in enumerate(lens)]
        out = bench.decode(q, pool, pad_block_tables(unrolled), lens)
    else:
        out = bench.decode(q, pool, tables, lens, window=window)
    expected = torch.stack(
        [
            attention_oracle(q[b], ks[b], vs[b], [t for t in range(n) if t < 3 or t > n - 1 - (14 - 3)])
            for b, n in enumerate(lens)
        ]
    )
    ok, max_abs, _, detail = _check_out(out, expected, 1e-5)
    detail = detail or "window 14, 3 sinks, pages of 4"
    return _finish("ring_window", bench, ok, detail, max_abs, seq_lens=tuple(lens))


def check_v_tail(append_fn, decode_fn, faults) -> CaseResult:
    """After a prefill write with ``zero_v_tail`` into a NaN-poisoned pool, the unused V
    rows of each last page are 0, so a reader that loads whole pages stays finite."""
    if not accepts(append_fn, "zero_v_tail"):
        return _scenario("v_tail", None, "append_fn takes no zero_v_tail")
    bench, gen = _Bench(append_fn, decode_fn), torch.Generator().manual_seed(3)
    lens, ps, hk, d = [6, 9], 4, 2, 16
    tables = pad_block_tables([[3, 0], [1, 4, 2]])
    pool = bench.pool(6, ps, hk, d, fill=float("nan"))
    csr = block_table_to_csr(tables, torch.tensor(lens), ps)
    b = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    k, v = rand((sum(lens), hk, d), torch.float32, gen), rand((sum(lens), hk, d), torch.float32, gen)
    tail = None if "v_tail_not_zeroed" in faults else tuple(x.to(runtime.device()) for x in csr)
    bench.append(k, v, pool, slot_mapping(tables, b, pos, ps), zero_v_tail=tail)
    q = rand((2, 4, d), torch.float32, gen)
    out = F.whole_page_decode(q, pool.paged(), tables, lens)
    expected = torch.stack([attention_oracle(q[i], k[b == i], v[b == i], list(range(n))) for i, n in enumerate(lens)])
    ok, max_abs, _, detail = _check_out(out, expected, 1e-5)
    return _finish("v_tail", bench, ok, detail or f"seq_lens {lens}, pages of {ps}, NaN pool", max_abs)


def check_fork(append_fn, decode_fn, faults) -> CaseResult:
    """Fork a 6-token prompt, append 3 tokens to the child, then 3 to the parent: both
    read back bit-identical to what was written for them, and the child's decode
    matches the oracle."""
    bench, gen = _Bench(append_fn, decode_fn), torch.Generator().manual_seed(4)
    ps, hk, d = 4, 2, 16
    manager = (F.NoCopyOnWriteManager if "no_copy_on_write" in faults else KVCacheManager)(16, ps)
    pool = bench.pool(16, ps, hk, d)
    written = {"parent": [], "child": []}

    def write(seq, n):
        k, v = rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen)
        slots = torch.tensor(manager.append_tokens(seq, n))
        pool.copy_blocks(manager.pop_copies())
        bench.append(k, v, pool, slots)
        written[seq].append((k, v))

    manager.add_sequence("parent")
    write("parent", 6)
    manager.fork("parent", "child")
    written["child"] = list(written["parent"])
    write("child", 3)
    write("parent", 3)
    changed = []
    for seq in ("parent", "child"):  # each must read back exactly what was written for it
        k_got, v_got = reference.gather_paged_kv(pool.paged(), manager.block_table(seq), 9)
        k_want, v_want = (torch.cat([x[i] for x in written[seq]]) for i in (0, 1))
        for name, got, want in (("K", k_got, k_want), ("V", v_got, v_want)):
            rows = torch.nonzero((got != want).any(-1).any(-1)).flatten().tolist()
            if rows:
                changed.append(f"{seq}'s {name} rows {rows} changed under the other's write")
    k_ref, v_ref = (torch.cat([x[i] for x in written["child"]]) for i in (0, 1))
    q = rand((1, 4, d), torch.float32, gen)
    out = bench.decode(q, pool, torch.tensor([manager.block_table("child")], dtype=torch.int32), [9])
    ok, max_abs, _, detail = _check_out(out, attention_oracle(q[0], k_ref, v_ref, list(range(9)))[None], 1e-5)
    detail = "; ".join([x for x in [detail, *changed] if x]) or "prompt 6, +3 each, pages of 4"
    return _finish("fork_cow", bench, ok and not changed, detail, max_abs)


def check_reused_page(append_fn, decode_fn, faults) -> CaseResult:
    """A request slot's table must be rebuilt when its sequence changes: A finishes,
    C takes its batch slot, D reuses A's pages; decode of C matches C's tokens."""
    bench, gen = _Bench(append_fn, decode_fn), torch.Generator().manual_seed(5)
    ps, hk, d = 4, 2, 16
    manager, pool = KVCacheManager(6, ps), bench.pool(6, ps, hk, d)
    data = {}
    for seq in ("A", "B"):
        manager.add_sequence(seq)
    for seq in ("A", "B"):
        data[seq] = (rand((8, hk, d), torch.float32, gen), rand((8, hk, d), torch.float32, gen))
        bench.append(*data[seq], pool, torch.tensor(manager.append_tokens(seq, 8)))
    stale = manager.block_table("A")
    manager.free_sequence("A")
    for seq in ("C", "D"):
        manager.add_sequence(seq)
        data[seq] = (rand((8, hk, d), torch.float32, gen), rand((8, hk, d), torch.float32, gen))
        bench.append(*data[seq], pool, torch.tensor(manager.append_tokens(seq, 8)))
    table = stale if "stale_block_table" in faults else manager.block_table("C")
    q = rand((1, 4, d), torch.float32, gen)
    out = bench.decode(q, pool, torch.tensor([table], dtype=torch.int32), [8])
    ok, max_abs, _, detail = _check_out(out, attention_oracle(q[0], *data["C"], list(range(8)))[None], 1e-5)
    reused = sorted(set(stale) & set(manager.block_table("D")))
    if not ok and not detail:
        in_d = sorted(set(table) & set(manager.block_table("D")))
        detail = (
            f"C's decode does not match C's tokens: the table it read names pages {table}, "
            f"of which {in_d} now hold D's tokens (C's own pages are {manager.block_table('C')})"
        )
    return _finish("reused_page", bench, ok, detail or f"A freed; its pages {reused} now hold D", max_abs)


def check_int64_offsets(append_fn, decode_fn, faults) -> CaseResult:
    """Element offsets of a pool past 2**31 elements (computed, not allocated): the last
    page's offsets must be exact. On a GPU with the memory, a real append + decode at the
    end of such a pool follows (``large_pool=True``)."""
    shape = (70_000, 2, 16, 8, 128)  # 2.3e9 elements: 4.6 GB in fp16
    strides = (2 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)
    offset_fn = F.element_offset_int32 if "int32_offset" in faults else element_offset
    index = (shape[0] - 1, 1, 7, 15, 127)  # page, V, head, row, feature
    got = int(offset_fn(strides, *index))
    exact = sum(i * s for i, s in zip((index[0], index[1], index[3], index[2], index[4]), strides))
    ok = got == exact and exact > 2**31
    return _scenario("int64_offsets", ok, f"{math.prod(shape):.2e} elements: offset {got} vs exact {exact}")


def check_large_pool(append_fn, decode_fn, faults) -> CaseResult:
    """A real pool of more than 2**31 elements (about 4.3 GB in fp16): append one token
    into its last page and decode it back. Needs a GPU with the memory."""
    if runtime.BACKEND.interpreted:
        return _scenario("large_pool", None, "needs a GPU (the interpreter copies every tensor argument)")
    pages, ps, hk, d = 2**31 // (2 * 16 * 8 * 128) + 2, 16, 8, 128
    cache = torch.zeros((pages, 2, ps, hk, d), dtype=torch.float16, device="cuda")
    gen = torch.Generator().manual_seed(6)
    k, v, q = (rand(s, torch.float16, gen).cuda() for s in ((1, hk, d), (1, hk, d), (1, hk, d)))
    append_fn(k, v, cache, torch.tensor([(pages - 1) * ps + ps - 1], device="cuda"))
    same = torch.equal(cache[-1, 0, -1], k[0]) and torch.equal(cache[-1, 1, -1], v[0])
    table = torch.full((1, ps), pages - 1, dtype=torch.int32, device="cuda")  # every row read is the last page
    out = decode_fn(q, cache, table[:, :1], torch.tensor([ps], dtype=torch.int32, device="cuda"))
    expected = attention_oracle(q[0].cpu(), cache[-1, 0].cpu(), cache[-1, 1].cpu(), list(range(ps)))[None]
    del cache
    ok, max_abs, _, detail = _check_out(out, expected, *TOLERANCES[torch.float16])
    return _scenario("large_pool", same and ok, detail or f"{pages * 2 * ps * hk * d:.2e} elements", max_abs, 1e-2)


# What each scenario asks of the kernels it runs, in the terms of a contract
# (:meth:`pagedkv_lib.verify.contract.Contract.outside`); checked before it runs.
SCENARIO_NEEDS = {
    "chunked_prefill": {"dtype": "fp32", "layout": "NHD", "head_dim": 32, "page_size": 4, "group": 2, "seq_lens": [29]},
    "ring_window": {"dtype": "fp32", "layout": "NHD", "head_dim": 32, "page_size": 4, "group": 2, "seq_lens": [57, 9],
                    "window": (14, 3)},
    "v_tail": {"dtype": "fp32", "layout": "NHD", "head_dim": 16, "page_size": 4, "group": 2, "seq_lens": [6, 9]},
    "fork_cow": {"dtype": "fp32", "layout": "NHD", "head_dim": 16, "page_size": 4, "group": 2, "seq_lens": [9]},
    "reused_page": {"dtype": "fp32", "layout": "NHD", "head_dim": 16, "page_size": 4, "group": 2, "seq_lens": [8]},
    "int64_offsets": {},
    "large_pool": {"dtype": "fp16", "layout": "NHD", "head_dim": 128, "page_size": 16, "group": 1, "seq_lens": [16]},
}  # fmt: skip

SCENARIOS = {
    "chunked_prefill": check_chunked_prefill,
    "ring_window": check_ring_window,
    "v_tail": check_v_tail,
    "fork_cow": check_fork,
    "reused_page": check_reused_page,
    "int64_offsets": check_int64_offsets,
    "large_pool": check_large_pool,
}

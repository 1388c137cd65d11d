"""Scenarios: the library's bookkeeping driven through the callables under test.

Each scenario plays one situation where paged KV caches go silently wrong (chunked
prefill, a ring window, V tails in a NaN-poisoned pool, a copy-on-write fork, a freed
and reused page, offsets past 2**31) and compares with a contiguous float64 oracle.
Each fault of :mod:`pagedkv_lib.faults` breaks one of them; the harness catches an
exception raised inside a scenario and reports it as a failed check.
"""

from __future__ import annotations

import math

import torch

from .. import faults as F
from .. import reference, runtime
from ..formats import block_table_to_csr, pad_block_tables, slot_mapping
from ..indexing import element_offset
from ..manager import KVCacheManager
from ..pool import PagedKVPool
from ..window import RingWindow
from .compare import TOLERANCES, bit_compare, compare, rand
from .grid import accepts
from .report import CaseResult

__all__ = [
    "SCENARIOS",
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


def check_chunked_prefill(append_fn, decode_fn, faults, prompt_len: int = 29, chunk: int = 8) -> CaseResult:
    """A prompt written in chunks (each at ``past_len = cache_len - chunk_len``) gives the
    same pool as one write, and decode over it matches the contiguous oracle."""
    gen, dev = torch.Generator().manual_seed(1), runtime.device()
    n, ps, hk, d = prompt_len, 4, 2, 32
    k, v, q = (
        rand((n, hk, d), torch.float32, gen),
        rand((n, hk, d), torch.float32, gen),
        rand((1, 4, d), torch.float32, gen),
    )
    num_pages = -(-n // ps) + 2
    tables = pad_block_tables([torch.randperm(num_pages, generator=gen)[: -(-n // ps)].tolist()])
    expected = PagedKVPool(num_pages, ps, hk, d, torch.float32)
    pool = PagedKVPool(num_pages, ps, hk, d, torch.float32, device=dev)
    reference.append_paged_kv(
        k, v, expected.cache, slot_mapping(tables, torch.zeros(n, dtype=torch.long), torch.arange(n), ps)
    )
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        b, p = F.chunk_positions(torch.tensor([0, end - start]), torch.tensor([end]), "past_len_zero" in faults)
        append_fn(k[start:end].to(dev), v[start:end].to(dev), pool.cache, slot_mapping(tables, b, p, ps).to(dev))
    same, _, detail = bit_compare(pool.cache, expected.cache)
    out = decode_fn(q.to(dev), pool.cache, tables.to(dev), torch.tensor([n], dtype=torch.int32, device=dev))
    ok, max_abs, _, d2 = _check_out(out, attention_oracle(q[0], k, v, list(range(n)))[None], 1e-5)
    return _scenario("chunked_prefill", same and ok, detail or d2, max_abs, 1e-5, prompt_len=n, chunk=chunk)


def check_ring_window(append_fn, decode_fn, faults, seq_lens: tuple[int, ...] = (57, 9)) -> CaseResult:
    """Decode through a ring cache (sinks, bubble, several wraps) equals attention over
    the sinks + last ``window - sinks`` tokens of a contiguous copy."""
    gen, dev = torch.Generator().manual_seed(2), runtime.device()
    window = RingWindow(max_attention_window=14, sink_tokens=3, tokens_per_block=4)
    lens, hk, d = list(seq_lens), 2, 32
    blocks = [window.num_blocks(n) for n in lens]
    tables = pad_block_tables([list(range(sum(blocks[:b]), sum(blocks[: b + 1]))) for b in range(len(lens))])
    pool = PagedKVPool(sum(blocks), 4, hk, d, torch.float32, device=dev)
    ks, vs = (
        [rand((n, hk, d), torch.float32, gen) for n in lens],
        [rand((n, hk, d), torch.float32, gen) for n in lens],
    )
    for t in range(max(lens)):  # one token per step: a plain ring takes one token per write
        live = [b for b, n in enumerate(lens) if t < n]
        slots = slot_mapping(tables, torch.tensor(live), torch.full((len(live),), t), 4, window)
        k = torch.stack([ks[b][t] for b in live]).to(dev)
        v = torch.stack([vs[b][t] for b in live]).to(dev)
        append_fn(k, v, pool.cache, slots.to(dev))
    q = rand((len(lens), 4, d), torch.float32, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    if "window_write_only" in faults:
        # The reader was not given the window: it reads the cache as linear, logical
        # block j landing on the ring's page j % num_blocks.
        unrolled = [[tables[b, j % blocks[b]].item() for j in range(-(-n // 4))] for b, n in enumerate(lens)]
        out = decode_fn(q.to(dev), pool.cache, pad_block_tables(unrolled).to(dev), seq_lens)
    else:
        out = decode_fn(q.to(dev), pool.cache, tables.to(dev), seq_lens, window=window)
    expected = torch.stack(
        [
            attention_oracle(q[b], ks[b], vs[b], [t for t in range(n) if t < 3 or t > n - 1 - (14 - 3)])
            for b, n in enumerate(lens)
        ]
    )
    ok, max_abs, _, detail = _check_out(out, expected, 1e-5)
    detail = detail or "window 14, 3 sinks, pages of 4"
    return _scenario("ring_window", ok, detail, max_abs, 1e-5, seq_lens=tuple(lens))


def check_v_tail(append_fn, decode_fn, faults) -> CaseResult:
    """After a prefill write with ``zero_v_tail`` into a NaN-poisoned pool, the unused V
    rows of each last page are 0, so a reader that loads whole pages stays finite."""
    if not accepts(append_fn, "zero_v_tail"):
        return _scenario("v_tail", None, "append_fn takes no zero_v_tail")
    gen, dev = torch.Generator().manual_seed(3), runtime.device()
    lens, ps, hk, d = [6, 9], 4, 2, 16
    tables = pad_block_tables([[3, 0], [1, 4, 2]])
    pool = PagedKVPool(6, ps, hk, d, torch.float32, device=dev)
    pool.cache.fill_(float("nan"))
    csr = block_table_to_csr(tables, torch.tensor(lens), ps)
    b = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    k, v = rand((sum(lens), hk, d), torch.float32, gen), rand((sum(lens), hk, d), torch.float32, gen)
    tail = None if "v_tail_not_zeroed" in faults else tuple(x.to(dev) for x in csr)
    append_fn(k.to(dev), v.to(dev), pool.cache, slot_mapping(tables, b, pos, ps).to(dev), zero_v_tail=tail)
    q = rand((2, 4, d), torch.float32, gen)
    out = F.whole_page_decode(q, pool.cache.cpu(), tables, lens)
    expected = torch.stack([attention_oracle(q[i], k[b == i], v[b == i], list(range(n))) for i, n in enumerate(lens)])
    ok, max_abs, _, detail = _check_out(out, expected, 1e-5)
    return _scenario("v_tail", ok, detail or f"seq_lens {lens}, pages of {ps}, NaN pool", max_abs, 1e-5)


def check_fork(append_fn, decode_fn, faults) -> CaseResult:
    """Fork a 6-token prompt, append 3 tokens to the child, then 3 to the parent: both
    read back bit-identical to what was written for them, and the child's decode
    matches the oracle."""
    gen, dev = torch.Generator().manual_seed(4), runtime.device()
    ps, hk, d = 4, 2, 16
    manager = (F.NoCopyOnWriteManager if "no_copy_on_write" in faults else KVCacheManager)(16, ps)
    pool = PagedKVPool(16, ps, hk, d, torch.float32, device=dev)
    written = {"parent": [], "child": []}

    def write(seq, n):
        k, v = rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen)
        slots = torch.tensor(manager.append_tokens(seq, n))
        pool.copy_blocks(manager.pop_copies())
        append_fn(k.to(dev), v.to(dev), pool.cache, slots.to(dev))
        written[seq].append((k, v))

    manager.add_sequence("parent")
    write("parent", 6)
    manager.fork("parent", "child")
    written["child"] = list(written["parent"])
    write("child", 3)
    write("parent", 3)
    same = []
    for seq in ("parent", "child"):  # each must read back exactly what was written for it
        k_got, v_got = reference.gather_paged_kv(pool.cache.cpu(), manager.block_table(seq), 9)
        same.append(torch.equal(k_got, torch.cat([k for k, _ in written[seq]])))
        same.append(torch.equal(v_got, torch.cat([v for _, v in written[seq]])))
    k_ref, v_ref = (torch.cat([x[i] for x in written["child"]]) for i in (0, 1))
    q = rand((1, 4, d), torch.float32, gen)
    table = torch.tensor([manager.block_table("child")], dtype=torch.int32, device=dev)
    out = decode_fn(q.to(dev), pool.cache, table, torch.tensor([9], dtype=torch.int32, device=dev))
    ok, max_abs, _, detail = _check_out(out, attention_oracle(q[0], k_ref, v_ref, list(range(9)))[None], 1e-5)
    detail = detail or ("" if all(same) else "a sequence's K/V changed under another's write")
    same = all(same)
    return _scenario("fork_cow", same and ok, detail or "prompt 6, +3 each, pages of 4", max_abs, 1e-5)


def check_reused_page(append_fn, decode_fn, faults) -> CaseResult:
    """A request slot's table must be rebuilt when its sequence changes: A finishes,
    C takes its batch slot, D reuses A's pages; decode of C matches C's tokens."""
    gen, dev = torch.Generator().manual_seed(5), runtime.device()
    ps, hk, d = 4, 2, 16
    manager, pool = KVCacheManager(6, ps), PagedKVPool(6, ps, hk, d, torch.float32, device=dev)
    data = {}
    for seq in ("A", "B"):
        manager.add_sequence(seq)
    for seq in ("A", "B"):
        data[seq] = (rand((8, hk, d), torch.float32, gen), rand((8, hk, d), torch.float32, gen))
        append_fn(*(x.to(dev) for x in data[seq]), pool.cache, torch.tensor(manager.append_tokens(seq, 8)).to(dev))
    stale = manager.block_table("A")
    manager.free_sequence("A")
    for seq in ("C", "D"):
        manager.add_sequence(seq)
        data[seq] = (rand((8, hk, d), torch.float32, gen), rand((8, hk, d), torch.float32, gen))
        append_fn(*(x.to(dev) for x in data[seq]), pool.cache, torch.tensor(manager.append_tokens(seq, 8)).to(dev))
    table = stale if "stale_block_table" in faults else manager.block_table("C")
    q = rand((1, 4, d), torch.float32, gen)
    out = decode_fn(
        q.to(dev),
        pool.cache,
        torch.tensor([table], dtype=torch.int32, device=dev),
        torch.tensor([8], dtype=torch.int32, device=dev),
    )
    ok, max_abs, _, detail = _check_out(out, attention_oracle(q[0], *data["C"], list(range(8)))[None], 1e-5)
    reused = sorted(set(stale) & set(manager.block_table("D")))
    if not ok and not detail:
        in_d = sorted(set(table) & set(manager.block_table("D")))
        detail = (
            f"C's decode does not match C's tokens: the table it read names pages {table}, "
            f"of which {in_d} now hold D's tokens (C's own pages are {manager.block_table('C')})"
        )
    return _scenario("reused_page", ok, detail or f"A freed; its pages {reused} now hold D", max_abs, 1e-5)


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


SCENARIOS = {
    "chunked_prefill": check_chunked_prefill,
    "ring_window": check_ring_window,
    "v_tail": check_v_tail,
    "fork_cow": check_fork,
    "reused_page": check_reused_page,
    "int64_offsets": check_int64_offsets,
    "large_pool": check_large_pool,
}

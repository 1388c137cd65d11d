"""Scenarios: the library's bookkeeping driven through the callables under test.

Each scenario plays one situation where paged KV caches go silently wrong (chunked
prefill, a ring window, V tails in a NaN-poisoned pool, a copy-on-write fork, a freed
and reused page, offsets past 2**31) and compares with a contiguous float64 oracle.
Each fault of :mod:`pagedkv_lab.faults` breaks one of them; the harness catches an
exception raised inside a scenario and reports it as a failed check. The scenarios
that drive a prefill kernel live in :mod:`.prefill_scenarios`.

The pools live in the cache layout the kernels declare (:mod:`.bench`), start with NaN
in every slot (a failure on non-finite outputs is re-run with finite stale values and
attributed, as the grids' cases are: :mod:`.stale`), in pages of
``page_size`` (4 by default; the runner picks one the kernels' contracts admit, 16 for
a kernel whose tile is one page); a failure names the request, the step, the page and
the first wrong element, and what the scenario believes went wrong. What each
scenario needs of a kernel is :data:`SCENARIO_NEEDS`, checked against the contracts.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab import faults as F
from pagedkv_lab.verify.bench import Bench, locate_output
from pagedkv_lab.verify.grid import accepts, rand
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lib import reference, runtime
from pagedkv_lib.cache_layouts import to_native, to_paged
from pagedkv_lib.compare import TOLERANCES, bit_compare, compare
from pagedkv_lib.formats import block_table_to_csr, pad_block_tables, slot_mapping
from pagedkv_lib.indexing import element_offset
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.window import RingWindow

__all__ = [
    "SCENARIOS",
    "SCENARIO_NEEDS",
    "attention_oracle",
    "scenario_case",
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


def _scenario(name: str, passed: bool, detail: str = "", max_abs: float = 0.0, atol: float = 0.0, **case):
    return CaseResult(name, case, passed, max_abs, 0.0, atol, detail)


def finish(name: str, bench: Bench, ok: bool, detail: str, max_abs: float, **case) -> CaseResult:
    """A scenario's result, failed too when a kernel wrote next to a pool or input."""
    guards = bench.guard_notes()
    if guards:
        ok, detail = False, f"{detail}; {guards}" if detail else guards
    return _scenario(name, ok, detail, max_abs, bench.atol, **case)


def scenario_case(page_size: int, **case) -> dict:
    """A scenario's case as its report shows it: ``page_size`` only when not the default 4."""
    return case if page_size == 4 else {**case, "page_size": page_size}


def check_chunked_prefill(
    append_fn, decode_fn, faults, prompt_len: int | None = None, chunk: int | None = None, *,
    page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None, stop_at_pool: bool = True,
) -> CaseResult:  # fmt: skip
    """A prompt of ``7 * page_size + 1`` tokens written in chunks of ``2 * page_size``
    (each at ``past_len = cache_len - chunk_len``) gives the same pool as one write
    after every chunk, and decode over it matches the contiguous oracle.

    The check ends at the first chunk after which the pool differs (``max_abs``: the
    pool's difference). With ``stop_at_pool=False`` every chunk is written all the same
    and the decode after the last one is compared: ``max_abs`` is then the decode's
    error, and the check still fails on the pool."""
    bench, gen = Bench(append_fn, decode_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(1)
    ps, hk, d = page_size, 2, 32
    n, chunk = prompt_len or 7 * ps + 1, chunk or 2 * ps
    k, v, q = (rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen),
               rand((1, 4, d), torch.float32, gen))  # fmt: skip
    num_pages = -(-n // ps) + 2
    tables = pad_block_tables([torch.randperm(num_pages, generator=gen)[: -(-n // ps)].tolist()])
    pool = bench.pool(num_pages, ps, hk, d)
    expected = PagedKVPool(num_pages, ps, hk, d, torch.float32)
    expected.cache.copy_(pool.paged())  # the same stale values (NaN, or finite in an attribution re-run)
    case, pool_wrong = scenario_case(ps, prompt_len=n, chunk=chunk), ""
    for step, start in enumerate(range(0, n, chunk)):
        end = min(start + chunk, n)
        b, p = F.chunk_positions(torch.tensor([0, end - start]), torch.tensor([end]), "past_len_zero" in faults)
        bench.append(k[start:end], v[start:end], pool, slot_mapping(tables, b, p, ps))
        reference.append_paged_kv(k[start:end], v[start:end], expected.cache,
                                  slot_mapping(tables, torch.zeros(end - start, dtype=torch.long),
                                               torch.arange(start, end), ps))  # fmt: skip
        same, max_abs, where = bit_compare(pool.paged(), expected.cache)
        if not same and not pool_wrong:
            table = tables[0].tolist()
            pool_wrong = (f"after chunk step {step} (positions {start}..{end - 1}, pages of {ps}, table {table}): "
                          f"the pool: {where}; the append wrote this chunk somewhere else")  # fmt: skip
            if stop_at_pool:
                return finish("chunked_prefill", bench, False, pool_wrong, max_abs, **case)
    out = bench.decode(q, pool, tables, [n])
    rows = [f"request 0 (decode after {-(-n // chunk)} chunk steps, seq_len {n}, pages {tables[0].tolist()})"]
    ok, max_abs, detail = bench.compare(out, attention_oracle(q[0], k, v, list(range(n)))[None], rows)
    if pool_wrong:
        return finish("chunked_prefill", bench, False, "; ".join(filter(None, [pool_wrong, detail])), max_abs, **case)
    if not ok:
        detail += "; the pool is right after every chunk, so the decode reads it wrongly"
    return finish("chunked_prefill", bench, ok, detail, max_abs, **case)


def check_ring_window(
    append_fn, decode_fn, faults, seq_lens: tuple[int, ...] = (57, 9), *,
    page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None,
) -> CaseResult:  # fmt: skip
    """Decode through a ring cache (sinks, bubble, several wraps) equals attention over
    the sinks + last ``window - sinks`` tokens of a contiguous copy."""
    bench, gen = Bench(append_fn, decode_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(2)
    ps, size, sinks = page_size, max(14, page_size + 6), 3
    window = RingWindow(max_attention_window=size, sink_tokens=sinks, tokens_per_block=ps)
    lens, hk, d = list(seq_lens), 2, 32
    blocks = [window.num_blocks(n) for n in lens]
    tables = pad_block_tables([list(range(sum(blocks[:b]), sum(blocks[: b + 1]))) for b in range(len(lens))])
    pool = bench.pool(sum(blocks), ps, hk, d)
    ks, vs = (
        [rand((n, hk, d), torch.float32, gen) for n in lens],
        [rand((n, hk, d), torch.float32, gen) for n in lens],
    )
    for t in range(max(lens)):  # one token per step: a plain ring takes one token per write
        live = [b for b, n in enumerate(lens) if t < n]
        slots = slot_mapping(tables, torch.tensor(live), torch.full((len(live),), t), ps, window)
        bench.append(torch.stack([ks[b][t] for b in live]), torch.stack([vs[b][t] for b in live]), pool, slots)
    q = rand((len(lens), 4, d), torch.float32, gen)
    # A reader not given the window reads the ring as linear: logical block j on page j % num_blocks.
    linear = [[tables[b, j % blocks[b]].item() for j in range(-(-n // ps))] for b, n in enumerate(lens)]
    if "window_write_only" in faults:
        out = bench.decode(q, pool, pad_block_tables(linear), lens)
    else:
        out = bench.decode(q, pool, tables, lens, window=window)
    visible = [[t for t in range(n) if t < sinks or t > n - 1 - (size - sinks)] for n in lens]
    expected = torch.stack([attention_oracle(q[b], ks[b], vs[b], visible[b]) for b in range(len(lens))])
    rows = [f"request {b} (decode after {n} one-token steps, ring pages {tables[b, : blocks[b]].tolist()})"
            for b, n in enumerate(lens)]  # fmt: skip
    ok, max_abs, detail = bench.compare(out, expected, rows)
    setup = f"window {size}, {sinks} sinks, pages of {ps}"
    detail = f"{detail}; {setup}: the decode does not see exactly the sinks and the last tokens" if detail else setup
    return finish("ring_window", bench, ok, detail, max_abs, **scenario_case(ps, seq_lens=tuple(lens)))


def check_v_tail(
    append_fn, decode_fn, faults, *, page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None
) -> CaseResult:
    """After a prefill write with ``zero_v_tail`` into a NaN-poisoned pool, the unused V
    rows of each last page are 0, so a reader that loads whole pages stays finite."""
    if not accepts(append_fn, "zero_v_tail"):
        return _scenario("v_tail", None, "append_fn takes no zero_v_tail")
    bench, gen = Bench(append_fn, decode_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(3)
    ps, hk, d = page_size, 2, 16
    lens = [ps + 2, 2 * ps + 1]
    tables = pad_block_tables([[3, 0], [1, 4, 2]])
    pool = bench.pool(6, ps, hk, d)
    csr = tuple(x.to(runtime.device()) for x in block_table_to_csr(tables, torch.tensor(lens), ps))
    b = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    k, v = rand((sum(lens), hk, d), torch.float32, gen), rand((sum(lens), hk, d), torch.float32, gen)
    slots = slot_mapping(tables, b, pos, ps)
    if "v_tail_not_zeroed" in faults:
        bench.append(k, v, pool, slots)
    else:
        bench.append(k, v, pool, slots, zero_v_tail=csr)
    paged = pool.paged()
    notes = []
    for r, n in enumerate(lens):  # the unused V rows of the last page must now be 0
        last = int(tables[r, (n - 1) // ps])
        rows = paged[last, 1, n - (n - 1) // ps * ps :]
        if rows.numel() and not torch.equal(rows, torch.zeros_like(rows)):
            row = int(torch.nonzero((rows != 0).flatten(1).any(1))[0]) + n - (n - 1) // ps * ps
            notes.append(f"request {r} (seq_len {n}): V row {row} of its last page {last} holds "
                         f"{float(paged[last, 1, row].flatten()[0])!r}, not 0")  # fmt: skip
    q = rand((2, 4, d), torch.float32, gen)
    out = F.whole_page_decode(q, paged, tables, lens)
    expected = torch.stack([attention_oracle(q[i], k[b == i], v[b == i], list(range(n))) for i, n in enumerate(lens)])
    rows = [f"request {i} (a whole-page read after the prefill write, seq_len {n})" for i, n in enumerate(lens)]
    ok, max_abs, detail = bench.compare(out, expected, rows)
    detail = "; ".join(filter(None, [detail, *notes])) or f"seq_lens {lens}, pages of {ps}, NaN pool"
    if notes:
        detail += ": the write did not zero the V tail it was given"
    return finish("v_tail", bench, ok and not notes, detail, max_abs, **scenario_case(ps))


def check_fork(
    append_fn, decode_fn, faults, *, page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None
) -> CaseResult:
    """Fork a prompt of ``page_size + 2`` tokens, append 3 tokens to the child, then 3 to
    the parent: both read back bit-identical to what was written for them, and the
    child's decode matches the oracle."""
    bench, gen = Bench(append_fn, decode_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(4)
    ps, hk, d = page_size, 2, 16
    prompt = ps + 2
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
    write("parent", prompt)
    manager.fork("parent", "child")
    written["child"] = list(written["parent"])
    write("child", 3)
    write("parent", 3)
    changed = []
    for seq in ("parent", "child"):  # each must read back exactly what was written for it
        table = manager.block_table(seq)
        k_got, v_got = reference.gather_paged_kv(pool.paged(), table, prompt + 3)
        k_want, v_want = (torch.cat([x[i] for x in written[seq]]) for i in (0, 1))
        for name, got, want in (("K", k_got, k_want), ("V", v_got, v_want)):
            rows = torch.nonzero((got != want).any(-1).any(-1)).flatten().tolist()
            if rows:
                r = rows[0]
                changed.append(f"{seq}'s {name} position {r} (page {table[r // ps]}, row {r % ps}) changed, "
                               f"{len(rows)} positions in all: the steps wrote into a page both share")  # fmt: skip
    k_ref, v_ref = (torch.cat([x[i] for x in written["child"]]) for i in (0, 1))
    q = rand((1, 4, d), torch.float32, gen)
    table = manager.block_table("child")
    out = bench.decode(q, pool, torch.tensor([table], dtype=torch.int32), [prompt + 3])
    rows = [f"the child (decode after the child's and the parent's steps, seq_len {prompt + 3}, pages {table})"]
    expected = attention_oracle(q[0], k_ref, v_ref, list(range(prompt + 3)))[None]
    ok, max_abs, detail = bench.compare(out, expected, rows)
    if detail and not changed:
        detail += "; both read back what was written for them, so the decode reads the child's pages wrongly"
    detail = "; ".join([x for x in [detail, *changed] if x]) or f"prompt {prompt}, +3 each, pages of {ps}"
    return finish("fork_cow", bench, ok and not changed, detail, max_abs, **scenario_case(ps))


def check_reused_page(
    append_fn, decode_fn, faults, *, page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None
) -> CaseResult:
    """A request slot's table must be rebuilt when its sequence changes: A finishes,
    C takes its batch slot, D reuses A's pages; decode of C matches C's tokens. A
    failure is blamed on page reuse only when the output is what the pages its table
    names now hold."""
    bench, gen = Bench(append_fn, decode_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(5)
    ps, hk, d = page_size, 2, 16
    n = 2 * ps
    manager, pool = KVCacheManager(6, ps), bench.pool(6, ps, hk, d)
    data = {}
    for seq in ("A", "B"):
        manager.add_sequence(seq)
    for seq in ("A", "B"):
        data[seq] = (rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen))
        bench.append(*data[seq], pool, torch.tensor(manager.append_tokens(seq, n)))
    stale = manager.block_table("A")
    manager.free_sequence("A")
    for seq in ("C", "D"):
        manager.add_sequence(seq)
        data[seq] = (rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen))
        bench.append(*data[seq], pool, torch.tensor(manager.append_tokens(seq, n)))
    if "stale_block_table" in faults:
        table = stale
    else:
        table = manager.block_table("C")
    own = manager.block_table("C")
    q = rand((1, 4, d), torch.float32, gen)
    out = bench.decode(q, pool, torch.tensor([table], dtype=torch.int32), [n])
    rows = [f"request C (decode after A was freed and D reused its pages; table {table})"]
    ok, max_abs, detail = bench.compare(out, attention_oracle(q[0], *data["C"], list(range(n)))[None], rows)
    reused = sorted(set(stale) & set(manager.block_table("D")))
    if ok:
        return finish("reused_page", bench, ok, f"A freed; its pages {reused} now hold D", max_abs, **scenario_case(ps))
    k_t, v_t = reference.gather_paged_kv(pool.paged(), table, n)
    what_it_names = compare(out, attention_oracle(q[0], k_t, v_t, list(range(n)))[None], bench.atol, bench.rtol)
    in_d = sorted(set(table) & set(manager.block_table("D")))
    if table != own and in_d and what_it_names.passed:
        reason = (f"the table it read names pages {table}, of which {in_d} now hold D's tokens (C's own pages "
                  f"are {own}): a stale block table")  # fmt: skip
    else:
        reason = (f"the table names C's own pages {own}, and the output is not attention over what they hold: "
                  "not a page-reuse bug (the decode itself is wrong; see the decode grid)")  # fmt: skip
    return finish("reused_page", bench, False, f"{detail}; {reason}", max_abs, **scenario_case(ps))


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


def check_large_pool(append_fn, decode_fn, faults, *, cache_layout: str | None = None) -> CaseResult:
    """A real pool of more than 2**31 elements (about 4.3 GB in fp16), in the cache layout
    the kernels declare: append one token into its last page and decode it back. Needs
    a GPU with the memory."""
    if runtime.BACKEND.interpreted:
        return _scenario("large_pool", None, "needs a GPU (the interpreter copies every tensor argument)")
    layout = cache_layout or Bench(append_fn, decode_fn).cache_layout
    pages, ps, hk, d = 2**31 // (2 * 16 * 8 * 128) + 2, 16, 8, 128
    cache = to_native(torch.zeros((pages, 2, ps, hk, d), dtype=torch.float16, device="cuda"), layout, "NHD")
    gen = torch.Generator().manual_seed(6)
    k, v, q = (rand(s, torch.float16, gen).cuda() for s in ((1, hk, d), (1, hk, d), (1, hk, d)))
    append_fn(k, v, cache, torch.tensor([(pages - 1) * ps + ps - 1], device="cuda"))
    last = to_paged_last_page(cache, layout, pages, ps, hk, d)  # [2, ps, hk, d] on the CPU
    same = torch.equal(last[0, -1], k[0].cpu()) and torch.equal(last[1, -1], v[0].cpu())
    table = torch.full((1, 1), pages - 1, dtype=torch.int32, device="cuda")  # every row read is the last page
    out = decode_fn(q, cache, table, torch.tensor([ps], dtype=torch.int32, device="cuda"))
    expected = attention_oracle(q[0].cpu(), last[0], last[1], list(range(ps)))[None]
    del cache
    atol, rtol = TOLERANCES[torch.float16]
    ok, max_abs, detail = locate_output(out, expected, atol, ["request 0 (the pool's last page)"], rtol)
    if not same:
        detail = "; ".join(filter(None, [detail, "the appended token is not in the last row of the last page"]))
    return _scenario("large_pool", same and ok, detail or f"{pages * 2 * ps * hk * d:.2e} elements", max_abs, atol)


def to_paged_last_page(native, cache_layout: str, num_pages: int, page_size: int, heads: int, dim: int):
    """The last page of a native pool as ``[2, page_size, heads, dim]`` on the CPU
    (only that page is converted: the pool is gigabytes)."""
    tensors = [native] if isinstance(native, torch.Tensor) else list(native)
    if cache_layout == "flat":
        tail = [t[-page_size:] for t in tensors]
    else:
        tail = [t[-1:] for t in tensors]
    if cache_layout == "paged":
        return to_paged(tail[0], cache_layout, "NHD", 1, page_size, heads, dim)[0].cpu()
    return to_paged(tuple(tail), cache_layout, "NHD", 1, page_size, heads, dim)[0].cpu()


# What each scenario asks of the kernels it runs, in the terms of a contract
# (:meth:`pagedkv_lab.verify.contract.Contract.outside`); checked before it runs.
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

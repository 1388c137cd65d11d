"""Scenarios that drive a prefill kernel (``fn(q, cache, qo_indptr, block_tables,
seq_lens, layout=...)``) through the library's bookkeeping, with the append under test
(or the reference) writing the pool:

* ``prefill_chunks``: a prompt written and attended to chunk by chunk, as chunked
  prefill does: after each chunk's write, the chunk's queries at positions
  ``past_len .. past_len + chunk_len - 1`` attend to every key up to their own;
* ``prefix_hit``: a request forks a cached prompt that ends mid-page (a prefix-cache
  hit; the manager copies the shared partial page before the first write), appends
  its own tokens and attends to them in one batch with the original request's next
  decode step.

Each compares with the contiguous float64 oracle (causal: query at position ``p`` sees
keys ``0 .. p``) and names the request, step, query position, pages and first wrong
element of a failure.
"""

from __future__ import annotations

import torch

from pagedkv_lab import faults as F
from pagedkv_lab.verify.bench import Bench
from pagedkv_lab.verify.grid import rand
from pagedkv_lab.verify.report import CaseResult
from pagedkv_lab.verify.scenarios import attention_oracle, finish, scenario_case
from pagedkv_lib.formats import pad_block_tables, slot_mapping
from pagedkv_lib.manager import KVCacheManager

__all__ = ["PREFILL_SCENARIOS", "PREFILL_SCENARIO_NEEDS", "check_prefill_chunks", "check_prefix_hit"]


def _causal(q, k, v, positions):
    """The oracle of queries ``q [n, Hq, D]`` at ``positions``, each seeing keys ``0..p``."""
    return torch.stack([attention_oracle(q[i], k, v, list(range(p + 1))) for i, p in enumerate(positions)])


def check_prefill_chunks(
    append_fn, prefill_fn, faults, *, page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None
) -> CaseResult:
    """A prompt of ``2 * page_size + 3`` tokens in chunks of ``page_size + 1`` (so chunks
    start and end mid-page, the last one a single token): each chunk written, then its
    queries attend to the pool."""
    bench, gen = Bench(append_fn, prefill_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(8)
    ps, hk, d = page_size, 1, 32
    n, chunk = 2 * ps + 3, ps + 1
    k, v = rand((n, hk, d), torch.float32, gen), rand((n, hk, d), torch.float32, gen)
    q = rand((n, 2, d), torch.float32, gen)
    num_pages = -(-n // ps) + 2
    tables = pad_block_tables([torch.randperm(num_pages, generator=gen)[: -(-n // ps)].tolist()])
    pool = bench.pool(num_pages, ps, hk, d)
    worst, case = 0.0, scenario_case(ps, prompt_len=n, chunk=chunk)
    for step, start in enumerate(range(0, n, chunk)):
        end = min(start + chunk, n)
        b, p = F.chunk_positions(torch.tensor([0, end - start]), torch.tensor([end]), "past_len_zero" in faults)
        bench.append(k[start:end], v[start:end], pool, slot_mapping(tables, b, p, ps))
        out = bench.prefill(q[start:end], pool, [0, end - start], tables, [end])
        expected = _causal(q[start:end], k, v, range(start, end))
        rows = [f"request 0, chunk step {step}, query at position {start + i} (pages {tables[0].tolist()})"
                for i in range(end - start)]  # fmt: skip
        ok, max_abs, detail = bench.compare(out, expected, rows)
        worst = max(worst, max_abs)
        if not ok:
            return finish("prefill_chunks", bench, False, f"{detail}; the chunk sees the wrong keys", max_abs, **case)
    return finish("prefill_chunks", bench, True, f"{n} tokens in chunks of {chunk}, pages of {ps}", worst, **case)


def check_prefix_hit(
    append_fn, prefill_fn, faults, *, page_size: int = 4, cache_layout: str | None = None, poison=True, tolerance=None
) -> CaseResult:
    """Request A writes ``page_size + page_size // 2 + 1`` tokens (its last page partly
    filled); B forks it (a prefix hit ending mid-page) and appends 5 tokens, A one;
    one prefill batch: A's decode step and B's 5 queries."""
    bench, gen = Bench(append_fn, prefill_fn, cache_layout, poison, tolerance), torch.Generator().manual_seed(9)
    ps, hk, d = page_size, 2, 16
    hit, new = ps + ps // 2 + 1, 5
    manager = (F.NoCopyOnWriteManager if "no_copy_on_write" in faults else KVCacheManager)(12, ps)
    pool = bench.pool(12, ps, hk, d)
    keys = {"A": [], "B": []}

    def write(seq, m):
        kv = rand((m, hk, d), torch.float32, gen), rand((m, hk, d), torch.float32, gen)
        slots = torch.tensor(manager.append_tokens(seq, m))
        pool.copy_blocks(manager.pop_copies())
        bench.append(*kv, pool, slots)
        keys[seq].append(kv)

    manager.add_sequence("A")
    write("A", hit)
    manager.fork("A", "B")
    keys["B"] = list(keys["A"])
    write("B", new)
    write("A", 1)
    lens = [hit + 1, hit + new]
    tables = pad_block_tables([manager.block_table("A"), manager.block_table("B")])
    q = rand((1 + new, 4, d), torch.float32, gen)
    out = bench.prefill(q, pool, [0, 1, 1 + new], tables, lens)
    kv = {s: [torch.cat([x[i] for x in keys[s]]) for i in (0, 1)] for s in ("A", "B")}
    expected = torch.cat([_causal(q[:1], *kv["A"], [hit]), _causal(q[1:], *kv["B"], range(hit, hit + new))])
    rows = [f"request 0 (A, its decode step at position {hit}, pages {manager.block_table('A')})"]
    rows += [f"request 1 (B, a prefix hit of {hit} tokens, query at position {hit + i}, pages "
             f"{manager.block_table('B')})" for i in range(new)]  # fmt: skip
    ok, max_abs, detail = bench.compare(out, expected, rows)
    if not ok:
        detail += "; the queries after a mid-page prefix hit do not see exactly their own keys"
    setup = f"a hit of {hit} tokens ending mid-page, +{new} for B and +1 for A, pages of {ps}"
    return finish("prefix_hit", bench, ok, detail or setup, max_abs, **scenario_case(ps))


# "new_tokens": "cache": both write the new tokens into the pool and read them back from
# it, which a kernel that takes them apart (Contract.new_tokens "separate") never does.
PREFILL_SCENARIO_NEEDS = {
    "prefill_chunks": {"dtype": "fp32", "layout": "NHD", "head_dim": 32, "page_size": 4, "group": 2,
                       "seq_lens": [11], "new_tokens": "cache"},
    "prefix_hit": {"dtype": "fp32", "layout": "NHD", "head_dim": 16, "page_size": 4, "group": 2, "seq_lens": [8, 12],
                   "new_tokens": "cache"},
}  # fmt: skip
PREFILL_SCENARIOS = {"prefill_chunks": check_prefill_chunks, "prefix_hit": check_prefix_hit}

"""Conformance harness: run the suite's checks against any paged-KV kernel.

Give :func:`run` an ``append_fn`` with the signature of ``kernels.append_paged_kv``
(``fn(k, v, cache, slot_mapping, layout=...)``, optionally ``zero_v_tail=``) and/or a
``decode_fn`` with that of ``kernels.paged_decode_attention``
(``fn(q, cache, block_tables, seq_lens, layout=..., window=...)``): the suite's own
kernels, a Python reference, your kernel, or a production library's wrapped function.
Inputs are built on :func:`pagedkv_lib.runtime.device`; expectations come from the
float64 references on the CPU (copies are exact, so appends must match bit for bit).

Two kinds of checks:

* a **case grid** (layouts, dtypes, head dims, page sizes, GQA ratios, empty and
  length-1 sequences, padding slots, ``last_page_len == page_size``, NaN-poisoned
  unused slots, physical pages shared by two sequences) plus hypothesis-generated
  cases, each a plain dict that :func:`run_case` replays;
* **scenarios** that drive the library's bookkeeping through the callables (chunked
  prefill, ring window, V-tail zeroing, copy-on-write fork, a freed and reused page,
  offsets past 2**31). Each fault of :mod:`pagedkv_lib.faults` breaks one of them.

``python -m pagedkv_lib.verify`` runs everything on the suite's kernels and exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import sys
from dataclasses import dataclass, field

import torch

from . import faults as F
from . import reference, runtime
from .formats import block_table_to_csr, pad_block_tables, scatter_pages, slot_mapping
from .indexing import element_offset
from .manager import KVCacheManager
from .pool import PagedKVPool
from .window import RingWindow

__all__ = ["TOLERANCES", "CaseResult", "Report", "run", "run_case", "main"]

# (atol, rtol) of a decode output against the float64 reference: |err| <= atol + rtol * |ref|.
# rtol is half an ulp of the output dtype (the final rounding alone costs that much on
# outputs of magnitude > 1); atol covers accumulation in fp32.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2**-11), torch.bfloat16: (1e-2, 2**-8)}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class CaseResult:
    """One check on one case: pass/fail, errors against the reference, tolerance."""

    check: str
    case: dict
    passed: bool | None  # None: skipped
    max_abs: float = 0.0
    max_rel: float = 0.0
    atol: float = 0.0
    detail: str = ""
    tol_ratio: float | None = None  # max |err| / (atol + rtol |ref|); None: max_abs / atol
    faults: tuple[str, ...] = ()

    @property
    def repro(self) -> str:
        """A line that re-runs this case when pasted: on the suite's kernels, or on yours
        with ``append_fn=`` / ``decode_fn=`` added."""
        extra = f", faults={set(self.faults)!r}" if self.faults else ""
        check = self.check.split("[")[0]
        return f"from pagedkv_lib import verify; verify.run_case({check!r}, {self.case!r}{extra})"


@dataclass
class Report:
    results: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.passed is False]

    def rows(self) -> list[dict]:
        """One dict per result: check, case, status, max_abs, max_rel, atol, detail."""
        status = {True: "pass", False: "FAIL", None: "skip"}
        return [
            {
                "check": r.check,
                "case": _short(r.case),
                "status": status[r.passed],
                "max_abs": r.max_abs,
                "max_rel": r.max_rel,
                "atol": r.atol,
                "detail": r.detail,
            }
            for r in self.results
        ]

    def to_frame(self):
        """The rows as a pandas DataFrame (pandas is optional)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> str:
        counts = {s: sum(r["status"] == s for r in self.rows()) for s in ("pass", "FAIL", "skip")}
        return f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"

    def __str__(self) -> str:
        lines = [f"{'check':<18} {'status':<6} {'max_abs':>9} {'atol':>8}  case / detail"]
        for row in self.rows():
            lines.append(
                f"{row['check']:<18} {row['status']:<6} {row['max_abs']:>9.2e} {row['atol']:>8.0e}  "
                f"{row['case']}{'  ' + row['detail'] if row['detail'] else ''}"
            )
        lines.append(self.summary())
        for r in self.failures:
            lines.append(f"reproduce: {r.repro}")
        return "\n".join(lines)

    def plot(self, title: str = "conformance: error / tolerance per case"):
        """Bar per case of ``max_abs / atol`` (log scale; failures red, at or above 1)."""
        import matplotlib.pyplot as plt

        ratios, colors = [], []
        for r in self.results:
            if r.passed is None:
                continue
            ratio = r.tol_ratio if r.tol_ratio is not None else (r.max_abs / r.atol if r.atol else 0.0)
            ratios.append(max(ratio if math.isfinite(ratio) else 1e3, 1e-8) if r.passed else max(ratio, 1.0))
            colors.append("tab:green" if r.passed else "tab:red")
        fig, ax = plt.subplots()
        ax.bar(range(len(ratios)), ratios, color=colors)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set(title=title, xlabel="case", ylabel="max |error| / tolerance (exact checks: 1e-8 = equal)")
        fig.tight_layout()
        return fig


def _short(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")


# --------------------------------------------------------------------------- building cases


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def _compare(out, expected, atol: float, rtol: float = 0.0) -> tuple[bool, float, float, str]:
    out = out.detach().cpu().double()
    if out.shape != expected.shape:
        return False, math.inf, math.inf, f"shape {tuple(out.shape)} != {tuple(expected.shape)}"
    if not torch.isfinite(out).all():
        return False, math.inf, math.inf, f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    err = (out - expected).abs()
    max_abs = float(err.max()) if err.numel() else 0.0
    max_rel = float((err / expected.abs().clamp(min=1e-6)).max()) if err.numel() else 0.0
    return bool((err <= atol + rtol * expected.abs()).all()), max_abs, max_rel, ""


def _bit_compare(cache, expected) -> tuple[bool, float, str]:
    got = cache.detach().cpu()
    differ = got.view(torch.uint8) != expected.view(torch.uint8)
    if not differ.any():
        return True, 0.0, ""
    diff = (got.double() - expected.double()).abs().nan_to_num(math.inf)
    return False, float(diff.max()), f"{int(differ.sum())} bytes differ"


def _decode_inputs(case: dict):
    """Pool, tables, lengths and q for a decode case; all on the CPU."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d = _DTYPES[case["dtype"]], case["page_size"], case["num_kv_heads"], case["head_dim"]
    lens = list(case["seq_lens"])
    shared = case.get("shared_pages", False) and len(lens) > 1
    if shared:  # sequence 1 reads a prefix of sequence 0's pages (a shared prefix)
        lens[1] = min(lens[1], lens[0])
    pages_each = [-(-n // ps) for n in lens]
    num_pages = sum(pages_each) - (pages_each[1] if shared else 0) + 2
    rows = scatter_pages([0 if shared and b == 1 else n for b, n in enumerate(pages_each)], num_pages, gen)
    if shared:
        rows[1] = rows[0][: pages_each[1]]
    pool = PagedKVPool(num_pages, ps, hk, d, dtype, case["layout"])
    if case.get("poison", True):
        pool.cache.fill_(float("nan"))
    else:
        pool.cache.copy_(_rand(pool.cache.shape, dtype, gen))
    tables = pad_block_tables(rows, max(pages_each, default=0) + 1)
    for b, n in enumerate(lens):
        if shared and b == 1:
            continue
        slots = slot_mapping(tables, torch.full((n,), b), torch.arange(n), ps)
        k, v = _rand((n, hk, d), dtype, gen), _rand((n, hk, d), dtype, gen)
        reference.append_paged_kv(k, v, pool.cache, slots, case["layout"])
    q = _rand((len(lens), hk * case["group"], d), dtype, gen)
    return q, pool.cache, tables, torch.tensor(lens, dtype=torch.int32)


def _decode_case(decode_fn, case: dict) -> CaseResult:
    q, cache, tables, lens = _decode_inputs(case)
    expected = reference.paged_decode_attention(q, cache, tables, lens, layout=case["layout"], precision="fp64")
    dev = runtime.device()
    atol, rtol = TOLERANCES[_DTYPES[case["dtype"]]]
    try:
        out = decode_fn(q.to(dev), cache.to(dev), tables.to(dev), lens.to(dev), layout=case["layout"])
    except Exception as err:  # a kernel that rejects a valid case fails it
        return CaseResult("decode", case, False, math.inf, math.inf, atol, f"raised {type(err).__name__}: {err}")
    ok, max_abs, max_rel, detail = _compare(out, expected, atol, rtol)
    ratio = None
    if ok and expected.numel():
        ratio = float(((out.cpu().double() - expected).abs() / (atol + rtol * expected.abs())).max())
    return CaseResult("decode", case, ok, max_abs, max_rel, atol, detail, ratio)


def _append_case(append_fn, case: dict) -> CaseResult:
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, hk, d, n = (
        _DTYPES[case["dtype"]],
        case["page_size"],
        case["num_kv_heads"],
        case["head_dim"],
        case["num_tokens"],
    )
    pool = PagedKVPool(-(-n // ps) + 2, ps, hk, d, dtype, case["layout"])
    pool.cache.copy_(_rand(pool.cache.shape, dtype, gen))  # random, so untouched bytes are checkable
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    slots[: case.get("padding", 0)] = -1  # padding tokens
    slots = slots[torch.randperm(n, generator=gen)]
    if case.get("noncontiguous", False):
        k = _rand((hk, n, d), dtype, gen).transpose(0, 1)
        v = _rand((d, n, hk), dtype, gen).permute(1, 2, 0)
    else:
        k, v = _rand((n, hk, d), dtype, gen), _rand((n, hk, d), dtype, gen)
    expected = pool.cache.clone()
    reference.append_paged_kv(k, v, expected, slots, case["layout"])
    dev = runtime.device()
    cache = pool.cache.to(dev)
    try:
        append_fn(k.to(dev), v.to(dev), cache, slots.to(dev), layout=case["layout"])
    except Exception as err:
        return CaseResult("append", case, False, math.inf, 0.0, 0.0, f"raised {type(err).__name__}: {err}")
    ok, max_abs, detail = _bit_compare(cache, expected)
    return CaseResult("append", case, ok, max_abs, 0.0, 0.0, detail)


def _cover(values: dict[str, list], extra: list[dict] = (), outer: int = 2) -> list[dict]:
    """Cases in which every value of every parameter occurs: the product of the first
    ``outer`` parameters, the others cycling through their values."""
    items = list(values.items())
    crossed, rest = items[:outer], items[outer:]
    cases = []
    for i, combo in enumerate(itertools.product(*(vs for _, vs in crossed))):
        case = {k: v for (k, _), v in zip(crossed, combo)}
        for j, (k, vs) in enumerate(rest):
            case[k] = vs[(i + j) % len(vs)]
        cases.append(case)
    return cases + list(extra)


def decode_grid(full: bool = False) -> list[dict]:
    """Decode cases: layouts x dtypes, cycling head dims, page sizes, GQA groups and
    batches that hold an empty, a length-1 and a page-aligned sequence."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 80, 128] + ([256] if full else []),
        "page_size": [1, 5, 16] + ([64] if full else []),
        "group": [1, 4, 5, 8],
        "num_kv_heads": [2, 1],
        "seq_lens": [[0, 1, 37], [16, 5, 70], [1, 80, 0], [33, 32]],
    }
    extra = [
        {
            "layout": "NHD",
            "dtype": "fp16",
            "head_dim": 64,
            "page_size": 4,
            "group": 2,
            "num_kv_heads": 2,
            "seq_lens": [24, 13],
            "shared_pages": True,
        },
        {
            "layout": "HND",
            "dtype": "fp32",
            "head_dim": 64,
            "page_size": 8,
            "group": 1,
            "num_kv_heads": 2,
            "seq_lens": [40, 3],
            "poison": False,
        },
    ]
    return _cover(values, extra, outer=3 if full else 2)


def append_grid(full: bool = False) -> list[dict]:
    """Append cases: layouts x dtypes, cycling head dims, page sizes, token counts,
    padding slots and non-contiguous K/V."""
    values = {
        "layout": ["NHD", "HND"],
        "dtype": ["fp32", "fp16", "bf16"],
        "head_dim": [64, 80, 128],
        "page_size": [1, 5, 16],
        "num_tokens": [0, 1, 45] + ([300] if full else []),
        "num_kv_heads": [2, 1],
        "padding": [0, 3],
        "noncontiguous": [False, True],
    }
    cases = _cover(values, outer=3 if full else 2)
    for c in cases:
        c["padding"] = min(c["padding"], c["num_tokens"])
    return cases


# --------------------------------------------------------------------------- scenarios


def _attention_oracle(q, k, v, visible):
    """float64 softmax attention of ``q [Hq, D]`` over the rows ``visible`` of contiguous
    ``k, v [T, Hk, D]`` (GQA by repeat)."""
    group = q.shape[0] // k.shape[1]
    k = k[visible].double().repeat_interleave(group, 1)
    v = v[visible].double().repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("hd,thd->ht", q.double(), k) / q.shape[-1] ** 0.5, dim=-1)
    return torch.einsum("ht,thd->hd", probs, v)


def _scenario(name: str, passed: bool, detail: str = "", max_abs: float = 0.0, atol: float = 0.0, **case):
    return CaseResult(name, case, passed, max_abs, 0.0, atol, detail)


def check_chunked_prefill(append_fn, decode_fn, faults, prompt_len: int = 29, chunk: int = 8) -> CaseResult:
    """A prompt written in chunks (each at ``past_len = cache_len - chunk_len``) gives the
    same pool as one write, and decode over it matches the contiguous oracle."""
    gen, dev = torch.Generator().manual_seed(1), runtime.device()
    n, ps, hk, d = prompt_len, 4, 2, 32
    k, v, q = (
        _rand((n, hk, d), torch.float32, gen),
        _rand((n, hk, d), torch.float32, gen),
        _rand((1, 4, d), torch.float32, gen),
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
    same, _, detail = _bit_compare(pool.cache, expected.cache)
    out = decode_fn(q.to(dev), pool.cache, tables.to(dev), torch.tensor([n], dtype=torch.int32, device=dev))
    ok, max_abs, _, d2 = _compare(out, _attention_oracle(q[0], k, v, list(range(n)))[None], 1e-5)
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
        [_rand((n, hk, d), torch.float32, gen) for n in lens],
        [_rand((n, hk, d), torch.float32, gen) for n in lens],
    )
    for t in range(max(lens)):  # one token per step: a plain ring takes one token per write
        live = [b for b, n in enumerate(lens) if t < n]
        slots = slot_mapping(tables, torch.tensor(live), torch.full((len(live),), t), 4, window)
        k = torch.stack([ks[b][t] for b in live]).to(dev)
        v = torch.stack([vs[b][t] for b in live]).to(dev)
        append_fn(k, v, pool.cache, slots.to(dev))
    q = _rand((len(lens), 4, d), torch.float32, gen)
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
            _attention_oracle(q[b], ks[b], vs[b], [t for t in range(n) if t < 3 or t > n - 1 - (14 - 3)])
            for b, n in enumerate(lens)
        ]
    )
    ok, max_abs, _, detail = _compare(out, expected, 1e-5)
    detail = detail or "window 14, 3 sinks, pages of 4"
    return _scenario("ring_window", ok, detail, max_abs, 1e-5, seq_lens=tuple(lens))


def check_v_tail(append_fn, decode_fn, faults) -> CaseResult:
    """After a prefill write with ``zero_v_tail`` into a NaN-poisoned pool, the unused V
    rows of each last page are 0, so a reader that loads whole pages stays finite."""
    if "zero_v_tail" not in inspect.signature(append_fn).parameters:
        return _scenario("v_tail", None, "append_fn takes no zero_v_tail")
    gen, dev = torch.Generator().manual_seed(3), runtime.device()
    lens, ps, hk, d = [6, 9], 4, 2, 16
    tables = pad_block_tables([[3, 0], [1, 4, 2]])
    pool = PagedKVPool(6, ps, hk, d, torch.float32, device=dev)
    pool.cache.fill_(float("nan"))
    csr = block_table_to_csr(tables, torch.tensor(lens), ps)
    b = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    k, v = _rand((sum(lens), hk, d), torch.float32, gen), _rand((sum(lens), hk, d), torch.float32, gen)
    tail = None if "v_tail_not_zeroed" in faults else tuple(x.to(dev) for x in csr)
    append_fn(k.to(dev), v.to(dev), pool.cache, slot_mapping(tables, b, pos, ps).to(dev), zero_v_tail=tail)
    q = _rand((2, 4, d), torch.float32, gen)
    out = F.whole_page_decode(q, pool.cache.cpu(), tables, lens)
    expected = torch.stack([_attention_oracle(q[i], k[b == i], v[b == i], list(range(n))) for i, n in enumerate(lens)])
    ok, max_abs, _, detail = _compare(out, expected, 1e-5)
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
        k, v = _rand((n, hk, d), torch.float32, gen), _rand((n, hk, d), torch.float32, gen)
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
    q = _rand((1, 4, d), torch.float32, gen)
    table = torch.tensor([manager.block_table("child")], dtype=torch.int32, device=dev)
    out = decode_fn(q.to(dev), pool.cache, table, torch.tensor([9], dtype=torch.int32, device=dev))
    ok, max_abs, _, detail = _compare(out, _attention_oracle(q[0], k_ref, v_ref, list(range(9)))[None], 1e-5)
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
        data[seq] = (_rand((8, hk, d), torch.float32, gen), _rand((8, hk, d), torch.float32, gen))
        append_fn(*(x.to(dev) for x in data[seq]), pool.cache, torch.tensor(manager.append_tokens(seq, 8)).to(dev))
    stale = manager.block_table("A")
    manager.free_sequence("A")
    for seq in ("C", "D"):
        manager.add_sequence(seq)
        data[seq] = (_rand((8, hk, d), torch.float32, gen), _rand((8, hk, d), torch.float32, gen))
        append_fn(*(x.to(dev) for x in data[seq]), pool.cache, torch.tensor(manager.append_tokens(seq, 8)).to(dev))
    table = stale if "stale_block_table" in faults else manager.block_table("C")
    q = _rand((1, 4, d), torch.float32, gen)
    out = decode_fn(
        q.to(dev),
        pool.cache,
        torch.tensor([table], dtype=torch.int32, device=dev),
        torch.tensor([8], dtype=torch.int32, device=dev),
    )
    ok, max_abs, _, detail = _compare(out, _attention_oracle(q[0], *data["C"], list(range(8)))[None], 1e-5)
    reused = sorted(set(stale) & set(manager.block_table("D")))
    return _scenario("reused_page", ok, detail or f"A's pages {reused} now hold D", max_abs, 1e-5)


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
    k, v, q = (_rand(s, torch.float16, gen).cuda() for s in ((1, hk, d), (1, hk, d), (1, hk, d)))
    append_fn(k, v, cache, torch.tensor([(pages - 1) * ps + ps - 1], device="cuda"))
    same = torch.equal(cache[-1, 0, -1], k[0]) and torch.equal(cache[-1, 1, -1], v[0])
    table = torch.full((1, ps), pages - 1, dtype=torch.int32, device="cuda")  # every row read is the last page
    out = decode_fn(q, cache, table[:, :1], torch.tensor([ps], dtype=torch.int32, device="cuda"))
    expected = _attention_oracle(q[0].cpu(), cache[-1, 0].cpu(), cache[-1, 1].cpu(), list(range(ps)))[None]
    del cache
    ok, max_abs, _, detail = _compare(out, expected, *TOLERANCES[torch.float16])
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


# --------------------------------------------------------------------------- hypothesis


def _hypothesis_cases(kind: str, fn, examples: int) -> list[CaseResult]:
    """Run ``examples`` generated cases; on failure, hypothesis shrinks to a minimal case,
    which is reported (with its repro line) as the last result."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    common = {
        "layout": st.sampled_from(["NHD", "HND"]),
        "dtype": st.sampled_from(["fp32", "fp16", "bf16"]),
        "head_dim": st.sampled_from([16, 64, 80]),
        "page_size": st.sampled_from([1, 3, 5, 16]),
        "num_kv_heads": st.sampled_from([1, 2]),
        "seed": st.integers(0, 2**16),
    }
    if kind == "decode":
        strat = st.fixed_dictionaries(
            {
                **common,
                "group": st.sampled_from([1, 2, 3, 5]),
                "seq_lens": st.lists(st.integers(0, 40), min_size=1, max_size=3),
                "poison": st.booleans(),
            }
        )
        run_one = lambda c: _decode_case(fn, c)  # noqa: E731
    else:
        strat = st.fixed_dictionaries(
            {**common, "num_tokens": st.integers(0, 40), "padding": st.integers(0, 3), "noncontiguous": st.booleans()}
        )
        run_one = lambda c: _append_case(fn, {**c, "padding": min(c["padding"], c["num_tokens"])})  # noqa: E731
    results: list[CaseResult] = []

    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strat)
    def prop(case):
        result = run_one(case)
        result.check = f"{kind}[hypothesis]"
        results.append(result)
        assert result.passed, result.detail

    try:
        prop()
    except Exception:  # hypothesis re-raises the failure after shrinking and replaying it
        shrunk = results[-1]  # the last run is the shrunk case
        shrunk.detail = f"shrunk from {len(results)} generated cases; {shrunk.detail}"
        return [shrunk]
    worst = max(results, key=lambda r: r.max_abs / r.atol if r.atol else 0.0)
    summary = {"generated": len(results), "worst": worst.case}
    return [CaseResult(f"{kind}[hypothesis]", summary, True, worst.max_abs, worst.max_rel, worst.atol)]


# --------------------------------------------------------------------------- entry points


def run(
    append_fn=None,
    decode_fn=None,
    *,
    faults=(),
    full: bool = False,
    hypothesis_examples: int = 0,
    checks: tuple[str, ...] | None = None,
) -> Report:
    """Run the case grid and the scenarios; return a :class:`Report`.

    ``append_fn`` / ``decode_fn``: callables with the kernels' signatures (either may
    be None: checks needing it are skipped; scenarios then use the reference for the
    missing side). ``faults``: names from :data:`pagedkv_lib.faults.FAULTS` to switch
    on. ``full``: the larger grid (head dim 256, page size 64, 300 tokens).
    ``hypothesis_examples``: generated cases per operation. ``checks``: a subset of
    ``("append", "decode", *SCENARIOS)``.
    """
    faults = F.check_faults(faults)
    if "minus_one_as_index" in faults and append_fn is not None:
        append_fn = F.minus_one_as_index(append_fn)
    wanted = set(checks) if checks else {"append", "decode", *SCENARIOS}
    unknown = wanted - {"append", "decode", *SCENARIOS}
    if unknown:
        raise ValueError(f"checks={sorted(unknown)} unknown; choose from append, decode, {', '.join(SCENARIOS)}")
    report = Report()
    if append_fn is not None and "append" in wanted:
        report.results += [_append_case(append_fn, c) for c in append_grid(full)]
        if hypothesis_examples:
            report.results += _hypothesis_cases("append", append_fn, hypothesis_examples)
    if decode_fn is not None and "decode" in wanted:
        report.results += [_decode_case(decode_fn, c) for c in decode_grid(full)]
        if hypothesis_examples:
            report.results += _hypothesis_cases("decode", decode_fn, hypothesis_examples)
    writer = append_fn or reference.append_paged_kv
    reader = decode_fn or reference.paged_decode_attention
    for name, check in SCENARIOS.items():
        if name in wanted:
            report.results.append(check(writer, reader, faults))
    for r in report.results:
        r.faults = tuple(sorted(faults))
    return report


def run_case(check: str, case: dict, append_fn=None, decode_fn=None, faults=()) -> CaseResult:
    """Re-run one case of a report (grid, hypothesis or scenario, as its ``repro`` line
    prints it) on the suite's kernels, or on the callables given."""
    faults = F.check_faults(faults)
    if append_fn is None or decode_fn is None:
        import kernels

        append_fn = append_fn or kernels.append_paged_kv
        decode_fn = decode_fn or kernels.paged_decode_attention
    if "minus_one_as_index" in faults:
        append_fn = F.minus_one_as_index(append_fn)
    if check == "append":
        result = _append_case(append_fn, case)
    elif check == "decode":
        result = _decode_case(decode_fn, case)
    elif check in SCENARIOS:
        result = SCENARIOS[check](append_fn, decode_fn, faults, **case)
    else:
        raise ValueError(f"check={check!r} unknown; choose from append, decode, {', '.join(SCENARIOS)}")
    result.faults = tuple(sorted(faults))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv_lib.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the larger grid")
    parser.add_argument("--hypothesis", type=int, default=10, metavar="N", help="generated cases per op (default 10)")
    parser.add_argument("--fault", action="append", default=[], choices=sorted(F.FAULTS), help="switch a fault on")
    parser.add_argument("--reference", action="store_true", help="check the Python references instead of the kernels")
    args = parser.parse_args(argv)
    if args.reference:
        append_fn, decode_fn = reference.append_paged_kv, reference.paged_decode_attention
    else:
        import kernels

        append_fn, decode_fn = kernels.append_paged_kv, kernels.paged_decode_attention
    print(runtime.backend_line())
    report = run(append_fn, decode_fn, faults=args.fault, full=args.full, hypothesis_examples=args.hypothesis)
    print(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())

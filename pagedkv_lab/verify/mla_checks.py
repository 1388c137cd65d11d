"""MLA cases of the conformance harness: the latent append and the absorbed decode.

* **append** (``mla_append_fn(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)``, optionally
  ``rope=``/``positions=``): a random pool, random slots (some ``-1``); the latent rows
  must equal the reference's bit for bit, every byte the call should not touch too; a
  RoPE key is compared with the float64 rotation by the pass rule (it is computed, not
  copied), and ``ckv``/``kpe`` must be left as they were;
* **decode** (``mla_decode_fn(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens,
  w_uk, w_uv, scale=...)``, optionally ``num_splits=``): sequences written on scattered
  pages of a NaN-poisoned pool, compared with the *naive* float64 reference (every
  ``c_kv`` projected up to K and V, :func:`pagedkv_lib.mla.mla_decode_naive`), so an
  absorbed kernel is judged by the algebra it claims to shortcut; the pool, the
  queries, the weights and the page table must be bit-for-bit unchanged.

Both grids include pools that are two column slices of one ``[num_pages, page_size,
kv_lora_rank + qk_rope_head_dim]`` buffer (vLLM's layout), non-power-of-two widths,
page sizes 1, 16 and 64, and batches with an empty sequence.
"""

from __future__ import annotations

import math

import torch

from pagedkv_lab.verify.errors import raised
from pagedkv_lab.verify.grid import accepts, rand
from pagedkv_lab.verify.guards import Guards
from pagedkv_lab.verify.report import CaseResult, located
from pagedkv_lab.verify.stale import restrict_poison
from pagedkv_lib import mla, runtime
from pagedkv_lib.compare import DTYPES, TOLERANCES, compare, first_difference
from pagedkv_lib.formats import pad_block_tables, scatter_pages, slot_mapping
from pagedkv_lib.reference import rope_reference

__all__ = [
    "mla_append_grid",
    "mla_append_case",
    "mla_decode_grid",
    "mla_decode_inputs",
    "mla_decode_case",
    "deepseek_v2_case",
]

# (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim): small power-of-two
# dims, and widths that leave masked lanes in every tile.
_SMALL = (64, 16, 32, 32)
_ODD = (80, 8, 24, 40)


def _pool(num_pages: int, page_size: int, rank: int, rope: int, dtype, fused: bool, fill, gen):
    """``(ckv_cache, kpe_cache, buffer)`` on the CPU: two tensors, or two column slices of
    one buffer (``fused``); filled with ``fill`` (a float) or random values (``None``)."""
    buf = torch.empty((num_pages, page_size, rank + rope), dtype=dtype)
    if fill is None:
        buf.copy_(rand(buf.shape, dtype, gen))
    else:
        buf.fill_(fill)
    if fused:
        return buf[..., :rank], buf[..., rank:], buf
    return buf[..., :rank].clone(), buf[..., rank:].clone(), None


def _to_device(ckv_cache, kpe_cache, buf, dev, guards: Guards):
    """A copy of the pool on ``dev`` (a copy on the CPU too, so the originals stay the
    snapshot the result is compared with) between guard bytes of a page, two slices of
    one buffer kept as such."""
    if buf is None:
        placed = [guards.place(n, c.to(dev), c[0].numel() * c.element_size())
                  for n, c in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache))]  # fmt: skip
        return placed[0], placed[1], None
    moved = guards.place("buffer", buf.to(dev), buf[0].numel() * buf.element_size())
    return moved[..., : ckv_cache.shape[2]], moved[..., ckv_cache.shape[2] :], moved


# --------------------------------------------------------------------------- append


def mla_append_grid(full: bool = False) -> list[dict]:
    """Append cases: every dtype with every page size (1, 16, 64), each with another
    combination of widths, token count, padding, strided inputs, one-buffer pool and
    RoPE style (every style meets every dtype and every page size); then an empty
    append, pages of 5, and with ``full`` 300 tokens at DeepSeek-V2's widths."""
    big = (512, 64)
    rows = [  # (dims, num_tokens, padding, noncontiguous, fused, rope)
        (_SMALL[:2], 45, 3, False, False, None),
        (_ODD[:2], 1, 0, True, True, "gptj"),
        (big, 17, 2, False, True, "neox"),
        (_ODD[:2], 17, 0, False, True, "neox"),
        (big, 45, 3, True, False, None),
        (_SMALL[:2], 1, 0, False, False, "gptj"),
        (big, 1, 0, False, False, "gptj"),
        (_SMALL[:2], 17, 2, True, True, "neox"),
        (_ODD[:2], 45, 3, False, False, None),
    ]
    keys = ("dims", "num_tokens", "padding", "noncontiguous", "fused", "rope")
    cases = [
        {"dtype": dtype, "page_size": ps, **dict(zip(keys, rows[3 * i + j]))}
        for i, dtype in enumerate(["fp32", "fp16", "bf16"])
        for j, ps in enumerate([1, 16, 64])
    ]
    cases.append({"dtype": "fp16", "page_size": 16, **dict(zip(keys, (_SMALL[:2], 0, 0, False, False, "gptj")))})
    # A page size that is no power of two, 17 tokens over a 5-row page's last rows.
    cases.append({"dtype": "fp16", "page_size": 5, **dict(zip(keys, (_ODD[:2], 17, 2, False, False, None)))})
    if full:
        cases.append({"dtype": "bf16", "page_size": 64, **dict(zip(keys, (big, 300, 5, True, True, "gptj")))})
    return cases


def mla_append_case(append_fn, case: dict) -> CaseResult:
    """Run one MLA append case: the pool must equal the reference's write bit for bit,
    except written RoPE keys, which must be within the dtype's tolerance of the float64
    rotation; ``ckv`` and ``kpe`` must be left as they were."""
    name = "mla_append"
    rope = case.get("rope")
    if rope is not None and not accepts(append_fn, "rope"):
        return CaseResult(name, case, None, detail="mla_append_fn takes no rope")
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, n = DTYPES[case["dtype"]], case["page_size"], case["num_tokens"]
    rank, rope_dim = case["dims"]
    ckv_cache, kpe_cache, buf = _pool(-(-n // ps) + 2, ps, rank, rope_dim, dtype, case.get("fused", False), None, gen)
    slots = torch.randperm(ckv_cache.shape[0] * ps, generator=gen)[:n]
    slots[: case.get("padding", 0)] = -1
    slots = slots[torch.randperm(n, generator=gen)]
    positions = torch.randint(0, 40_000, (n,), generator=gen)
    if case.get("noncontiguous", False):
        ckv, kpe = rand((rank, n), dtype, gen).t(), rand((rope_dim, 2 * n), dtype, gen).t()[::2]
    else:
        ckv, kpe = rand((n, rank), dtype, gen), rand((n, rope_dim), dtype, gen)
    want_c, want_p = ckv_cache.clone(), kpe_cache.clone()
    mla.append_paged_mla_kv(ckv, kpe, want_c, want_p, slots)  # RoPE keys are checked by value below
    dev, guards = runtime.device(), Guards()
    got_c, got_p, _ = _to_device(ckv_cache, kpe_cache, buf, dev, guards)
    ckv_dev, kpe_dev, slots_dev = (
        guards.place(n, t.to(dev)) for n, t in (("ckv", ckv), ("kpe", kpe), ("slot_mapping", slots))
    )
    kwargs = {} if rope is None else {"rope": rope, "positions": positions.to(dev)}
    try:
        append_fn(ckv_dev, kpe_dev, got_c, got_p, slots_dev, **kwargs)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult(name, case, False, math.inf, 0.0, 0.0, raised(err))
    got_c, got_p = got_c.cpu(), got_p.cpu()
    notes, max_abs, ratio = [], 0.0, 0.0
    written = slots[slots >= 0]
    page, row = written // ps, written % ps
    if rope is not None:
        # Compare the rotated rows by value, then put the reference's bits there so the
        # bit comparison below covers every other byte.
        rotated = rope_reference(kpe[slots >= 0][:, None, :], positions[slots >= 0], style=rope)[:, 0]
        atol, rtol = TOLERANCES[dtype]
        c = compare(got_p[page, row], rotated, atol, rtol)
        max_abs, ratio = c.max_abs, c.tol_ratio
        if not c.passed:
            notes.append(f"RoPE key beyond tolerance ({c.detail or f'max |err| {c.max_abs:.2e}'})")
        got_p = got_p.clone()
        got_p[page, row] = want_p[page, row]
    for what, got, want in (("ckv_cache", got_c, want_c), ("kpe_cache", got_p, want_p)):
        count, where = first_difference(got, want)
        if count:
            notes.append(f"{what}: {count} elements differ, first at (page, row, feature) {where}")
    for what, before, after in (("ckv", ckv, ckv_dev), ("kpe", kpe, kpe_dev)):
        count, where = first_difference(after.cpu(), before)
        if count:
            notes.append(f"append modified its input {what} ({where})")
    notes += guards.corrupted()
    ok = not notes
    return CaseResult(name, case, ok, max_abs, 0.0, 0.0, "; ".join(notes), ratio)


# --------------------------------------------------------------------------- decode


def mla_decode_grid(full: bool = False) -> list[dict]:
    """Decode cases: every dtype with every page size (1, 16, 64), each with another
    head count (1 to 8, powers of two or not), widths, batch (lengths 0 to 300, each
    batch with an empty or a one-token sequence or lengths around a page boundary),
    split count (1, the heuristic's, 3) and pool layout (two tensors or one buffer);
    then a page shared by two sequences, a pool of finite stale values, 1000 tokens in 7
    splits, pages of 5, and with ``full`` the DeepSeek-V2 dimensions."""
    rows = [  # (num_heads, dims, seq_lens, num_splits, fused)
        (4, _SMALL, [0, 1, 37], 1, False),
        (5, _ODD, [300, 0, 129], None, True),
        (8, _SMALL, [64, 63, 65, 1], 3, False),
        (1, _ODD, [16, 5, 70, 0], 3, True),
        (4, _SMALL, [64, 63, 65, 1], 1, True),
        (5, _ODD, [0, 1, 37], None, False),
        (8, _ODD, [300, 0, 129], None, False),
        (1, _SMALL, [16, 5, 70, 0], 3, True),
        (4, _ODD, [300, 0, 129], 1, True),
    ]
    keys = ("num_heads", "dims", "seq_lens", "num_splits", "fused")
    cases = [
        {"dtype": dtype, "page_size": ps, **dict(zip(keys, rows[3 * i + j]))}
        for i, dtype in enumerate(["fp32", "fp16", "bf16"])
        for j, ps in enumerate([1, 16, 64])
    ]
    cases += [
        {"dtype": "fp16", "page_size": 4, "num_heads": 4, "dims": _SMALL, "seq_lens": [24, 13],
         "num_splits": 2, "shared_pages": True},
        {"dtype": "fp32", "page_size": 8, "num_heads": 2, "dims": _ODD, "seq_lens": [40, 3], "poison": False},
        {"dtype": "bf16", "page_size": 16, "num_heads": 2, "dims": _SMALL, "seq_lens": [1000, 2], "num_splits": 7},
        # pages of 5 (no power of two), a sequence ending exactly on a page boundary
        {"dtype": "fp32", "page_size": 5, "num_heads": 2, "dims": _ODD, "seq_lens": [10, 7, 1], "num_splits": 2},
    ]  # fmt: skip
    if full:
        cases.append(deepseek_v2_case())
    return cases


def deepseek_v2_case() -> dict:
    """One decode case at DeepSeek-V2's attention dimensions (128 heads, rank 512, RoPE
    64, nope 128, v 128), bf16, pages of 64: about 4 s in the interpreter."""
    shape = mla.DEEPSEEK_V2
    return {
        "dtype": "bf16",
        "page_size": 64,
        "num_heads": shape.num_heads,
        "dims": (shape.kv_lora_rank, shape.qk_rope_head_dim, shape.qk_nope_head_dim, shape.v_head_dim),
        "seq_lens": [300, 0, 77],
        "num_splits": None,
    }


def mla_decode_inputs(case: dict) -> dict:
    """The tensors of a decode case, on the CPU: ``q_nope, q_pe, ckv_cache, kpe_cache,
    block_tables, seq_lens, w_uk, w_uv`` (the names of ``mla_decode_attention``'s
    arguments), plus ``buffer`` (the one buffer both caches slice, or None) and
    ``scale``. Unused slots hold NaN unless ``case["poison"]`` is False."""
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    dtype, ps, heads = DTYPES[case["dtype"]], case["page_size"], case["num_heads"]
    rank, rope, nope, v_dim = case["dims"]
    lens = list(case["seq_lens"])
    shared = case.get("shared_pages", False) and len(lens) > 1
    if shared:  # sequence 1 reads a prefix of sequence 0's pages (a shared prefix)
        lens[1] = min(lens[1], lens[0])
    pages_each = [-(-n // ps) for n in lens]
    num_pages = sum(pages_each) - (pages_each[1] if shared else 0) + 2
    rows = scatter_pages([0 if shared and b == 1 else n for b, n in enumerate(pages_each)], num_pages, gen)
    if shared:
        rows[1] = rows[0][: pages_each[1]]
    fill = float("nan") if case.get("poison", True) else None
    ckv_cache, kpe_cache, buf = _pool(num_pages, ps, rank, rope, dtype, case.get("fused", False), fill, gen)
    tables = pad_block_tables(rows, max(pages_each, default=0) + 1)
    for b, n in enumerate(lens):
        if shared and b == 1:
            continue
        slots = slot_mapping(tables, torch.full((n,), b), torch.arange(n), ps)
        mla.append_paged_mla_kv(rand((n, rank), dtype, gen), rand((n, rope), dtype, gen), ckv_cache, kpe_cache, slots)
    restrict_poison([ckv_cache, kpe_cache], tables, case.get("poison", True), case.get("seed", 0))
    # Weights scaled so q_latent and the output stay of order 1 (as trained weights do).
    w_uk = (torch.randn((heads, nope, rank), generator=gen) / math.sqrt(nope)).to(dtype)
    w_uv = (torch.randn((heads, v_dim, rank), generator=gen) / math.sqrt(rank)).to(dtype)
    return {
        "q_nope": rand((len(lens), heads, nope), dtype, gen),
        "q_pe": rand((len(lens), heads, rope), dtype, gen),
        "ckv_cache": ckv_cache,
        "kpe_cache": kpe_cache,
        "block_tables": tables,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "w_uk": w_uk,
        "w_uv": w_uv,
        "buffer": buf,
        "scale": mla.default_scale(nope, rope),
    }


_ARGS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "block_tables", "seq_lens", "w_uk", "w_uv")


def mla_decode_case(decode_fn, case: dict) -> CaseResult:
    """Run one MLA decode case: the output within tolerance of the naive float64
    reference, and the pool, the queries, the weights and the page table bit-for-bit
    unchanged."""
    name = "mla_decode"
    t = mla_decode_inputs(case)
    expected = mla.mla_decode_naive(*(t[a] for a in _ARGS), scale=t["scale"])
    atol, rtol = TOLERANCES[DTYPES[case["dtype"]]]
    dev, guards = runtime.device(), Guards()
    inputs = {a: guards.place(a, t[a].to(dev)) for a in _ARGS}  # copies: t stays the snapshot, even on the CPU
    inputs["ckv_cache"], inputs["kpe_cache"], buf_dev = _to_device(
        t["ckv_cache"], t["kpe_cache"], t["buffer"], dev, guards
    )
    kwargs, notes = {"scale": t["scale"]}, []
    if "num_splits" in case:
        if accepts(decode_fn, "num_splits"):
            kwargs["num_splits"] = case["num_splits"]
        else:
            notes.append("mla_decode_fn takes no num_splits: ran with its own")
    try:
        out = decode_fn(*inputs.values(), **kwargs)
    except Exception as err:  # a kernel that rejects (or crashes on) a valid case fails it
        return CaseResult(name, case, False, math.inf, math.inf, atol, raised(err))
    result = compare(out, expected, atol, rtol)
    ok = result.passed
    lens = t["seq_lens"]
    detail = located(result, lambda i: f"sequence {i[0]} (length {int(lens[i[0]])}), head {i[1]}, feature {i[2]}",
                     out, expected)  # fmt: skip
    for a in _ARGS:
        count, where = first_difference(inputs[a].cpu(), t[a])
        if count:
            ok = False
            what = "wrote into the pool" if a.endswith("_cache") else f"modified its input {a}"
            notes.append(f"decode {what} ({a}): {count} elements changed, first at {where}")
    if buf_dev is not None:  # the bytes between the two slices belong to the pool too
        count, where = first_difference(buf_dev.cpu(), t["buffer"])
        if count:
            ok = False
            notes.append(f"decode wrote into the pool's buffer: {count} elements changed, first at {where}")
    guard_notes = guards.corrupted()
    ok = ok and not guard_notes
    notes += guard_notes
    detail = "; ".join([detail, *notes]) if detail else "; ".join(notes)
    return CaseResult(name, case, ok, result.max_abs, result.max_rel, atol, detail, result.tol_ratio)

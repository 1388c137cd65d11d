"""The references and the kernels accept exactly the same inputs.

Each case below is a valid call with one thing changed (a bad value or an edge case).
It is given to the Python reference and to the Triton kernel; both must refuse it with
the *same* ValueError message (they share :mod:`pagedkv_lib.checks`), or both accept it
and agree on the result (bit for bit for a plain write; within the RoPE and decode
tolerances otherwise).

Inputs live on the CPU, which is the kernels' device in the interpreter; on a GPU
machine the test moves them to CUDA for the kernel (a launch concern, not a value
rule). Launch-only rules (device, float64, int32 ranges, memory overlap) are tested in
the kernel test files.
"""

import math

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab.verify.compare import TOLERANCES
from pagedkv_lib import reference, runtime
from pagedkv_lib.formats import block_table_to_csr, pad_block_tables, slot_mapping
from pagedkv_lib.pool import PagedKVPool

# isort: split
import pagedkv_kernels as kernels

DEV = runtime.device()
PS, HK, D = 4, 2, 8


def _pool(dtype=torch.float32, pages=6, fill=None):
    pool = PagedKVPool(pages, PS, HK, D, dtype)
    pool.cache.copy_(torch.randn(pool.cache.shape, generator=torch.Generator().manual_seed(7)).to(dtype))
    if fill is not None:
        pool.cache.fill_(fill)
    return pool.cache


def _kv(n, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HK, D, generator=gen).to(dtype), torch.randn(n, HK, D, generator=gen).to(dtype)


# --------------------------------------------------------------------------- append (slot mapping)


_POSITIONS = torch.tensor([0, 1, 2, 3, 4])
_Q = torch.randn(5, 4, D, generator=torch.Generator().manual_seed(2))


def _append_args():
    """A valid append of 5 tokens (one padding) into a random pool, as keyword arguments;
    options (``rope``, ``positions``, ``q``, ``zero_v_tail``) are added by the cases."""
    k, v = _kv(5)
    return {"k": k, "v": v, "cache": _pool(), "slot_mapping": torch.tensor([0, 5, -1, 9, 2])}


def _rope(a, **extra):
    a.update(rope="neox", positions=_POSITIONS.clone(), q=_Q.clone(), **extra)


def _tail(indptr, indices, last):
    return tuple(torch.tensor(x) for x in (indptr, indices, last))


APPEND_CASES = {
    "valid": lambda a: None,
    "zero tokens": lambda a: a.update(k=a["k"][:0], v=a["v"][:0], slot_mapping=a["slot_mapping"][:0]),
    "all padding": lambda a: a.update(slot_mapping=torch.full((5,), -1)),
    "slot -2": lambda a: a["slot_mapping"].__setitem__(1, -2),
    "slot past the pool": lambda a: a["slot_mapping"].__setitem__(1, 24),
    "slot written twice": lambda a: a["slot_mapping"].__setitem__(1, 0),
    "slot_mapping None": lambda a: a.update(slot_mapping=None),
    "slot_mapping float": lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
    "slot_mapping on meta": lambda a: a.update(slot_mapping=torch.empty(5, dtype=torch.long, device="meta")),
    "slot_mapping longer than k": lambda a: a.update(k=a["k"][:4], v=a["v"][:4]),
    "k and v with more rows than slot_mapping (vLLM's padding)": lambda a: a.update(slot_mapping=a["slot_mapping"][:3]),
    "rope with more q and k rows than tokens": lambda a: (
        _rope(a),
        a.update(slot_mapping=a["slot_mapping"][:3], positions=_POSITIONS[:3].clone()),
    ),
    "k has other heads": lambda a: a.update(k=a["k"][:, :1]),
    "v in another dtype": lambda a: a.update(v=a["v"].half()),
    "k and v differ": lambda a: a.update(v=a["v"][:4]),
    "page_size 0 pool, all padding": lambda a: a.update(
        cache=torch.zeros(6, 2, 0, HK, D), slot_mapping=torch.full((5,), -1)
    ),
    "head_dim 0 pool": lambda a: a.update(cache=torch.zeros(6, 2, PS, HK, 0), k=a["k"][..., :0], v=a["v"][..., :0]),
    # V tails (slots 0, 5, 9, 2 are page 0 row 0, page 1 row 1, page 2 row 1, page 0 row 2)
    "v tail zeroed": lambda a: a.update(zero_v_tail=_tail([0, 1, 3], [3, 1, 2], [2, 4])),
    "full last page shared by two requests": lambda a: a.update(zero_v_tail=_tail([0, 1, 2], [4, 4], [4, 4])),
    "tail page shared by two requests": lambda a: a.update(zero_v_tail=_tail([0, 1, 2], [4, 4], [2, 4])),
    "token written into a V tail": lambda a: a.update(zero_v_tail=_tail([0, 1], [0], [2])),
    "v tail page outside the pool": lambda a: a.update(zero_v_tail=_tail([0, 1], [6], [2])),
    "v tail: no pages but a length": lambda a: a.update(zero_v_tail=_tail([0, 0, 1], [3], [1, 2])),
    # fused RoPE
    "rope neox with q": lambda a: _rope(a),
    "rope gptj without q": lambda a: (_rope(a), a.update(rope="gptj", q=None)),
    "q without rope": lambda a: a.update(q=_Q.clone()),
    "unknown rope style": lambda a: _rope(a, rope_theta=10000.0) or a.update(rope="llama"),
    "rope without positions": lambda a: (_rope(a), a.update(positions=None)),
    "negative position of a written token": lambda a: (_rope(a), a["positions"].__setitem__(0, -1)),
    "negative position of a padding token": lambda a: (_rope(a), a["positions"].__setitem__(2, -7)),
    "rope_theta inf": lambda a: _rope(a, rope_theta=math.inf),
    "rope_theta 1": lambda a: _rope(a, rope_theta=1.0),
    "q with another head_dim": lambda a: (_rope(a), a.update(q=_Q[..., :4].clone())),
    "q with fewer rows": lambda a: (_rope(a), a.update(q=_Q[:3].clone())),
}


def _outcome(call):
    try:
        return "ok", call()
    except ValueError as err:
        return "ValueError", str(err)


def _on_dev(a):
    def move(v):
        if isinstance(v, tuple):
            return tuple(move(t) for t in v)
        return v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v

    return {k: move(v) for k, v in a.items()}


def _clone(a):
    out = {}
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif isinstance(v, tuple):
            out[k] = tuple(t.clone() for t in v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("name", APPEND_CASES)
def test_append_reference_and_kernel_accept_the_same_inputs(name):
    a = _append_args()
    APPEND_CASES[name](a)
    ref_args, ker_args = _clone(a), _on_dev(_clone(a))
    ref = _outcome(lambda: reference.append_paged_kv(**ref_args))
    ker = _outcome(lambda: kernels.append_paged_kv(**ker_args))
    assert ref[0] == ker[0], f"reference: {ref}, kernel: {ker}"
    if ref[0] == "ValueError":
        assert ref[1] == ker[1]
        return
    got, want = ker_args["cache"].cpu(), ref_args["cache"]
    if a.get("rope") is None:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "a plain write must be bit-exact"
    else:  # RoPE in fp32 (kernel) against float64 rounded once (reference)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if a.get("q") is not None:
            torch.testing.assert_close(ker_args["q"].cpu(), ref_args["q"], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- append (CSR)


def _csr_args():
    k, v = _kv(6)
    return {
        "k": k,
        "v": v,
        "cache": _pool(),
        "batch_indices": torch.tensor([0, 0, 1, -1, 1, 1]),
        "positions": torch.tensor([3, 4, 0, 0, 1, 2]),
        "kv_indices": torch.tensor([5, 2, 0]),
        "kv_indptr": torch.tensor([0, 2, 3]),
    }


CSR_CASES = {
    "valid": lambda a: None,
    "padding by position -1": lambda a: a["positions"].__setitem__(0, -1),
    "batch index -2": lambda a: a["batch_indices"].__setitem__(1, -2),
    "position -3": lambda a: a["positions"].__setitem__(4, -3),
    "request id past the batch": lambda a: a["batch_indices"].__setitem__(0, 2),
    "position past the request's pages": lambda a: a["positions"].__setitem__(0, 8),
    "page id outside the pool": lambda a: a["kv_indices"].__setitem__(1, 25),
    "negative page id": lambda a: a["kv_indices"].__setitem__(2, -4),
    "kv_indptr decreases": lambda a: a.update(kv_indptr=torch.tensor([0, 3, 2])),
    "two tokens on one slot": lambda a: a["positions"].__setitem__(1, 3),
    "batch_indices None": lambda a: a.update(batch_indices=None),
    "v tail zeroed": lambda a: a.update(zero_v_tail=(a["kv_indptr"], a["kv_indices"], torch.tensor([1, 3]))),
    "token written into a V tail": lambda a: a.update(
        zero_v_tail=(a["kv_indptr"], a["kv_indices"], torch.tensor([1, 2]))
    ),
    "k and v with more rows than tokens (vLLM's padding)": lambda a: a.update(
        k=torch.cat([a["k"], a["k"][:2]]), v=torch.cat([a["v"], a["v"][:2]])
    ),
}


@pytest.mark.parametrize("name", CSR_CASES)
def test_csr_append_reference_and_kernel_accept_the_same_inputs(name):
    a = _csr_args()
    CSR_CASES[name](a)
    names = ("k", "v", "cache", "batch_indices", "positions", "kv_indices", "kv_indptr")

    def call(impl, b):
        kw = {"zero_v_tail": b["zero_v_tail"]} if "zero_v_tail" in b else {}
        return impl(*(b[n] for n in names), "NHD", **kw)

    ref_args, ker_args = _clone(a), _on_dev(_clone(a))
    ref = _outcome(lambda: call(reference.append_paged_kv_csr, ref_args))
    ker = _outcome(lambda: call(kernels.append_paged_kv_csr, ker_args))
    assert ref[0] == ker[0], f"reference: {ref}, kernel: {ker}"
    if ref[0] == "ValueError":
        assert ref[1] == ker[1]
    else:
        assert torch.equal(ker_args["cache"].cpu().view(torch.int32), ref_args["cache"].view(torch.int32))


# --------------------------------------------------------------------------- decode


def _decode_args():
    lens = [6, 0, 9]
    tables = pad_block_tables([[3, 0], [], [1, 4, 2]], 4)
    cache = _pool(fill=float("nan"))
    for b, n in enumerate(lens):
        k, v = _kv(n, seed=b + 3)
        reference.append_paged_kv(k, v, cache, slot_mapping(tables, torch.full((n,), b), torch.arange(n), PS))
    q = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(4))
    return {"q": q, "cache": cache, "block_tables": tables, "seq_lens": torch.tensor(lens, dtype=torch.int32)}


DECODE_CASES = {
    "valid": lambda a: None,
    "empty batch": lambda a: a.update(q=a["q"][:0], block_tables=a["block_tables"][:0], seq_lens=a["seq_lens"][:0]),
    "negative length": lambda a: a["seq_lens"].__setitem__(0, -1),
    "length past the table": lambda a: a["seq_lens"].__setitem__(0, 17),
    "-1 inside the length": lambda a: a["block_tables"].__setitem__((2, 2), -1),
    "page outside the pool": lambda a: a["block_tables"].__setitem__((0, 1), 6),
    "heads not a multiple": lambda a: a.update(q=a["q"][:, :3]),
    "q of another head_dim": lambda a: a.update(q=a["q"][..., :4]),
    "q rows differ from the batch": lambda a: a.update(q=a["q"][:2]),
    "scale nan": lambda a: a.update(scale=math.nan),
    "scale a string": lambda a: a.update(scale="0.1"),
    "window not a RingWindow": lambda a: a.update(window=8),
    "window with other pages": lambda a: a.update(window=pagedkv_lib.RingWindow(8, 2, 8)),
    "seq_lens float": lambda a: a.update(seq_lens=a["seq_lens"].float()),
    "layout unknown": lambda a: a.update(layout="NDH"),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_reference_and_kernel_accept_the_same_inputs(name):
    a = _decode_args()
    DECODE_CASES[name](a)
    kw = {k: a[k] for k in ("scale", "window", "layout") if k in a}
    names = ("q", "cache", "block_tables", "seq_lens")
    ref = _outcome(lambda: reference.paged_decode_attention(*(a[n] for n in names), **kw))
    dev = _on_dev(a)
    ker = _outcome(lambda: kernels.paged_decode_attention(*(dev[n] for n in names), **kw))
    assert ref[0] == ker[0], f"reference: {ref}, kernel: {ker}"
    if ref[0] == "ValueError":
        assert ref[1] == ker[1]
    else:
        atol, rtol = TOLERANCES[torch.float32]
        torch.testing.assert_close(ker[1].cpu(), ref[1], atol=atol, rtol=rtol)


CSR_DECODE_CASES = {
    "valid": lambda a: None,
    "no pages but a length": lambda a: a.update(kv_last_page_len=torch.tensor([2, 1, 1])),
    "last page overfull": lambda a: a.update(kv_last_page_len=torch.tensor([2, 0, 5])),
    "last page empty": lambda a: a.update(kv_last_page_len=torch.tensor([0, 0, 1])),
    "page outside the pool": lambda a: a["kv_indices"].__setitem__(0, 9),
    "kv_indptr not starting at 0": lambda a: a.update(kv_indptr=a["kv_indptr"] + 1),
    "kv_indptr short": lambda a: a.update(kv_indptr=a["kv_indptr"][:-1]),
}


@pytest.mark.parametrize("name", CSR_DECODE_CASES)
def test_csr_decode_reference_and_kernel_accept_the_same_inputs(name):
    d = _decode_args()
    indptr, indices, last = block_table_to_csr(d["block_tables"], d["seq_lens"], PS)
    a = {"q": d["q"], "cache": d["cache"], "kv_indptr": indptr, "kv_indices": indices, "kv_last_page_len": last}
    CSR_DECODE_CASES[name](a)
    names = ("q", "cache", "kv_indptr", "kv_indices", "kv_last_page_len")
    ref = _outcome(lambda: reference.paged_decode_attention_csr(*(a[n] for n in names)))
    dev = {k: v.to(DEV).to(torch.int32) if k.startswith("kv_") else v.to(DEV) for k, v in a.items()}
    ker = _outcome(lambda: kernels.paged_decode_attention_csr(*(dev[n] for n in names)))
    assert ref[0] == ker[0], f"reference: {ref}, kernel: {ker}"
    if ref[0] == "ValueError":
        assert ref[1] == ker[1]
    else:
        torch.testing.assert_close(ker[1].cpu(), ref[1], atol=1e-5, rtol=1e-6)

"""Deliberately broken copies of the suite's kernels, made by mutation: the real source of
``pagedkv_kernels`` with one small text edit, loaded as a separate package.

A mutant is built from the *current* source, so it tracks the kernels as they change;
every edit must match exactly once, or building the mutant fails (a patch that no
longer applies would otherwise test the unbroken kernel and pass for the wrong reason).
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import pagedkv_kernels as kernels
from pagedkv_lib import mla, quant_reference, reference

KERNELS_DIR = Path(kernels.__file__).parent


@dataclass(frozen=True)
class Mutant:
    """``edits`` maps a module of ``pagedkv_kernels`` (``"decode"``, ``"device.addressing"``)
    to ``(old, new)`` text edits;
    ``entry`` names the entry point to return (``"paged_decode_attention"``)."""

    name: str
    bug: str  # what a learner would call the bug
    edits: dict[str, tuple[tuple[str, str], ...]]
    entry: str


_WEIGHTS = 'w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))'
_EQUAL = 'w = tl.where(lse == float("-inf"), 0.0, 1.0)'
_ZERO_V = "tl.store(v_ptrs, tl.zeros_like(v).to(v_ptrs.dtype.element_ty), mask=kv_mask)"
_LOAD_V = "    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)\n"
_RECENT = "recent_start = tl.maximum(sink_tokens, first_end - window_recent)"
_HEADS = "heads = kv_head * group + offs_g\n"
_HEADS_SHIFTED = "heads = (kv_head * group + offs_g + 1) % (group * tl.num_programs(1))\n"

DECODE_MUTANTS = [
    Mutant(
        "no_rescale",
        "online softmax without rescaling the running sum and output when the maximum grows",
        {"device.attention_core": (
            ("l_new = l_i * alpha + ", "l_new = l_i + "),
            ("    acc = acc * alpha[:, None]\n", ""),
        )},
        "paged_decode_attention",
    ),
    Mutant(
        "equal_split_weights",
        "the split-KV merge averages the non-empty splits instead of weighting them by 2**lse",
        {"merge": ((_WEIGHTS, _EQUAL),)},
        "paged_decode_attention",
    ),
    Mutant(
        "reads_prefix",
        "reads only the first 96 keys of every sequence",
        {"device.attention_core": (("valid = j < n_vis\n", "valid = j < tl.minimum(n_vis, 96)\n"),)},
        "paged_decode_attention",
    ),
    Mutant(
        "writes_pool",
        "zeroes the V rows it has read: the output is right, the pool is not",
        {"device.attention_core": ((_LOAD_V, f"{_LOAD_V}    {_ZERO_V}\n"),)},
        "paged_decode_attention",
    ),
    Mutant(
        "drops_last_token",
        "attends to positions 0 .. seq_len - 2: the token just written is left out",
        {"device.attention_core": (("        n_vis = end\n", "        n_vis = tl.maximum(end - 1, 0)\n"),)},
        "paged_decode_attention",
    ),
    Mutant(
        "ignores_window",
        "attends to every position after the sinks, through the ring (keys the window excludes, and rows overwritten)",
        {"device.attention_core": ((_RECENT, "recent_start = sink_tokens"),)},
        "paged_decode_attention",
    ),
    Mutant(
        "gqa_off_by_one",
        "query head h is served by the KV head of query head h - 1",
        {"device.attention_core": ((_HEADS, _HEADS_SHIFTED),)},
        "paged_decode_attention",
    ),
]  # fmt: skip

# Linear-cache windows (FlashInfer's window_left): each bug once through the decode and
# once through the prefill entry point; tests/test_kernel_window.py runs them on the
# grids' linear-window cases.
_LINEAR_RECENT = "recent = 0 if window is None else window.recent_tokens\n"
_LINEAR_KIND = "    if isinstance(window, LinearWindow):\n        return 2\n"
_LINEAR_BUGS = {
    "linear_window_off_by_one": (
        "reads window_left as vLLM's sliding_window: a query sees window_left keys, not window_left + 1",
        (_LINEAR_RECENT, "recent = 0 if window is None else window.recent_tokens - isinstance(window, LinearWindow)\n"),
    ),
    "ignores_linear_window": (
        "launches a linear window as no window: every query sees every key",
        (_LINEAR_KIND, "    if isinstance(window, LinearWindow):\n        return 0\n"),
    ),
}
WINDOW_MUTANTS = [
    Mutant(f"{name}_{entry.split('_')[1]}", bug, {"host.read_plan": (edit,)}, entry)
    for name, (bug, edit) in _LINEAR_BUGS.items()
    for entry in ("paged_decode_attention", "paged_prefill_attention")
]

APPEND_MUTANTS = [
    Mutant(
        "append_drops_last_token",
        "the last token of every append is not written",
        {"device.addressing": (("in_range = tokens < num_tokens\n", "in_range = tokens < num_tokens - 1\n"),)},
        "append_paged_kv",
    ),
    Mutant(
        "append_v_over_k",
        "V is stored at K's offset (the K/V stride forgotten)",
        {"write": (("cache_ptr, dst_k + stride_kv, stride_h", "cache_ptr, dst_k, stride_h"),)},
        "append_paged_kv",
    ),
]

# Write kernels that take the RoPE angle from the cache position instead of
# rope_positions (TensorRT-LLM's speculative-decoding, M-RoPE and Helix sources ignored).
# The MHA and quantized writes start from device.addressing.kv_write_start, the MLA write
# reads its positions itself.
_ROPE_FROM = "rotary_positions(tokens, num_tokens, valid, rope_pos_ptr, "
_ROPE_AT_CACHE = "rotary_positions(tokens, num_tokens, valid, positions_ptr, "
ROTARY_MUTANTS = [
    Mutant(
        f"{family}_rope_at_cache_position",
        "RoPE at the cache position: the rotary positions given apart from it are ignored",
        {module: ((_ROPE_FROM, _ROPE_AT_CACHE),)},
        entry,
    )
    for family, module, entry in (
        ("write", "device.addressing", "append_paged_kv_csr"),
        ("quant_write", "device.addressing", "append_paged_kv_quant_csr_pool"),
        ("mla_write", "mla_write", "append_paged_mla_kv_csr"),
    )
]

# The rule NaN broke before issue 36: a row whose running sum is NaN counted as empty
# (``l_i > 0`` false: LSE -inf), and the merge weighed it 0 like an empty split, so a NaN
# in a visible key gave NaN with one split and a plausible finite answer with several.
_LSE_NOW = """    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))"""
_LSE_OLD = """    has = l_i > 0.0
    return tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))"""
_NAN_ROW = 'nan_row = tl.max(tl.where(lse < float("inf"), 0, 1), axis=0) != 0\n'
_INVALID_AS_EMPTY = (
    '    lse = tl.where(lse < float("inf"), lse, float("-inf"))  # the rest merges as if that split were empty\n'
)
NAN_IS_EMPTY = Mutant(
    "nan_is_empty",
    "a NaN row counts as empty: LSE -inf where l_i > 0 fails, and the merge drops it with the empty splits",
    {
        "device.attention_core": (
            (_LSE_NOW, _LSE_OLD),
            ("acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]", "acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]"),
        ),
        "merge": (
            (_NAN_ROW + _INVALID_AS_EMPTY, _NAN_ROW.replace("0, 1)", "0, 0)")),
            (
                'part = tl.where(lse[:, None] == float("-inf"), 0.0, part)',
                "part = tl.where(w[:, None] > 0.0, part, 0.0)",
            ),
        ),
    },
    "paged_decode_attention",
)

_BUILT: dict[str, object] = {}
_TMP = Path(tempfile.mkdtemp(prefix="pagedkv-mutants-"))


def build(mutant: Mutant):
    """Copy ``pagedkv_kernels`` into a package named after the mutant, apply its edits (each
    must match exactly once), import it and return its entry point."""
    if mutant.name in _BUILT:
        return _BUILT[mutant.name]
    package = f"kernels_mutant_{mutant.name}"
    target = _TMP / package
    shutil.copytree(KERNELS_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    for module, edits in mutant.edits.items():
        path = target / f"{module.replace('.', '/')}.py"
        text = path.read_text()
        for old, new in edits:
            count = text.count(old)
            if count != 1:
                raise AssertionError(f"mutant {mutant.name}: {old!r} occurs {count} times in pagedkv_kernels.{module}")
            text = text.replace(old, new)
        path.write_text(text)
    if str(_TMP) not in sys.path:
        sys.path.insert(0, str(_TMP))
    fn = getattr(importlib.import_module(package), mutant.entry)
    _BUILT[mutant.name] = fn
    return fn


# --------------------------------------------------------------------------- one row past its page
# Writers that put a page's last row one row further on: into the next page's first row
# (the end of a page computed with <= instead of <). A grid catches them only where a
# case writes some page's last row, so every writing family's default grid must.


def _past_its_page(slots, page_size: int, num_slots: int):
    shifted = torch.where((slots >= 0) & (slots % page_size == page_size - 1), slots + 1, slots)
    return torch.where(shifted < num_slots, shifted, slots)  # the pool's last row has no next page


def append_one_row_past_its_page(k, v, cache, slot_mapping, layout="NHD"):
    """``reference.append_paged_kv`` writing each page's last row one row past its page."""
    page_size = cache.shape[2] if layout == "NHD" else cache.shape[3]
    slots = _past_its_page(slot_mapping, page_size, cache.shape[0] * page_size)
    reference.append_paged_kv(k, v, cache, slots, layout)


def quant_append_one_row_past_its_page(k, v, pool, slot_mapping):
    """``quant_reference.append_paged_kv_quant`` writing a page's last row past its page."""
    slots = _past_its_page(slot_mapping, pool.page_size, pool.num_slots)
    quant_reference.append_paged_kv_quant(k, v, pool, slots)


def mla_append_one_row_past_its_page(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, rope=None, positions=None):
    """``mla.append_paged_mla_kv`` writing a page's last row past its page."""
    page_size = ckv_cache.shape[1]
    slots = _past_its_page(slot_mapping, page_size, ckv_cache.shape[0] * page_size)
    kwargs = {} if rope is None else {"rope": rope, "positions": positions}
    mla.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slots, **kwargs)


def package(mutant: Mutant):
    """The mutant's whole package (built by :func:`build`), for its other entry points."""
    build(mutant)
    return sys.modules[f"kernels_mutant_{mutant.name}"]

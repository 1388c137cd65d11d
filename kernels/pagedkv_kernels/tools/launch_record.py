"""Record the kernel launches a GPU would see, by running the suite in Triton's interpreter.

:mod:`pagedkv_kernels.tools.compile_check` compiles what this module records. A launch is recorded
as Triton specializes it, not as its values: a tensor by its dtype and whether its
address is 16-byte aligned, an int by its class (the value 1, i32 or i64, divisible by
16 or not), a float as fp32, and every ``tl.constexpr`` and launch option
(``num_warps``, ``num_stages``) by value. Two launches with the same record compile to
the same machine code.

The sources are what a GPU user runs, planned as on a GPU (``PAGEDKV_PLAN=gpu``, see
:mod:`pagedkv_lib.runtime`):

* ``verify``: the default conformance grid on the suite's kernels (executed: it must pass);
* ``notebooks``: the kernels notebooks 06 and 07 build in the page (executed, asserts on);
* ``exercises``: the workshop's kernel solutions through the exercise checker;
* ``benchmarks``: each benchmark's default GPU dtype, head size and tiles, on short
  sequences (the tiles stop growing at 64 keys, so longer ones add no specialization),
  the indexer-K scatter and block copy at DeepSeek-V3.2's and an offload's shapes, MLA
  in FlashInfer's convention, the read options the grid leaves out (CSR tables, LSE
  outputs, non-causal and draft-tree prefill, merge_states, cascade attention), the
  quantized append and decode under the peers' scale conventions (NVFP4 encode scales,
  FP8 per head, FP8 per token across heads) and the CSR decode and prefill with
  FlashInfer's ``window_left``;
* ``foreign``: the kernels written to vLLM's and nano-vllm's conventions
  (:mod:`pagedkv_lab.peer_kernels`), in fp32, fp16 and bf16, and the suite's prefill
  over vLLM's x-packed pair and FlashInfer's K/V tuple, the new tokens in the cache or
  apart (:mod:`pagedkv_kernels.adapters.prefix_prefill`).

Kernels defined outside ``kernels/`` (a notebook's or an exercise's) are recorded with
the text of their file, so that the compile step can rebuild them without running it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import runpy
import sys
import time
from pathlib import Path

from pagedkv_lib import runtime

# isort: split
import torch
import triton.language as tl
from triton.runtime import interpreter

__all__ = ["SOURCES", "Recorder", "int_class", "record_sources"]

ROOT = Path(__file__).resolve().parents[3]  # the checkout
SOURCES = ("verify", "notebooks", "exercises", "benchmarks", "foreign")
INT32 = (-(2**31), 2**31 - 1)


def int_class(value: int) -> str:
    """Triton's specialization class of an int argument: ``"1"`` (compiled in as a
    constant), else ``"i32"``/``"i64"`` by range, with ``"D"`` appended when divisible
    by 16 (Triton then assumes the alignment)."""
    if value == 1:
        return "1"
    width = "i32" if INT32[0] <= value <= INT32[1] else "i64"
    return width + ("D" if value % 16 == 0 else "")


def _constexpr_names(fn) -> set[str]:
    names = set()
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation
        if ann is tl.constexpr or (isinstance(ann, str) and "constexpr" in ann):
            names.add(name)
    return names


def _describe(value, constexpr: bool):
    """A JSON-able description of one argument, as Triton specializes it."""
    if constexpr:
        if isinstance(value, tl.dtype):
            return ["dtype", str(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return ["c", value]
        raise TypeError(f"constexpr of type {type(value).__name__} cannot be recorded")
    if isinstance(value, torch.Tensor):
        return ["t", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0]
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", value]
    if isinstance(value, int):
        return ["i", int_class(value)]
    if isinstance(value, float):
        return ["f"]
    raise TypeError(f"argument of type {type(value).__name__} cannot be recorded")


class Recorder:
    """Records every interpreted launch while active (a context manager); ``launches``
    maps each distinct record's key to the record, ``files`` a kernel file's path to its
    text. The launch itself runs as usual, unless ``dry`` (record only: outputs are left
    as they were, for sources whose results nobody reads)."""

    def __init__(self, source: str = "", dry: bool = False):
        self.source = source
        self.dry = dry
        self.launches: dict[str, dict] = {}
        self.files: dict[str, str] = {}
        self._saved = None

    def add(self, fn, args: tuple, kwargs: dict) -> None:
        sig = inspect.signature(fn)
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        const = _constexpr_names(fn)
        described = {name: _describe(v, name in const) for name, v in bound.arguments.items()}
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        path = inspect.getsourcefile(fn) or fn.__code__.co_filename
        path = str(Path(path).resolve())
        if path not in self.files:
            self.files[path] = Path(path).read_text()
        in_kernels = Path(path).parent == ROOT / "kernels"
        record = {
            "kernel": fn.__name__,
            "module": f"kernels.{Path(path).stem}" if in_kernels else None,
            "file": path,
            "args": described,
            "options": options,
        }
        key = json.dumps({k: record[k] for k in ("kernel", "module", "args", "options")}, sort_keys=True)
        if not in_kernels:
            key += self.files[path]  # an edited learner kernel is another kernel
        entry = self.launches.setdefault(key, {**record, "sources": [], "count": 0})
        entry["count"] += 1
        if self.source and self.source not in entry["sources"]:
            entry["sources"].append(self.source)

    def __enter__(self):
        original = interpreter.InterpretedFunction.run
        recorder = self

        def run(self_fn, *args, grid, warmup, **kwargs):
            if recorder.dry:
                recorder.add(self_fn.fn, args, kwargs)
                return None
            out = original(self_fn, *args, grid=grid, warmup=warmup, **kwargs)
            recorder.add(self_fn.fn, args, kwargs)  # after: a launch that raised (a lesson's refusal) is no plan
            return out

        self._saved = original
        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._saved
        return False


# --------------------------------------------------------------------------- sources


def _run_verify() -> None:
    from . import verify

    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = verify.main(["--no-isolate", "--hypothesis", "0"])
    if code != 0:
        raise RuntimeError("the default verify grid failed under GPU plans:\n" + out.getvalue()[-4000:])


def _run_notebook(stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = ROOT / "notebooks" / "src" / f"{stem}.py"
    cwd = os.getcwd()
    os.chdir(src.parent.parent)  # notebooks run from notebooks/
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(src), run_name=f"notebook_{stem}")
    finally:
        os.chdir(cwd)
        plt.close("all")


def _run_exercises() -> None:
    from pagedkv_lab.exercises import EXERCISES, check
    from pagedkv_lab.exercises.files import load_solution

    for exercise in EXERCISES.values():
        if not exercise.runs_kernels:
            continue
        space = load_solution(exercise)
        # in this process: an isolated check launches in a child the recorder cannot see
        result = check(exercise.name, *(space[f] for f in exercise.functions), isolate=False)
        if not result.passed:
            raise RuntimeError(f"the solution of {exercise.stem} failed under GPU plans:\n{result}")


def _run_bf16_prefill() -> None:
    """The prefill grid in bf16 (its ``tl.dot`` mode), recorded dry: the interpreter's
    bf16 dot is wrong, so these launches are compiled but never run on CPU."""
    from pagedkv_lab.verify import run

    from ..prefill import paged_prefill_attention

    run(prefill_fn=paged_prefill_attention, checks=("prefill",), isolate=False)


# The GPU defaults of benchmarks/bench_*.py (dtype, KV heads, GQA group, head size, page
# size), on short sequences: tiles stop growing at 64 keys, so 256 keys give the same
# specializations as the benchmarks' 64K.
BENCH_SHAPES = {"heads": 8, "group": 4, "head_dim": 128, "page_size": 16, "tokens": 256}


def _bench_batch():
    """The benchmarks' shapes as ``(h, g, d, p, n)`` (:data:`BENCH_SHAPES`), and two full
    sequences of ``n`` tokens on pages ``0 .. 2n / p - 1``: ``table [2, n / p]`` and
    ``lens [2]``, int32."""
    h, g, d, p, n = (BENCH_SHAPES[k] for k in ("heads", "group", "head_dim", "page_size", "tokens"))
    table = torch.arange(2 * n // p, dtype=torch.int32).view(2, n // p)
    return (h, g, d, p, n), table, torch.full((2,), n, dtype=torch.int32)


def _run_benchmarks() -> None:
    from pagedkv_lib.quant_pool import QuantizedKVPool

    from .. import decode, gather, prefill, quant_decode, quant_write, write

    (h, g, d, p, n), table, lens = _bench_batch()
    gen = torch.Generator().manual_seed(0)
    pages = 2 * n // p
    slots = torch.arange(n, dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float16):  # decode/prefill default bf16, write fp16
        cache = torch.zeros((pages, 2, p, h, d), dtype=dtype)
        q = torch.randn((2, h * g, d), generator=gen).to(dtype)
        decode.paged_decode_attention(q, cache, table, lens)
        gather.gather_paged_kv(cache, table, lens)
        qp = torch.randn((2 * n, h * g, d), generator=gen).to(dtype)
        prefill.paged_prefill_attention(qp, cache, torch.tensor([0, n, 2 * n], dtype=torch.int32), table, lens)
        k = torch.randn((n, h, d), generator=gen).to(dtype)
        write.append_paged_kv(k, k, cache, slots)
    for fmt in ("fp8", "nvfp4"):  # bench_quant.py: fp16 inputs into each format
        pool = QuantizedKVPool(pages, p, h, d, kv_dtype=fmt)
        k = torch.randn((n, h, d), generator=gen).to(torch.float16)
        quant_write.append_paged_kv_quant(k, k, slot_mapping=slots, **pool.kernel_args())
        q = torch.randn((2, h * g, d), generator=gen).to(torch.float16)
        quant_decode.paged_decode_attention_quant(q, block_tables=table, seq_lens=lens, **pool.kernel_args())


def _run_scale_conventions() -> None:
    """The scale conventions of other engines at the benchmarks' shapes, recorded dry:
    NVFP4 with TensorRT-LLM's / FlashInfer's encode scale, FP8 with vLLM's per-head scales
    and vLLM's per-token scale across heads (the write kernel then holds every KV head in
    one program), each appended and decoded in both layouts."""
    from pagedkv_lib.quant_pool import QuantizedKVPool

    from .. import quant_decode, quant_write

    (h, g, d, p, n), table, lens = _bench_batch()
    gen = torch.Generator().manual_seed(0)
    pages = 2 * n // p
    slots = torch.arange(n, dtype=torch.int64)
    modes = (
        {"kv_dtype": "nvfp4", "k_scale_encode": 448.0, "v_scale_encode": 448.0},
        {"kv_dtype": "fp8", "scale_mode": "head", "k_scale": [0.01] * h, "v_scale": [0.01] * h},
        {"kv_dtype": "fp8", "scale_mode": "token_all_heads"},
    )
    for kwargs in modes:
        for layout in ("NHD", "HND"):
            pool = QuantizedKVPool(pages, p, h, d, layout=layout, **kwargs)
            k = torch.randn((n, h, d), generator=gen).to(torch.float16)
            quant_write.append_paged_kv_quant(k, k, slot_mapping=slots, **pool.kernel_args())
            q = torch.randn((2, h * g, d), generator=gen).to(torch.float16)
            quant_decode.paged_decode_attention_quant(q, block_tables=table, seq_lens=lens, **pool.kernel_args())


def _run_foreign() -> None:
    """The kernels written to other engines' conventions (:mod:`pagedkv_lab.peer_kernels`,
    notebook 08 and the harness tests), once per dtype, recorded dry."""
    from pagedkv_lab import peer_kernels as peer_conventions

    gen = torch.Generator().manual_seed(0)
    blocks, block, heads, dim, n = 8, 16, 2, 64, 40
    slots = torch.arange(n, dtype=torch.int64)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    lens = torch.tensor([n], dtype=torch.int32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kc, vc = (torch.zeros((blocks, block, heads, dim), dtype=dtype) for _ in range(2))
        k = torch.randn((n, heads, dim), generator=gen).to(dtype)
        peer_conventions.store_kv_tuple(k, k, kc, vc, slots)
        q = torch.randn((1, 2 * heads, dim), generator=gen).to(dtype)
        peer_conventions.decode_kv_tuple(q, kc, vc, table, lens)
        qp = torch.randn((n, 2 * heads, dim), generator=gen).to(dtype)
        peer_conventions.prefill_kv_tuple(qp, kc, vc, torch.tensor([0, n], dtype=torch.int32), table, lens)
        # the unified-attention peer, plain and with every option (tf32 dots for fp32)
        peer_conventions.decode_paged(q, kc, vc, table, lens)
        mods = {"sinks": torch.zeros(2 * heads), "alibi_slopes": torch.ones(2 * heads), "softcap": 30.0}
        peer_conventions.decode_paged(q, kc, vc, table, lens, tf32=dtype == torch.float32, **mods)


def _run_vllm_layouts() -> None:
    """The prefill over vLLM's and FlashInfer's cache pairs at the benchmarks' shapes,
    recorded dry (the verify grid runs the suite's 5-D pool only): vLLM's
    ``context_attention_fwd`` (the x-packed pair, the new tokens apart: ``NEW_KV``) with
    and without its ``sliding_window``, the same pair and FlashInfer's ``(k_cache,
    v_cache)`` tuple in NHD with the new tokens in the cache, and the tuple in HND through
    a CSR table of the context with the new tokens apart."""
    from pagedkv_lib.cache_layouts import to_native
    from pagedkv_lib.formats import block_table_to_csr

    from .. import prefill
    from ..adapters import prefix_prefill

    (h, g, d, p, n), table, lens = _bench_batch()
    gen = torch.Generator().manual_seed(0)
    qo = torch.tensor([0, n // 2, n], dtype=torch.int32)  # half of each sequence is new
    context = lens - n // 2
    indptr, indices, last = block_table_to_csr(table, context, p)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        pool = torch.zeros((2 * n // p, 2, p, h, d), dtype=dtype)
        q = torch.randn((n, h * g, d), generator=gen).to(dtype)
        k = torch.randn((n, h, d), generator=gen).to(dtype)
        k_cache, v_cache = to_native(pool, "vllm_x")
        for window in (None, 1024):
            prefix_prefill.context_attention_fwd(q, k, k, torch.empty_like(q), "auto", k_cache, v_cache, table, qo,
                                                 lens, n // 2, 1.0, 1.0, sliding_window=window)  # fmt: skip
        prefill.paged_prefill_attention(q, to_native(pool, "kv_tuple"), qo, table, lens)
        prefill.paged_prefill_attention(q, (k_cache, v_cache), qo, table, lens)  # the new tokens in the cache
        pair = to_native(pool.transpose(2, 3).contiguous(), "kv_tuple", "HND")
        prefill.paged_prefill_attention_csr(q, pair, qo, indptr, indices, last, "HND", k_new=k, v_new=k)


def _run_production_shapes() -> None:
    """The indexer-K scatter at DeepSeek-V3.2's shapes (indexer head 128, blocks of 64) and
    an offload-sized block copy per dtype and layout, recorded dry (the verify grid runs
    both kernels at small shapes)."""
    from pagedkv_lib.indexer_cache import IndexerKPool, indexer_slots, quantize_indexer_k

    from .. import block_copy, indexer_k

    gen = torch.Generator().manual_seed(0)
    pool, pos = IndexerKPool(8, 64, 128, num_layers=2, fill=0), torch.arange(300)
    fp8, sc = indexer_slots(torch.arange(8).view(1, 8), torch.zeros_like(pos), pos, 64, 128)
    codes, scales = quantize_indexer_k(torch.randn((300, 128), generator=gen))
    indexer_k.indexer_k_cache_scatter(pool.cache(1), codes, scales, fp8, sc)
    for dtype in (torch.bfloat16, torch.float16):
        for layout in ("NHD", "HND"):
            inner = (16, 8, 128) if layout == "NHD" else (8, 16, 128)
            ids = torch.arange(4)
            cache = torch.zeros((4, 8, 2, *inner), dtype=dtype)
            block_copy.copy_paged_blocks(cache, ids, ids + 4, torch.tensor([0, 3, -1, 16]), layout)


def _run_mla_latent() -> None:
    """MLA in FlashInfer's convention at DeepSeek's widths (rank 512, RoPE 64, 16 heads,
    pages of 64): a CSR decode and a causal prefill of several queries per request,
    recorded dry (the verify grid runs the padded absorbed decode)."""
    from .. import mla_latent

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        ckv = torch.randn((8, 64, 512), generator=gen).to(dtype)
        kpe = torch.randn((8, 64, 64), generator=gen).to(dtype)
        kv_indptr, kv_indices, kv_len = torch.tensor([0, 3, 5]), torch.arange(5), torch.tensor([150, 100])
        for q_lens in ((1, 1), (30, 20)):
            qo = torch.tensor([0, q_lens[0], sum(q_lens)])
            q_nope = torch.randn((sum(q_lens), 16, 512), generator=gen).to(dtype)
            q_pe = torch.randn((sum(q_lens), 16, 64), generator=gen).to(dtype)
            mla_latent.mla_latent_attention_csr(q_nope, q_pe, ckv, kpe, qo, kv_indptr, kv_indices, kv_len, 0.07)


def _run_read_options() -> None:
    """The read options the verify grid leaves out, at the benchmarks' shapes, recorded dry:
    FlashInfer's CSR tables for decode and prefill, the base-2 LSE outputs
    (``return_lse``), non-causal prefill, draft-tree prefill (``tree_mask``, padded and
    CSR), the states' merge with its LSE (``merge_states``) and cascade attention over a
    shared prefix."""
    from pagedkv_lib.draft_tree import batch_tree_mask
    from pagedkv_lib.formats import block_table_to_csr

    from .. import cascade, decode, prefill

    (h, g, d, p, n), table, lens = _bench_batch()
    gen = torch.Generator().manual_seed(0)
    indptr, indices, last = block_table_to_csr(table, lens, p)
    qo = torch.tensor([0, 8, 16], dtype=torch.int32)
    tree = batch_tree_mask([(-1, 0, 0, 1, 1, 2, 2, -1)] * 2, qo)  # 8 drafts per request
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        cache = torch.randn((2 * n // p, 2, p, h, d), generator=gen).to(dtype)
        q = torch.randn((2, h * g, d), generator=gen).to(dtype)
        qp = torch.randn((16, h * g, d), generator=gen).to(dtype)
        decode.paged_decode_attention_csr(q, cache, indptr, indices, last, return_lse=True)
        decode.paged_decode_attention(q, cache, table, lens, num_splits=4, return_lse=True)
        prefill.paged_prefill_attention_csr(qp, cache, qo, indptr, indices, last, return_lse=True)
        prefill.paged_prefill_attention(qp, cache, qo, table, lens, causal=False, return_lse=True)
        prefill.paged_prefill_attention(qp, cache, qo, table, lens, tree_mask=tree)
        prefill.paged_prefill_attention_csr(qp, cache, qo, indptr, indices, last, return_lse=True, tree_mask=tree)
        states = torch.randn((16, 3, h * g, d), generator=gen).to(dtype)
        cascade.merge_states(states, torch.randn((16, 3, h * g), generator=gen))
        cascade.cascade_attention(qp, cache, qo, table[0, :2], 2 * p, table[:, 2:], lens - 2 * p)


def _run_linear_windows() -> None:
    """FlashInfer's sliding-window shapes on the CSR entry points (``window_left``, pages
    of 16, head size 128, 16-bit), recorded dry: the verify grid runs linear windows
    through the padded entries only."""
    from pagedkv_lib.formats import block_table_to_csr
    from pagedkv_lib.window import LinearWindow

    from .. import decode, prefill

    gen = torch.Generator().manual_seed(0)
    (h, g, d, p, n), table, lens = _bench_batch()
    kv_indptr, kv_indices, last = block_table_to_csr(table, lens, p)
    window = LinearWindow(127)
    for dtype in (torch.bfloat16, torch.float16):
        cache = torch.zeros((2 * n // p, 2, p, h, d), dtype=dtype)
        q = torch.randn((2, h * g, d), generator=gen).to(dtype)
        decode.paged_decode_attention_csr(q, cache, kv_indptr, kv_indices, last, window=window)
        qp = torch.randn((2 * n, h * g, d), generator=gen).to(dtype)
        qo = torch.tensor([0, n, 2 * n], dtype=torch.int32)
        prefill.paged_prefill_attention_csr(qp, cache, qo, kv_indptr, kv_indices, last, window=window)


def _run_rotary_positions() -> None:
    """The CSR write kernels with rotary positions of their own (``rope_positions``, the
    ``ROPE_POS`` branch: TensorRT-LLM's spec-decode, M-RoPE and Helix sources) and ``q``,
    at the benchmarks' shapes, recorded dry: MHA in both layouts, FP8 and NVFP4, MLA (the
    verify grid runs only the MHA one, at small shapes)."""
    from pagedkv_lib.formats import block_table_to_csr
    from pagedkv_lib.quant_pool import QuantizedKVPool

    from .. import mla_write, quant_write, write

    (h, g, d, p, n), table, lens = _bench_batch()
    gen = torch.Generator().manual_seed(0)
    indptr, indices, _ = block_table_to_csr(table, lens, p)
    batch = torch.arange(2, dtype=torch.int32).repeat_interleave(n // 2)
    pos = torch.arange(n // 2, n, dtype=torch.int32).repeat(2)
    rope_pos = pos.clone()
    pos[: n // 2] = -1  # request 0 inactive (a Helix rank that does not own its KV)
    csr = (batch, pos, indices, indptr)
    for dtype in (torch.float16, torch.bfloat16):
        k = torch.randn((n, h, d), generator=gen).to(dtype)
        q = torch.randn((n, h * g, d), generator=gen).to(dtype)
        for layout in ("NHD", "HND"):
            cache = torch.zeros((2 * n // p, 2, p, h, d) if layout == "NHD" else (2 * n // p, 2, h, p, d), dtype=dtype)
            write.append_paged_kv_csr(k, k, cache, *csr, layout, rope="neox", q=q, rope_positions=rope_pos)
        ckv, kpe = torch.randn((n, 512), generator=gen).to(dtype), torch.randn((n, 64), generator=gen).to(dtype)
        caches = torch.zeros((2 * n // p, p, 512), dtype=dtype), torch.zeros((2 * n // p, p, 64), dtype=dtype)
        mla_write.append_paged_mla_kv_csr(ckv, kpe, *caches, *csr, rope="gptj", rope_positions=rope_pos)
    for fmt in ("fp8", "nvfp4"):
        pool = QuantizedKVPool(2 * n // p, p, h, d, kv_dtype=fmt)
        k = torch.randn((n, h, d), generator=gen).to(torch.float16)
        q = torch.randn((n, h * g, d), generator=gen).to(torch.float16)
        index = dict(zip(("batch_indices", "positions", "kv_indices", "kv_indptr"), csr))
        quant_write.append_paged_kv_quant_csr(
            k, k, **index, **pool.kernel_args(), rope="neox", q=q, rope_positions=rope_pos
        )


RUNNERS = {  # (label, runner, dry)
    "verify": [("verify grid", _run_verify, False), ("bf16 prefill grid (dry)", _run_bf16_prefill, True)],
    "notebooks": [
        (f"notebook {s[:2]}", lambda s=s: _run_notebook(s), False) for s in ("06_triton_write", "07_triton_read")
    ],
    "exercises": [("exercise solutions", _run_exercises, False)],
    "benchmarks": [
        ("benchmark shapes (dry)", _run_benchmarks, True),
        ("indexer and block-copy shapes (dry)", _run_production_shapes, True),
        ("FlashInfer-convention MLA shapes (dry)", _run_mla_latent, True),
        ("read options: CSR, LSE, non-causal, draft trees, merge, cascade (dry)", _run_read_options, True),
        ("peer scale conventions (dry)", _run_scale_conventions, True),
        ("linear-window CSR shapes (dry)", _run_linear_windows, True),
        ("rotary positions apart from cache positions (dry)", _run_rotary_positions, True),
    ],
    "foreign": [
        ("engine-convention kernels (dry)", _run_foreign, True),
        ("prefill over vLLM's and FlashInfer's cache pairs (dry)", _run_vllm_layouts, True),
    ],
}


def record_sources(sources=SOURCES, log=print) -> tuple[list[dict], dict[str, str]]:
    """Run each source under a :class:`Recorder`; return ``(launches, files)``. Raises
    ``RuntimeError`` when not run in the interpreter with GPU plans, or when a source
    fails or records nothing (its launches would be incomplete)."""
    if not (runtime.BACKEND.interpreted and runtime.gpu_plans()):
        raise RuntimeError("record launches in the interpreter with GPU plans: PAGEDKV_PLAN=gpu, no CUDA")
    launches: dict[str, dict] = {}
    files: dict[str, str] = {}
    for source in sources:
        for label, runner, dry in RUNNERS[source]:
            start = time.perf_counter()
            with Recorder(label, dry=dry) as rec:
                runner()
            for key, entry in rec.launches.items():
                mine = launches.setdefault(key, {**entry, "sources": [], "count": 0})
                mine["count"] += entry["count"]
                mine["sources"] += [s for s in entry["sources"] if s not in mine["sources"]]
            if not rec.launches:  # e.g. launches moved to a child process the recorder cannot see
                raise RuntimeError(
                    f"{label} launched no kernel this process could record: the compile check would miss it"
                )
            files.update(rec.files)
            log(f"recorded {label}: {len(rec.launches)} distinct launches in {time.perf_counter() - start:.1f} s")
    return list(launches.values()), files


if __name__ == "__main__":  # the compile check's first step, in its own process
    out = Path(sys.argv[1])
    launches, files = record_sources(sys.argv[2].split(",") if len(sys.argv) > 2 else SOURCES)
    out.write_text(json.dumps({"launches": launches, "files": files}))

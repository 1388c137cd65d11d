"""Bytes moved and time of the quantized KV kernels, per format, against bf16 and a copy.

    python benchmarks/bench_quant.py --out benchmarks/results

For each format (``bf16`` through :mod:`pagedkv_kernels.write` / :mod:`pagedkv_kernels.decode`, then
``fp8``, ``fp8_token`` and ``nvfp4`` through :mod:`pagedkv_kernels.quant_write` /
:mod:`pagedkv_kernels.quant_decode`) and each token count:

* **append**: a prefill-like append of ``tokens`` K/V rows (fp16 inputs) over shuffled
  pages; bytes moved = K and V read (fp16) + codes and scales written;
* **decode**: one query per sequence over ``batch`` sequences of ``tokens / batch``
  keys; bytes moved = codes and scales read (the pool's bytes per token x tokens) +
  queries read + outputs written.

Each point is checked once before it is timed (append codes bit-exact against
:mod:`pagedkv_lib.quant_reference`, decode within the fp32 pass rule), then the launch
alone is timed (arguments validated once by a plan). A ``copy`` of a contiguous
buffer as large as the append's bytes is timed in the same run: on a GPU each
method's ``ratio_vs_copy`` is its effective bandwidth over the copy's. Writes
``bench_quant.json`` and ``bench_quant.png``.

Without a GPU the kernels run in Triton's interpreter and times come from
``time.perf_counter``: interpreter timings, not GPU performance (its cost follows the
number of ``tl`` operations, so the quantizing kernels' extra arithmetic shows up
much larger than on a GPU, where the same bytes move).
"""

from __future__ import annotations

import pagedkv_lib  # noqa: F401  (before triton: chooses the backend)
from pagedkv_lib import formats, quant, quant_reference, reference, runtime
from pagedkv_lib.compare import TOLERANCES, compare
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import timer  # noqa: E402

from pagedkv_kernels import decode, quant_decode, quant_write, write  # noqa: E402

FORMATS = {"bf16": None, "fp8": ("fp8", "tensor"), "fp8_token": ("fp8", "token"), "nvfp4": ("nvfp4", "block")}
CPU_TOKENS = (64, 512)
GPU_TOKENS = (512, 4096, 32768)
INTERPRETER_NOTE = "interpreter timings, not GPU performance"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and PNG")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default: small on CPU, large on GPU)")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="sequences of the decode")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point on CPU (median)")
    return p.parse_args(argv)


class Case:
    """K/V, slots and page table of ``tokens`` rows in ``batch`` sequences."""

    def __init__(self, tokens: int, args, gen: torch.Generator):
        dev = runtime.device()
        self.lens = [tokens // args.batch] * args.batch
        self.num_pages = sum(-(-n // args.page_size) for n in self.lens) + 4
        rows = formats.scatter_pages([-(-n // args.page_size) for n in self.lens], self.num_pages, gen)
        self.table = formats.pad_block_tables(rows)
        batch = torch.repeat_interleave(torch.arange(args.batch), torch.tensor(self.lens))
        pos = torch.cat([torch.arange(n) for n in self.lens])
        self.slots = formats.slot_mapping(self.table, batch, pos, args.page_size)
        shape = (sum(self.lens), args.heads, args.head_dim)
        self.k, self.v = (torch.randn(shape, generator=gen).half() for _ in range(2))
        self.q = torch.randn(args.batch, args.heads * 4, args.head_dim, generator=gen).half()
        self.dev = {name: getattr(self, name).to(dev) for name in ("k", "v", "q", "slots", "table")}
        self.dev["lens"] = torch.tensor(self.lens, device=dev)


def pool_bytes_per_token(fmt: str, args) -> int:
    """Bytes one token occupies in one layer's pool (K and V, codes and scales)."""
    if FORMATS[fmt] is None:
        return 2 * args.heads * args.head_dim * 2
    kv_dtype, mode = FORMATS[fmt]
    return QuantizedKVPool(1, 1, args.heads, args.head_dim, kv_dtype, scale_mode=mode).nbytes


def measure_format(fmt: str, case: Case, args, time_it) -> dict:
    """Check, then time the append and the decode of one format."""
    dev, d = runtime.device(), case.dev
    if FORMATS[fmt] is None:
        inner = (args.page_size, args.heads)
        cache = torch.zeros((case.num_pages, 2, *inner, args.head_dim), dtype=torch.bfloat16, device=dev)
        k, v, q = d["k"].bfloat16(), d["v"].bfloat16(), d["q"].bfloat16()
        plan = write.plan_append(k, v, cache, d["slots"])
        write.run_append(plan, k, v, cache)
        want = torch.zeros_like(cache, device="cpu")
        reference.append_paged_kv(case.k.bfloat16(), case.v.bfloat16(), want, case.slots)
        assert torch.equal(cache.cpu(), want), "bf16 append differs from the reference"
        dplan = decode.plan_decode(q, cache, d["table"], d["lens"])
        out = decode.run_decode(dplan, q, cache)
        exp = reference.paged_decode_attention(q.cpu(), want, case.table, case.lens, precision="fp64")
        tol = TOLERANCES[torch.bfloat16]
        append, read = (lambda: write.run_append(plan, k, v, cache)), (lambda: decode.run_decode(dplan, q, cache))
    else:
        kv_dtype, mode = FORMATS[fmt]
        scales = {
            "k_scale": quant.global_scale_for(case.k, kv_dtype),
            "v_scale": quant.global_scale_for(case.v, kv_dtype),
        }
        pool = QuantizedKVPool(case.num_pages, args.page_size, args.heads, args.head_dim, kv_dtype, device=dev,
                               scale_mode=mode, **scales)  # fmt: skip
        tensors = (pool.data, pool.scales, pool.global_scale)
        plan = quant_write.plan_append_quant(d["k"], d["v"], slot_mapping=d["slots"], **pool.kernel_args())
        quant_write.run_append_quant(plan, d["k"], d["v"], *tensors)
        want = pool.to("cpu")
        want.data.zero_()
        if want.scales is not None:
            want.scales.zero_()
        quant_reference.append_paged_kv_quant(case.k, case.v, want, case.slots)
        assert torch.equal(pool.data.cpu(), want.data), f"{fmt} append codes differ from the reference"
        dplan = quant_decode.plan_decode_quant(
            d["q"], block_tables=d["table"], seq_lens=d["lens"], **pool.kernel_args()
        )
        out = quant_decode.run_decode_quant(dplan, d["q"], *tensors)
        exp = quant_reference.paged_decode_attention_quant(case.q, want, case.table, case.lens, precision="fp64")
        tol = TOLERANCES[torch.float16]
        append = lambda: quant_write.run_append_quant(plan, d["k"], d["v"], *tensors)  # noqa: E731
        read = lambda: quant_decode.run_decode_quant(dplan, d["q"], *tensors)  # noqa: E731
    assert compare(out, exp, *tol).passed, f"{fmt} decode is outside the tolerance"
    tokens, per_token = sum(case.lens), pool_bytes_per_token(fmt, args)
    q_bytes = 2 * case.q.numel() * 2  # q read, output written (16-bit)
    append_bytes = case.k.numel() * 2 * 2 + tokens * per_token  # fp16 K and V read, the pool's bytes written
    decode_bytes = tokens * per_token + q_bytes
    seconds = {"append": time_it(append), "decode": time_it(read)}
    return {
        "format": fmt,
        "pool_bytes_per_token_per_layer": per_token,
        "bytes": {"append": append_bytes, "decode": decode_bytes},
        "seconds": seconds,
        "gb_per_s": {
            "append": append_bytes / seconds["append"] / 1e9,
            "decode": decode_bytes / seconds["decode"] / 1e9,
        },
    }


def measure(args) -> dict:
    tokens_list = args.tokens or (CPU_TOKENS if runtime.BACKEND.interpreted else GPU_TOKENS)
    time_it = timer(args.repeats)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in tokens_list:
        case = Case(tokens, args, gen)
        nbytes = case.k.numel() * 2 * 2  # as much as the fp16 K and V of the append
        src = torch.randn(nbytes // 2, generator=gen).half().to(runtime.device())
        dst = torch.empty_like(src)
        copy_s = time_it(lambda dst=dst, src=src: dst.copy_(src))
        copy_gbps = 2 * nbytes / copy_s / 1e9  # read + write
        point = {"tokens": tokens, "copy": {"bytes": 2 * nbytes, "seconds": copy_s, "gb_per_s": copy_gbps}}
        point["formats"] = [measure_format(fmt, case, args, time_it) for fmt in FORMATS]
        for r in point["formats"]:
            r["ratio_vs_copy"] = {op: r["gb_per_s"][op] / copy_gbps for op in ("append", "decode")}
            print(
                f"{tokens:>6} tokens {r['format']:>9}: {r['pool_bytes_per_token_per_layer']:>5} B/token  "
                f"append {r['seconds']['append'] * 1e3:9.2f} ms ({r['bytes']['append'] / 1e6:7.3f} MB)  "
                f"decode {r['seconds']['decode'] * 1e3:9.2f} ms ({r['bytes']['decode'] / 1e6:7.3f} MB)"
            )
        rows.append(point)
    return {
        "benchmark": "quantized paged KV: append and decode per format",
        "backend": runtime.backend_line(),
        "interpreted": runtime.BACKEND.interpreted,
        "note": INTERPRETER_NOTE if runtime.BACKEND.interpreted else "compiled kernels, do_bench median",
        "machine": platform.platform(),
        "config": {"heads": args.heads, "head_dim": args.head_dim, "page_size": args.page_size, "batch": args.batch},
        "bytes_formula": {
            "append": "fp16 K and V read + tokens * pool bytes per token (codes and scales) written",
            "decode": "tokens * pool bytes per token read + q read + output written",
        },
        "results": rows,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for ax, op in zip(axes, ("append", "decode")):
        for i, fmt in enumerate(FORMATS):
            key = "ratio_vs_copy" if not report["interpreted"] else "seconds"
            ax.plot([r["tokens"] for r in rows], [r["formats"][i][key][op] for r in rows], marker="o", label=fmt)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("bandwidth / copy's bandwidth" if not report["interpreted"] else "seconds per launch")
        ax.set_title(op + (f"\n({INTERPRETER_NOTE})" if report["interpreted"] else ""), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if runtime.BACKEND.interpreted:
        print(f"*** {INTERPRETER_NOTE}: Triton's interpreter on CPU ***")
    print(runtime.backend_line())
    report = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quant.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "bench_quant.png")
    print(f"wrote {args.out / 'bench_quant.json'} and {args.out / 'bench_quant.png'}")
    if runtime.BACKEND.interpreted:
        print(f"*** {INTERPRETER_NOTE} ***")


if __name__ == "__main__":
    main()

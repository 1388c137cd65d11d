"""Effective bandwidth of the paged KV write kernel against torch and a plain copy.

    python benchmarks/bench_write.py --out benchmarks/results

For each token count, a prefill-like append (tokens fill whole pages of a shuffled
page list) is timed three ways, plus a baseline measured in the same run:

* ``kernel``: the Triton launch alone (arguments validated once beforehand);
* ``kernel+checks``: :func:`pagedkv_kernels.write.append_paged_kv` as users call it, with the
  launcher's validation (which reads the slot mapping on the host);
* ``torch``: :func:`pagedkv_lib.reference.append_paged_kv`, the vectorized reference
  (its own validation included);
* ``copy``: ``dst.copy_(src)`` of a contiguous tensor as large as K and V together.

Effective bandwidth = bytes of K and V read plus written (``2 * 2 * tokens * heads *
head_dim * itemsize``) / time; each method's ``ratio`` is its bandwidth over the
copy's. Writes ``bench_write.json`` (every measurement) and ``bench_write.png``.

On a GPU times come from ``triton.testing.do_bench`` (median, CUDA events). Without
one the kernels run in Triton's interpreter and times come from
``time.perf_counter``: those are interpreter timings, not GPU performance.
"""

from __future__ import annotations

import pagedkv_lib  # noqa: F401  (before triton: chooses the backend)
from pagedkv_lib import reference, runtime

# isort: split
import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import timer  # noqa: E402

from pagedkv_kernels import write  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CPU_TOKENS = (1, 16, 256, 2048)
GPU_TOKENS = (1, 16, 128, 1024, 8192, 32768)
INTERPRETER_NOTE = "interpreter timings, not GPU performance"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and PNG")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default: small on CPU, large on GPU)")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point on CPU (median)")
    return p.parse_args(argv)


def make_case(num_tokens, heads, head_dim, page_size, dtype, layout, gen):
    """A pool with 8 spare pages, K/V and a slot mapping over a shuffled page list."""
    dev = runtime.device()
    num_pages = -(-num_tokens // page_size) + 8
    inner = (page_size, heads) if layout == "NHD" else (heads, page_size)
    cache = torch.zeros((num_pages, 2, *inner, head_dim), dtype=dtype, device=dev)
    k, v = (torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype).to(dev) for _ in range(2))
    pages = torch.randperm(num_pages, generator=gen)
    t = torch.arange(num_tokens)
    slots = (pages[t // page_size] * page_size + t % page_size).to(dev)
    return cache, k, v, slots


def measure_point(n: int, args, time_it, gen) -> dict:
    """Check the kernel against the reference once, then time every method at ``n`` tokens."""
    dtype = DTYPES[args.dtype]
    cache, k, v, slots = make_case(n, args.heads, args.head_dim, args.page_size, dtype, args.layout, gen)
    nbytes = 2 * 2 * k.numel() * k.element_size()  # K and V, each read once and written once
    src = torch.randn(2 * k.numel(), generator=gen).to(dtype).to(cache.device)
    dst = torch.empty_like(src)
    want = cache.clone()
    reference.append_paged_kv(k, v, want, slots, args.layout)
    write.append_paged_kv(k, v, cache, slots, args.layout)
    assert torch.equal(cache, want), f"kernel and reference disagree at {n} tokens"

    plan = write.plan_append(k, v, cache, slots, args.layout)  # validated once, launched many times

    def launch_only():
        write.run_append(plan, k, v, cache)

    seconds = {
        "copy": time_it(lambda: dst.copy_(src)),
        "kernel": time_it(launch_only),
        "kernel+checks": time_it(lambda: write.append_paged_kv(k, v, cache, slots, args.layout)),
        "torch": time_it(lambda: reference.append_paged_kv(k, v, want, slots, args.layout)),
    }
    gbps = {m: nbytes / s / 1e9 for m, s in seconds.items()}
    print(
        f"{n:>6} tokens {nbytes / 1e6:9.3f} MB  "
        + "  ".join(f"{m} {s * 1e3:9.3f} ms ({gbps[m]:8.3f} GB/s)" for m, s in seconds.items())
    )
    return {
        "tokens": n,
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": gbps,
        "ratio_vs_copy": {m: gbps[m] / gbps["copy"] for m in seconds if m != "copy"},
    }


def measure(args) -> dict:
    tokens = args.tokens or (CPU_TOKENS if runtime.BACKEND.interpreted else GPU_TOKENS)
    time_it = timer(args.repeats)
    gen = torch.Generator().manual_seed(0)
    rows = [measure_point(n, args, time_it, gen) for n in tokens]
    return {
        "benchmark": "paged KV append (write kernel)",
        "backend": runtime.backend_line(),
        "interpreted": runtime.BACKEND.interpreted,
        "note": INTERPRETER_NOTE if runtime.BACKEND.interpreted else "compiled kernels, do_bench median",
        "machine": platform.platform(),
        "config": {
            "heads": args.heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": args.dtype,
            "layout": args.layout,
        },
        "bytes_formula": "2 (read + write) * 2 (K, V) * tokens * heads * head_dim * itemsize",
        "results": rows,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method in rows[0]["gb_per_s"]:
        ax.plot([r["tokens"] for r in rows], [r["gb_per_s"][method] for r in rows], marker="o", label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens appended")
    ax.set_ylabel("effective bandwidth (GB/s)")
    cfg = report["config"]
    title = f"Paged KV append, {cfg['heads']} heads x {cfg['head_dim']}, {cfg['dtype']}, page {cfg['page_size']}"
    if report["interpreted"]:
        title += f"\n({INTERPRETER_NOTE})"
    ax.set_title(title)
    ax.legend()
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
    (args.out / "bench_write.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out / "bench_write.png")
    print(f"wrote {args.out / 'bench_write.json'} and {args.out / 'bench_write.png'}")
    if runtime.BACKEND.interpreted:
        print(f"*** {INTERPRETER_NOTE} ***")


if __name__ == "__main__":
    main()

"""Decode attention: the paged kernel vs gather-then-attend vs contiguous-KV SDPA.

    python benchmarks/bench_decode.py --out benchmarks/results

For every (batch, seq_len) it times three routes to the same result

* ``paged``: :func:`kernels.paged_decode_attention` reads K/V straight from the pool;
* ``gather+sdpa``: :func:`kernels.gather_paged_kv` copies K/V out of the pool, then
  torch ``scaled_dot_product_attention`` reads the copy;
* ``contiguous sdpa``: SDPA on K/V that already sit contiguously (the no-paging baseline),

and, with ``--route``, the read side's other two routes on the same batch (timed from
plans validated beforehand, as the paged kernel):

* ``page pointers``: :func:`kernels.run_page_pointers`, the host-flattened page
  addresses of TensorRT-LLM's MMHA (one program per request and KV head, no splits);
* ``descriptors``: :func:`kernels.run_descriptors`, page tiles loaded through a TMA
  descriptor as XQA does (power-of-two page sizes and head dims);

    python benchmarks/bench_decode.py --route "page pointers" descriptors

It reports bytes moved (computed from the shapes, not measured), effective bandwidth
(bytes / time) and the time ratios within the run. Results go to
``<out>/bench_decode.json`` and ``<out>/bench_decode.png``.

On a machine without CUDA the kernels run in Triton's interpreter: the timings are
then interpreter timings (Python executing the kernel's operations), useful only to
see that everything runs; the bandwidth numbers mean nothing there and the JSON and
the plot say so.

The timed paged and gather calls launch plans (:func:`kernels.plan_decode`,
:func:`kernels.plan_gather`) validated once beforehand, so that the launchers' argument
checks (which copy the tables to the host) are not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedkv_lib import runtime  # noqa: E402  (chooses the backend before triton is imported)

# isort: split
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from timing import median_seconds  # noqa: E402

import pagedkv_kernels as kernels  # noqa: E402
from pagedkv_lib.memory import kv_dtype  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ROUTES = ("paged", "gather+sdpa", "contiguous sdpa")
READ_ROUTES = {  # --route: (plan, run) of the read side's other routes
    "page pointers": (kernels.plan_page_pointers, kernels.run_page_pointers),
    "descriptors": (kernels.plan_descriptors, kernels.run_descriptors),
}


# ----------------------------------------------------------------------------- bytes


def gather_bytes_per_step(
    batch: int, seq_len: int, num_kv_heads: int, head_dim: int, dtype: object = "bf16", num_layers: int = 1
) -> dict[str, int]:
    """Bytes one decode step moves through memory for K/V, per route (``num_layers``
    layers; queries and outputs are negligible and left out).

    * ``kv_bytes``: K and V of every token once, ``batch * seq_len * num_kv_heads * 2 *
      vector_bytes(head_dim)`` per layer: what the paged kernel and contiguous SDPA read;
    * ``gather_copy_bytes``: the gather alone reads the pool and writes the copy (2x);
    * ``gather_route_bytes``: the copy plus attention reading it again (3x).

    The seed numbers: batch 32, 128K tokens, 8 KV heads, head dim 128, bf16 gives
    ``kv_bytes`` 17.2 GB and ``gather_copy_bytes`` 34.4 GB per layer and step.
    """
    kv = num_layers * batch * seq_len * num_kv_heads * 2 * kv_dtype(dtype).vector_bytes(head_dim)
    return {"kv_bytes": kv, "gather_copy_bytes": 2 * kv, "gather_route_bytes": 3 * kv, "paged_bytes": kv}


def seed_numbers() -> dict:
    """The issue's example: batch 32, 128K-token sequences, 8 KV heads of 128, bf16."""
    shape = dict(batch=32, seq_len=128 * 1024, num_kv_heads=8, head_dim=128, dtype="bf16")
    b = gather_bytes_per_step(**shape)
    return {**shape, **b, "gather_copy_GB": b["gather_copy_bytes"] / 1e9, "kv_GB": b["kv_bytes"] / 1e9}


def route_bytes(batch, seq_len, num_kv_heads, group, head_dim, page_size, itemsize, num_splits) -> dict[str, int]:
    """Bytes each route moves for one call, from the shapes: K/V (once, or three times
    for the gather route), q and the output, the block table, and the split-KV
    partials (written by stage 1, read by the merge)."""
    kv = batch * seq_len * num_kv_heads * head_dim * 2 * itemsize
    qo = 2 * batch * num_kv_heads * group * head_dim * itemsize
    table = batch * math.ceil(seq_len / page_size) * 4
    partials = 0 if num_splits == 1 else 2 * batch * num_kv_heads * group * num_splits * (head_dim + 1) * 4
    pointers = batch * math.ceil(seq_len / page_size) * 2 * 8  # an int64 address for each page's K and V
    return {
        "paged": kv + qo + table + partials,
        "page pointers": kv + qo + pointers,
        "descriptors": kv + qo + table,
        "gather+sdpa": 3 * kv + qo + table,
        "contiguous sdpa": kv + qo,
        "kv": kv,
    }


# ----------------------------------------------------------------------------- timing


def bench_one(
    batch, seq_len, num_kv_heads, group, head_dim, page_size, dtype, layout, repeats, warmup, seed=0, read_routes=()
):
    device = runtime.device()
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = math.ceil(seq_len / page_size)
    num_pages = batch * pages_per_seq
    inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    cache = torch.randn((num_pages, 2, *inner, head_dim), generator=gen).to(dtype).to(device)
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(torch.int32).to(device)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn((batch, num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)

    # Checked once through the public entry points (and used as the correctness check).
    out_paged = kernels.paged_decode_attention(q, cache, table, lens, layout=layout)
    g = kernels.gather_paged_kv(cache, table, lens, layout=layout)
    plan = kernels.plan_decode(q, cache, table, lens, layout=layout)
    gather_plan = kernels.plan_gather(cache, table, lens, layout)

    # GQA without repeating K/V: the group's query heads are G query rows of one KV head.
    def sdpa(k, v):  # k, v [batch, Hk, L, D]
        return F.scaled_dot_product_attention(q.view(batch, num_kv_heads, group, head_dim), k, v)

    def as_bhld(x):
        return x.view(batch, seq_len, num_kv_heads, head_dim).transpose(1, 2)

    kc, vc = as_bhld(g.k).contiguous(), as_bhld(g.v).contiguous()
    out_contig = sdpa(kc, vc).reshape(batch, -1, head_dim)

    routes = {
        "paged": lambda: kernels.run_decode(plan, q, cache),
        "gather+sdpa": lambda: sdpa(*(as_bhld(t) for t in kernels.run_gather(gather_plan, cache)[:2])),
        "contiguous sdpa": lambda: sdpa(kc, vc),
    }
    errors = {}
    for name in read_routes:  # checked once against the paged kernel, then timed from a plan
        plan_route, run_route = READ_ROUTES[name]
        route_plan = plan_route(q, cache, table, lens, layout=layout)
        errors[name] = float((run_route(route_plan, q, cache).float() - out_paged.float()).abs().max())
        routes[name] = lambda run_route=run_route, route_plan=route_plan: run_route(route_plan, q, cache)
    seconds = {name: median_seconds(fn, repeats, warmup) for name, fn in routes.items()}
    nbytes = route_bytes(
        batch, seq_len, num_kv_heads, group, head_dim, page_size, cache.element_size(), plan.num_splits
    )
    return {
        "batch": batch,
        "seq_len": seq_len,
        "num_splits": plan.num_splits,
        "block_n": plan.block_n,
        "seconds": seconds,
        "bytes": {name: nbytes[name] for name in routes},
        "kv_bytes": nbytes["kv"],
        "effective_GBps": {name: nbytes[name] / seconds[name] / 1e9 for name in routes},
        "ratios": {
            "gather_route_over_paged": seconds["gather+sdpa"] / seconds["paged"],
            "paged_over_contiguous": seconds["paged"] / seconds["contiguous sdpa"],
            **{f"{name}_over_paged": seconds[name] / seconds["paged"] for name in read_routes},
        },
        "max_abs_err_paged_vs_contiguous": float((out_paged.float() - out_contig.float()).abs().max()),
        "max_abs_err_vs_paged": errors,
    }


# ----------------------------------------------------------------------------- report


def plot(results, meta, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4))
    batches = sorted({r["batch"] for r in results})
    colors = {"paged": "C0", "gather+sdpa": "C1", "contiguous sdpa": "C2", "page pointers": "C3", "descriptors": "C4"}
    lines = ["-o", "--s", ":^", "-.v", "-D", "--x"]
    for i, b in enumerate(batches):
        rows = [r for r in results if r["batch"] == b]
        lens = [r["seq_len"] for r in rows]
        style = lines[i % len(lines)]
        for name in rows[0]["seconds"]:  # colour: route; line: batch
            bw = [r["effective_GBps"][name] for r in rows]
            ax_bw.plot(lens, bw, style, color=colors[name], label=f"{name}, batch {b}")
        ax_ratio.plot(lens, [r["ratios"]["gather_route_over_paged"] for r in rows], style, label=f"batch {b}")
    where = "Triton interpreter on CPU: interpreter timings" if meta["interpreted"] else meta["device"]
    for ax in (ax_bw, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seq_len (tokens)")
        ax.legend(fontsize=6)
    ax_bw.set_yscale("log")
    ax_bw.set_ylabel("effective bandwidth (GB/s, bytes from shapes / time)")
    ax_bw.set_title(f"Decode attention bandwidth\n({where})", fontsize=9)
    ax_ratio.axhline(1.0, color="grey", lw=0.5)
    ax_ratio.set_ylabel("time(gather + SDPA) / time(paged kernel)")
    ax_ratio.set_title("Gathering costs (ratio, same run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    gpu = not runtime.BACKEND.interpreted
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32] if gpu else [1, 4])
    p.add_argument("--seq-len", type=int, nargs="+", default=[1024, 4096, 16384, 65536] if gpu else [64, 256, 1024])
    p.add_argument("--num-kv-heads", type=int, default=8 if gpu else 2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    p.add_argument("--repeats", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument(
        "--route", nargs="*", default=[], choices=sorted(READ_ROUTES),
        help="also time the read side's other routes (page-pointer and TMA-descriptor decode)",
    )  # fmt: skip
    args = p.parse_args(argv)

    meta = {
        "backend": runtime.backend_line(),
        "interpreted": runtime.BACKEND.interpreted,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "note": (
            "compiled kernels; times are medians of CUDA-event timings"
            if gpu
            else "Triton interpreter on CPU: the paged kernel and the gather are interpreter timings (Python "
            "executing the kernels' operations) while SDPA is native torch, so neither the bandwidths nor the "
            "ratios say anything about a GPU; run on CUDA for those"
        ),
        "bytes_note": "bytes are computed from shapes: the paged kernel and contiguous SDPA read K/V once, "
        "the gather route reads the pool, writes the copy and reads it again (3x)",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seed_numbers": seed_numbers(),
    }
    results = []
    for batch in args.batch:
        for seq_len in args.seq_len:
            r = bench_one(
                batch,
                seq_len,
                args.num_kv_heads,
                args.group,
                args.head_dim,
                args.page_size,
                DTYPES[args.dtype],
                args.layout,
                args.repeats,
                args.warmup,
                read_routes=tuple(dict.fromkeys(args.route)),
            )
            results.append(r)
            ms = "  ".join(f"{n} {t * 1e3:9.3f} ms" for n, t in r["seconds"].items())
            print(
                f"batch {batch:3d} seq_len {seq_len:6d} splits {r['num_splits']:3d}: {ms}  "
                f"gather/paged {r['ratios']['gather_route_over_paged']:.2f}x"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_decode.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    plot(results, meta, args.out / "bench_decode.png")
    print(meta["note"])
    print(f"wrote {args.out / 'bench_decode.json'} and {args.out / 'bench_decode.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

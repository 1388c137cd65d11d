"""Chunked prefill attention: the paged prefill kernel against SDPA on contiguous K/V.

    python benchmarks/bench_prefill.py --out benchmarks/results

For every (past, chunk) shape a batch of requests each holds ``past`` cached tokens
and ``chunk`` new ones (``seq_len = past + chunk``; all written beforehand), and the
chunk's queries attend causally, aligned bottom-right. Two routes to the same result:

* ``paged``: :func:`kernels.run_prefill` on a plan made once (the launcher's argument
  checks, which copy the tables to the host, are not timed);
* ``sdpa``: torch ``scaled_dot_product_attention`` on K/V already gathered into
  contiguous ``[batch, num_kv_heads, seq_len, head_dim]`` tensors (the gather is not
  timed: this is the no-paging baseline), with a lower-right causal mask.

On a GPU the script reports, in the same run, the time of each route, TFLOP/s (from
the exact count of visible (query, key) pairs: ``4 * num_q_heads * head_dim`` flops
each, QK^T and PV) and the ratio ``time(paged) / time(sdpa)``. Without CUDA the
kernel runs in Triton's interpreter: only the kernel's interpreter time is reported
(SDPA would run natively, so a ratio would mean nothing). Results go to
``<out>/bench_prefill.json`` and ``<out>/bench_prefill.png``.
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

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def visible_pairs(batch: int, past: int, chunk: int) -> int:
    """(query, key) pairs a causal chunk attends to: ``chunk * past + chunk (chunk + 1) / 2``
    per request."""
    return batch * (chunk * past + chunk * (chunk + 1) // 2)


def sdpa_route(q, k, v, group: int, chunk: int, seq_len: int):
    """A callable running SDPA on contiguous ``k, v [batch, Hk, seq_len, D]`` for ``q
    [batch, Hq, chunk, D]``, causal aligned bottom-right. GQA through ``enable_gqa``
    where this torch has it, else by repeating K/V once, outside the timed call."""
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(chunk, seq_len)
    try:
        F.scaled_dot_product_attention(q[:, :, :1], k, v, attn_mask=causal_lower_right(1, seq_len), enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    except (TypeError, RuntimeError):
        k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)


def bench_one(batch, past, chunk, num_kv_heads, group, head_dim, page_size, dtype, layout, repeats, warmup, seed=0):
    device = runtime.device()
    gen = torch.Generator().manual_seed(seed)
    seq_len = past + chunk
    pages_per_seq = math.ceil(seq_len / page_size)
    num_pages = batch * pages_per_seq
    inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
    cache = torch.randn((num_pages, 2, *inner, head_dim), generator=gen).to(dtype).to(device)
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).to(torch.int32).to(device)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    qo = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device=device)
    q = torch.randn((batch * chunk, num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)

    plan = kernels.plan_prefill(q, cache, qo, table, lens, layout=layout)
    out = kernels.run_prefill(plan, q, cache)
    pairs = visible_pairs(batch, past, chunk)
    flops = 4 * num_kv_heads * group * head_dim * pairs
    result = {"batch": batch, "past": past, "chunk": chunk, "seq_len": seq_len, "visible_pairs": pairs,
              "flops": flops, "plan": {"block_m": plan.block_m, "block_n": plan.block_n, "num_tiles": plan.num_tiles,
                                       "dot_mode": plan.dot_mode, "visited_pairs": plan.visited_pairs}}  # fmt: skip
    seconds = {"paged": median_seconds(lambda: kernels.run_prefill(plan, q, cache), repeats, warmup)}
    if not runtime.BACKEND.interpreted:
        g = kernels.gather_paged_kv(cache, table, lens, layout=layout)

        def as_bhld(x):
            return x.view(batch, seq_len, num_kv_heads, head_dim).transpose(1, 2).contiguous()

        q_bhld = q.view(batch, chunk, num_kv_heads * group, head_dim).transpose(1, 2).contiguous()
        sdpa = sdpa_route(q_bhld, as_bhld(g.k), as_bhld(g.v), group, chunk, seq_len)
        ref = sdpa().transpose(1, 2).reshape(out.shape)
        seconds["sdpa"] = median_seconds(sdpa, repeats, warmup)
        result["tflops"] = {name: flops / s / 1e12 for name, s in seconds.items()}
        result["paged_over_sdpa"] = seconds["paged"] / seconds["sdpa"]
        result["max_abs_err_paged_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
    result["seconds"] = seconds
    return result


def plot(results, meta, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = sorted({r["chunk"] for r in results})
    if meta["interpreted"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in chunks:
            rows = [r for r in results if r["chunk"] == c]
            ax.plot([r["past"] for r in rows], [r["seconds"]["paged"] for r in rows], "-o", label=f"chunk {c}")
        ax.set(xlabel="cached tokens before the chunk (past)", ylabel="interpreter time (s)")
        ax.set_title("Paged prefill in Triton's interpreter on CPU (no GPU numbers)", fontsize=9)
        ax.legend(fontsize=7)
    else:
        fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(10, 4))
        for i, c in enumerate(chunks):
            rows = [r for r in results if r["chunk"] == c]
            x = [r["past"] for r in rows]
            ax_t.plot(x, [r["tflops"]["paged"] for r in rows], "-o", color=f"C{i}", label=f"paged, chunk {c}")
            ax_t.plot(x, [r["tflops"]["sdpa"] for r in rows], "--s", color=f"C{i}", label=f"SDPA, chunk {c}")
            ax_r.plot(x, [r["paged_over_sdpa"] for r in rows], "-o", color=f"C{i}", label=f"chunk {c}")
        ax_t.set(xlabel="cached tokens before the chunk (past)", ylabel="TFLOP/s (visible pairs x 4 Hq D / time)")
        ax_t.set_title(f"Chunked prefill throughput ({meta['device']})", fontsize=9)
        ax_r.axhline(1.0, color="grey", lw=0.5)
        ax_r.set(xlabel="cached tokens before the chunk (past)", ylabel="time(paged) / time(SDPA, contiguous)")
        ax_r.set_title("Paged kernel vs SDPA on gathered K/V (same run)", fontsize=9)
        for ax in (ax_t, ax_r):
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    gpu = not runtime.BACKEND.interpreted
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--batch", type=int, default=4 if gpu else 1)
    p.add_argument("--past", type=int, nargs="+", default=[0, 2048, 8192] if gpu else [0, 64, 192])
    p.add_argument("--chunk", type=int, nargs="+", default=[512, 2048] if gpu else [16, 64])
    p.add_argument("--num-kv-heads", type=int, default=8 if gpu else 2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--layout", choices=("NHD", "HND"), default="NHD")
    p.add_argument("--repeats", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    args = p.parse_args(argv)

    meta = {
        "backend": runtime.backend_line(),
        "interpreted": runtime.BACKEND.interpreted,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "note": (
            "compiled kernels; times are medians of CUDA-event timings; SDPA runs on K/V gathered beforehand"
            if gpu
            else "Triton interpreter on CPU: interpreter times of the paged kernel only (Python executing the "
            "kernel's operations); no TFLOP/s and no ratio against SDPA, which would run natively"
        ),
        "flops_note": "flops = 4 * num_q_heads * head_dim * visible (query, key) pairs, from the shapes",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    results = []
    for chunk in args.chunk:
        for past in args.past:
            r = bench_one(args.batch, past, chunk, args.num_kv_heads, args.group, args.head_dim, args.page_size,
                          DTYPES[args.dtype], args.layout, args.repeats, args.warmup)  # fmt: skip
            results.append(r)
            line = f"chunk {chunk:5d} after {past:6d}: paged {r['seconds']['paged'] * 1e3:9.3f} ms"
            if gpu:
                line += (
                    f" ({r['tflops']['paged']:.1f} TFLOP/s), SDPA {r['seconds']['sdpa'] * 1e3:9.3f} ms "
                    f"({r['tflops']['sdpa']:.1f} TFLOP/s), paged/SDPA {r['paged_over_sdpa']:.2f}x, "
                    f"max |paged - SDPA| {r['max_abs_err_paged_vs_sdpa']:.1e}"
                )
            print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefill.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    plot(results, meta, args.out / "bench_prefill.png")
    print(meta["note"])
    print(f"wrote {args.out / 'bench_prefill.json'} and {args.out / 'bench_prefill.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

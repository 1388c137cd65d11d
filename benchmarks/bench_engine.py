"""Tokens per second of pagedkv_engine against transformers' generate, same prompts, same run.

    python benchmarks/bench_engine.py --out benchmarks/results [--attention torch|triton] [--tokens 32]

The prompts are those of the standard batch (:func:`pagedkv_engine.check.standard_batch`,
seven requests, one with two samples: eight sequences). Three measurements, one process,
one torch thread count:

* ``engine, standard pool``: the batch as the tests serve it (arrivals spread over
  steps, a pool small enough to preempt);
* ``engine, roomy pool``: every request submitted at step 0, a pool of 256 pages (no
  preemption), a 256-token step budget;
* ``transformers``: ``generate(do_sample=False)`` one prompt at a time (the second
  sample of the fork: prompt plus its forced first token), as the oracle runs it.

Every engine run is also checked against transformers (the report says PASS/FAIL).
Also writes the memory comparison of the standard run (``--memory``: bytes reserved,
used and wasted by a ``torch.cat`` cache, a contiguous buffer and the paged pool).
Writes ``bench_engine.json``. Generation stops at EOS, so a few sequences may
generate fewer than ``--tokens`` tokens; rates count tokens actually generated.
"""

from __future__ import annotations

import pagedkv_lib  # noqa: F401  (before triton: chooses the backend)
from pagedkv_lib import runtime

# isort: split
import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from timing import timed

from pagedkv_engine import Engine, weights
from pagedkv_engine import check as oracle
from pagedkv_engine.memory import compare_caches, summary_rows


def run_engine(loaded, attention, tokens, arrivals, **settings):
    engine = Engine(loaded.model, attention, record_logits=True, **settings)
    _, wall = timed(lambda: engine.run(arrivals))
    return engine, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--attention", choices=("torch", "triton"), default="torch")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_start = time.perf_counter()
    loaded = weights.load()
    rows, references = {}, {}
    print(f"{runtime.backend_line()}; torch threads {torch.get_num_threads()}; load {loaded.seconds:.1f} s wall")

    standard = oracle.standard_batch(loaded.tokenizer, args.tokens)
    engine, wall = run_engine(loaded, args.attention, args.tokens, standard, **oracle.standard_engine_args(args.tokens))
    report = oracle.check_engine(engine, loaded.model, references=references)
    rows["engine, standard pool"] = dict(
        tokens=engine.stats.generated_tokens,
        seconds=wall,
        steps=engine.stats.steps,
        preemptions=engine.stats.preemptions,
        check="PASS" if report.ok else "FAIL",
        max_logit_diff=report.max_diff,
    )
    rows["transformers"] = dict(
        tokens=report.hf_tokens, seconds=report.hf_seconds, note="generate, one prompt at a time"
    )
    series = compare_caches(engine)
    memory = {
        name: dict(
            peak_reserved=s.peak_reserved, peak_used=max(s.used), waste_fraction=s.waste_fraction, copied=s.copied
        )
        for name, s in series.items()
    }
    memory_lines = summary_rows(series, sum(pool.nbytes for pool in engine.pools))

    at_once = {0: [r for reqs in standard.values() for r in reqs]}
    engine, wall = run_engine(
        loaded, args.attention, args.tokens, at_once, num_pages=256, page_size=16, max_num_batched_tokens=256
    )
    report = oracle.check_engine(engine, loaded.model, references=references)
    rows["engine, roomy pool"] = dict(
        tokens=engine.stats.generated_tokens,
        seconds=wall,
        steps=engine.stats.steps,
        preemptions=engine.stats.preemptions,
        check="PASS" if report.ok else "FAIL",
        max_logit_diff=report.max_diff,
    )
    for name, row in rows.items():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        extra = f"  ({row['check']}, {row['preemptions']} preemptions)" if "check" in row else ""
        rate = f"{row['tokens']:4d} tokens in {row['seconds']:6.1f} s wall = {row['tokens_per_s']:5.1f} tokens/s"
        print(f"{name:>22}: {rate}{extra}")
    print("\n".join(memory_lines))
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(
        backend=runtime.backend_line(),
        attention=args.attention,
        max_new_tokens=args.tokens,
        torch_threads=torch.get_num_threads(),
        load_average=os.getloadavg(),
        machine=platform.platform(),
        total_seconds=time.perf_counter() - load_start,
        throughput=rows,
        memory_bytes=memory,
    )
    (args.out / "bench_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_engine.json'}")


if __name__ == "__main__":
    main()

"""Tokens per second of pagedkv_engine against transformers' generate, same prompts, same run.

    python benchmarks/bench_engine.py --out benchmarks/results [--attention torch|triton|reference]
        [--tokens 32] [--threads 1] [--repeats 3] [--profile 15] [--speculative 4] [--lock-turns 5]

The prompts are those of the standard batch (:func:`pagedkv_engine.check.standard_batch`,
seven requests, one with two samples: eight sequences). One process, one torch thread
count, these rows:

* ``engine, standard pool``: the batch as the tests serve it (arrivals spread over
  steps, a pool small enough to preempt), checked against transformers;
* ``engine, roomy pool``: the same eight sequences submitted at step 0, a pool of 256
  pages (no preemption), a 256-token step budget, checked against transformers;
* ``engine, same work`` and ``transformers, batched``: the comparison of like with
  like. The seven prompts, one sample each, exactly ``--tokens`` new tokens each
  (the engine with ``ignore_eos``, ``generate`` with ``min_new_tokens``, so both
  generate ``7 x tokens`` tokens and neither stops at EOS; after an EOS the two
  continue differently, at the same cost). The engine takes every request at step 0
  with the roomy pool (prefill in 256-token steps, then one decode step per token
  for all seven); ``generate(do_sample=False)`` takes one left-padded batch with its
  attention mask (its prefill computes the padding too). The two are run in turns,
  ``--repeats`` times each (engine, transformers, engine, ...; after one untimed
  engine run), and the table gives the medians and the median of the per-turn
  ratios, so a busy machine slows both;
* ``engine, repetitive`` and ``engine, repetitive, speculative N`` (``--speculative``,
  default 4; 0 leaves them out): the two prompts of
  :func:`pagedkv_engine.check.repetitive_batch`, which the model copies, served
  without and with prompt-lookup drafts (default pool), checked against transformers;
  the second row adds the drafts' acceptance rate and forwards per generated token;
* ``transformers, one prompt at a time``: ``generate(do_sample=False)`` per sequence
  (the second sample of the fork: prompt plus its forced first token), as the oracle
  runs it (its time from the checks above).

``--lock-turns N`` (default 5; 0 leaves it out) adds what the block manager's lock
(:mod:`pagedkv_lib.locking`) costs the single-threaded engine: the same-work run with
the correct manager and with the fault ``no_lock``'s (a lock that excludes nobody), in
``N`` turns, their median step times and the median of the per-turn ratios; and, as a
bound that no timing noise blurs, the lock round trips one run takes per step times
what :func:`~pagedkv_lib.locking.locked` adds to a method call (measured: a locked
call's time minus a plain call's) over the step time.

``--profile N`` prints the top ``N`` Python functions (cProfile) and torch operators
(torch profiler), by own time, of one more same-work engine run each. The report ends
with this machine's limit for the same-work schedule (:func:`matmul_replays`, timed
in the same turns): the model's matrix products alone, step by step, with the
engine's shapes and weight layout, and their FLOPs over a large square matmul's rate. Also writes the
memory comparison of the standard run (bytes reserved, used and wasted by a
``torch.cat`` cache, a contiguous buffer and the paged pool). Writes
``bench_engine.json``. Rates count tokens actually generated.
"""

from __future__ import annotations

import pagedkv_lib  # noqa: F401  (before triton: chooses the backend)
from pagedkv_lib import runtime

# isort: split
import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import timed

from pagedkv_engine import Engine, SamplingParams, weights
from pagedkv_engine import check as oracle
from pagedkv_engine.memory import compare_caches, summary_rows
from pagedkv_engine.model import PROJECTIONS, row_major_weights
from pagedkv_engine.parts import EngineParts
from pagedkv_lab import faults
from pagedkv_lib.locking import locked
from pagedkv_lib.manager import KVCacheManager

ROOMY = dict(num_pages=256, page_size=16, max_num_batched_tokens=256)


def run_engine(loaded, attention, arrivals, **settings):
    engine = Engine(loaded.model, attention, record_logits=True, **settings)
    _, wall = timed(lambda: engine.run(arrivals))
    return engine, wall


def checked_row(engine, wall, loaded, references) -> dict:
    """A table row for an engine run, with its check against transformers."""
    report = oracle.check_engine(engine, loaded.model, references=references)
    row = dict(
        tokens=engine.stats.generated_tokens,
        seconds=wall,
        steps=engine.stats.steps,
        preemptions=engine.stats.preemptions,
        check="PASS" if report.ok else "FAIL",
        max_logit_diff=report.max_diff,
    )
    return row, report


def speculative_rows(loaded, attention, tokens: int, drafts: int, references: dict) -> dict:
    """The rows ``engine, repetitive`` (no drafts) and ``engine, repetitive, speculative
    <drafts>``: the repetitive batch, ``tokens`` new tokens each, checked."""
    rows = {}
    for n in (0, drafts):
        arrivals = oracle.repetitive_batch(loaded.tokenizer, tokens)
        engine, wall = run_engine(loaded, attention, arrivals, speculative=n)
        name = "engine, repetitive" + (f", speculative {n}" if n else "")
        rows[name], _ = checked_row(engine, wall, loaded, references)
        if n:
            s = engine.stats
            rows[name].update(acceptance_rate=s.acceptance_rate, forwards_per_token=s.forwards_per_token)
    return rows


def same_work_prompts(standard: dict) -> list[list[int]]:
    """The standard batch's seven prompts, in arrival order."""
    return [prompt for reqs in standard.values() for prompt, _ in reqs]


def same_work(loaded, attention, prompts, tokens, parts=None) -> tuple[Engine, dict]:
    """An engine with the roomy pool and its arrivals: every prompt at step 0, exactly
    ``tokens`` new tokens each (``ignore_eos``)."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    return Engine(loaded.model, attention, parts=parts, **ROOMY), {0: [(p, params) for p in prompts]}


def engine_same_work(loaded, attention, prompts, tokens, parts=None) -> tuple[Engine, float]:
    """:func:`same_work`, served; returns the engine and the seconds ``run`` took."""
    engine, arrivals = same_work(loaded, attention, prompts, tokens, parts)
    _, wall = timed(lambda: engine.run(arrivals))
    assert engine.stats.generated_tokens == len(prompts) * tokens, "the engine stopped early"
    return engine, wall


@torch.inference_mode()
def generate_batched(loaded, prompts, tokens) -> tuple[int, float]:
    """``generate`` over one left-padded batch of ``prompts``, exactly ``tokens`` new
    tokens each; returns ``(tokens generated, seconds)``."""
    pad = loaded.model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out, wall = timed(
        lambda: loaded.model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
    )
    new = out.shape[1] - width
    assert new == tokens, f"generate made {new} new tokens, not {tokens}"
    return len(prompts) * new, wall


def in_turns(loaded, attention, prompts, tokens, repeats) -> dict:
    """Engine, batched ``generate`` and the matmul replays of :func:`matmul_replays`, in
    turns, after one untimed engine run (which gives the schedule the replays follow);
    medians of tokens/s and of the per-turn ratios."""
    warm, _ = engine_same_work(loaded, attention, prompts, tokens)
    schedule = step_shapes(warm)
    replays, flops = matmul_replays(loaded.model, schedule)
    runs = {name: [] for name in ("engine", "generate", *replays)}
    for _ in range(repeats):
        runs["engine"].append(engine_same_work(loaded, attention, prompts, tokens)[1])
        runs["generate"].append(generate_batched(loaded, prompts, tokens)[1])
        for name, replay in replays.items():
            runs[name].append(timed(replay)[1])
    n = len(prompts) * tokens
    seconds = {name: statistics.median(times) for name, times in runs.items()}
    return {
        "engine, same work": dict(
            tokens=n, seconds=seconds["engine"], steps=warm.stats.steps, rates=[n / t for t in runs["engine"]]
        ),
        "transformers, batched": dict(
            tokens=n,
            seconds=seconds["generate"],
            note="generate, left-padded batch",
            rates=[n / t for t in runs["generate"]],
        ),
        "ratio": dict(
            median=statistics.median(g / e for e, g in zip(runs["engine"], runs["generate"])),
            each=[g / e for e, g in zip(runs["engine"], runs["generate"])],
        ),
        "limit": dict(
            steps=len(schedule),
            flops=flops,
            seconds=seconds,
            engine_over_matmuls=statistics.median(e / m for e, m in zip(runs["engine"], runs["matmuls"])),
            gemm_flops_per_s=2 * 1024**3 / seconds["gemm 1024^3"],
        ),
    }


class CountingLock:
    """An RLock that counts its acquisitions (how many lock round trips a run makes)."""

    count = 0

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        CountingLock.count += 1
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CountingManager(KVCacheManager):
    lock_type = CountingLock


class _Probe:
    """A method plain and the same method under :func:`pagedkv_lib.locking.locked`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def plain(self) -> None:
        return None

    held = locked(plain)


def round_trip_seconds(n: int = 200_000) -> float:
    """What :func:`~pagedkv_lib.locking.locked` adds to one method call (the wrapper and
    an RLock round trip): seconds, the median of five loops of ``n`` calls each way."""
    probe = _Probe()

    def loop(call) -> float:
        start = time.perf_counter()
        for _ in range(n):
            call()
        return time.perf_counter() - start

    return statistics.median(loop(probe.held) - loop(probe.plain) for _ in range(5)) / n


def lock_rows(loaded, attention, prompts, tokens, turns: int) -> dict:
    """The rows ``engine, same work, lock`` and ``engine, same work, no lock`` and the
    lock's cost (module docstring, ``--lock-turns``)."""
    no_lock = faults.faults_of("concurrency")["no_lock"]
    parts = {"lock": None, "no lock": EngineParts(manager=no_lock.part("manager"))}
    CountingLock.count = 0
    counted, _ = engine_same_work(loaded, attention, prompts, tokens, EngineParts(manager=CountingManager))
    per_step = CountingLock.count / counted.stats.steps
    runs = {name: [] for name in parts}
    for _ in range(turns):
        for name, p in parts.items():
            engine, wall = engine_same_work(loaded, attention, prompts, tokens, p)
            runs[name].append(wall / engine.stats.steps)
    step = {name: statistics.median(times) for name, times in runs.items()}
    trip = round_trip_seconds()
    rows = {f"engine, same work, {name}": dict(step_seconds=step[name], steps_each=[*runs[name]]) for name in parts}
    rows["lock cost"] = dict(
        median_ratio=statistics.median(a / b for a, b in zip(runs["lock"], runs["no lock"])),
        acquisitions_per_step=per_step,
        round_trip_seconds=trip,
        bound_fraction=per_step * trip / step["lock"],
    )
    return rows


def lock_line(cost: dict) -> str:
    return (
        f"the manager's lock: step time with / without {cost['median_ratio']:.3f}x (median of turns); "
        f"{cost['acquisitions_per_step']:.0f} acquisitions per step x {1e9 * cost['round_trip_seconds']:.0f} ns "
        f"= {100 * cost['bound_fraction']:.3f} % of a step"
    )


def step_shapes(engine: Engine) -> list[tuple[int, int]]:
    """``(tokens, sampled rows)`` of every step the engine ran: the rows of its matrix
    products and of its LM head (one per token generated in that step)."""
    sampled = Counter(step for seq in engine.sequences.values() for step in seq.token_steps)
    return [(r.num_prefill_tokens + r.num_decode_tokens, sampled[r.step]) for r in engine.history]


def profile_lines(loaded, attention, prompts, tokens, top: int) -> list[str]:
    """The ``top`` entries by own time of one same-work ``Engine.run`` (the engine is
    built before): cProfile's Python functions, then the torch profiler's operators
    (``x @ w`` is ``aten::mm``, which cProfile counts inside ``forward``)."""
    engine, arrivals = same_work(loaded, attention, prompts, tokens)
    prof = cProfile.Profile()
    prof.enable()
    engine.run(arrivals)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    engine, arrivals = same_work(loaded, attention, prompts, tokens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ops:
        engine.run(arrivals)
    table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return [line for line in (out.getvalue() + table).splitlines() if line.strip()]


@torch.inference_mode()
def matmul_replays(hf_model, schedule: list[tuple[int, int]]) -> tuple[dict, int]:
    """``({name: replay}, flops)``: this CPU's limit for ``schedule`` (``(tokens, sampled
    rows)`` per step, see :func:`step_shapes`), to be timed in turns with the engine:

    * ``matmuls``: every step's matrix products alone (the
      :data:`~pagedkv_engine.model.PROJECTIONS` of every layer over the step's
      tokens; the LM head over its sampled rows) with the engine's row-major ``[in,
      out]`` weights (:func:`pagedkv_engine.model.row_major_weights`); nothing else a
      step does (attention, norms, RoPE, sampling, Python) is in it;
    * ``matmuls, F.linear``: the same through ``F.linear`` on transformers' ``[out, in]``
      tensors (what ``generate`` runs);
    * ``gemm 1024^3``: one 1024 x 1024 x 1024 fp32 matmul, for the FLOP rate.

    ``flops`` counts the replays' multiply-adds x 2: at the 1024^3 rate they would take
    ``flops / rate`` seconds, the compute bound."""
    layers, lm_head_t = row_major_weights(hf_model, "cpu")
    row_major = [w for layer in layers for w in layer.values()]
    out_in = [layer.get_submodule(path).weight for layer in hf_model.model.layers for path in PROJECTIONS.values()]
    lm_head = hf_model.lm_head.weight
    inputs = {width: torch.ones(max(t for t, _ in schedule), width) for width in {w.shape[0] for w in row_major}}
    hidden, square = lm_head.shape[1], torch.ones(1024, 1024)

    @torch.inference_mode()
    def row_major_products() -> None:
        for tokens, sampled in schedule:
            for w in row_major:
                inputs[w.shape[0]][:tokens] @ w
            inputs[hidden][:sampled] @ lm_head_t

    @torch.inference_mode()
    def linear_products() -> None:
        for tokens, sampled in schedule:
            for w in out_in:
                F.linear(inputs[w.shape[1]][:tokens], w)
            F.linear(inputs[hidden][:sampled], lm_head)

    per_token = sum(w.numel() for w in out_in)
    flops = sum(2 * tokens * per_token + 2 * sampled * lm_head.numel() for tokens, sampled in schedule)
    replays = {
        "matmuls": row_major_products,
        "matmuls, F.linear": linear_products,
        "gemm 1024^3": lambda: square @ square,
    }
    return replays, flops


def table_lines(rows: dict) -> list[str]:
    """One line per row (adding its ``tokens_per_s``): tokens, seconds, rate, and the
    check or the turns' rates."""
    lines = []
    for name, row in rows.items():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        extra = f"  ({row['check']}, {row['preemptions']} preemptions)" if "check" in row else ""
        if "forwards_per_token" in row:
            rate, per_token = row["acceptance_rate"], row["forwards_per_token"]
            extra = extra[:-1] + f", {rate:.0%} of drafts accepted, {per_token:.2f} forwards per token)"
        if "rates" in row:
            extra = f"  (median of {len(row['rates'])}: " + ", ".join(f"{r:.1f}" for r in row["rates"]) + ")"
        rate = f"{row['tokens']:4d} tokens in {row['seconds']:6.1f} s wall = {row['tokens_per_s']:5.1f} tokens/s"
        lines.append(f"{name:>34}: {rate}{extra}")
    return lines


def limit_line(limit: dict, tokens: int) -> str:
    """The limit of :func:`in_turns` in words (adding its rates for ``tokens`` tokens)."""
    took = limit["seconds"]
    limit["tokens_per_s_matmuls"] = tokens / took["matmuls"]
    limit["tokens_per_s_gemm_rate"] = tokens * limit["gemm_flops_per_s"] / limit["flops"]
    return (
        f"limit of the same-work schedule ({limit['steps']} steps, in the same turns): its matmuls alone "
        f"{took['matmuls']:.2f} s = {limit['tokens_per_s_matmuls']:.1f} tokens/s "
        f"(through F.linear {took['matmuls, F.linear']:.2f} s); "
        f"the engine takes {limit['engine_over_matmuls']:.2f}x its matmuls' time; {limit['flops'] / 1e9:.0f} GFLOP "
        f"at the 1024^3 matmul's {limit['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s = "
        f"{limit['tokens_per_s_gemm_rate']:.1f} tokens/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--attention", choices=("torch", "triton", "reference"), default="torch")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="turns of engine vs batched generate (default 3)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N of an engine run")
    p.add_argument("--speculative", type=int, default=4, metavar="N", help="drafts per step of the repetitive rows")
    p.add_argument("--lock-turns", type=int, default=5, metavar="N", help="turns of the lock's cost (0: none)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_start = time.perf_counter()
    loaded = weights.load()
    rows, references = {}, {}
    print(f"{runtime.backend_line()}; torch threads {torch.get_num_threads()}; load {loaded.seconds:.1f} s wall")

    standard = oracle.standard_batch(loaded.tokenizer, args.tokens)
    engine, wall = run_engine(loaded, args.attention, standard, **oracle.standard_engine_args(args.tokens))
    rows["engine, standard pool"], report = checked_row(engine, wall, loaded, references)
    series = compare_caches(engine)
    memory = {
        name: dict(
            peak_reserved=s.peak_reserved, peak_used=max(s.used), waste_fraction=s.waste_fraction, copied=s.copied
        )
        for name, s in series.items()
    }
    memory_lines = summary_rows(series, sum(pool.nbytes for pool in engine.pools))

    at_once = {0: [r for reqs in standard.values() for r in reqs]}
    engine, wall = run_engine(loaded, args.attention, at_once, **ROOMY)
    rows["engine, roomy pool"], _ = checked_row(engine, wall, loaded, references)

    prompts = same_work_prompts(standard)
    turns = in_turns(loaded, args.attention, prompts, args.tokens, args.repeats)
    rows["engine, same work"] = turns["engine, same work"]
    rows["transformers, batched"] = turns["transformers, batched"]
    # The oracle ran generate for every sequence during the first check (the second reused it).
    rows["transformers, one prompt at a time"] = dict(tokens=report.hf_tokens, seconds=report.hf_seconds)
    if args.speculative:
        rows |= speculative_rows(loaded, args.attention, args.tokens, args.speculative, references)
    locks = lock_rows(loaded, args.attention, prompts, args.tokens, args.lock_turns) if args.lock_turns else {}
    print("\n".join(table_lines(rows)))
    ratio, limit = turns["ratio"], turns["limit"]
    print(
        f"engine / batched generate, same work: {ratio['median']:.2f}x "
        f"(median of {', '.join(f'{r:.2f}' for r in ratio['each'])})"
    )
    print(limit_line(limit, rows["engine, same work"]["tokens"]))
    print("\n".join(memory_lines))
    if locks:
        print(lock_line(locks["lock cost"]))
    profile = profile_lines(loaded, args.attention, prompts, args.tokens, args.profile) if args.profile else []
    print("\n".join(profile))
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
        engine_over_batched_generate=ratio,
        limit=limit,
        memory_bytes=memory,
        lock=locks,
        profile=profile,
    )
    (args.out / "bench_engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'bench_engine.json'}")


if __name__ == "__main__":
    main()

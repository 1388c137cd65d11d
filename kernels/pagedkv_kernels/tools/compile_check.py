"""``python -m pagedkv_kernels.tools.compile_check``: compile every kernel the suite launches for real GPUs.

No GPU is needed. Two steps, each in its own processes:

1. **record** (:mod:`pagedkv_kernels.tools.launch_record`): run the verify grid, notebooks 06 and 07,
   the exercise solutions, the benchmarks' default shapes and the engine-convention
   kernels in Triton's interpreter
   with GPU plans (``PAGEDKV_PLAN=gpu``), keeping every distinct specialization a GPU
   would compile;
2. **compile** (:mod:`pagedkv_kernels.tools.gpu_compile`): compile each one with ``triton.compile``
   for ``GPUTarget("cuda", arch, 32)``, for every arch of ``--arch`` (default sm_80 and
   sm_90), and one specialization per kernel and dtype family for each arch of
   ``--sample`` (default sm_75, a T4, and sm_89, an L4).

It fails (exit 1) on any compile error, on a kernel of :data:`TMA_KERNELS` whose build
for sm_90 or newer holds no TMA copy (``cp.async.bulk.tensor`` in its PTX: the
descriptor decode would then have fallen back to ordinary loads), and, on the
``--arch`` targets, on any spill or a kernel at 255 registers (the budget of :mod:`pagedkv_kernels.host.tiles`; the one
measured spill that is not register pressure is listed there,
:data:`pagedkv_kernels.host.tiles.PTXAS_SPILL_QUIRKS`). It prints a table per
kernel (specializations, archs, registers, spill bytes, shared memory, from Triton's
bundled ``ptxas -v``) and writes it with every result to ``--out``
(``build/compile_check/``: ``table.md``, ``results.json``).

    python -m pagedkv_kernels.tools.compile_check                       # the test command's run
    python -m pagedkv_kernels.tools.compile_check --arch 90 --sources verify --per-class
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ..host.tiles import PTXAS_SPILL_QUIRKS
from .launch_record import SOURCES

__all__ = ["main", "REGISTER_LIMIT", "TMA_KERNELS", "check_budget", "check_tma", "class_key", "family_key"]
__all__ += ["render_table"]

REGISTER_LIMIT = 255  # a kernel at the hardware's per-thread maximum has nowhere left to go but spills
DEFAULT_ARCHS = (80, 90)
SAMPLED_ARCHS = (75, 89)
TMA_KERNELS = ("decode_descriptors_kernel",)  # kernels whose loads must be TMA copies from sm_90 on
TMA_ARCH = 90


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected compute capabilities such as 80,90") from None


def class_key(record: dict) -> str:
    """A launch without its int specializations (alignment of ints and pointers): the
    kernel, its dtypes, constexprs and options. ``--per-class`` compiles one per class."""
    args = {n: (d[:2] if d[0] == "t" else d if d[0] != "i" else ["i"]) for n, d in record["args"].items()}
    return json.dumps([record["kernel"], record["file"], args, record["options"]], sort_keys=True)


def family_key(record: dict) -> tuple[str, tuple[str, ...]]:
    """``(kernel, floating-point pointer dtypes)``: what the sampled archs compile once."""
    dtypes = sorted({d[1] for d in record["args"].values() if d[0] == "t" and not d[1].startswith(("int", "uint"))})
    return record["kernel"], tuple(dtypes)


def check_budget(kernel: str, result: dict, budgeted: bool) -> str | None:
    """Why ``result`` (a compile result's JSON) breaks the rules, or None."""
    if result["error"]:
        return f"{kernel} does not compile for sm_{result['arch']}: {result['error'].splitlines()[0]}"
    if not budgeted:
        return None
    quirk = PTXAS_SPILL_QUIRKS.get((kernel, result["arch"]), 0)
    if result["spill_stores"] > quirk or result["spill_loads"] > quirk:
        return (f"{kernel} spills on sm_{result['arch']}: {result['spill_stores']} B stored, "
                f"{result['spill_loads']} B loaded per thread (registers {result['registers']})")  # fmt: skip
    if result["registers"] >= REGISTER_LIMIT:
        return f"{kernel} needs {result['registers']} registers on sm_{result['arch']} (limit {REGISTER_LIMIT - 1})"
    return None


def check_tma(kernel: str, result: dict) -> str | None:
    """Why ``result`` of a :data:`TMA_KERNELS` kernel on sm_90 or newer has no TMA
    copy, or None (other kernels, older archs and failed compiles: None)."""
    if kernel not in TMA_KERNELS or result["arch"] < TMA_ARCH or result["error"]:
        return None
    if result["ptx"]["tma_loads"] == 0:
        return (f"{kernel} has no TMA copy (cp.async.bulk.tensor) in its sm_{result['arch']} PTX: "
                f"its descriptor loads were lowered to {result['ptx']['global_loads']} ordinary loads")  # fmt: skip
    return None


def _record(sources: tuple[str, ...], path: Path) -> dict:
    env = dict(os.environ, PAGEDKV_BACKEND="interpreter", PAGEDKV_PLAN="gpu", MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "pagedkv_kernels.tools.launch_record", str(path), ",".join(sources)]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(path.read_text())


_FILES: dict[str, str] = {}


def _init_worker(files: dict[str, str]) -> None:
    _FILES.update(files)


def _compile(task):
    from . import gpu_compile  # in the worker: kernels decorated for compilation

    index, record, arch = task
    return index, gpu_compile.compile_launch(record, _FILES, arch).to_json()


def _tasks(launches: list[dict], archs, sampled, per_class: bool) -> tuple[list, int]:
    chosen, seen = [], set()
    for i, rec in enumerate(launches):
        key = class_key(rec) if per_class else i
        if key not in seen:
            seen.add(key)
            chosen.append(i)
    tasks = [(i, launches[i], a) for i in chosen for a in archs]
    families = {}
    for i in chosen:
        families.setdefault(family_key(launches[i]), i)
    tasks += [(i, launches[i], a) for i in families.values() for a in sampled if a not in archs]
    return tasks, len(launches) - len(chosen)


def render_table(launches: list[dict], results: dict[int, list[dict]]) -> str:
    """A markdown table, one row per kernel and arch: specializations compiled, the
    largest registers, spill bytes (stores + loads) and shared memory of any of them."""
    rows = defaultdict(lambda: {"n": 0, "regs": 0, "spill": 0, "smem": 0, "errors": 0, "where": set()})
    for i, per_arch in results.items():
        rec = launches[i]
        where = "kernels" if rec["module"] else Path(rec["file"]).stem
        for r in per_arch:
            row = rows[(rec["kernel"], where, r["arch"])]
            row["n"] += 1
            if r["error"]:
                row["errors"] += 1
                continue
            row["regs"] = max(row["regs"], r["registers"])
            row["spill"] = max(row["spill"], r["spill_stores"] + r["spill_loads"])
            row["smem"] = max(row["smem"], r["shared"])
    lines = ["| kernel | from | arch | specializations | max registers | max spill B | max shared B | errors |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (kernel, where, arch), row in sorted(rows.items()):
        lines.append(f"| {kernel} | {where} | sm_{arch} | {row['n']} | {row['regs']} | {row['spill']} | "
                     f"{row['smem']} | {row['errors']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv_kernels.tools.compile_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--arch", type=_ints, default=DEFAULT_ARCHS, help="every specialization (default 80,90)")
    parser.add_argument("--sample", type=_ints, default=SAMPLED_ARCHS, help="one per kernel and dtype (75,89)")
    parser.add_argument("--sources", default=",".join(SOURCES), help=f"of {','.join(SOURCES)}")
    parser.add_argument("--per-class", action="store_true", help="one specialization per class (ints collapsed)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    parser.add_argument("--records", type=Path, help="reuse the launches recorded in this JSON file")
    parser.add_argument("--out", type=Path, default=Path("build/compile_check"))
    args = parser.parse_args(argv)
    sources = tuple(s for s in args.sources.split(",") if s)
    if unknown := set(sources) - set(SOURCES):
        parser.error(f"--sources: unknown {sorted(unknown)}; choose from {', '.join(SOURCES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    recorded = json.loads(args.records.read_text()) if args.records else _record(sources, args.out / "launches.json")
    launches, files = recorded["launches"], recorded["files"]
    tasks, skipped = _tasks(launches, args.arch, args.sample, args.per_class)
    t_record = time.perf_counter() - start
    skip_note = f"; {skipped} skipped (--per-class: same kernel, dtypes and constexprs)" if skipped else ""
    print(
        f"compile check: {len(launches)} specializations recorded in {t_record:.0f} s; compiling "
        f"{len(tasks)} (arch, specialization) pairs on {args.jobs} processes{skip_note}"
    )
    # Workers decorate kernels for compilation; a fresh cache makes every compile (and
    # its ptxas -v log) happen, so the figures and the time are those of a clean machine.
    os.environ.update(
        PAGEDKV_BACKEND="compile-only",
        TRITON_DEFAULT_FP_FUSION="1",
        TRITON_ALWAYS_COMPILE="1",
        TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="pagedkv-triton-cache-"),
    )
    results: dict[int, list[dict]] = defaultdict(list)
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: kernels decorated for compilation
    with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker, initargs=(files,)) as pool:
        for i, result in pool.map(_compile, tasks):
            results[i].append(result)
    problems = []
    for i, per_arch in results.items():
        for r in per_arch:
            kernel = launches[i]["kernel"]
            for why in (check_budget(kernel, r, r["arch"] in args.arch), check_tma(kernel, r)):
                if why:
                    problems.append(f"{why} (from {', '.join(launches[i]['sources'])})")
    table = render_table(launches, results)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    dump = [{**launches[i], "results": results[i]} for i in sorted(results)]
    (args.out / "results.json").write_text(json.dumps(dump, indent=1))
    took = time.perf_counter() - start
    print(f"compile check: {len(tasks)} compiles in {took:.0f} s ({t_record:.0f} s recording); wrote {args.out}")
    for p in dict.fromkeys(problems):
        print("FAIL", p)
    print("compile check: " + (f"{len(set(problems))} problems" if problems else "every kernel compiles, no spills"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

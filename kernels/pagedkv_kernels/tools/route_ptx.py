"""The read side's three routes compiled side by side, for a GPU target, without a GPU.

Who computes a page's address differs between the routes (notebook 07): the generic
decode (:mod:`pagedkv_kernels.decode`) computes every key's address from the page table,
the page-pointer decode (:mod:`pagedkv_kernels.decode_page_pointers`) loads addresses
the host computed, and the descriptor decode (:mod:`pagedkv_kernels.decode_descriptors`)
asks the TMA unit for a page tile by its coordinates. :func:`compare_routes` measures
what that leaves in the compiled code: it records each route's launches for one batch
as a GPU would plan them (a child process with ``PAGEDKV_PLAN=gpu``;
:class:`pagedkv_kernels.tools.launch_record.Recorder`, record only: nothing runs),
compiles them in another (``PAGEDKV_BACKEND=compile-only``, as the compile check does,
:func:`pagedkv_kernels.tools.gpu_compile.compile_launch`) and returns each kernel's PTX
counts (:func:`pagedkv_kernels.tools.gpu_compile.ptx_counts`) and ptxas figures.

    python -m pagedkv_kernels.tools.route_ptx 90      # the table, for sm_90
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..decode import paged_decode_attention
from ..decode_descriptors import paged_decode_attention_descriptors
from ..decode_page_pointers import paged_decode_attention_page_pointers
from .launch_record import Recorder

__all__ = ["ROUTES", "record_routes", "compile_records", "compare_routes", "example_batch"]

ROUTES = {
    "paged": paged_decode_attention,  # route 1: the kernel computes each key's address
    "page pointers": paged_decode_attention_page_pointers,  # route 2: the host computes each page's
    "descriptors": paged_decode_attention_descriptors,  # route 3: the TMA unit, from coordinates
}
KERNELS_ROOT = Path(__file__).resolve().parents[2]  # kernels/, the folder above the package
COMPILE = (
    "import json, sys\n"
    "from pagedkv_kernels.tools import gpu_compile\n"
    "records, files, arch = json.load(sys.stdin)\n"
    "print(json.dumps([gpu_compile.compile_launch(r, files, arch).to_json() for r in records]))\n"
)
RECORD = (
    "import json, sys\n"
    "from pagedkv_kernels.tools import route_ptx\n"
    "routes, batch = json.load(sys.stdin)\n"
    "print(json.dumps(route_ptx.record_routes(*route_ptx.example_batch(**batch), routes=routes)))\n"
)


def record_routes(q, cache, block_tables, seq_lens, routes=tuple(ROUTES)) -> tuple[dict[str, list[dict]], dict]:
    """``({route: [launch record, ...]}, files)``: the launches each of ``routes`` (names
    of :data:`ROUTES`) makes for this batch (validated and planned as usual, never run)."""
    records, files = {}, {}
    for name in routes:
        with Recorder(name, dry=True) as rec:
            ROUTES[name](q, cache, block_tables, seq_lens)
        records[name] = list(rec.launches.values())
        files.update(rec.files)
    return records, files


def _child(code: str, payload, timeout_s: float, **env):
    """Run ``code`` in a fresh interpreter with ``env`` (the suite's own variables
    replaced), ``payload`` as JSON on stdin; its last line of output, parsed."""
    path = os.pathsep.join([str(KERNELS_ROOT.parent), str(KERNELS_ROOT), os.environ.get("PYTHONPATH", "")])
    full = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")} | env | {"PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(payload), env=full, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"a child process failed ({env}):\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compile_records(records: list[dict], files: dict[str, str], arch: int, timeout_s: float = 600) -> list[dict]:
    """Compile each record for ``sm_<arch>`` in one child process; their
    :class:`~pagedkv_kernels.tools.gpu_compile.CompileResult` as JSON, in order. Raises
    RuntimeError when the child fails (a compiler error is a result's ``error``)."""
    return _child(
        COMPILE, [records, files, arch], timeout_s, PAGEDKV_BACKEND="compile-only", TRITON_DEFAULT_FP_FUSION="1"
    )


def compare_routes(arch: int = 90, routes=tuple(ROUTES), **batch) -> dict[str, list[dict]]:
    """``{route: [{"kernel": name, **compile result}, ...]}`` for :func:`example_batch`
    (``batch``: its keywords, JSON values) planned as on a GPU, each of ``routes``
    compiled for ``sm_<arch>`` (see the module docstring). Runs two child processes;
    needs Triton's bundled ptxas, no GPU."""
    payload = [list(routes), batch]
    records, files = _child(RECORD, payload, 300, PAGEDKV_BACKEND="interpreter", PAGEDKV_PLAN="gpu")
    flat = [(name, rec) for name, recs in records.items() for rec in recs]
    results = compile_records([rec for _, rec in flat], files, arch)
    out: dict[str, list[dict]] = {name: [] for name in records}
    for (name, rec), result in zip(flat, results, strict=True):
        out[name].append({"kernel": rec["kernel"], **result})
    return out


def example_batch(dtype: str = "fp16", page_size: int = 16, head_dim: int = 128, group: int = 4):
    """A batch of 2 requests (100 and 37 tokens, fewer if 8 pages hold fewer) over a
    pool of 16 pages, 2 KV heads: ``(q, cache, block_tables, seq_lens)``, contents zero
    (only shapes matter here). ``dtype``: ``"fp32"``, ``"fp16"`` or ``"bf16"``."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    cache = torch.zeros((16, 2, page_size, 2, head_dim), dtype=dtype)
    table = torch.arange(16, dtype=torch.int32).view(2, 8)
    lens = torch.tensor([min(100, 8 * page_size), min(37, 8 * page_size)], dtype=torch.int32)
    q = torch.zeros((2, 2 * group, head_dim), dtype=dtype)
    return q, cache, table, lens


if __name__ == "__main__":
    for route, results in compare_routes(int(sys.argv[1]) if len(sys.argv) > 1 else 90).items():
        for r in results:
            print(f"{route:14s} {r['kernel']:28s} registers {r['registers']} spills {r['spill_stores']} {r['ptx']}")

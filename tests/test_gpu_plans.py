"""PAGEDKV_PLAN=gpu: the launchers plan as on a GPU (tiles, tl.dot modes, split counts for
PAGEDKV_PLAN_SMS SMs) while the kernels run in the interpreter. Checked in a child
process, since the plan mode is chosen once, at import."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, torch
import pagedkv_kernels as kernels
from pagedkv_kernels.host import tiles
from pagedkv_lib import runtime
cache = torch.zeros(70, 2, 16, 2, 64, dtype=torch.float16)
table = torch.arange(64, dtype=torch.int32).view(1, 64)
lens = torch.tensor([1000], dtype=torch.int32)
q = torch.zeros(1, 8, 64, dtype=torch.float16)
decode = kernels.plan_decode(q, cache, table, lens)
qp = torch.zeros(100, 8, 64, dtype=torch.float16)
prefill = kernels.plan_prefill(qp, cache, torch.tensor([0, 100], dtype=torch.int32), table, lens)
print(json.dumps({"line": runtime.backend_line(), "splits": decode.num_splits, "block_n": decode.block_n,
                  "dot": prefill.dot_mode, "prefill": [prefill.block_m, prefill.block_n, prefill.num_warps],
                  "fp32_dot": kernels.prefill.dot_mode(torch.float32, torch.float32)}))
"""


def _probe(**env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")} | env
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_gpu_plans_split_decode_and_use_tl_dot_in_the_interpreter():
    run = _probe(PAGEDKV_BACKEND="interpreter", PAGEDKV_PLAN="gpu")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # One sequence on 2 KV heads leaves 130 of 132 SMs idle: the heuristic splits it.
    assert got["splits"] > 1 and got["block_n"] == 32, got  # 2**13 elements: group 4 x 32 keys x 64
    assert got["dot"] == "fp16" and got["fp32_dot"] == "fp32", got
    assert got["prefill"] == [64, 64, 8], got  # the 16-bit tl.dot tiles at head dim 64 (pagedkv_kernels.host.tiles)
    assert "GPU plans for 132 SMs" in got["line"], got["line"]


def test_interpreter_plans_are_unchanged_without_the_switch():
    run = _probe(PAGEDKV_BACKEND="interpreter")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["splits"] == 1 and got["dot"] == "sum" and got["fp32_dot"] == "sum", got


def test_sm_count_is_taken_from_the_environment():
    few = json.loads(_probe(PAGEDKV_BACKEND="interpreter", PAGEDKV_PLAN="gpu", PAGEDKV_PLAN_SMS="2").stdout)
    many = json.loads(_probe(PAGEDKV_BACKEND="interpreter", PAGEDKV_PLAN="gpu").stdout)
    assert few["splits"] < many["splits"], (few, many)


def test_a_bad_plan_switch_is_refused_by_name():
    for env, needle in (
        ({"PAGEDKV_PLAN": "tpu"}, "PAGEDKV_PLAN='tpu'"),
        ({"PAGEDKV_PLAN_SMS": "0"}, "PAGEDKV_PLAN_SMS"),
    ):
        run = _probe(PAGEDKV_BACKEND="interpreter", **env)
        assert run.returncode != 0 and needle in run.stderr and "ValueError" in run.stderr, run.stderr[-1000:]

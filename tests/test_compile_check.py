"""The compile check: kernels compiled for real GPU targets without a GPU, their resource
budget, and the launch records it compiles (pagedkv_kernels.tools.compile_check, launch_record,
gpu_compile). The whole check runs as its own step of the test command; these tests
prove its parts, the bf16 prefill fix among them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv_kernels.tools import compile_check, launch_record
from pagedkv_kernels.tools.gpu_compile import parse_ptxas
from pagedkv_lib import runtime

ROOT = Path(__file__).resolve().parents[1]
PREFILL = ROOT / "kernels" / "pagedkv_kernels" / "prefill.py"
PREFILL_TILE = ROOT / "kernels" / "pagedkv_kernels" / "device" / "prefill_tile.py"
# The bf16 split of P both prefill kernels take (pagedkv_kernels.device.prefill_tile.attend_keys).
FIXED_BF16 = """        p_big = p.to(tl.bfloat16)
        p_small = (p - p_big.to(tl.float32)).to(tl.bfloat16)
        acc += tl.dot(p_big, v) + tl.dot(p_small, v)"""
# The bug this test was built for: the prefill kernel's key loop once held that split, bound
# to p_hi/p_lo, the names of the int32 key range computed before the loop. The interpreter
# rebinds names; the compiler refuses a loop-carried name whose type changes. The split now
# lives in a helper with names of its own, so the test plants the same rebinding in the
# plain kernel's loop: its int32 prologue name ``past`` bound to a bf16 tensor.
LOOP_END = "        tile += 1\n"
BROKEN_LOOP_END = "        past = l_i.to(tl.bfloat16)\n        tile += 1\n"

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_other' for 'sm_90a'
ptxas info    : Used 40 registers
ptxas info    : Compiling entry function 'prefill_kernel' for 'sm_90a'
ptxas info    : Function properties for prefill_kernel
    5168 bytes stack frame, 5168 bytes spill stores, 11020 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 5168 bytes cumulative stack size
"""


def test_ptxas_log_gives_the_named_kernels_registers_and_spills():
    assert parse_ptxas(PTXAS_LOG, "prefill_kernel") == (96, 5168, 11020)
    assert parse_ptxas(PTXAS_LOG, "_other") == (40, 0, 0)
    with pytest.raises(ValueError, match="no 'Used N registers'"):
        parse_ptxas("ptxas info : 0 bytes gmem", "prefill_kernel")


def _result(**kw):
    return {"arch": 90, "registers": 96, "spill_stores": 0, "spill_loads": 0, "shared": 0, "error": None} | kw


def test_budget_fails_a_spill_a_full_register_file_and_a_compile_error():
    assert compile_check.check_budget("k", _result(), budgeted=True) is None
    assert "spills on sm_90: 8 B stored" in compile_check.check_budget("k", _result(spill_stores=8), True)
    assert "needs 255 registers" in compile_check.check_budget("k", _result(registers=255), True)
    assert "does not compile for sm_90" in compile_check.check_budget("k", _result(error="CompilationError: x"), False)
    assert compile_check.check_budget("k", _result(spill_stores=8), budgeted=False) is None  # sampled archs
    quirk = _result(
        arch=80, spill_stores=4, spill_loads=4, registers=64
    )  # the one listed in pagedkv_kernels.host.tiles
    assert compile_check.check_budget("quant_decode_split_kernel", quirk, True) is None
    assert "spills on sm_80" in compile_check.check_budget(
        "quant_decode_split_kernel", quirk | {"spill_stores": 8}, True
    )
    assert "spills on sm_80" in compile_check.check_budget("decode_split_kernel", quirk, True)


@pytest.mark.parametrize(
    "value, cls", [(1, "1"), (0, "i32D"), (17, "i32"), (-16, "i32D"), (2**31, "i64D"), (2**40 + 3, "i64")]
)
def test_int_arguments_are_recorded_by_their_triton_specialization(value, cls):
    assert launch_record.int_class(value) == cls


def test_recorder_keeps_distinct_specializations_and_drops_launches_that_raise():
    """Two launches that differ only in an int's value class are two records; the same
    launch twice is one record counted twice; a launch the kernel refuses is none."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) + 1.0, mask=offs < n)

    x = torch.zeros(32, device=runtime.device())
    with launch_record.Recorder("test") as rec:
        _k[(1,)](x, 5, BLOCK=16)
        _k[(1,)](x, 7, BLOCK=16)  # same class (i32, not divisible by 16)
        _k[(1,)](x, 16, BLOCK=16)  # divisible by 16: another specialization
        with pytest.raises(Exception, match="power of 2"):
            _k[(1,)](x, 5, BLOCK=12)  # tl.arange needs a power of two
    records = sorted(rec.launches.values(), key=lambda r: r["args"]["n"][1])
    assert [r["args"]["n"] for r in records] == [["i", "i32"], ["i", "i32D"]]
    assert [r["count"] for r in records] == [2, 1] and records[0]["args"]["BLOCK"] == ["c", 16]
    assert records[0]["args"]["x_ptr"] == ["t", "float32", True]


def _compile_in_child(record: dict, files: dict, arch: int) -> dict:
    code = (
        "import json, sys; from pagedkv_kernels.tools import gpu_compile; r, f, a = json.load(sys.stdin); "
        "print(json.dumps(gpu_compile.compile_launch(r, f, a).to_json()))"
    )
    env = dict(os.environ, PAGEDKV_BACKEND="compile-only", TRITON_DEFAULT_FP_FUSION="1")
    payload = json.dumps([record, files, arch])
    run = subprocess.run(
        [sys.executable, "-c", code], input=payload, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


INDEX_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "kv_indptr_ptr", "kv_indices_ptr", "kv_last_page_len_ptr")
INDEX_POINTERS += ("qo_indptr_ptr", "tile_request_ptr", "tile_row_ptr")
INT_ARGS = ("stride_qt", "stride_qh", "stride_page", "stride_kv", "stride_n", "stride_h", "stride_table")
INT_ARGS += ("stride_ot", "stride_oh", "group", "head_dim", "page_size", "sink_tokens", "bubble_len")
INT_ARGS += ("cyclic_cache_len", "window_recent", "stride_lt", "stride_lh")


def _bf16_prefill_record(path: Path) -> dict:
    """A record of one bf16 tl.dot launch of the plain prefill kernel (as launch_record writes them)."""
    args = {name: ["t", "int32", True] for name in INDEX_POINTERS}
    args |= {name: ["t", "bfloat16", True] for name in ("q_ptr", "cache_ptr", "out_ptr")}
    args["lse_ptr"] = ["t", "float32", True]
    args |= {name: ["i", "i32"] for name in INT_ARGS}
    args |= {name: ["i", "1"] for name in ("stride_qd", "stride_d", "stride_od")} | {"qk_scale": ["f"]}
    consts = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": 64, "WINDOW": 0, "IS_CSR": False, "DOT": 3}
    consts |= {"CAUSAL": True, "WRITE_LSE": False}
    args |= {k: ["c", v] for k, v in consts.items()}
    return {"kernel": "prefill_kernel", "module": None, "file": str(path), "args": args, "options": {"num_warps": 4}}


def test_bf16_prefill_compiles_for_sm90_and_a_rebound_loop_name_would_not():
    """The bug this check was built for: compiled from kernels/pagedkv_kernels/prefill.py's
    text as it is (its key loop taking the bf16 split of P from device/prefill_tile.py),
    the bf16 tl.dot prefill compiles for sm_90 within budget; with a name of the int32
    prologue rebound to a bf16 tensor inside the loop, as the split once did, the
    compiler refuses the loop."""
    assert FIXED_BF16 in PREFILL_TILE.read_text(), "device/prefill_tile.py changed: update this test's bf16 split"
    text = PREFILL.read_text()
    assert text.count(LOOP_END) == 1 and "past = seq_len - q_len" in text, "prefill.py's key loop changed"
    fixed = _compile_in_child(_bf16_prefill_record(PREFILL), {str(PREFILL): text}, 90)
    assert fixed["error"] is None and fixed["registers"] < 255 and fixed["spill_stores"] == 0, fixed
    broken_path = PREFILL.with_name("prefill_broken_for_test.py")  # never written: its text travels in the record
    broken = _compile_in_child(
        _bf16_prefill_record(broken_path), {str(broken_path): text.replace(LOOP_END, BROKEN_LOOP_END)}, 90
    )
    assert broken["error"] and "Loop-carried variable" in broken["error"], broken


def test_tma_check_fails_a_descriptor_decode_without_tma_copies_from_sm90_on():
    """The rule the compile check applies to every sm_90 build of the descriptor decode;
    its mutant is a build whose descriptor loads were lowered to ordinary loads."""
    lowered = _result(ptx={"tma_loads": 0, "global_loads": 5, "address_ops": 43, "instructions": 1068})
    assert "no TMA copy (cp.async.bulk.tensor) in its sm_90 PTX" in compile_check.check_tma(
        "decode_descriptors_kernel", lowered
    )
    assert compile_check.check_tma("decode_descriptors_kernel", lowered | {"ptx": {"tma_loads": 2}}) is None
    assert compile_check.check_tma("decode_descriptors_kernel", lowered | {"arch": 80}) is None  # no TMA before sm_90
    assert compile_check.check_tma("decode_split_kernel", lowered) is None


def test_read_routes_compile_and_the_descriptor_decode_is_tma_on_sm90_only():
    """Route 2 (page pointers) and route 3 (TMA descriptors) planned as on a GPU and
    compiled from kernels/ for sm_90 and sm_80: no error, no spill; the descriptor
    decode's sm_90 PTX holds TMA copies (the compile check's rule, applied to a real
    build) and its sm_80 build falls back to ordinary loads. About 25 s (4 child
    processes)."""
    from pagedkv_kernels.tools import route_ptx

    routes = ("page pointers", "descriptors")
    for arch in (90, 80):
        built = route_ptx.compare_routes(arch, routes=routes)
        for route in routes:
            (result,) = built[route]
            assert result["error"] is None and result["spill_stores"] == 0, (arch, route, result)
            assert compile_check.check_tma(result["kernel"], result) is None, result
        tma = built["descriptors"][0]["ptx"]["tma_loads"]
        assert tma == (2 if arch >= 90 else 0), f"sm_{arch}: {tma} TMA copies in the descriptor decode (K and V: 2)"
        assert built["page pointers"][0]["ptx"]["tma_loads"] == 0

"""Poisoned masked lanes (``PAGEDKV_POISON_MASKED``): in Triton's interpreter a masked
``tl.load`` without ``other=`` reads NaN (integers: a far out-of-range value) where its
mask is off, as undefined as on a GPU; the harness and the exercise checker turn it on
by default, and exercise 08 without ``other=0.0`` then fails with a message naming the
load. Tiny kernels of 8 lanes: the module runs in about 4 s (2 of them exercise 08)."""

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab import verify
from pagedkv_lab.exercises import EXERCISES, check
from pagedkv_lab.exercises.files import load_solution
from pagedkv_lab.verify import cli
from pagedkv_lib import reference, runtime

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels as kernels  # noqa: F401  (reads PAGEDKV_POISON_MASKED)
from pagedkv_kernels import interpreter
from pagedkv_kernels.interpreter import poison

interpreted = pytest.mark.skipif(not runtime.BACKEND.interpreted, reason="poisons Triton's interpreter only")


@triton.jit
def _sum_masked_out_lanes(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr, tl.sum(tl.where(i < n, 0.0, x), axis=0))  # only the lanes the mask turned off


@triton.jit
def _copy_lanes(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n))


@triton.jit
def _copy_lanes_other(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n, other=3))


def _copied(kernel, dtype, n=5):
    x = torch.arange(1, 9).to(dtype)
    out = torch.zeros(8, dtype=dtype)
    kernel[(1,)](x, out, n, BLOCK=8)
    return out


@pytest.fixture
def restore_poison():
    before = poison.enabled()
    yield
    if before:
        poison.enable()
    else:
        poison.disable()


@interpreted
def test_masked_out_lanes_sum_to_nan_under_poison_and_to_zero_without():
    x, out = torch.ones(8), torch.full((1,), -1.0)
    with poison.poisoned():
        _sum_masked_out_lanes[(1,)](x, out, 5, BLOCK=8)
    assert out.isnan().all(), f"masked lanes summed to {out.item()} under poison, not NaN"
    with poison.poisoned(False):
        _sum_masked_out_lanes[(1,)](x, out, 5, BLOCK=8)
    assert out.item() == 0.0, "without poison the interpreter's masked lanes read 0"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_poison_fills_only_the_masked_out_float_lanes_with_nan(dtype):
    with poison.poisoned():
        out = _copied(_copy_lanes, dtype)
    assert out[:5].tolist() == [1, 2, 3, 4, 5], "lanes inside the mask must load what memory holds"
    assert out[5:].isnan().all(), f"{dtype} masked lanes: {out[5:].tolist()}"


@interpreted
@pytest.mark.parametrize(
    "dtype, value",
    [
        (torch.int32, -1640531527),  # 0x9E3779B9
        (torch.int64, -7046029254386353131),  # 0x9E3779B97F4A7C15
        (torch.int16, -25033),  # 0x9E37
        (torch.uint8, 127),  # 0x7F: NaN as an E4M3 or E5M2 code
        (torch.int8, 127),
    ],
)
def test_poison_fills_masked_out_integer_lanes_with_a_far_out_of_range_value(dtype, value):
    with poison.poisoned():
        out = _copied(_copy_lanes, dtype)
    assert out.tolist() == [1, 2, 3, 4, 5, value, value, value]


@interpreted
def test_poisoned_int32_index_times_a_small_stride_stays_far_out_of_range_after_wraparound():
    value = int(poison.poison_value(tl.int32)[1])
    for stride in (*range(1, 65), 128, 256, 1024, 4096, 65536):
        wrapped = (value * stride + 2**31) % 2**32 - 2**31  # int32 arithmetic, as a GPU wraps it
        assert abs(wrapped) >= 2**16, f"poison x stride {stride} wraps to {wrapped}, a plausible offset"


@interpreted
def test_a_load_with_other_and_an_unmasked_load_are_unchanged_under_poison():
    with poison.poisoned() as seen:
        assert _copied(_copy_lanes_other, torch.float32).tolist() == [1, 2, 3, 4, 5, 3, 3, 3]
        assert _copied(_copy_lanes_other, torch.int32).tolist() == [1, 2, 3, 4, 5, 3, 3, 3]
        assert _copied(_copy_lanes, torch.float32, n=8).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert seen == [], f"nothing was poisoned, yet {seen} were recorded"


@interpreted
def test_poisoned_block_names_the_masked_load_and_restores_the_state_before_it(restore_poison):
    poison.disable()
    with poison.poisoned() as seen:
        _copied(_copy_lanes, torch.float32)
        assert poison.enabled() and "masked lanes poisoned" in runtime.backend_line()
    assert not poison.enabled(), "the block must restore the state it found"
    assert [(s.lineno, s.source) for s in seen] == [
        (_copy_lanes.fn.__code__.co_firstlineno + 3, "tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n))")
    ]
    assert str(seen[0]).startswith("test_interpreter_poison.py, line ")


@interpreted
def test_a_poisoned_load_is_named_by_its_kernel_line_under_the_access_recording_too(restore_poison):
    """The access map's recording wraps the same interpreter load (once installed, for
    the rest of the process): the line named is still the kernel's, not the wrapper's."""
    from pagedkv_kernels.interpreter import access

    poison.enable()  # installed first, as in a run where poisoning came before any access map
    with access.recorded(), poison.poisoned() as seen:
        _copied(_copy_lanes, torch.float32)
    assert [(s.lineno, s.source) for s in seen] == [
        (_copy_lanes.fn.__code__.co_firstlineno + 3, "tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n))")
    ], [str(s) for s in seen]


@interpreted
def test_environment_switch_is_read_when_kernels_enable_it(monkeypatch, restore_poison):
    poison.disable()
    monkeypatch.setenv(runtime.POISON_ENV_VAR, "0")
    assert poison.enable_from_env() is False
    monkeypatch.setenv(runtime.POISON_ENV_VAR, "1")
    assert poison.enable_from_env() is True and poison.enabled()
    monkeypatch.setenv(runtime.POISON_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="PAGEDKV_POISON_MASKED='yes'"):
        runtime.poison_masked_requested()


def test_a_triton_the_patch_was_not_checked_against_is_refused_by_version():
    method = triton.runtime.interpreter.InterpreterBuilder.create_masked_load
    with pytest.raises(RuntimeError, match=r"Triton 3\.10\.0 is not one whose interpreter"):
        poison.check_patchable("3.10.0", method)
    with pytest.raises(RuntimeError, match=r"Triton 3\.9\.0's InterpreterBuilder.create_masked_load takes"):
        poison.check_patchable("3.9.0", lambda self, ptrs, other, mask: None)
    poison.check_patchable(triton.__version__, method)  # the installed one is admitted


def test_on_the_gpu_backend_poisoning_is_a_no_op(monkeypatch, restore_poison):
    poison.disable()
    monkeypatch.setattr(runtime, "BACKEND", runtime.Backend("gpu", torch.device("cuda")))
    poison.enable()
    assert not poison.enabled()
    with interpreter.masked_lanes_poisoned() as seen:
        assert not poison.enabled() and seen == []


@verify.contract(page_sizes=(1,), dtypes=("fp32",))  # a few short cases of the grid, to stay cheap
def _spy_decode(q, cache, block_tables, seq_lens, layout="NHD", window=None):
    """The reference decode, right only while masked lanes are poisoned."""
    args = (q.cpu(), cache.cpu(), block_tables.cpu(), seq_lens.cpu())
    out = reference.paged_decode_attention(*args, layout=layout, window=window)
    return (out if poison.enabled() else out + 1).to(q.device)


@interpreted
def test_harness_poisons_masked_lanes_by_default_and_not_with_the_flag():
    case = verify.decode_grid()[0]
    assert verify.run_case("decode", case, decode_fn=_spy_decode, isolate=False).passed
    assert verify.run_case("decode", case, decode_fn=_spy_decode, isolate=True).passed, "a child inherits it"
    assert not verify.run_case("decode", case, decode_fn=_spy_decode, isolate=False, poison_masked=False).passed
    assert verify.run(decode_fn=_spy_decode, checks=("decode",), isolate=False).passed
    assert not verify.run(decode_fn=_spy_decode, checks=("decode",), isolate=False, poison_masked=False).passed


@interpreted
def test_harness_command_line_poisons_unless_told_not_to(monkeypatch, capsys):
    seen = []

    def run(**kwargs):
        seen.append(kwargs["poison_masked"])
        return verify.Report()

    monkeypatch.setattr(cli, "run", run)
    assert cli.main(["--no-isolate"], defaults={"decode_fn": _spy_decode}) == 0
    assert "masked lanes poisoned" in capsys.readouterr().out
    assert cli.main(["--no-isolate", "--no-poison-masked"], defaults={"decode_fn": _spy_decode}) == 0
    assert "masked lanes poisoned" not in capsys.readouterr().out
    assert seen == [True, False]


@interpreted
def test_exercise_checker_poisons_by_default_and_not_with_the_flag():
    states = []

    def decode(q, cache, block_tables, seq_lens, layout="NHD"):
        states.append(poison.enabled())
        raise RuntimeError("a spy: fails the first case at once")

    # in this process (isolate=False), so that the spy's list sees what the kernel saw
    assert not check("decode_kernel", decode, isolate=False).passed and states == [True]
    assert not check("decode_kernel", decode, isolate=False, poison_masked=False).passed and states == [True, False]


def _decode_without_other():
    """Exercise 08's solution with ``other=0.0`` dropped from its masked K/V loads."""
    space = load_solution(EXERCISES["decode_kernel"], replace=("mask=mask, other=0.0)", "mask=mask)"))
    return space["decode"]


@interpreted
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: 0 * NaN
def test_harness_fails_a_decode_that_uses_masked_lanes_and_passes_it_only_without_poison():
    decode, case = _decode_without_other(), verify.decode_grid()[0]
    result = verify.run_case("decode", case, decode_fn=decode, isolate=False)
    assert not result.passed and "non-finite outputs" in result.detail, result.detail
    assert verify.run_case("decode", case, decode_fn=decode, isolate=False, poison_masked=False).passed


@interpreted
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: 0 * NaN
def test_exercise_08_without_other_on_its_masked_kv_loads_fails_naming_the_loads():
    result = check("decode_kernel", _decode_without_other())
    assert not result.passed and result.failure.case == 1, result.message
    message = " ".join(result.message.split())
    assert "NaN came from the masked lanes of a tl.load without other=" in message, message
    assert "`k = tl.load(cache_ptr + offs, mask=mask).to(tl.float32)`" in message
    assert "`v = tl.load(cache_ptr + stride_kv + offs, mask=mask).to(tl.float32)`" in message
    assert "load masked K/V lanes with other=0.0" in message

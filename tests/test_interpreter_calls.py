"""Device-helper calls in Triton's interpreter skip the re-patching of ``triton.language``
(:mod:`pagedkv_kernels.interpreter.calls`): the results are the same bit for bit, the
launch's own patching is still undone after it, and an error inside a launch leaves no
launch open."""

import pytest
import torch

import pagedkv_kernels as kernels  # noqa: F401  (installs the wrapper on the interpreter backend)
from pagedkv_kernels.interpreter import calls as interpreter_calls
from pagedkv_lib import runtime

# isort: split
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(not runtime.BACKEND.interpreted, reason="the interpreter's own behaviour")


@triton.jit
def _scaled(x, k):
    return x * k


@triton.jit
def _loop_kernel(x_ptr, out_ptr, TIMES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offs)
    for k in tl.static_range(TIMES):
        acc = _scaled(acc, k + 1.5)  # one helper call per iteration and program
    tl.store(out_ptr + offs, acc)


@triton.jit
def _sum_kernel(x_ptr, out_ptr, TIMES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * BLOCK + offs)
    acc = 0.0
    for k in tl.static_range(TIMES):
        acc += tl.sum(x * (k + 1.0), axis=0)  # tl.sum: a helper of triton.language.standard, which sees tl.core
    tl.store(out_ptr + tl.program_id(0), acc)


@triton.jit
def _failing_helper(x):
    tl.static_assert(False, "planted")
    return x


@triton.jit
def _failing_kernel(x_ptr):
    tl.store(x_ptr, _failing_helper(tl.load(x_ptr)))


def _run(x):
    out = torch.empty_like(x)
    _loop_kernel[(3,)](x, out, TIMES=4, BLOCK=8)
    return out


def test_helper_calls_skip_the_repatching_and_the_result_is_the_same_bit_for_bit():
    x = torch.randn(24, generator=torch.Generator().manual_seed(0))
    assert interpreter_calls.installed()
    before = interpreter_calls.nested_calls_skipped()
    fast = _run(x)
    assert interpreter_calls.nested_calls_skipped() - before == 3 * 4  # 3 programs x 4 calls
    interpreter_calls.uninstall()
    try:
        skipped = interpreter_calls.nested_calls_skipped()
        plain = _run(x)
        assert interpreter_calls.nested_calls_skipped() == skipped  # the interpreter's own path
    finally:
        assert interpreter_calls.install()
    want = x.double()
    for k in range(4):
        want = want * (k + 1.5)
    assert torch.equal(fast.view(torch.int32), plain.view(torch.int32))
    assert torch.allclose(fast.double(), want, rtol=1e-6)


def test_standard_helpers_patch_tl_core_once_and_the_result_is_the_same_bit_for_bit():
    """``tl.sum`` sees ``tl.core``, which the launch does not patch: its first call patches
    it for good (upstream never restores a helper's patching); the later calls skip."""
    x = torch.randn(3 * 16, generator=torch.Generator().manual_seed(1))

    def run():
        out = torch.empty(3)
        _sum_kernel[(3,)](x, out, TIMES=5, BLOCK=16)
        return out

    run()  # tl.core patched for good from here on
    before = interpreter_calls.nested_calls_skipped()
    fast = run()
    assert interpreter_calls.nested_calls_skipped() - before >= 3 * 5  # every tl.sum of every program
    interpreter_calls.uninstall()
    try:
        plain = run()
    finally:
        assert interpreter_calls.install()
    assert torch.equal(fast.view(torch.int32), plain.view(torch.int32))
    want = x.double().view(3, 16).sum(1) * sum(k + 1.0 for k in range(5))
    assert torch.allclose(fast.double(), want, rtol=1e-5)


def test_the_launch_still_restores_triton_language_after_it():
    arange, load = tl.arange, tl.load
    _run(torch.ones(24))
    assert tl.arange is arange and tl.load is load


def test_an_error_inside_a_launch_leaves_no_launch_open():
    with pytest.raises(Exception, match="planted"):
        _failing_kernel[(1,)](torch.ones(1))
    arange = tl.arange
    out = _run(torch.ones(24))  # patched and restored as usual: no launch was left open
    assert tl.arange is arange and torch.equal(out, torch.full((24,), 1.5 * 2.5 * 3.5 * 4.5))

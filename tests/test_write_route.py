"""One route per write family: every entry point is ``return run_x(plan_x(...), ...)``,
and that route validates once.

A plan runs every value and launch check; a run given the very tensors its plan
checked (same addresses, shapes, strides, dtypes, devices: :func:`pagedkv_kernels.host.launch.memory_key`)
does not run them again, while a run given other tensors is checked against the plan.
The counts below wrap every ``check_*`` function the write modules call (their own
imports from :mod:`pagedkv_kernels.host.validate` and :mod:`pagedkv_lib.checks`).
"""

import ast
import collections
import inspect
import textwrap

import pytest
import torch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lib import checks, runtime
from pagedkv_lib.quant_pool import QuantizedKVPool

# isort: split
import pagedkv_kernels.mla_write as kmla
import pagedkv_kernels.quant_write as quant_write
import pagedkv_kernels.v_tail as v_tail
import pagedkv_kernels.write as write

DEV = runtime.device()
ENTRY_POINTS = [
    write.append_paged_kv,
    write.append_paged_kv_csr,
    v_tail.zero_paged_v_tail,
    quant_write.append_paged_kv_quant,
    quant_write.append_paged_kv_quant_csr,
    quant_write.zero_paged_v_tail_quant,
    kmla.append_paged_mla_kv,
    kmla.append_paged_mla_kv_csr,
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_entry_point_is_run_of_plan(entry):
    """The body (after the docstring) is one ``return run_x(plan_x(...), ...)``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(entry)))
    body = tree.body[0].body[1:]  # after the docstring
    assert len(body) == 1 and isinstance(body[0], ast.Return), f"{entry.__name__} is more than one return"
    call = body[0].value
    assert isinstance(call, ast.Call) and call.func.id.startswith("run_"), f"{entry.__name__} does not return run_*"
    inner = call.args[0]
    assert isinstance(inner, ast.Call) and inner.func.id.startswith("plan_"), f"{entry.__name__}: run_*(plan_*(...))"


def _count_checks(monkeypatch) -> collections.Counter:
    """Wrap every ``check_*`` the write modules call; return the live call counter."""
    counts = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for module in (write, v_tail, quant_write, kmla, checks):
        for name, fn in list(vars(module).items()):
            if name.startswith("check_") and callable(fn):
                monkeypatch.setattr(module, name, counted(name, fn))
    return counts


def _mha_call():
    cache = torch.zeros(3, 2, 4, 2, 8, device=DEV)
    k, v, q = torch.randn(3, 2, 8, device=DEV), torch.randn(3, 2, 8, device=DEV), torch.randn(3, 4, 8, device=DEV)
    slots, pos = torch.tensor([4, 9, 5], device=DEV), torch.tensor([0, 5, 1], device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    tail = (torch.tensor([0, 2], **i32), torch.tensor([1, 2], **i32), torch.tensor([2], **i32))
    args = (k, v, cache, slots)
    kwargs = dict(rope="neox", positions=pos, q=q, zero_v_tail=tail)
    return write.plan_append, write.append_paged_kv, args, kwargs


def _quant_call():
    pool = QuantizedKVPool(3, 4, 2, 16, "fp8", "NHD", DEV, scale_mode="token")
    k, v, q = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 2, 16, device=DEV), torch.randn(3, 4, 16, device=DEV)
    args = (k, v, pool.data, pool.scales, pool.global_scale, torch.tensor([4, 9, 5], device=DEV), "fp8", "token")
    kwargs = dict(rope="gptj", positions=torch.tensor([0, 5, 1], device=DEV), q=q)
    return quant_write.plan_append_quant, quant_write.append_paged_kv_quant, args, kwargs


def _mla_call():
    ckv, kpe = torch.randn(3, 16, device=DEV), torch.randn(3, 8, device=DEV)
    caches = (torch.zeros(3, 4, 16, device=DEV), torch.zeros(3, 4, 8, device=DEV))
    args = (ckv, kpe, *caches, torch.tensor([4, 9, 5], device=DEV))
    kwargs = dict(rope="neox", positions=torch.tensor([0, 5, 1], device=DEV))
    return kmla.plan_append_mla, kmla.append_paged_mla_kv, args, kwargs


@pytest.mark.parametrize("make_call", [_mha_call, _quant_call, _mla_call], ids=["mha", "quant", "mla"])
def test_entry_point_validates_once(monkeypatch, make_call):
    """The entry point runs exactly the checks its plan runs (before, its run_* checked
    the planned tensors a second time)."""
    plan_x, entry, args, kwargs = make_call()
    counts = _count_checks(monkeypatch)
    plan_x(*args, **kwargs)
    planned = dict(counts)
    counts.clear()
    entry(*args, **kwargs)
    assert planned and dict(counts) == planned, f"plan alone {planned}, entry point {dict(counts)}"


def test_run_with_other_tensors_is_still_checked():
    """A run given a ``k`` other than planned (here a view of the pool it writes) is
    checked and refused; only the planned tensors themselves skip the checks."""
    plan_x, _, (k, v, cache, slots), kwargs = _mha_call()
    plan = plan_x(k, v, cache, slots, **kwargs)
    before = cache.clone()
    alias = cache[0, 0, :3]  # [3, 2, 8]: the shape and dtype of k, inside the pool
    with pytest.raises(ValueError, match=r"k overlaps the memory of cache"):
        write.run_append(plan, alias, v, cache, kwargs["q"])
    assert torch.equal(cache, before)

"""Host-side launch helpers of the quantized kernels (:mod:`pagedkv_kernels.quant_write`,
:mod:`pagedkv_kernels.quant_decode`): one home for what both need of a quantized pool.

* :data:`FORMAT_CODES`: the kernels' ``FORMAT`` constexpr of each (format, scale mode);
* :func:`pool_fingerprint`: what a plan records of the pool, so a run can refuse
  tensors of another format, layout or shape;
* :func:`scale_strides`: the scale pool's strides as the kernels take them;
* :func:`check_pool_launch`: the pool's value rules plus the launch's memory rules;
* :func:`planned_pool`: the tensors a run is given, read in its plan's format.
"""

from __future__ import annotations

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_strides
from pagedkv_lib.quant_pool import QuantizedKVPool

from .launch import fingerprint
from .validate import (
    check_device,
    check_disjoint,
    check_in_storage,
    check_no_overlap,
    check_no_self_overlap,
)

__all__ = ["FORMAT_CODES", "pool_fingerprint", "scale_strides", "check_pool_launch", "planned_pool"]

# The FORMAT constexpr of the quantized kernels: (kv_dtype, scale_mode) -> code.
FORMAT_CODES = {
    ("fp8", "tensor"): 0,
    ("fp8", "token"): 1,
    ("nvfp4", "block"): 2,
    ("nvfp4", "block_encode"): 3,
    ("fp8", "head"): 4,
    ("fp8", "token_all_heads"): 5,
}


def pool_fingerprint(pool) -> tuple:
    """``(format, layout, data, scales, global_scale)`` with each tensor's ``(shape, strides,
    dtype, device)``: what a plan was checked against."""

    def fp(t):
        return None if t is None else fingerprint(t)

    return (pool.kv_dtype, pool.scale_mode, pool.layout, fp(pool.data), fp(pool.scales), fp(pool.global_scale))


def scale_strides(pool) -> tuple:
    """The scale pool's strides in :func:`pagedkv_lib.pool.cache_strides` order, zeros
    without one; the head stride is 0 for ``"token_all_heads"`` (every head of a row reads
    and writes the row's one scale)."""
    if pool.scales is None:
        return (0, 0, 0, 0, 0)
    page, kv, n, h, g = cache_strides(pool.scales, pool.layout)
    return (page, kv, n, 0 if pool.scale_mode == "token_all_heads" else h, g)


def check_pool_launch(pool) -> None:
    """Launch checks of a quantized pool: its value rules
    (:func:`pagedkv_lib.checks.check_quant_pool`), every tensor on the kernels' device,
    and the written ones (codes, scales) each reaching no element twice, inside their
    storage and not overlapping each other or the global scale."""
    checks.check_quant_pool(pool)
    check_device("pool.data", pool.data)
    check_device("pool.global_scale", pool.global_scale)
    written = [("pool.data", pool.data)]
    if pool.scales is not None:
        check_device("pool.scales", pool.scales)
        written.append(("pool.scales", pool.scales))
        check_no_overlap("pool.scales", pool.scales, "pool.data", pool.data)
    for name, t in written:
        check_no_self_overlap(name, t)
        check_in_storage(name, t)
    check_disjoint(written, [("pool.global_scale", pool.global_scale)])


def planned_pool(plan, data, scales, global_scale) -> QuantizedKVPool:
    """The pool tensors given to a run, read in the format and layout the plan (a
    ``QuantAppendPlan`` or ``QuantDecodePlan``) was made for."""
    kv_dtype, scale_mode, layout = plan.pool[:3]
    # The run compares the tensors' fingerprints with the plan's (pool_fingerprint), as before.
    return QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout, validate=False)

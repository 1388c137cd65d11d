"""Host-side launch helpers every kernel module shares: what a plan records and copies.

One home for the small host rules a kernel launch needs, so the write, decode,
prefill, quantized and MLA modules cannot drift apart:

* :func:`int32_on_device`: the int32 contiguous device copy of an index tensor that
  a kernel indexes with (a table with no columns still gets a valid pointer);
* :func:`parallel_units`: how many programs the device runs at once, the input of the
  split-KV choice (1 in the interpreter unless it plans as on a GPU);
* :func:`fingerprint`: ``(shape, strides, dtype, device)`` of a tensor, which a plan
  records so that a later run can refuse a tensor it was not made for;
* :func:`memory_key`: the fingerprints plus the addresses of the tensors a plan checked,
  so that a run given those very tensors need not check their memory again.

The host copy of index tensors for the value checks is
:func:`kernels.validate.host_copy` (it belongs with the checks that use it).
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import functools

import torch

__all__ = ["int32_on_device", "parallel_units", "fingerprint", "memory_key"]


def int32_on_device(x, device: torch.device, min_len: int = 0) -> torch.Tensor:
    """The int32 contiguous copy of ``x`` on ``device`` that a kernel indexes with.

    ``x`` is a tensor (or anything :func:`torch.as_tensor` takes) whose values were
    already checked to fit in int32. A 2-D table with no columns becomes ``[rows, 1]``
    zeros, and a 1-D list shorter than ``min_len`` (an empty index list) becomes
    ``min_len`` zeros, so the kernel still gets a valid pointer (it never reads them).
    """
    t = torch.as_tensor(x).to(device=device, dtype=torch.int32).contiguous()
    if t.dim() == 2 and t.shape[1] == 0:
        t = torch.zeros((t.shape[0], 1), dtype=torch.int32, device=device)
    elif t.dim() == 1 and t.numel() < min_len:
        t = torch.zeros(min_len, dtype=torch.int32, device=device)
    return t


@functools.cache
def _num_sms(index: int) -> int:
    # Queried at call time (never at import), once per device.
    return torch.cuda.get_device_properties(index).multi_processor_count


def parallel_units(device: torch.device) -> int:
    """Programs the device runs at once: the SM count compiled; 1 in the interpreter,
    which runs programs one after another (so splitting there only adds work), unless
    it plans as on a GPU (``PAGEDKV_PLAN=gpu``: the SM count it was given)."""
    if not runtime.BACKEND.interpreted and device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return runtime.PLANS.sm_count if runtime.gpu_plans() else 1


def fingerprint(t: torch.Tensor) -> tuple:
    """``(shape, strides, dtype, device)`` of ``t``: what a plan checks a later tensor against."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def memory_key(*tensors) -> tuple:
    """``(data_ptr, shape, strides, dtype, device)`` of each tensor (None stays None).

    Overlap and in-bounds checks depend on nothing else, so a run whose tensors have
    the key its plan recorded is covered by the plan's checks and skips them (an entry
    point, which plans and runs at once, then validates once)."""
    return tuple(None if t is None else (t.data_ptr(), *fingerprint(t)) for t in tensors)

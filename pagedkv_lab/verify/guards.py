"""Guard regions: every tensor a kernel under test receives sits between canary bytes.

A kernel that writes before or after a tensor (a ``-1`` slot used as an index, a
block id off by one at the end of the table, a store without its mask) lands in the
canary instead of in memory the process uses for something else. After the call the
canaries are read: a changed byte names the tensor and the offset of the first
corrupted byte from the tensor's first element (negative: before it). A write further
away than the guard may still crash the process; the harness runs kernels in a child
process for that (:mod:`pagedkv_lab.verify.isolation`).
"""

from __future__ import annotations

import torch

from pagedkv_lib.cache_layouts import native_from, native_tensors, to_native

__all__ = ["CANARY", "Guards", "KV_STRIDES", "V_PAGE_PADDING"]

CANARY = 0xA5  # the byte every guard region is filled with
MIN_GUARD_BYTES = 4096
_ALIGN = 256  # tensors start 256-byte aligned inside their buffer, as allocations do
KV_STRIDES = ("shared", "distinct")
# Elements added to V's page (or slot) stride when K and V are to have distinct strides:
# 16 bytes or more in every dtype, so vector loads stay aligned.
V_PAGE_PADDING = 8


def _page_padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    """A copy of ``t`` whose dim-0 stride is ``pad`` elements longer than contiguous (the
    rest contiguous): the same values, other strides. The gaps hold NaN."""
    inner = t[0].numel() if t.shape[0] else 0
    buf = torch.full((t.shape[0], inner + pad), float("nan"), dtype=t.dtype, device=t.device)
    out = buf[:, :inner].view(t.shape) if inner else buf[:, :0].reshape(t.shape)
    out.copy_(t)
    return out


def _span_elements(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


class Guards:
    """Places tensors between canary regions and checks them after a call."""

    def __init__(self) -> None:
        self._placed: list[tuple[str, torch.Tensor, int, int]] = []  # name, byte buffer, guard, span bytes

    def place(self, name: str, t: torch.Tensor, guard_bytes: int = MIN_GUARD_BYTES) -> torch.Tensor:
        """A copy of ``t`` (same shape, strides, dtype and device) whose memory has
        ``guard_bytes`` (at least 4 KiB, rounded up to 256) of canary before and after."""
        guard = -(-max(guard_bytes, MIN_GUARD_BYTES) // _ALIGN) * _ALIGN
        span = _span_elements(t) * t.element_size()
        buf = torch.full((2 * guard + span + _ALIGN,), CANARY, dtype=torch.uint8, device=t.device)
        inner = buf[guard : guard + span].view(t.dtype) if span else buf[guard:guard].view(t.dtype)
        out = inner.as_strided(t.shape, t.stride()) if span else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        out.copy_(t)
        if span:
            self._placed.append((name, buf, guard, span))
        return out

    def corrupted(self) -> list[str]:
        """One line per tensor whose guard changed: ``"kernel wrote before|after <name>:
        first corrupted byte at offset <n> (bytes from its first element)"``."""
        lines = []
        for name, buf, guard, span in self._placed:
            host = buf.cpu()
            before = torch.nonzero(host[:guard] != CANARY)
            after = torch.nonzero(host[guard + span :] != CANARY)
            if before.numel():
                first = int(before[0]) - guard
                count = int(before.numel())
                lines.append(f"kernel wrote before {name}: {count} bytes changed, the first at offset {first}")
            if after.numel():
                first = span + int(after[0])
                lines.append(
                    f"kernel wrote after the end of {name} ({span} bytes): {int(after.numel())} bytes changed, "
                    f"the first at offset {first}"
                )
        return lines

    def place_pool(
        self, cache: torch.Tensor, cache_layout: str, layout: str, device, kv_strides: str = "shared"
    ) -> torch.Tensor | tuple:
        """The suite pool ``cache`` (5-D, in ``layout``) converted to ``cache_layout``
        (:func:`pagedkv_lib.cache_layouts.to_native`) and moved to ``device``, each of its
        tensors between guards of at least one page's bytes: the object a kernel under
        test receives (a tensor, a ``(k_cache, v_cache)`` tuple, a
        :class:`~pagedkv_lib.cache_layouts.FlatCache`). ``kv_strides="distinct"``: for
        ``"kv_tuple"`` and ``"flat"``, V's page (slot) stride is :data:`V_PAGE_PADDING`
        elements longer than K's, so a kernel that addresses V with K's strides reads
        the wrong rows (the suite's pool holds K and V in one tensor: nothing changes)."""
        if kv_strides not in KV_STRIDES:
            raise ValueError(f"kv_strides={kv_strides!r} must be one of {KV_STRIDES}")
        page_bytes = cache[0].numel() * cache.element_size()
        native = to_native(cache, cache_layout, layout)
        tensors = {n: t.to(device) for n, t in native_tensors(native).items()}
        if kv_strides == "distinct" and cache_layout in ("kv_tuple", "flat"):
            tensors["v_cache"] = _page_padded(tensors["v_cache"], V_PAGE_PADDING)
        return native_from(native, {n: self.place(n, t, page_bytes) for n, t in tensors.items()})

    def place_output(self, name: str, shape, dtype, device) -> torch.Tensor:
        """An output buffer for a kernel that writes into ``out=``: ``shape`` in ``dtype`` on
        ``device``, filled with NaN (a row the kernel leaves unwritten shows), between
        guards like every input."""
        return self.place(name, torch.full(tuple(shape), float("nan"), dtype=dtype, device=device))

"""What every paged read launch fixes on the host, written once: the plan fields the MHA
read families share (:class:`ReadPlan`), the window's launch arguments and constexpr,
and the split-KV outputs. The device side of the same reads is
:mod:`pagedkv_kernels.device.attention_core`; the merge of split outputs is
:func:`pagedkv_kernels.merge.finish_splits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv_lib.window import LinearWindow, Window

from ..device.addressing import ring_params
from .launch import PageTable

__all__ = ["ReadPlan", "read_plan_fields", "window_args", "window_kind", "split_outputs"]


@dataclass(frozen=True)
class ReadPlan:
    """What every MHA read plan fixes (:class:`pagedkv_kernels.decode.DecodePlan`,
    :class:`pagedkv_kernels.quant_decode.QuantDecodePlan`, :class:`pagedkv_kernels.prefill.PrefillPlan`
    add their tiles and their pool's fingerprint): the query heads, the pool's heads and
    page size, the softmax scale (natural units), the window and the page table."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    q_dtype: torch.dtype
    scale: float
    window: Window | None
    group: int  # query heads per KV head
    table: PageTable


def read_plan_fields(q: torch.Tensor, num_kv_heads: int, page_size: int, scale, window, table: PageTable) -> dict:
    """The :class:`ReadPlan` fields of a launch with ``q [tokens, num_q_heads, head_dim]``
    (values already checked); ``scale=None`` is ``1 / sqrt(head_dim)``."""
    _, num_q_heads, head_dim = q.shape
    return {
        "num_q_heads": num_q_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "page_size": page_size,
        "q_dtype": q.dtype,
        "scale": 1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        "window": window,
        "group": num_q_heads // num_kv_heads,
        "table": table,
    }


def window_args(window: Window | None) -> tuple[int, int, int, int]:
    """``(sink_tokens, bubble_len, cyclic_cache_len, window_recent)`` of a launch: the
    ring's parameters (:func:`pagedkv_kernels.device.addressing.ring_params`; zeros without a ring) and
    the recent range's length ``window.recent_tokens`` (a ring's ``window - sinks``, a
    linear window's ``window_left + 1``; 0 without a window, unused then)."""
    sinks, bubble, cyclic = ring_params(window)
    recent = 0 if window is None else window.recent_tokens
    return sinks, bubble, cyclic, recent


def window_kind(window: Window | None) -> int:
    """The ``WINDOW`` constexpr of a read launch: 0 no window, 1 a ring, 2 a linear window."""
    if isinstance(window, LinearWindow):
        return 2
    return 0 if window is None else 1


def split_outputs(out: torch.Tensor, splits: int, partials: bool):
    """``(part, lse, part_strides, lse_strides)`` that a split-KV kernel writes for
    ``out [batch, heads, width]``: with one split (and no partials asked for) ``out``
    itself, with a split stride of 0 and ``lse`` unused; otherwise new fp32 ``part
    [batch, heads, splits, width]`` and ``lse [batch, heads, splits]``."""
    if splits == 1 and not partials:
        return out, out, (out.stride(0), out.stride(1), 0, out.stride(2)), (0, 0, 0)
    batch, heads, width = out.shape
    part = torch.empty((batch, heads, splits, width), dtype=torch.float32, device=out.device)
    lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=out.device)
    return part, lse, part.stride(), lse.stride()

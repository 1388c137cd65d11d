"""The prefill kernel's launch plan: product mode, tiles and the tile list.

:func:`pagedkv_kernels.prefill.plan_prefill` and :func:`~pagedkv_kernels.prefill.plan_prefill_csr` check
a call and hand the results here; :func:`pagedkv_kernels.prefill.run_prefill` launches the plan.
Kept apart from the kernel so that each module stays short: this one is host code only.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch

from pagedkv_lib.cache_layouts import KVCacheView
from pagedkv_lib.draft_tree import pack_tree_mask

from .host.launch import PageTable, cache_fingerprint, int32_on_device
from .host.read_plan import ReadPlan, read_plan_fields
from .host.tiles import prefill_tiles
from .host.validate import INT32_MAX

__all__ = ["DOT_MODES", "PrefillPlan", "dot_mode", "tile_list", "make_prefill_plan"]

DOT_MODES = ("sum", "fp32", "fp16", "bf16")  # index = the kernel's DOT constexpr


@dataclass(frozen=True)
class PrefillPlan(ReadPlan):
    """A validated prefill launch, fixed once by :func:`plan_prefill` or
    :func:`plan_prefill_csr` and launched by :func:`run_prefill`: the tiles, the dot
    mode, the tile list and the index tensors (int32, contiguous, on the device).

    ``q``, ``cache`` (and ``k_new``, ``v_new`` when planned with them) given to
    :func:`run_prefill` must have the planned shapes, dtypes and device (``cache`` also
    its strides: page ids were checked against it).
    """

    layout: str
    cache: tuple  # (shape, strides, dtype, device) of the pool, or one per tensor of a pair
    cache_layout: str  # "paged", "kv_tuple" or "vllm_x" (pagedkv_lib.cache_layouts.kv_cache_view)
    total_q: int
    block_m: int  # (query, head) rows per tile
    block_n: int  # keys per loop iteration
    block_d: int
    num_warps: int
    dot_mode: str  # one of DOT_MODES
    num_tiles: int  # programs along grid axis 0
    visited_pairs: int  # (query row, key) pairs inside the tiles' key ranges, all KV heads
    tile_request: torch.Tensor  # [num_tiles] request of each tile
    tile_row: torch.Tensor  # [num_tiles] first (query, head) row of each tile in its request
    qo_indptr: torch.Tensor  # [batch + 1]
    causal: bool = True  # False: every query sees all its request's keys
    new_kv: bool = False  # the new tokens' K/V come apart (k_new, v_new), the cache holds the context
    tree_mask: torch.Tensor | None = None  # [total_q, words] int32: the draft-tree mask, packed (pack_tree_mask)

    @property
    def plain(self) -> bool:
        """Whether the plain kernel (:func:`pagedkv_kernels.prefill.prefill_kernel`) runs this
        plan: the suite's pool, the new tokens' K/V in it, no draft tree. Else
        :func:`pagedkv_kernels.prefill_any_layout.prefill_any_layout_kernel` does."""
        return self.cache_layout == "paged" and not self.new_kv and self.tree_mask is None


def dot_mode(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """The kernel's product mode (one of :data:`DOT_MODES`): ``"sum"`` in the
    interpreter; compiled, ``"fp32"`` for fp32 pools and for a ``q`` whose dtype differs
    from the pool's, else the 16-bit dtype. See the module docstring for what each mode
    computes and costs in precision."""
    if not runtime.gpu_plans():
        return "sum"
    if cache_dtype == torch.float32 or q_dtype != cache_dtype:
        return "fp32"
    return "fp16" if cache_dtype == torch.float16 else "bf16"


def tile_list(q_lens: torch.Tensor, seq_lens: torch.Tensor, group: int, block_m: int, window, causal: bool = True):
    """``(tile_request, tile_row, visited_pairs)``: one tile per ``block_m`` (query, head)
    rows of every request, longest key range first; ``visited_pairs`` counts the
    (row, key) pairs of every tile's key range (what the kernel computes scores for)."""
    rows = q_lens * group
    per = torch.div(rows + block_m - 1, block_m, rounding_mode="floor")
    request = torch.repeat_interleave(torch.arange(q_lens.numel()), per)
    first = torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    row0 = (torch.arange(int(per.sum())) - first) * block_m
    past = (seq_lens - q_lens)[request]
    p_lo = past + torch.div(row0, group, rounding_mode="floor")
    p_hi = past + torch.minimum(torch.div(row0 + block_m - 1, group, rounding_mode="floor"), q_lens[request] - 1)
    end = p_hi + 1 if causal else seq_lens[request]  # the kernel's key range ends here
    keys = end
    if window is not None:
        sinks, recent = window.sink_tokens, window.recent_tokens
        start = torch.clamp(p_lo - recent + 1, min=sinks)
        keys = torch.clamp(end, max=sinks) + torch.clamp(end - start, min=0)
    order = torch.argsort(-keys, stable=True)
    live_rows = torch.clamp(rows[request] - row0, max=block_m)
    return request[order], row0[order], int((keys * live_rows).sum())


def make_prefill_plan(
    q, view: KVCacheView, cache, layout, scale, window, qo, lens, table: PageTable, causal, new_kv, tree
) -> PrefillPlan:
    """The :class:`PrefillPlan` of a checked call: ``qo``, ``lens`` host int64 (the
    checks' results), ``view`` the cache's :class:`~pagedkv_lib.cache_layouts.KVCacheView`,
    ``tree`` the checked bool draft-tree mask or None (packed here, a copy)."""
    dims = view.dims
    fields = read_plan_fields(q, dims.num_kv_heads, dims.page_size, scale, window, table)
    group = fields["group"]
    q_lens = qo[1:] - qo[:-1]
    max_rows = int(q_lens.max()) * group if q_lens.numel() else 0
    if max_rows > INT32_MAX - 2**20:  # the kernel numbers a request's (query, head) rows in int32
        raise ValueError(f"a request has {max_rows} (query, head) rows; the kernel indexes them with int32")
    max_keys = int(lens.max()) if lens.numel() else 0
    mode = dot_mode(q.dtype, view.key.dtype)
    gathered = view.cache_layout == "vllm_x" or new_kv
    block_m, block_n, block_d, num_warps = prefill_tiles(group, fields["head_dim"], max_rows, max_keys, mode, gathered)
    tile_request, tile_row, pairs = tile_list(q_lens, lens, group, block_m, window, causal)
    return PrefillPlan(
        layout=layout,
        cache=cache_fingerprint(cache),
        cache_layout=view.cache_layout,
        total_q=q.shape[0],
        block_m=block_m,
        block_n=block_n,
        block_d=block_d,
        num_warps=num_warps,
        dot_mode=mode,
        num_tiles=int(tile_request.numel()),
        visited_pairs=pairs * dims.num_kv_heads,
        tile_request=int32_on_device(tile_request, q.device, min_len=1),
        tile_row=int32_on_device(tile_row, q.device, min_len=1),
        qo_indptr=int32_on_device(qo, q.device),
        causal=causal,
        new_kv=new_kv,
        tree_mask=None if tree is None else pack_tree_mask(tree),  # a copy: the plan holds what was checked
        **fields,
    )

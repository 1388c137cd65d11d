"""Attention backends: the three paged operations a Llama layer needs, on one of three paths.

Every class has the same three methods, called in this order by every layer of every
step (:mod:`pagedkv_engine.model`):

* ``write(q, k, v, cache, slot_mapping, positions)``: rotate ``q`` (in place) and ``k``
  by RoPE at ``positions`` and store the rotated K and V at ``slot_mapping``;
* ``prefill(q, cache, qo_indptr, block_tables, seq_lens)``: attention of chunks of
  several new tokens per sequence (chunked prefill, prefix-cache hits);
* ``decode(q, cache, block_tables, seq_lens)``: one new token per sequence.

:class:`TorchAttention` (``"torch"``, the default) is the fast CPU path: transformers'
RoPE, then batched torch gathers and matrix products whose index tensors are built
once per step (:func:`plan_write`, :func:`plan_decode`, :func:`plan_prefill`) and
reused by every layer, with no argument checks per layer beyond the step's slots.
:class:`ReferenceAttention` (``"reference"``) calls the suite's Python references
(:mod:`pagedkv_lib.reference`), every argument checked on every call; the tests hold
the two equal. Both compute RoPE exactly as Hugging Face transformers does (fp32
``inv_freq``, fp32 angle, ``rotate_half``), so their rotated Q and K are bit-identical
to the oracle's.
:class:`pagedkv_engine.triton_attention.TritonAttention` (its own module, which imports
:mod:`pagedkv_kernels` and with it triton) calls the suite's Triton kernels: the fused write
(RoPE on Q and K in the same launch; its angle is reduced in fp64, so its cos/sin
differ from transformers' in the last bits) and the paged decode kernel.

Shapes: ``q [num_tokens, num_q_heads, head_dim]``, ``k, v [num_tokens, num_kv_heads,
head_dim]``, all in the cache's dtype; ``cache`` is one layer's raw NHD pool
``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedkv_lib import reference
from pagedkv_lib.checks.shared import check_slots
from pagedkv_lib.pool import CacheDims

__all__ = [
    "ATTENTION_PATHS",
    "HFRope",
    "LastCall",
    "WritePlan",
    "AttendPlan",
    "plan_write",
    "plan_decode",
    "plan_prefill",
    "grouped_attention",
    "TorchAttention",
    "ReferenceAttention",
    "make_attention",
]

ATTENTION_PATHS = ("torch", "triton", "reference")


class HFRope:
    """Rotary embedding computed the way transformers' ``LlamaRotaryEmbedding`` and
    ``apply_rotary_pos_emb`` compute it, op for op, in fp32 (NeoX half-split pairs)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = float(theta)
        # LlamaRotaryEmbedding.compute_default_rope_parameters, verbatim.
        self.inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [num_tokens, 1, head_dim]`` (fp32) at integer ``positions [num_tokens]``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x [num_tokens, heads, head_dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)


# --------------------------------------------------------------------------- per-step plans


class LastCall:
    """``fn`` remembering its latest call: called again with the same arguments (tensors
    by identity, other values by ``==``) it returns the same result without running.

    The model passes one step's index tensors to all of its layers, so a plan built
    from them is built once per step, not once per layer; the next step brings new
    tensors and a new plan. (The engine never changes a step's tensors in place.)"""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.args: tuple | None = None
        self.result = None

    def _same(self, args: tuple) -> bool:
        if self.args is None or len(args) != len(self.args):
            return False
        return all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(args, self.args))

    def __call__(self, *args):
        if not self._same(args):
            self.result = self.fn(*args)
            self.args = args  # holding the tensors keeps their ids from being reused
        return self.result


class WritePlan(NamedTuple):
    """Where one step's tokens go: ``k_rows, v_rows [num_tokens]`` int64 rows of the
    flat pool ``cache.view(-1, num_kv_heads, head_dim)``, and RoPE's ``cos, sin
    [num_tokens, 1, head_dim]`` fp32 at the tokens' positions."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class AttendPlan(NamedTuple):
    """What a group of queries reads: ``pages [batch, num_blocks]`` int64, the pages of
    each sequence in order (a table's ``-1`` padding replaced by its first page, which
    the bias hides), and ``bias [batch or 1, 1, group * q_len or 1, num_blocks *
    page_size]`` fp32: 0 where a key is visible to a query and ``-inf`` where it is not
    (rows ``g * q_len + i`` for query ``i`` of the ``g``-th head of a GQA group)."""

    pages: torch.Tensor
    bias: torch.Tensor


def flat_rows(pages: torch.Tensor, offsets: torch.Tensor, page_size: int) -> torch.Tensor:
    """K rows of the flat pool ``[num_pages * 2 * page_size, heads, head_dim]`` of the
    NHD cache ``[num_pages, 2, page_size, heads, head_dim]`` (V rows: ``+ page_size``)."""
    return pages.long() * (2 * page_size) + offsets


def plan_write(slot_mapping: torch.Tensor, positions: torch.Tensor, cache_shape: tuple, rope: HFRope) -> WritePlan:
    """The :class:`WritePlan` of one step's ``slot_mapping [num_tokens]`` (int64, no
    ``-1``) and ``positions [num_tokens]``. ValueError, naming the slot, for a slot
    outside the pool or written twice (:func:`pagedkv_lib.checks.shared.check_slots`)."""
    num_pages, _, page_size, num_kv_heads, head_dim = cache_shape
    check_slots(slot_mapping.cpu(), CacheDims(num_pages, page_size, num_kv_heads, head_dim))
    if bool((slot_mapping < 0).any()):
        raise ValueError("slot_mapping holds -1 (padding): the engine's torch path writes every token")
    k_rows = flat_rows(slot_mapping // page_size, slot_mapping % page_size, page_size)
    cos, sin = rope.cos_sin(positions)
    return WritePlan(k_rows, k_rows + page_size, cos, sin)


def _pages(block_tables: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """The first ``ceil(num_tokens / page_size)`` columns of ``block_tables [batch,
    max_blocks]`` as int64, ``-1`` replaced by each row's first page."""
    pages = block_tables[:, : -(-num_tokens // page_size)].long()
    return torch.where(pages < 0, pages[:, :1], pages)


def _bias(visible: torch.Tensor) -> torch.Tensor:
    """0 where ``visible``, ``-inf`` elsewhere (fp32)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> AttendPlan:
    """The :class:`AttendPlan` (``q_len = 1``) of ``batch`` decoding sequences:
    ``block_tables [batch, max_blocks]`` (``-1`` padded), ``seq_lens [batch]`` >= 1 (KV
    length including the new token, which sees every key)."""
    lens = seq_lens.long()
    max_len = int(lens.max()) if lens.numel() else 0
    pages = _pages(block_tables, max_len, page_size)
    keys = torch.arange(pages.shape[1] * page_size, device=lens.device)
    return AttendPlan(pages, _bias(keys[None, :] < lens[:, None])[:, None, None, :])


def plan_prefill(
    qo_indptr: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, group: int
) -> list[tuple[int, int, AttendPlan]]:
    """``(lo, hi, plan)`` per prefill chunk with queries (``qo_indptr [batch + 1]``):
    queries ``lo:hi`` of the step's prefill rows over ``seq_lens[b]`` keys, causal and
    aligned bottom-right (query ``i`` sits at position ``seq_len - (hi - lo) + i``), the
    bias repeated for the ``group`` query heads of a KV head."""
    out = []
    bounds, lens = qo_indptr.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        pages = _pages(block_tables[b : b + 1], n, page_size)
        keys = torch.arange(pages.shape[1] * page_size, device=pages.device)
        queries = torch.arange(n - (hi - lo), n, device=pages.device)
        bias = _bias(keys[None, :] <= queries[:, None]).repeat(group, 1)
        out.append((lo, hi, AttendPlan(pages, bias[None, None])))
    return out


def grouped_attention(q: torch.Tensor, cache: torch.Tensor, plan: AttendPlan) -> torch.Tensor:
    """Softmax attention (fp32) of ``q [batch, q_len, num_q_heads, head_dim]`` over the
    pages of ``plan``; returns ``[batch * q_len, num_q_heads, head_dim]``.

    Whole pages are gathered (one copy of ``page_size`` rows each, K and V apart), and
    the ``group = num_q_heads // num_kv_heads`` query heads that share a KV head (heads
    ``h * group ..``) are stacked into one matrix of ``group * q_len`` rows, so K and V
    are never repeated per query head (and ``enable_gqa``, torch >= 2.5, is not needed)."""
    batch, q_len, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = cache.shape
    group = num_q_heads // num_kv_heads
    width = plan.pages.shape[1] * page_size

    def gather(kv: int) -> torch.Tensor:  # [batch, Hk, width, D], a view of the copied pages
        rows = cache[:, kv].index_select(0, plan.pages.view(-1))
        return rows.view(batch, width, num_kv_heads, head_dim).transpose(1, 2)

    qg = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(batch, num_kv_heads, group * q_len, head_dim)
    out = F.scaled_dot_product_attention(qg, gather(0), gather(1), attn_mask=plan.bias)
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * q_len, num_q_heads, head_dim)


class TorchAttention:
    """The fast CPU path (see the module docstring): plans built once per step by
    :class:`LastCall`, batched gathers and matrix products per layer.

    Preconditions the engine meets and the references do not need: ``cache`` is
    contiguous, and every row of a sequence's pages holds finite values, written or
    not (the engine's pools start zeroed), because whole pages are read and a hidden
    key's zero weight times NaN would still be NaN."""

    name = "torch"

    def __init__(self, head_dim: int, rope_theta: float) -> None:
        self.rope = HFRope(head_dim, rope_theta)
        self._write_plan = LastCall(lambda slots, pos, shape: plan_write(slots, pos, shape, self.rope))
        self._decode_plan = LastCall(plan_decode)
        self._prefill_plan = LastCall(plan_prefill)

    def write(self, q, k, v, cache, slot_mapping, positions) -> None:
        """Rotate ``q`` in place and store RoPE(``k``) and ``v`` at ``slot_mapping``."""
        plan = self._write_plan(slot_mapping, positions, tuple(cache.shape))
        q.copy_(HFRope.rotate(q, plan.cos, plan.sin))
        flat = cache.view(-1, *cache.shape[-2:])
        flat[plan.k_rows] = HFRope.rotate(k, plan.cos, plan.sin)
        flat[plan.v_rows] = v

    def prefill(self, q, cache, qo_indptr, block_tables, seq_lens) -> torch.Tensor:
        """``[num_tokens, num_q_heads, head_dim]``: query ``i`` of request ``b`` sits at
        position ``seq_lens[b] - q_len[b] + i`` (bottom-right causal)."""
        out = torch.empty_like(q)
        group = q.shape[1] // cache.shape[3]
        for lo, hi, plan in self._prefill_plan(qo_indptr, block_tables, seq_lens, cache.shape[2], group):
            out[lo:hi] = grouped_attention(q[None, lo:hi], cache, plan)
        return out

    def decode(self, q, cache, block_tables, seq_lens) -> torch.Tensor:
        """``[batch, num_q_heads, head_dim]``: each sequence's last token over its pages."""
        return grouped_attention(q[:, None], cache, self._decode_plan(block_tables, seq_lens, cache.shape[2]))


class ReferenceAttention:
    """The reference path: transformers' RoPE, then :mod:`pagedkv_lib.reference`'s paged
    append, prefill and decode attention (fp32 softmax), every argument checked."""

    name = "reference"

    def __init__(self, head_dim: int, rope_theta: float, layout: str = "NHD") -> None:
        self.rope = HFRope(head_dim, rope_theta)
        self.layout = layout

    def write(self, q, k, v, cache, slot_mapping, positions) -> None:
        """Rotate ``q`` in place and store RoPE(``k``) and ``v`` at ``slot_mapping``."""
        cos, sin = self.rope.cos_sin(positions)
        q.copy_(self.rope.rotate(q, cos, sin))
        reference.append_paged_kv(self.rope.rotate(k, cos, sin), v, cache, slot_mapping, self.layout)

    def prefill(self, q, cache, qo_indptr, block_tables, seq_lens) -> torch.Tensor:
        """As :meth:`TorchAttention.prefill`, by :func:`pagedkv_lib.reference.paged_prefill_attention`."""
        return reference.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout=self.layout)

    def decode(self, q, cache, block_tables, seq_lens) -> torch.Tensor:
        """As :meth:`TorchAttention.decode`, by :func:`pagedkv_lib.reference.paged_decode_attention`."""
        return reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=self.layout)


def make_attention(path: str, head_dim: int, rope_theta: float):
    """The backend for ``path`` (one of :data:`ATTENTION_PATHS`); ValueError otherwise."""
    if path == "torch":
        return TorchAttention(head_dim, rope_theta)
    if path == "reference":
        return ReferenceAttention(head_dim, rope_theta)
    if path == "triton":
        # Imported here, not at the top: pagedkv_engine imports no triton until a caller
        # asks for the kernel path (the module's name says what it brings in).
        from pagedkv_engine.triton_attention import TritonAttention

        return TritonAttention(head_dim, rope_theta)
    raise ValueError(f"attention={path!r} must be one of {ATTENTION_PATHS}")

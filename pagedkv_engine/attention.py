"""Attention backends: the three paged operations a Llama layer needs, on one of two paths.

Both classes have the same three methods, called in this order by every layer of
every step (:mod:`pagedkv_engine.model`):

* ``write(q, k, v, cache, slot_mapping, positions)``: rotate ``q`` (in place) and ``k``
  by RoPE at ``positions`` and store the rotated K and V at ``slot_mapping``;
* ``prefill(q, cache, qo_indptr, block_tables, seq_lens)``: attention of chunks of
  several new tokens per sequence (chunked prefill, prefix-cache hits);
* ``decode(q, cache, block_tables, seq_lens)``: one new token per sequence.

:class:`TorchAttention` calls the suite's Python references and computes RoPE exactly
as Hugging Face transformers does (fp32 ``inv_freq``, fp32 angle, ``rotate_half``), so
its rotated Q and K are bit-identical to the oracle's.
:class:`pagedkv_engine.triton_attention.TritonAttention` (its own module, which imports
:mod:`kernels` and with it triton) calls the suite's Triton kernels: the fused write
(RoPE on Q and K in the same launch; its angle is reduced in fp64, so its cos/sin
differ from transformers' in the last bits) and the paged decode kernel.

Shapes: ``q [num_tokens, num_q_heads, head_dim]``, ``k, v [num_tokens, num_kv_heads,
head_dim]``, all in the cache's dtype; ``cache`` is one layer's raw NHD pool
``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch

from pagedkv_lib import reference

__all__ = ["ATTENTION_PATHS", "HFRope", "TorchAttention", "make_attention"]

ATTENTION_PATHS = ("torch", "triton")


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


class TorchAttention:
    """The reference path: transformers' RoPE, then :mod:`pagedkv_lib.reference`'s paged
    append, prefill and decode attention (fp32 softmax)."""

    name = "torch"

    def __init__(self, head_dim: int, rope_theta: float, layout: str = "NHD") -> None:
        self.rope = HFRope(head_dim, rope_theta)
        self.layout = layout

    def write(self, q, k, v, cache, slot_mapping, positions) -> None:
        """Rotate ``q`` in place and store RoPE(``k``) and ``v`` at ``slot_mapping``."""
        cos, sin = self.rope.cos_sin(positions)
        q.copy_(self.rope.rotate(q, cos, sin))
        reference.append_paged_kv(self.rope.rotate(k, cos, sin), v, cache, slot_mapping, self.layout)

    def prefill(self, q, cache, qo_indptr, block_tables, seq_lens) -> torch.Tensor:
        """``[num_tokens, num_q_heads, head_dim]``: query ``i`` of request ``b`` sits at
        position ``seq_lens[b] - q_len[b] + i`` (bottom-right causal)."""
        return reference.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout=self.layout)

    def decode(self, q, cache, block_tables, seq_lens) -> torch.Tensor:
        """``[batch, num_q_heads, head_dim]``: each sequence's last token over its pages."""
        return reference.paged_decode_attention(q, cache, block_tables, seq_lens, layout=self.layout)


def make_attention(path: str, head_dim: int, rope_theta: float):
    """The backend for ``path`` (``"torch"`` or ``"triton"``); ValueError otherwise."""
    if path == "torch":
        return TorchAttention(head_dim, rope_theta)
    if path == "triton":
        # Imported here, not at the top: pagedkv_engine imports no triton until a caller
        # asks for the kernel path (the module's name says what it brings in).
        from .triton_attention import TritonAttention

        return TritonAttention(head_dim, rope_theta)
    raise ValueError(f"attention={path!r} must be one of {ATTENTION_PATHS}")

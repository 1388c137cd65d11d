"""The kernel attention path: the suite's Triton kernels behind the backend interface of
:mod:`pagedkv_engine.attention` (``write``, ``prefill``, ``decode``; same shapes).

Its own module because it imports :mod:`pagedkv_kernels` and with it triton, which the rest of
:mod:`pagedkv_engine` never does: :func:`pagedkv_engine.attention.make_attention`
imports it for ``attention="triton"`` only.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (chooses the Triton backend before anything imports triton)

# isort: split
import torch

import pagedkv_kernels as kernels

__all__ = ["TritonAttention"]


class TritonAttention:
    """The kernel path: the fused Triton write (RoPE on Q and K, then store) and the
    Triton paged decode; prefill through ``kernels.paged_prefill_attention``."""

    name = "triton"
    # Block copies (copy-on-write, offload, restore): every layer in one launch.
    copy_blocks = staticmethod(kernels.copy_paged_blocks)

    def __init__(self, head_dim: int, rope_theta: float, layout: str = "NHD") -> None:
        self.head_dim = head_dim
        self.rope_theta = float(rope_theta)
        self.layout = layout

    def write(self, q, k, v, cache, slot_mapping, positions) -> None:
        """One launch: K rotated and stored with V, ``q`` rotated in place."""
        kernels.append_paged_kv(
            k, v, cache, slot_mapping, self.layout, rope="neox", positions=positions, rope_theta=self.rope_theta, q=q
        )

    def prefill(self, q, cache, qo_indptr, block_tables, seq_lens) -> torch.Tensor:
        """As :meth:`pagedkv_engine.attention.TorchAttention.prefill`, in the Triton prefill kernel."""
        return kernels.paged_prefill_attention(q, cache, qo_indptr, block_tables, seq_lens, layout=self.layout)

    def decode(self, q, cache, block_tables, seq_lens) -> torch.Tensor:
        """As :meth:`pagedkv_engine.attention.TorchAttention.decode`, in the Triton decode kernel."""
        return kernels.paged_decode_attention(q, cache, block_tables, seq_lens, layout=self.layout)

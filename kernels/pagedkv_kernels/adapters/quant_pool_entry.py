"""The quantized kernels on a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool` object.

Every kernel family takes its pool as tensors plus a layout; the quantized one as its
codes, scales and global scale plus ``kv_dtype``, ``scale_mode`` and ``layout``
(:mod:`pagedkv_kernels.quant_write`, :mod:`pagedkv_kernels.quant_decode`). These thin wrappers take
the pool object instead (its :meth:`~pagedkv_lib.quant_pool.QuantizedKVPool.kernel_args`),
which is the signature of the Python twins in :mod:`pagedkv_lib.quant_reference` and of
the conformance harness's quantized family (``quant_append_fn``, ``quant_decode_fn``).
"""

from __future__ import annotations

from ..quant_decode import paged_decode_attention_quant, paged_decode_attention_quant_csr
from ..quant_write import append_paged_kv_quant, append_paged_kv_quant_csr, zero_paged_v_tail_quant

__all__ = [
    "append_paged_kv_quant_pool",
    "append_paged_kv_quant_csr_pool",
    "zero_paged_v_tail_quant_pool",
    "paged_decode_attention_quant_pool",
    "paged_decode_attention_quant_csr_pool",
]


def append_paged_kv_quant_pool(k, v, pool, slot_mapping, **options) -> None:
    """:func:`append_paged_kv_quant` into a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`
    (the signature of the Python twin and of the conformance harness's quantized family)."""
    return append_paged_kv_quant(k, v, slot_mapping=slot_mapping, **pool.kernel_args(), **options)


def append_paged_kv_quant_csr_pool(k, v, pool, batch_indices, positions, kv_indices, kv_indptr, **options) -> None:
    """:func:`append_paged_kv_quant_csr` into a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`."""
    index = {"batch_indices": batch_indices, "positions": positions, "kv_indices": kv_indices, "kv_indptr": kv_indptr}
    return append_paged_kv_quant_csr(k, v, **index, **pool.kernel_args(), **options)


def zero_paged_v_tail_quant_pool(pool, kv_indptr, kv_indices, kv_last_page_len) -> None:
    """:func:`zero_paged_v_tail_quant` on a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`."""
    tables = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    return zero_paged_v_tail_quant(**tables, **pool.kernel_args())


def paged_decode_attention_quant_pool(q, pool, block_tables, seq_lens, scale=None, num_splits=None, window=None):
    """:func:`paged_decode_attention_quant` over a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`
    (the signature of the Python twin and of the conformance harness's quantized family)."""
    # fmt: off
    return paged_decode_attention_quant(
        q, block_tables=block_tables, seq_lens=seq_lens, scale=scale, num_splits=num_splits, window=window,
        **pool.kernel_args(),
    )
    # fmt: on


def paged_decode_attention_quant_csr_pool(
    q, pool, kv_indptr, kv_indices, kv_last_page_len, scale=None, num_splits=None
):
    """:func:`paged_decode_attention_quant_csr` over a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`."""
    tables = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    return paged_decode_attention_quant_csr(q, **tables, scale=scale, num_splits=num_splits, **pool.kernel_args())

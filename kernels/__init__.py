"""Triton kernels for paged KV caches: a write (append) kernel and a read (decode) kernel.

Importing this package first imports :mod:`pagedkv_lib.runtime`, which sets
``TRITON_INTERPRET`` before triton is imported: compiled kernels when CUDA is
available, Triton's interpreter on CPU otherwise (``PAGEDKV_BACKEND`` forces either).
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

from .read import (  # noqa: E402
    gather_paged_kv,
    merge_partials,
    paged_decode_attention,
    paged_decode_attention_csr,
    paged_decode_attention_partials,
)
from .write import append_paged_kv, append_paged_kv_csr, zero_paged_v_tail  # noqa: E402

__all__ = [
    "append_paged_kv",
    "append_paged_kv_csr",
    "zero_paged_v_tail",
    "paged_decode_attention",
    "paged_decode_attention_csr",
    "paged_decode_attention_partials",
    "merge_partials",
    "gather_paged_kv",
]

"""Triton kernels for paged KV caches: a write (append) kernel and a read (decode) kernel.

Importing this package first imports :mod:`pagedkv_lib.runtime`, which sets
``TRITON_INTERPRET`` before triton is imported: compiled kernels when CUDA is
available, Triton's interpreter on CPU otherwise (``PAGEDKV_BACKEND`` forces either).
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

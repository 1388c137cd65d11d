"""pagedkv_lib: bookkeeping, Python references and plots for paged KV caches.

Pure Python + PyTorch; importing it never imports triton (the ``kernels`` package
does, after :mod:`pagedkv_lib.runtime` has chosen the backend).
"""

from pagedkv_lib import runtime
from pagedkv_lib.allocator import BlockAllocator, OutOfBlocksError
from pagedkv_lib.formats import (
    PAD,
    block_table_to_csr,
    csr_seq_lens,
    csr_to_block_table,
    get_batch_indices_positions,
    pad_block_tables,
    slot_mapping,
)
from pagedkv_lib.indexing import element_offset, locate, locate_pow2
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.memory import PRESETS, ModelSpec, kv_bytes_per_token, kv_cache_bytes, max_tokens
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.window import LinearWindow, RingWindow

__all__ = [
    "runtime",
    "BlockAllocator",
    "OutOfBlocksError",
    "KVCacheManager",
    "PagedKVPool",
    "RingWindow",
    "LinearWindow",
    "ModelSpec",
    "PRESETS",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "max_tokens",
    "PAD",
    "block_table_to_csr",
    "csr_seq_lens",
    "csr_to_block_table",
    "get_batch_indices_positions",
    "pad_block_tables",
    "slot_mapping",
    "element_offset",
    "locate",
    "locate_pow2",
]

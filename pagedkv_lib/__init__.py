"""pagedkv_lib: the ground floor of the suite: the caches before paging (a ``torch.cat``
cache, a preallocated pool, a packed batch, an attention layer that carries its cache:
:mod:`pagedkv_lib.contiguous_cache`), block bookkeeping (allocator, manager, prefix cache,
windows), pools and table formats, float64 and bit-exact references, the argument rules
references and kernels share (:mod:`pagedkv_lib.checks`), and the backend choice
(:mod:`pagedkv_lib.runtime`).

Pure Python + PyTorch; it imports nothing of the floors above it (the kernels
``pagedkv_kernels``, the engine ``pagedkv_engine``, the lab ``pagedkv_lab``) and never
triton, which ``pagedkv_kernels`` imports after :mod:`pagedkv_lib.runtime` has chosen the
backend (``tests/test_layout.py``).
"""

from pagedkv_lib import runtime
from pagedkv_lib.allocator import BlockAllocator, OutOfBlocksError
from pagedkv_lib.contiguous_cache import (
    MHAWithCache,
    PreallocKVCache,
    SimpleKVCache,
    VariableLengthKVCache,
    broadcast_kv_for_gqa,
)
from pagedkv_lib.formats import (
    PAD,
    block_table_to_csr,
    csr_seq_lens,
    csr_to_block_table,
    get_batch_indices_positions,
    pad_block_tables,
    slot_mapping,
)
from pagedkv_lib.global_manager import GlobalKVCacheManager
from pagedkv_lib.indexing import element_offset, locate, locate_pow2
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.memory import PRESETS, ModelSpec, kv_bytes_per_token, kv_cache_bytes, max_tokens
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.window import LinearWindow, RingWindow

__all__ = [
    "runtime",
    "SimpleKVCache",
    "PreallocKVCache",
    "VariableLengthKVCache",
    "MHAWithCache",
    "broadcast_kv_for_gqa",
    "BlockAllocator",
    "OutOfBlocksError",
    "KVCacheManager",
    "GlobalKVCacheManager",
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

"""pagedkv_engine: serve a real language model on the suite's paged KV cache.

A small engine (nano-vllm sized) that sits above :mod:`pagedkv_lib` (allocator, block
tables, prefix cache, copy-on-write forks, pools) and :mod:`pagedkv_kernels` (the Triton
write with fused RoPE and the paged decode): its own Llama forward over the weights
transformers loads, a scheduler with continuous batching, chunked prefill, prefix
caching, preemption by recompute, parallel sampling by fork and speculative decoding
with KV rollback, and an oracle that holds every generated token to transformers' own
``generate``.

Modules, in reading order: :mod:`~pagedkv_engine.weights` (the model file and its disk
cache), :mod:`~pagedkv_engine.attention` (the two attention paths; the kernel path in
:mod:`~pagedkv_engine.triton_attention`), :mod:`~pagedkv_engine.model` (the forward),
:mod:`~pagedkv_engine.scheduler`, :mod:`~pagedkv_engine.speculative` (prompt-lookup drafts
for speculative decoding), :mod:`~pagedkv_engine.parts` (the engine's replaceable
parts: where planted bugs go in), :mod:`~pagedkv_engine.engine`, :mod:`~pagedkv_engine.check` (the oracle),
:mod:`~pagedkv_engine.memory` (caches before paging), :mod:`~pagedkv_engine.plots`.
Command line: ``python -m pagedkv_engine --help``.

Importing this package imports neither transformers nor triton; ``attention="triton"``
imports :mod:`pagedkv_kernels` (through :mod:`~pagedkv_engine.triton_attention`).
"""

from pagedkv_engine.engine import Engine, EngineStats, StepRecord  # noqa: E402
from pagedkv_engine.scheduler import SamplingParams, Sequence  # noqa: E402
from pagedkv_lib import runtime  # noqa: F401  (chooses the Triton backend before anything imports triton)

__all__ = ["Engine", "EngineStats", "StepRecord", "SamplingParams", "Sequence"]

"""The KV-cache memory formula: exact bytes for a model, a batch and a storage dtype.

For standard attention every layer stores one K and one V vector per KV head and
token, so

    bytes_per_token = num_layers * kv_factor * kv_heads_per_rank * vector_bytes(head_dim)

with ``kv_factor = 2``. MLA (DeepSeek-V2) caches one compressed latent of width
``kv_lora_rank`` plus a decoupled RoPE key of width ``qk_rope_head_dim`` per layer
and token, shared by all heads: ``kv_factor = 1`` and one "head" of width
``kv_lora_rank + qk_rope_head_dim``.

``vector_bytes(n)`` is ``n * itemsize`` for the plain dtypes; the packed 4-bit
format stores two values per byte plus one fp8 scale byte per 16 elements, so a
128-wide head costs 64 + 8 = 72 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedkv_lib.checks.scalars import check_int, check_positive_int

__all__ = [
    "KVDtype",
    "ModelSpec",
    "PRESETS",
    "get_preset",
    "kv_dtype",
    "kv_heads_per_rank",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "max_tokens",
    "padded_tokens",
]


@dataclass(frozen=True)
class KVDtype:
    """A storage format for cached K/V values.

    ``bits`` per element; formats with ``scale_group > 0`` also store one scale of
    ``scale_bytes`` for every ``scale_group`` elements of a vector.
    """

    name: str
    bits: int
    scale_group: int = 0
    scale_bytes: int = 0

    def vector_bytes(self, n: int) -> int:
        """Bytes to store one vector of ``n`` elements, scales included."""
        data = math.ceil(n * self.bits / 8)
        scales = math.ceil(n / self.scale_group) * self.scale_bytes if self.scale_group else 0
        return data + scales


_FP32 = KVDtype("fp32", 32)
_FP16 = KVDtype("fp16", 16)
_BF16 = KVDtype("bf16", 16)
_FP8 = KVDtype("fp8", 8)
# NVFP4-style: e2m1 values packed two per byte, one e4m3 scale per 16 elements.
_FP4 = KVDtype("fp4", 4, scale_group=16, scale_bytes=1)

_DTYPES: dict[object, KVDtype] = {
    torch.float32: _FP32,
    torch.float16: _FP16,
    torch.bfloat16: _BF16,
    torch.float8_e4m3fn: _FP8,
    torch.float8_e5m2: _FP8,
    "fp32": _FP32,
    "float32": _FP32,
    "fp16": _FP16,
    "float16": _FP16,
    "half": _FP16,
    "bf16": _BF16,
    "bfloat16": _BF16,
    "fp8": _FP8,
    "fp8_e4m3": _FP8,
    "fp8_e5m2": _FP8,
    "fp4": _FP4,
    "nvfp4": _FP4,
}


def kv_dtype(dtype: object) -> KVDtype:
    """Return the storage format for ``dtype`` (a torch dtype or a name such as
    ``"bf16"``, ``"fp8"``, ``"fp4"``); raises ValueError for anything else."""
    if isinstance(dtype, KVDtype):
        return dtype
    key = dtype.lower() if isinstance(dtype, str) else dtype
    try:
        return _DTYPES[key]
    except (KeyError, TypeError):
        names = sorted(k for k in _DTYPES if isinstance(k, str))
        raise ValueError(f"dtype={dtype!r} is not a known KV storage dtype; use one of {names}") from None


@dataclass(frozen=True)
class ModelSpec:
    """The attention shape of a model, as far as the KV cache is concerned.

    ``num_kv_heads == num_q_heads`` is MHA, ``1`` is MQA, anything between is GQA.
    ``kv_lora_rank > 0`` makes it MLA: the cache then holds one latent of width
    ``kv_lora_rank + qk_rope_head_dim`` per token and layer (``kv_factor == 1``) and
    ``num_kv_heads``/``head_dim`` describe the decompressed heads, not the cache.
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            check_positive_int(field, getattr(self, field), f"ModelSpec {self.name!r}")
        for field in ("kv_lora_rank", "qk_rope_head_dim"):
            check_int(field, getattr(self, field), owner=f"ModelSpec {self.name!r}")
        if self.qk_rope_head_dim and not self.kv_lora_rank:
            raise ValueError(f"ModelSpec {self.name!r}: qk_rope_head_dim needs kv_lora_rank > 0 (MLA)")
        if not self.is_mla and self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec {self.name!r}: num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention(self) -> str:
        """``"MHA"``, ``"GQA"``, ``"MQA"`` or ``"MLA"``."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_q_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_factor(self) -> int:
        """Cached tensors per layer: 2 (K and V), or 1 for MLA's shared latent."""
        return 1 if self.is_mla else 2

    @property
    def cached_dim(self) -> int:
        """Width of one cached vector: ``head_dim``, or the MLA latent plus RoPE part."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim


# Published Hugging Face config.json values (num_hidden_layers, num_attention_heads,
# num_key_value_heads, hidden_size / num_attention_heads or head_dim).
PRESETS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-7b-hf: 32 layers, 32 heads, no GQA, hidden 4096.
    "llama-2-7b": ModelSpec("llama-2-7b", 32, 32, 32, 128),
    # meta-llama/Llama-2-70b-hf: 80 layers, 64 heads, 8 KV heads, hidden 8192.
    "llama-2-70b": ModelSpec("llama-2-70b", 80, 64, 8, 128),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads, hidden 4096.
    "llama-3-8b": ModelSpec("llama-3-8b", 32, 32, 8, 128),
    # meta-llama/Meta-Llama-3-70B: 80 layers, 64 heads, 8 KV heads, hidden 8192.
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 64, 8, 128),
    # mistralai/Mistral-7B-v0.1: 32 layers, 32 heads, 8 KV heads, hidden 4096.
    "mistral-7b": ModelSpec("mistral-7b", 32, 32, 8, 128),
    # Qwen/Qwen2.5-7B: 28 layers, 28 heads, 4 KV heads, hidden 3584.
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 28, 4, 128),
    # tiiuae/falcon-7b: 32 layers, 71 heads, multi_query (1 KV head), hidden 4544.
    "falcon-7b": ModelSpec("falcon-7b", 32, 71, 1, 64),
    # deepseek-ai/DeepSeek-V2: 60 layers, 128 heads, kv_lora_rank 512,
    # qk_rope_head_dim 64, qk_nope_head_dim 128 (q/k head dim 192).
    "deepseek-v2": ModelSpec("deepseek-v2", 60, 128, 128, 192, kv_lora_rank=512, qk_rope_head_dim=64),
}


def get_preset(name: str) -> ModelSpec:
    """Return ``PRESETS[name]`` (case-insensitive); ValueError lists the known names."""
    try:
        return PRESETS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"preset={name!r} is unknown; known presets: {sorted(PRESETS)}") from None


def kv_heads_per_rank(spec: ModelSpec, tensor_parallel: int = 1) -> int:
    """KV heads one tensor-parallel rank stores.

    Heads are split evenly when ``num_kv_heads >= tensor_parallel``; with fewer KV
    heads than ranks each head is replicated so every rank holds one, which needs
    ``tensor_parallel % num_kv_heads == 0``. MLA's latent is replicated on every rank.
    """
    tp = check_positive_int("tensor_parallel", tensor_parallel)
    if spec.is_mla:
        return 1
    heads = spec.num_kv_heads
    if heads >= tp:
        if heads % tp:
            raise ValueError(f"tensor_parallel={tp} does not divide num_kv_heads={heads} of {spec.name}")
        return heads // tp
    if tp % heads:
        raise ValueError(
            f"tensor_parallel={tp} is not a multiple of num_kv_heads={heads} of {spec.name}, "
            "so heads cannot be replicated evenly"
        )
    return 1


def kv_bytes_per_token(spec: ModelSpec, dtype: object = torch.float16, tensor_parallel: int = 1) -> int:
    """Bytes of KV cache one token costs on one rank, over all layers."""
    fmt = kv_dtype(dtype)
    heads = kv_heads_per_rank(spec, tensor_parallel)
    return spec.num_layers * spec.kv_factor * heads * fmt.vector_bytes(spec.cached_dim)


def _lengths(seq_lens: Iterable[int] | torch.Tensor) -> list[int]:
    values = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    for i, n in enumerate(values):
        check_int(f"seq_lens[{i}]", n)
    return values


def padded_tokens(seq_lens: Iterable[int] | torch.Tensor, page_size: int | None = None) -> int:
    """Token slots a batch occupies: the sum of lengths, each rounded up to whole
    pages of ``page_size`` tokens when given."""
    lengths = _lengths(seq_lens)
    if page_size is None:
        return sum(lengths)
    page = check_positive_int("page_size", page_size)
    return sum(-(-n // page) * page for n in lengths)


def kv_cache_bytes(
    spec: ModelSpec,
    seq_lens: Iterable[int] | torch.Tensor,
    dtype: object = torch.float16,
    page_size: int | None = None,
    tensor_parallel: int = 1,
) -> int:
    """Exact bytes of KV cache for a batch of sequences on one rank.

    ``seq_lens`` are token counts; with ``page_size`` every sequence is rounded up
    to whole pages, so the result includes internal fragmentation.
    """
    return padded_tokens(seq_lens, page_size) * kv_bytes_per_token(spec, dtype, tensor_parallel)


def max_tokens(
    spec: ModelSpec,
    budget_bytes: int,
    dtype: object = torch.float16,
    page_size: int | None = None,
    tensor_parallel: int = 1,
) -> int:
    """The inverse question: how many tokens fit in ``budget_bytes`` on one rank
    (whole pages only when ``page_size`` is given)."""
    check_int("budget_bytes", budget_bytes)
    per_token = kv_bytes_per_token(spec, dtype, tensor_parallel)
    if page_size is None:
        return budget_bytes // per_token
    page = check_positive_int("page_size", page_size)
    return budget_bytes // (per_token * page) * page


# =========================================================================== quantized pools
# FP8 with one scale per token and head (pagedkv_lib.quant_pool, scale_mode="token")
# stores a float32 scale beside every K and V vector: 4 bytes per vector on top of the
# codes, whatever head_dim is, which a per-element scale_group cannot express.


@dataclass(frozen=True)
class _VectorScaledKVDtype(KVDtype):
    """A format that also stores ``vector_scale_bytes`` per vector (not per group)."""

    vector_scale_bytes: int = 0

    def vector_bytes(self, n: int) -> int:
        return super().vector_bytes(n) + self.vector_scale_bytes


_FP8_PER_TOKEN = _VectorScaledKVDtype("fp8_per_token", 8, vector_scale_bytes=4)
_DTYPES["fp8_per_token"] = _FP8_PER_TOKEN

"""DeepSeek sparse attention's indexer-K cache: FP8 keys with one fp32 scale per token.

The lightning indexer of DeepSeek-V3.2 (DSA) scores every cached token for each query
and keeps the top k; it reads its own key cache, separate from the attention's KV pool.
TensorRT-LLM writes it with ``indexerKCacheScatter``, vLLM with
``indexer_k_quant_and_cache``, and DeepGEMM's paged MQA-logits kernel reads it, all in
one layout, the one this module builds:

* the pool of one layer is ``uint8 [num_blocks, block_size, 1, per_token_size]`` with
  ``per_token_size = head_dim + 4``: block ``b`` holds ``block_size * per_token_size``
  bytes, the ``block_size`` tokens' FP8 E4M3 codes first (token ``r`` at byte
  ``r * head_dim`` of the block), then their fp32 scales (token ``r`` at byte
  ``block_size * head_dim + 4 r``). The four dimensions are only the unit in which the
  pool's strides are given: a token's codes do not sit in "its" row of dimension 1.
* the pool is **not contiguous**: the cache manager allocates one block for every layer
  at once, so the arena is ``[num_blocks, num_layers, block_bytes + pad]`` and layer
  ``l``'s pool is a strided view whose block stride is ``num_layers * (block_bytes +
  pad)`` bytes. Each block is its own segment of memory, with the other layers' bytes
  (and ``pad``) between it and the next.

Because of that, the page arithmetic lives on the host (:func:`flat_slots`): it turns
each token's (page, row) into two *flat element indices* of the 4-D view, one where its
codes start and one where its scale starts. The kernel
(:func:`pagedkv_kernels.indexer_k.indexer_k_cache_scatter`) unravels a flat index over the
view's shape and multiplies by its strides; it knows nothing of pages. Contrast the main
pool's write kernel, which does the divmod over pages itself.

Quantization (:func:`quantize_indexer_k`): per token, ``scale = amax / 448`` in fp32 over
the finite values of the row (0 for a row without any), ``code = fp8(k / scale)``
rounded to nearest even and saturating at +-448 (:func:`pagedkv_lib.quant.fp8_encode`),
and a row whose scale is 0 is encoded as it is (zeros stay zeros). DeepSeek's reference
(``act_quant``) uses the same ``amax / 448``; vLLM clamps ``amax`` at ``1e-4`` and can
round the scale up to a power of two (``scale_fmt="ue8m0"``); neither variant is
modelled here.

The top-k read (:func:`indexer_topk`) is DeepSeek-V3.2's documented score
``I[s] = sum_j w[j] * relu(q[j] . k[s])`` over the indexer heads ``j``, in float64 on
the dequantized keys; DeepSeek's own kernel also quantizes ``q`` and folds the softmax
scale into ``w``, which changes the values but not the idea.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv_lib.checks.scalars import check_int, check_positive_int
from pagedkv_lib.formats import check_has_values, slot_mapping
from pagedkv_lib.indexing import split_slot
from pagedkv_lib.quant import fp8_decode, fp8_encode, fp8_token_scales

__all__ = [
    "SCALE_BYTES",
    "IndexerKPool",
    "indexer_slots",
    "flat_slots",
    "quantize_indexer_k",
    "check_indexer_scatter_args",
    "scatter_indexer_k",
    "read_indexer_k",
    "IndexerTopK",
    "indexer_topk",
]

SCALE_BYTES = 4  # one fp32 scale per token, stored as its 4 bytes


class IndexerKPool:
    """The indexer-K pools of ``num_layers`` layers in one arena.

    ``arena`` is ``uint8 [num_blocks, num_layers, block_bytes + pad]`` with
    ``block_bytes = block_size * (head_dim + 4)``; :meth:`cache` is layer ``l``'s pool,
    the non-contiguous view ``[num_blocks, block_size, 1, head_dim + 4]`` with strides
    ``(num_layers * (block_bytes + pad), head_dim + 4, head_dim + 4, 1)``. ``fill``:
    the arena's initial bytes (random ones from ``generator`` when None, so that a test
    sees what a write left untouched).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        head_dim: int,
        num_layers: int = 2,
        pad: int = 0,
        *,
        fill: int | None = None,
        generator: torch.Generator | None = None,
        device=None,
    ):
        sizes = {"num_blocks": num_blocks, "block_size": block_size, "head_dim": head_dim, "num_layers": num_layers}
        for name, value in {**sizes, "pad": pad}.items():
            low = 0 if name == "pad" else 1
            check_int(name, value, low)
        self.block_size, self.head_dim, self.num_layers = block_size, head_dim, num_layers
        self.per_token_size = head_dim + SCALE_BYTES
        self.block_bytes = block_size * self.per_token_size
        shape = (num_blocks, num_layers, self.block_bytes + pad)
        if fill is None:
            self.arena = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        else:
            self.arena = torch.full(shape, fill, dtype=torch.uint8)
        self.arena = self.arena.to(device) if device is not None else self.arena

    @property
    def num_blocks(self) -> int:
        return self.arena.shape[0]

    def cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pool: the strided view ``uint8 [num_blocks, block_size, 1,
        per_token_size]`` into :attr:`arena` (writes through it land in the arena)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} must be in [0, {self.num_layers})")
        a = self.arena
        return a.as_strided(
            (self.num_blocks, self.block_size, 1, self.per_token_size),
            (a.stride(0), self.per_token_size, self.per_token_size, 1),
            a.storage_offset() + layer * a.stride(1),
        )


def indexer_slots(block_tables, batch_indices, positions, block_size: int, head_dim: int):
    """``(slot_fp8, slot_scale)`` of tokens given by request and position: the slot
    mapping of :func:`pagedkv_lib.formats.slot_mapping` (and its errors), turned into
    flat indices by :func:`flat_slots`. Padding tokens (batch or position ``-1``) get
    ``-1`` in both."""
    return flat_slots(slot_mapping(block_tables, batch_indices, positions, block_size), block_size, head_dim)


def flat_slots(slots: torch.Tensor, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_fp8, slot_scale)``, int64 ``[num_tokens]``: where each token's codes and
    scale start, as flat element indices of a pool ``[num_blocks, block_size, 1,
    head_dim + 4]`` (logical indices, as if it were contiguous; the kernel applies the
    real strides). ``slots`` is the main pool's slot mapping (``page * block_size +
    row``, ``-1`` for padding, which stays ``-1``); for row ``r`` of page ``p``::

        slot_fp8   = p * block_size * (head_dim + 4) + r * head_dim
        slot_scale = p * block_size * (head_dim + 4) + block_size * head_dim + r * 4
    """
    slots = torch.as_tensor(slots).long()
    page, row = split_slot(slots.clamp(min=0), block_size)
    base = page * (block_size * (head_dim + SCALE_BYTES))
    pad = slots < 0
    fp8 = torch.where(pad, -1, base + row * head_dim)
    scale = torch.where(pad, -1, base + block_size * head_dim + row * SCALE_BYTES)
    return fp8, scale


def quantize_indexer_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of indexer keys ``k [num_tokens, head_dim]`` (any float dtype):
    ``codes`` uint8 ``[num_tokens, head_dim]`` E4M3, ``scales`` fp32 ``[num_tokens]``,
    by the module's per-token rule (``amax / 448``, nearest-even, saturating)."""
    if not (isinstance(k, torch.Tensor) and k.dim() == 2 and k.is_floating_point()):
        raise ValueError(f"k must be a float tensor [num_tokens, head_dim], got {_describe(k)}")
    scales = fp8_token_scales(k)  # [num_tokens, 1] fp32, 0 for a row with no finite value
    y = k.detach().to(torch.float32)
    y = torch.where(scales > 0, y / torch.where(scales > 0, scales, 1.0), y)
    return fp8_encode(y), scales[:, 0]


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)}"
    return type(t).__name__


def _check_slots(name: str, slots, num_tokens: int) -> torch.Tensor:
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {_describe(slots)}")
    if slots.numel() != num_tokens:
        raise ValueError(f"{name} has {slots.numel()} entries but there are {num_tokens} tokens")
    check_has_values(name, slots)
    host = slots.detach().cpu().long()
    if (host < -1).any():
        i = int(torch.nonzero(host < -1)[0])
        raise ValueError(f"{name}[{i}]={int(host[i])}; a slot is >= 0, or -1 for a padding token")
    return host


def _check_disjoint_writes(starts: torch.Tensor, sizes: torch.Tensor, owners: list[str]) -> None:
    """The byte ranges ``[start, start + size)`` of the pool's flat index space must not
    overlap: two tokens writing one byte would leave whichever program ran last."""
    order = torch.argsort(starts, stable=True)
    s, e = starts[order], (starts + sizes)[order]
    clash = torch.nonzero(s[1:] < e[:-1])
    if clash.numel():
        i = int(clash[0])
        a, b = owners[int(order[i])], owners[int(order[i + 1])]
        raise ValueError(
            f"{a} (flat {int(s[i])}..{int(e[i]) - 1}) and {b} (flat {int(s[i + 1])}..{int(e[i + 1]) - 1}) "
            "write the same bytes of k_cache; every slot must address its own bytes"
        )


def check_indexer_scatter_args(k_cache, codes, scales, slot_fp8, slot_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Value checks of an indexer-K scatter; returns the host int64 copies of
    ``(slot_fp8, slot_scale)``. ValueError naming the argument unless ``k_cache`` is a
    uint8 ``[num_blocks, block_size, 1, per_token_size]`` tensor, ``codes`` uint8 or
    float8_e4m3fn ``[num_tokens, head_dim]``, ``scales`` fp32 ``[num_tokens]``, each
    slot ``-1`` (padding, in both mappings) or a flat index whose range (``head_dim``
    bytes, 4 for a scale) lies inside the pool, and no two ranges overlap."""
    if not (isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.uint8 and k_cache.dim() == 4):
        raise ValueError(f"k_cache must be uint8 [num_blocks, block_size, 1, per_token_size], got {_describe(k_cache)}")
    if k_cache.shape[2] != 1:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; dimension 2 is the indexer's single head (1)")
    if not (isinstance(codes, torch.Tensor) and codes.dtype in (torch.uint8, torch.float8_e4m3fn) and codes.dim() == 2):
        raise ValueError(f"codes must be uint8 or float8_e4m3fn [num_tokens, head_dim], got {_describe(codes)}")
    num_tokens, head_dim = codes.shape
    if not (isinstance(scales, torch.Tensor) and scales.dtype == torch.float32 and scales.shape == (num_tokens,)):
        raise ValueError(f"scales must be float32 [{num_tokens}] (one per token of codes), got {_describe(scales)}")
    fp8 = _check_slots("slot_fp8", slot_fp8, num_tokens)
    sc = _check_slots("slot_scale", slot_scale, num_tokens)
    if ((fp8 < 0) != (sc < 0)).any():
        i = int(torch.nonzero((fp8 < 0) != (sc < 0))[0])
        raise ValueError(
            f"token {i}: slot_fp8={int(fp8[i])} but slot_scale={int(sc[i])}; a padding token is -1 in both"
        )
    numel = k_cache.numel()
    for name, slots, size in (("slot_fp8", fp8, head_dim), ("slot_scale", sc, SCALE_BYTES)):
        bad = slots > numel - size  # not slots + size > numel: a slot near 2**63 would wrap around
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"{name}[{i}]={int(slots[i])} writes flat {int(slots[i])}..{int(slots[i]) + size - 1}, "
                f"outside k_cache {tuple(k_cache.shape)} ({numel} elements)"
            )
    real = torch.nonzero(fp8 >= 0)[:, 0]
    starts = torch.cat([fp8[real], sc[real]])
    sizes = torch.cat([torch.full_like(real, head_dim), torch.full_like(real, SCALE_BYTES)])
    owners = [f"slot_fp8[{int(i)}]" for i in real] + [f"slot_scale[{int(i)}]" for i in real]
    _check_disjoint_writes(starts, sizes, owners)
    return fp8, sc


def _elements(k_cache: torch.Tensor, starts: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """Index tuples into the 4-D ``k_cache`` of ``size`` consecutive flat indices from each
    start: torch's own unravelling and strides, not the kernel's arithmetic."""
    flat = starts[:, None] + torch.arange(size)
    return torch.unravel_index(flat, tuple(k_cache.shape))


def scatter_indexer_k(k_cache, codes, scales, slot_fp8, slot_scale) -> None:
    """The reference scatter, in place: each real token's ``head_dim`` code bytes to the
    flat indices ``slot_fp8[t] ...`` of ``k_cache`` and its scale's 4 bytes to
    ``slot_scale[t] ...``; padding tokens (``-1``) write nothing. A byte copy, so the
    result is exact by construction. Arguments and errors as
    :func:`check_indexer_scatter_args`."""
    fp8, sc = check_indexer_scatter_args(k_cache, codes, scales, slot_fp8, slot_scale)
    real = torch.nonzero(fp8 >= 0)[:, 0]
    code_bytes = codes.detach().cpu().view(torch.uint8)[real]
    scale_bytes = scales.detach().cpu().contiguous().view(torch.uint8).view(-1, SCALE_BYTES)[real]
    k_cache[_elements(k_cache, fp8[real], codes.shape[1])] = code_bytes.to(k_cache.device)
    k_cache[_elements(k_cache, sc[real], SCALE_BYTES)] = scale_bytes.to(k_cache.device)


def read_indexer_k(k_cache, slot_fp8, slot_scale, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [n, head_dim], scales fp32 [n])`` stored at the given slots (all real,
    ``>= 0``) of ``k_cache``, read through torch's indexing of the 4-D view."""
    fp8, sc = slot_fp8.cpu().long(), slot_scale.cpu().long()
    if (fp8 < 0).any() or (sc < 0).any():
        raise ValueError("read_indexer_k reads real tokens only: every slot must be >= 0")
    cache = k_cache.cpu()
    codes = cache[_elements(cache, fp8, head_dim)]
    scales = cache[_elements(cache, sc, SCALE_BYTES)].contiguous().view(torch.float32)[:, 0]
    return codes, scales


class IndexerTopK(NamedTuple):
    """What one query selects: ``tokens`` int64 ``[top_k]`` (positions, best first, ties
    to the lower position), ``blocks`` int64 (the distinct pages holding them, ascending),
    ``scores`` float64 ``[seq_len]`` (every cached token's index score)."""

    tokens: torch.Tensor
    blocks: torch.Tensor
    scores: torch.Tensor


def indexer_topk(q, weights, k_cache, block_table, seq_len: int, head_dim: int, top_k: int) -> IndexerTopK:
    """The DSA indexer's selection for one query, in float64: the keys of positions
    ``0 .. seq_len - 1`` of one sequence (``block_table [max_blocks]`` of ``k_cache``,
    ``block_size = k_cache.shape[1]``) are dequantized (``fp8_value(code) * scale``),
    scored ``I[s] = sum_j weights[j] * relu(q[j] . k[s])`` with ``q [index_heads,
    head_dim]`` and ``weights [index_heads]``, and the ``min(top_k, seq_len)`` best kept."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 2 and q.shape[1] == head_dim):
        raise ValueError(f"q must be [index_heads, {head_dim}], got {_describe(q)}")
    if not (isinstance(weights, torch.Tensor) and weights.shape == (q.shape[0],)):
        raise ValueError(f"weights must be [{q.shape[0]}] (one per indexer head), got {_describe(weights)}")
    check_positive_int("top_k", top_k)
    check_int("seq_len", seq_len)
    block_size = k_cache.shape[1]
    table = torch.as_tensor(block_table).view(1, -1)
    pos = torch.arange(seq_len)
    fp8, sc = indexer_slots(table, torch.zeros_like(pos), pos, block_size, head_dim)
    codes, scales = read_indexer_k(k_cache, fp8, sc, head_dim)
    keys = fp8_decode(codes).double() * scales.double()[:, None]  # [seq_len, head_dim]
    per_head = torch.relu(q.detach().cpu().double() @ keys.T)  # [index_heads, seq_len]
    scores = (weights.detach().cpu().double()[:, None] * per_head).sum(0)
    tokens = torch.argsort(-scores, stable=True)[: min(top_k, seq_len)]
    blocks = torch.unique(table[0, tokens // block_size].long())
    return IndexerTopK(tokens, blocks, scores)

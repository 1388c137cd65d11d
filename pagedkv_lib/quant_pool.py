"""A quantized paged KV pool: FP8 or NVFP4 codes, and the scales to read them back.

:class:`QuantizedKVPool` is the quantized sibling of :class:`pagedkv_lib.pool.PagedKVPool`.
It owns up to three tensors, each indexed by page first, then K=0/V=1, then the token
row and the head in the pool's layout (NHD: ``[num_pages, 2, page_size, num_kv_heads,
...]``; HND: ``[num_pages, 2, num_kv_heads, page_size, ...]``):

* ``data``, uint8: the codes, ``[..., head_dim]`` for FP8 (one E4M3 byte per element,
  so byte offsets equal element offsets) or ``[..., head_dim / 2]`` for NVFP4 (two E2M1
  codes per byte, the even element in the low nibble);
* ``scales``, the scale pool beside it, addressed by the same page, row and head:
  ``None`` for FP8 with one scale per tensor, ``[..., 1]`` float32 for FP8 with one
  scale per token and head, ``[..., head_dim / 16]`` uint8 (E4M3 bits) for NVFP4's
  block scales;
* ``global_scale``, float32 ``[2]``: the K and V scales of FP8 per tensor, or NVFP4's
  global scales (decode multipliers for ``"block"``, encode scales for
  ``"block_encode"``); ``[2, num_kv_heads]`` for FP8 per head (vLLM's per-head
  ``k_scale`` / ``v_scale``); unused by FP8 per token. Separate for K and V: K after RoPE
  and V have different ranges.

Every rule of the formats is in :mod:`pagedkv_lib.quant`; the appends and decodes that
fill and read a pool are :mod:`pagedkv_lib.quant_reference` (Python) and
``pagedkv_kernels.quant_write`` / ``pagedkv_kernels.quant_decode`` (Triton).
"""

from __future__ import annotations

import torch

from pagedkv_lib import quant
from pagedkv_lib.checks import (
    check_global_scale,
    check_kv_format,
    check_nvfp4_head_dim,
    check_positive_int,
    check_quant_pool,
    global_scale_shape,
    is_number,
    quant_widths,
    scale_pool_shape,
)
from pagedkv_lib.pool import CacheDims, cache_dims, check_layout

__all__ = ["QuantizedKVPool"]


class QuantizedKVPool:
    """A pool of ``num_pages`` pages of ``page_size`` token rows of quantized K and V.

    ``kv_dtype``: ``"fp8"`` (E4M3) or ``"nvfp4"``. ``scale_mode``: for FP8 ``"tensor"``
    (default: ``k_scale`` and ``v_scale`` divide every K and V value), ``"token"`` (the
    append computes ``amax / 448`` per token and head and stores it in ``scales``),
    ``"head"`` (``k_scale`` and ``v_scale`` are ``[num_kv_heads]`` scales, one per KV
    head, as vLLM's per-head ``k_scale`` / ``v_scale``; a number is used for every head)
    or ``"token_all_heads"`` (vLLM's per-token mode: one scale per token shared by its
    heads, ``max(amax / 448, 1e-6)``, stored in ``scales`` with head dim 1); for NVFP4
    ``"block"`` (default: ``k_scale`` and ``v_scale`` are the global *decode*
    multipliers) or ``"block_encode"`` (TensorRT-LLM's and FlashInfer's convention: the
    global scales are *encode* scales, ``448 * 6 / amax``, given by name as
    ``k_scale_encode`` and ``v_scale_encode``; giving them selects this mode). Block
    scales go to ``scales``. Codes and scales start at 0 (every row reads back as 0).
    Raises ValueError for non-positive sizes, an unknown format or layout, an NVFP4
    ``head_dim`` that is not a multiple of 16, a scale that is not a positive finite
    fp32 number, or a scale given under the other convention's name.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str = "fp8",
        layout: str = "NHD",
        device: torch.device | str = "cpu",
        *,
        scale_mode: str | None = None,
        k_scale=None,
        v_scale=None,
        k_scale_encode=None,
        v_scale_encode=None,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            check_positive_int(name, value, "QuantizedKVPool")
        encode = k_scale_encode is not None or v_scale_encode is not None
        if encode and scale_mode is None and kv_dtype == "nvfp4":
            scale_mode = "block_encode"
        self.kv_dtype, self.scale_mode = check_kv_format(kv_dtype, scale_mode)
        _check_scale_names(self.scale_mode, encode, k_scale, v_scale)
        if self.kv_dtype == "nvfp4":
            check_nvfp4_head_dim(head_dim)
        self.layout = check_layout(layout)
        self.page_size, self.num_kv_heads, self.head_dim = page_size, num_kv_heads, head_dim
        inner = (page_size, num_kv_heads) if layout == "NHD" else (num_kv_heads, page_size)
        width, groups = quant_widths(self.kv_dtype, self.scale_mode, head_dim)
        self.data = torch.zeros((num_pages, 2, *inner, width), dtype=torch.uint8, device=device)
        self.scales = None
        if groups:
            dtype = torch.uint8 if self.kv_dtype == "nvfp4" else torch.float32
            shape = scale_pool_shape(self.data.shape, layout, self.scale_mode, groups)
            self.scales = torch.zeros(shape, dtype=dtype, device=device)
        gs_shape = global_scale_shape(self.scale_mode, num_kv_heads)
        self.global_scale = torch.ones(gs_shape, dtype=torch.float32, device=device)
        if encode:
            self.set_encode_scales(k_scale_encode, v_scale_encode)
        else:
            self.set_global_scales(1.0 if k_scale is None else k_scale, 1.0 if v_scale is None else v_scale)

    @classmethod
    def from_tensors(
        cls, data, scales, global_scale, kv_dtype: str = "fp8", scale_mode=None, layout: str = "NHD", validate=True
    ):
        """A pool over existing tensors (no copy): the codes ``data``, the scale pool
        ``scales`` (None per tensor or per head) and ``global_scale``, read as ``kv_dtype``
        with ``scale_mode`` in ``layout``; what the kernels of ``pagedkv_kernels.quant_write`` and
        ``pagedkv_kernels.quant_decode`` take instead of the object. The sizes come from ``data``'s
        shape. Raises ValueError when the tensors do not fit the format
        (:func:`pagedkv_lib.checks.check_quant_pool`); ``validate=False`` skips that rule
        for a kernel's run, which compares the tensors' fingerprints with its plan's."""
        pool = object.__new__(cls)
        pool.kv_dtype, pool.scale_mode = check_kv_format(kv_dtype, scale_mode)
        pool.layout = check_layout(layout)
        if not isinstance(data, torch.Tensor) or data.dim() != 5:
            raise ValueError(f"data must be the 5-D uint8 code pool, got {getattr(data, 'shape', type(data).__name__)}")
        dims = cache_dims(data, pool.layout)
        pool.page_size, pool.num_kv_heads = dims.page_size, dims.num_kv_heads
        pool.head_dim = dims.head_dim * (2 if pool.kv_dtype == "nvfp4" else 1)
        pool.data, pool.scales, pool.global_scale = data, scales, global_scale
        if validate:
            check_quant_pool(pool)
        return pool

    def kernel_args(self) -> dict:
        """The pool as the kernels take it: ``data``, ``scales``, ``global_scale``,
        ``kv_dtype``, ``scale_mode`` and ``layout`` by name."""
        return {
            "data": self.data,
            "scales": self.scales,
            "global_scale": self.global_scale,
            "kv_dtype": self.kv_dtype,
            "scale_mode": self.scale_mode,
            "layout": self.layout,
        }

    # ----------------------------------------------------------------- shape

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        """Token rows in the pool: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def dims(self) -> CacheDims:
        """Logical ``(num_pages, page_size, num_kv_heads, head_dim)``."""
        return CacheDims(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def shape_proxy(self) -> torch.Tensor:
        """A meta tensor (no storage) of the logical pool shape ``[num_pages, 2, ...,
        head_dim]`` in this layout, for the shape-only rules of :mod:`pagedkv_lib.checks`."""
        return torch.empty((*self.data.shape[:4], self.head_dim), device="meta")

    # ----------------------------------------------------------------- scales

    @property
    def k_scale(self):
        """K's decode multiplier: a float (for ``"block_encode"`` ``fp32(1 / k_scale_encode)``),
        or a float32 ``[num_kv_heads]`` tensor per head."""
        return self._decode_scale(0)

    @property
    def v_scale(self):
        """V's decode multiplier, as :attr:`k_scale`."""
        return self._decode_scale(1)

    def _decode_scale(self, kv: int):
        if self.scale_mode == "head":
            return self.global_scale[kv].cpu().clone()
        if self.scale_mode == "block_encode":
            return quant.nvfp4_decode_scale(global_scale_encode=float(self.global_scale[kv]))
        return float(self.global_scale[kv])

    def set_global_scales(self, k_scale, v_scale) -> None:
        """Set the K and V decode scales (FP8 per tensor, NVFP4 ``"block"`` global; per head a
        number or ``[num_kv_heads]`` values); each must be a positive finite fp32 number.
        Codes already written are *not* re-quantized. ``"block_encode"`` pools take
        :meth:`set_encode_scales` (ValueError here)."""
        if self.scale_mode == "block_encode":
            raise ValueError("this pool holds encode scales: use set_encode_scales(k_scale_encode, v_scale_encode)")
        if self.scale_mode == "head":
            rows = [self._head_scales("k_scale", k_scale), self._head_scales("v_scale", v_scale)]
        else:
            rows = [check_global_scale("k_scale", k_scale), check_global_scale("v_scale", v_scale)]
        self.global_scale.copy_(torch.tensor(rows, dtype=torch.float32))

    def set_encode_scales(self, k_scale_encode, v_scale_encode) -> None:
        """Set NVFP4's K and V *encode* scales (TensorRT-LLM's ``qkv_scale_orig_quant``,
        FlashInfer's ``fp4_quantize(global_scale=...)``: ``448 * 6 / amax``) of a
        ``"block_encode"`` pool; ValueError for another mode or a bad scale."""
        if self.scale_mode != "block_encode":
            raise ValueError(f"k_scale_encode/v_scale_encode need scale_mode='block_encode', not {self.scale_mode!r}")
        scales = [
            check_global_scale("k_scale_encode", k_scale_encode),
            check_global_scale("v_scale_encode", v_scale_encode),
        ]
        self.global_scale.copy_(torch.tensor(scales, dtype=torch.float32))

    def _head_scales(self, name: str, value) -> list[float]:
        """``value`` as ``num_kv_heads`` checked fp32 scales (a number is used for every head)."""
        if is_number(value):
            return [check_global_scale(name, value)] * self.num_kv_heads
        values = list(value) if isinstance(value, (list, tuple)) else torch.as_tensor(value).flatten().tolist()
        if len(values) != self.num_kv_heads:
            raise ValueError(f"{name} has {len(values)} per-head scales for {self.num_kv_heads} KV heads")
        return [check_global_scale(f"{name}[{h}]", v) for h, v in enumerate(values)]

    # ----------------------------------------------------------------- bytes

    @property
    def memory_dtype(self) -> str:
        """The name :func:`pagedkv_lib.memory.kv_cache_bytes` knows this storage by:
        ``"fp8"`` (per tensor or per head: the scales do not grow with the tokens),
        ``"fp8_per_token"`` or ``"nvfp4"``. ValueError for ``"token_all_heads"`` (4 bytes
        per token, not per vector: the formula has no name for it yet)."""
        if self.scale_mode == "token_all_heads":
            raise ValueError("the memory formula has no dtype for one FP8 scale per token across heads")
        if self.kv_dtype == "fp8":
            return "fp8_per_token" if self.scale_mode == "token" else "fp8"
        return "nvfp4"

    @property
    def nbytes(self) -> int:
        """Bytes of per-token storage: codes plus the scale pool. The two global scales
        (8 bytes per layer, independent of the token count) are not counted, as the
        memory formula does not count them."""
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    # ----------------------------------------------------------------- reading

    def dequantize(self) -> torch.Tensor:
        """The values the pool holds, float32 ``[num_pages, 2, ..., head_dim]`` in its
        layout (on its device): FP8 ``fp8_value(code) * scale`` with the tensor,
        head or token scale; NVFP4 ``e2m1_value(code) * fp8_value(sf8) * gs``, ``gs`` the
        decode multiplier (``fp32(1 / encode scale)`` for ``"block_encode"``)."""
        check_quant_pool(self)
        if self.kv_dtype == "nvfp4":
            halves = [
                quant.nvfp4_dequantize(self.data[:, kv], self.scales[:, kv], self._decode_scale(kv)) for kv in (0, 1)
            ]
            return torch.stack(halves, dim=1)
        if self.scale_mode in ("token", "token_all_heads"):
            return quant.fp8_dequantize(self.data, self.scales)
        if self.scale_mode == "head":
            shape = (1, 2, 1, -1, 1) if self.layout == "NHD" else (1, 2, -1, 1, 1)
            return quant.fp8_decode(self.data) * self.global_scale.view(shape)
        return quant.fp8_decode(self.data) * self.global_scale.view(1, 2, 1, 1, 1)

    def read_slots(self, slots, kv: int) -> torch.Tensor:
        """Dequantized K (``kv=0``) or V (``kv=1``) of flat slots ``slots [n]`` (``page *
        page_size + row``, each in the pool), float32 ``[n, num_kv_heads, head_dim]``."""
        slots = torch.as_tensor(slots).long().cpu()
        if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < self.num_slots):
            raise ValueError(f"slots must lie in [0, {self.num_slots}), got {slots.min()}..{slots.max()}")
        page, row = slots // self.page_size, slots % self.page_size
        values = self.dequantize().cpu()
        return values[page, kv, row] if self.layout == "NHD" else values[page, kv, :, row]

    def rows(self, page: int, kv: int) -> torch.Tensor:
        """Dequantized view of one page's K (``kv=0``) or V (``kv=1``) as float32
        ``[page_size, num_kv_heads, head_dim]`` (a copy, whatever the layout)."""
        block = self.dequantize()[page, kv]
        return block if self.layout == "NHD" else block.transpose(0, 1)

    # ----------------------------------------------------------------- tests

    def poison_(self) -> QuantizedKVPool:
        """Fill every row with codes that read back as NaN (FP8 code ``0x7F``; NaN
        scales), as freshly allocated memory may; returns the pool. A reader that lets an
        unused row into its output then shows NaN instead of a plausible number."""
        self.data.fill_(quant.FP8_NAN)
        if self.scales is not None:
            self.scales.fill_(float("nan") if self.scales.dtype == torch.float32 else quant.FP8_NAN)
        return self

    def clone(self) -> QuantizedKVPool:
        """A deep copy (codes, scales and global scales)."""
        twin = object.__new__(QuantizedKVPool)
        twin.__dict__.update(self.__dict__)
        twin.data = self.data.clone()
        twin.scales = None if self.scales is None else self.scales.clone()
        twin.global_scale = self.global_scale.clone()
        return twin

    def to(self, device) -> QuantizedKVPool:
        """A copy on ``device``."""
        twin = self.clone()
        twin.data = twin.data.to(device)
        twin.scales = None if twin.scales is None else twin.scales.to(device)
        twin.global_scale = twin.global_scale.to(device)
        return twin

    def __repr__(self) -> str:
        if self.scale_mode in ("head", "block_encode"):
            name = "_encode" if self.scale_mode == "block_encode" else ""
            k, v = (", ".join(f"{x:.4g}" for x in row) for row in self.global_scale.reshape(2, -1).tolist())
            scales = f"k_scale{name}=[{k}], v_scale{name}=[{v}]"
        else:
            scales = f"k_scale={self.k_scale:.4g}, v_scale={self.v_scale:.4g}"
        return (
            f"QuantizedKVPool({self.num_pages} pages x {self.page_size} rows, {self.num_kv_heads} heads x "
            f"{self.head_dim}, {self.kv_dtype}/{self.scale_mode}, {self.layout}, {scales})"
        )


def _check_scale_names(scale_mode: str, encode: bool, k_scale, v_scale) -> None:
    """NVFP4's encode scales go by their own names, and only with ``"block_encode"``."""
    if encode and scale_mode != "block_encode":
        raise ValueError(
            f"k_scale_encode/v_scale_encode are NVFP4 encode scales; scale_mode={scale_mode!r} takes k_scale/v_scale"
        )
    if encode and (k_scale is not None or v_scale is not None):
        raise ValueError("give k_scale_encode/v_scale_encode or k_scale/v_scale, not both")
    if scale_mode == "block_encode" and not encode:
        raise ValueError("scale_mode='block_encode' takes the encode scales by name: k_scale_encode=, v_scale_encode=")

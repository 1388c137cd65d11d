"""Host-side launch helpers every kernel module shares: what a plan records and copies.

One home for the small host rules a kernel launch needs, so the write, decode,
prefill, quantized and MLA modules cannot drift apart:

* :func:`owned_copy` and :func:`int32_on_device`: the contiguous device copy of an
  index tensor that a kernel indexes with (int32 for the latter; a table with no
  columns still gets a valid pointer);
* :func:`parallel_units`: how many programs the device runs at once, the input of the
  split-KV choice (1 in the interpreter unless it plans as on a GPU);
* :func:`fingerprint`: ``(shape, strides, dtype, device)`` of a tensor, which a plan
  records so that a later run can refuse a tensor it was not made for;
* :func:`memory_key`: the fingerprints plus the addresses of the tensors a plan checked,
  so that a run given those very tensors need not check their memory again;
* :class:`TokenIndex` and :class:`PageTable`: the index tensors a write plan addresses
  its tokens with (by name from :func:`slot_index` or :func:`csr_index`), and a read
  plan's page table, as the kernels take them.

A plan owns the index tensors it validated: every one of them goes through
:func:`owned_copy`, which always copies (``.to(...).contiguous()`` returns the caller's
tensor itself when it already has the dtype, device and layout). A caller that changes
its table after planning therefore changes nothing a run does; with a reference kept,
the run would write or read wherever the new values point, unchecked.

The host copy of index tensors for the value checks is
:func:`pagedkv_kernels.host.validate.host_copy` (it belongs with the checks that use it).
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import functools
from dataclasses import dataclass, fields

import torch

__all__ = [
    "owned_copy",
    "int32_on_device",
    "parallel_units",
    "fingerprint",
    "memory_key",
    "TokenIndex",
    "slot_index",
    "csr_index",
    "PageTable",
]


def owned_copy(x, device: torch.device | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor holding ``x`` (a tensor, or anything :func:`torch.as_tensor`
    takes) on ``device`` in ``dtype`` (default: ``x``'s): never ``x`` itself, so that a
    plan's index tensors are its own (the module docstring)."""
    t = torch.as_tensor(x)
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=device or t.device)
    out.copy_(t)
    return out


def int32_on_device(x, device: torch.device, min_len: int = 0) -> torch.Tensor:
    """The int32 contiguous copy of ``x`` on ``device`` that a kernel indexes with (always
    a copy: :func:`owned_copy`).

    ``x`` is a tensor (or anything :func:`torch.as_tensor` takes) whose values were
    already checked to fit in int32. A 2-D table with no columns becomes ``[rows, 1]``
    zeros, and a 1-D list shorter than ``min_len`` (an empty index list) becomes
    ``min_len`` zeros, so the kernel still gets a valid pointer (it never reads them).
    """
    t = owned_copy(x, device, torch.int32)
    if t.dim() == 2 and t.shape[1] == 0:
        t = torch.zeros((t.shape[0], 1), dtype=torch.int32, device=device)
    elif t.dim() == 1 and t.numel() < min_len:
        t = torch.zeros(min_len, dtype=torch.int32, device=device)
    return t


@functools.cache
def _num_sms(index: int) -> int:
    # Queried at call time (never at import), once per device.
    return torch.cuda.get_device_properties(index).multi_processor_count


def parallel_units(device: torch.device) -> int:
    """Programs the device runs at once: the SM count compiled; 1 in the interpreter,
    which runs programs one after another (so splitting there only adds work), unless
    it plans as on a GPU (``PAGEDKV_PLAN=gpu``: the SM count it was given)."""
    if not runtime.BACKEND.interpreted and device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return runtime.PLANS.sm_count if runtime.gpu_plans() else 1


def fingerprint(t: torch.Tensor) -> tuple:
    """``(shape, strides, dtype, device)`` of ``t``: what a plan checks a later tensor against."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def cache_fingerprint(cache) -> tuple:
    """What a read plan records of ``cache``: the pool's :func:`fingerprint`, or for a
    ``(key, value)`` pair (:func:`pagedkv_lib.cache_layouts.kv_cache_view`) a tuple of
    both tensors' fingerprints."""
    if isinstance(cache, torch.Tensor):
        return fingerprint(cache)
    return tuple(fingerprint(t) if isinstance(t, torch.Tensor) else None for t in cache)


def memory_key(*tensors) -> tuple:
    """``(data_ptr, shape, strides, dtype, device)`` of each tensor (None stays None).

    Overlap and in-bounds checks depend on nothing else, so a run whose tensors have
    the key its plan recorded is covered by the plan's checks and skips them (an entry
    point, which plans and runs at once, then validates once)."""
    return tuple(None if t is None else (t.data_ptr(), *fingerprint(t)) for t in tensors)


@dataclass(frozen=True)
class TokenIndex:
    """The index tensors a write plan addresses its tokens with (:func:`token_rows`), each
    ``[num_tokens]`` (``kv_indptr [batch + 1]``, ``kv_indices [pages]``) int32 or int64 on
    the kernels' device, made contiguous: the slot form holds ``slot_mapping`` (and
    ``positions`` with RoPE), the CSR form ``batch_indices``, ``positions``, ``kv_indptr``
    and ``kv_indices``, and ``rope_positions`` when the rotary positions are given apart
    from the cache positions (:mod:`pagedkv_lib.rotary_positions`); the others are None."""

    slot_mapping: torch.Tensor | None = None
    batch_indices: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None

    @classmethod
    def of(cls, **tensors) -> TokenIndex:
        """The index of ``tensors`` (already checked), each copied contiguous
        (:func:`owned_copy`: the plan's own)."""
        return cls(**{name: None if t is None else owned_copy(t) for name, t in tensors.items()})

    @property
    def csr(self) -> bool:
        """Whether tokens are addressed by request and position (else by slot)."""
        return self.kv_indptr is not None

    @property
    def own_rope_positions(self) -> bool:
        """Whether the rotary positions are their own tensor (the ``ROPE_POS`` constexpr of
        the write kernels), not the cache positions."""
        return self.rope_positions is not None

    def named(self) -> list[tuple[str, torch.Tensor | None]]:
        """``(name, tensor)`` of each field, for the launch checks."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def launch_args(self) -> tuple:
        """Six tensors: the five of :func:`token_rows`, in its order, then the rotary
        positions (``rope_pos_ptr``: ``rope_positions``, else ``positions``). An absent
        one is replaced by a given one, which the kernel never dereferences under its
        ``CSR`` and ``ROPE`` constexprs (a launch needs a tensor for every pointer)."""
        given = self.slot_mapping if self.slot_mapping is not None else self.batch_indices
        rope = self.rope_positions if self.rope_positions is not None else self.positions
        return (*(given if t is None else t for _, t in self.named()[:5]), given if rope is None else rope)


def slot_index(slot_mapping, positions=None) -> dict:
    """The index tensors of a write in the slot form, by name (``positions`` only with
    RoPE, else None), in the order of their launch checks; :meth:`TokenIndex.of` takes them."""
    return {"slot_mapping": slot_mapping, "positions": positions}


def csr_index(batch_indices, positions, kv_indices, kv_indptr, rope_positions=None) -> dict:
    """The index tensors of a write in the CSR form, by name (``rope_positions`` None when
    the rotary positions are the cache positions), in the order of their launch checks;
    :meth:`TokenIndex.of` takes them."""
    return {
        "batch_indices": batch_indices,
        "positions": positions,
        "kv_indices": kv_indices,
        "kv_indptr": kv_indptr,
        "rope_positions": rope_positions,
    }


@dataclass(frozen=True)
class PageTable:
    """A read launch's page table, int32, contiguous, on the kernels' device: the padded
    form (``block_tables [batch, max_blocks]``, ``seq_lens [batch]``) or the CSR form
    (``kv_indptr [batch + 1]``, ``kv_indices [nnz_pages]`` with at least one entry,
    ``kv_last_page_len [batch]``); the other form's fields are None."""

    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = None

    @classmethod
    def padded(cls, block_tables, seq_lens, device: torch.device) -> PageTable:
        """The padded form, copied to int32 on ``device`` (values already checked)."""
        return cls(block_tables=int32_on_device(block_tables, device), seq_lens=int32_on_device(seq_lens, device))

    @classmethod
    def csr(cls, kv_indptr, kv_indices, kv_last_page_len, device: torch.device) -> PageTable:
        """The CSR form, copied to int32 on ``device`` (values already checked)."""
        return cls(
            kv_indptr=int32_on_device(kv_indptr, device),
            kv_indices=int32_on_device(kv_indices, device, min_len=1),
            kv_last_page_len=int32_on_device(kv_last_page_len, device),
        )

    @property
    def is_csr(self) -> bool:
        return self.kv_indptr is not None

    def pointers(self) -> tuple:
        """``(block_tables, seq_lens, kv_indptr, kv_indices, kv_last_page_len)`` as the
        kernels take them (:func:`sequence_span`): the other form's are a tensor of this
        one, never dereferenced."""
        if self.is_csr:
            dummy = self.kv_indptr
            return dummy, dummy, self.kv_indptr, self.kv_indices, self.kv_last_page_len
        dummy = self.seq_lens
        return self.block_tables, self.seq_lens, dummy, dummy, dummy

    @property
    def stride(self) -> int:
        """Elements between two rows of the padded table (0 for CSR: unused)."""
        return 0 if self.is_csr else self.block_tables.stride(0)

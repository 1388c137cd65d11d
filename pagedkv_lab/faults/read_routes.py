"""Faulty parts of the read side's page-pointer route
(:mod:`pagedkv_kernels.decode_page_pointers`), each beside the check that refuses it.

The route's kernel dereferences addresses the host built; a wrong one is a segmentation
fault in the interpreter or an illegal access on a GPU. So its host checks are what
stands between a builder's bug and the kernel, and each is proven here by a part that
breaks what it guards:

* :func:`build_page_pointers_element_stride` steps from page to page by the page
  stride in *elements*, not bytes (the element size forgotten): every page after page 0
  lands inside an earlier page. :func:`pagedkv_kernels.decode_page_pointers.check_page_pointers`
  refuses the array before launch.
* :func:`check_layout_only` compares a launch's pool with the planned one by shape,
  strides and dtype only, not by where it lives: a plan then runs on another pool of the
  same shape and reads the pool it was built from.
"""

from __future__ import annotations

import torch

__all__ = ["build_page_pointers_element_stride", "check_layout_only"]


def build_page_pointers_element_stride(cache: torch.Tensor, table: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """:func:`pagedkv_kernels.decode_page_pointers.build_page_pointers` with the page
    stride counted in elements where addresses are bytes."""
    size = cache.element_size()
    page = torch.where(used, table, 0)
    k = cache.data_ptr() + page * cache.stride(0)  # the fault: elements, not bytes
    both = torch.stack([k, k + cache.stride(1) * size], dim=1)
    return torch.where(used[:, None, :], both, 0)


def check_layout_only(name: str, t: torch.Tensor, planned) -> None:
    """:func:`pagedkv_kernels.host.validate.check_same_placement` reduced to the layout:
    a pool of the planned shape, strides and dtype passes wherever it lives."""
    from pagedkv_kernels.host.validate import check_same_layout

    check_same_layout(name, t, planned.layout)  # the fault: the address is not compared

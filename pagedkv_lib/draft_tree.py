"""Draft trees of speculative decoding: which new tokens each draft token attends to.

Speculative decoding verifies several draft tokens of a request in one forward pass.
With a *tree* of drafts (EAGLE, Medusa; TensorRT-LLM's ``spec_decoding_packed_mask``,
FlashInfer's ``custom_mask``, vLLM's tree attention) the request's new tokens are the
nodes of a tree listed in topological order, described by ``parents [num_nodes]``:

* ``parents[j] == -1``: node ``j`` is a root, a child of the last token already in the
  cache (with one root, node 0, the tree of TensorRT-LLM and vLLM whose root is the
  token after the last accepted one; several roots are alternatives for that token);
* otherwise ``0 <= parents[j] < j``: parents come before their children.

Node ``i`` attends to every cached key before the request's new tokens (the prompt and
the accepted tokens) and to the new tokens that are ``i`` itself or its ancestors, not
to its siblings or cousins: each path from a root is one candidate continuation, as if
it were verified alone. A chain of drafts (``parents = [-1, 0, 1, ...]``) is plain
causal attention. The rotary position of node ``i`` is ``past_len + depth[i]``
(:func:`pagedkv_lib.rotary_positions.draft_tree_offsets`).

The prefill kernel and its reference take the mask as ``tree_mask [total_q,
max_q_len]`` (torch.bool; :func:`batch_tree_mask` builds it): row ``r``, the ``i``-th
new token of its request, holds True at column ``j`` when it sees the request's
``j``-th new token. The mask must be lower-triangular with a true diagonal within each
request (a draft never sees a later token; it always sees itself), and False past a
request's own tokens (:func:`pagedkv_lib.checks.check_tree_mask`). The kernel's plan
packs it into int32 words, one bit per column (:func:`pack_tree_mask`), so that a key
tile costs a few word loads per row rather than a byte per (row, key).
"""

from __future__ import annotations

import torch

from pagedkv_lib.formats import index_tensor

__all__ = ["check_parents", "tree_mask", "batch_tree_mask", "pack_tree_mask"]


def check_parents(parents) -> torch.Tensor:
    """``parents`` as host int64 ``[num_nodes]``, after the one rule of a draft tree: each
    entry is ``-1`` (a root) or names an earlier node (``0 <= parents[j] < j``), so node
    0 is always a root. Raises ValueError naming the first entry that breaks it (or a
    non-integer or non-1-D ``parents``)."""
    par = index_tensor("parents", parents, 1)
    bad = (par < -1) | (par >= torch.arange(par.numel()))
    if bad.any():
        j = int(torch.nonzero(bad)[0])
        if j == 0:
            raise ValueError(f"parents[0] = {int(par[0])}: node 0 has no earlier node, its parent must be -1 (a root)")
        raise ValueError(f"parents[{j}] = {int(par[j])} must be -1 (a root) or name an earlier node (0..{j - 1})")
    return par


def tree_mask(parents) -> torch.Tensor:
    """``[num_nodes, num_nodes]`` torch.bool (host): row ``i`` is True at column ``j`` iff
    node ``j`` is node ``i`` or one of its ancestors in the draft tree ``parents``
    (:func:`check_parents`'s rule). Lower-triangular with a true diagonal; a chain is
    the full lower triangle."""
    par = check_parents(parents).tolist()
    mask = torch.eye(len(par), dtype=torch.bool)
    for i, p in enumerate(par):
        if p >= 0:
            mask[i] |= mask[p]  # the parent's row holds the parent and all its ancestors
    return mask


def batch_tree_mask(parents, qo_indptr) -> torch.Tensor:
    """The prefill kernel's ``tree_mask [total_q, max_q_len]`` (torch.bool, host) of a batch.

    ``qo_indptr [batch + 1]`` delimits each request's new tokens (rows of ``q``);
    ``parents`` holds one entry per request: the draft tree of its ``q_len`` new tokens
    (a list or 1-D tensor of ``q_len`` parents, :func:`tree_mask`), or None for a request
    that is not a tree (a plain prefill chunk or decode step: the causal lower
    triangle). Row ``qo_indptr[b] + i`` holds request ``b``'s row ``i`` in columns ``0 ..
    q_len[b] - 1`` and False after them; ``max_q_len`` is the largest ``q_len``. Raises
    ValueError for a count of trees other than ``batch`` or a tree whose size is not its
    request's ``q_len``."""
    indptr = index_tensor("qo_indptr", qo_indptr, 1)
    q_lens = (indptr[1:] - indptr[:-1]).tolist()
    parents = list(parents)
    if len(parents) != len(q_lens):
        raise ValueError(f"parents has {len(parents)} entries (trees or None) for {len(q_lens)} requests")
    width = max(q_lens, default=0)
    out = torch.zeros((int(indptr[-1]) if indptr.numel() else 0, width), dtype=torch.bool)
    for b, (tree, n) in enumerate(zip(parents, q_lens)):
        rows = slice(int(indptr[b]), int(indptr[b]) + n)
        if tree is None:
            out[rows, :n] = torch.ones((n, n), dtype=torch.bool).tril()
            continue
        mask = tree_mask(tree)
        if mask.shape[0] != n:
            raise ValueError(f"parents[{b}] has {mask.shape[0]} nodes but request {b} has {n} new tokens (q_len)")
        out[rows, :n] = mask
    return out


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask [rows, cols]`` (torch.bool) packed into int32 words ``[rows, max(1,
    ceil(cols / 32)))]`` on ``mask``'s device: column ``j`` is bit ``j % 32`` (least
    significant first) of word ``j // 32``; unused high bits are 0. The prefill plan
    packs ``tree_mask`` so, as FlashInfer's ``plan`` packs ``custom_mask`` (into bytes)
    and TensorRT-LLM takes ``spec_decoding_packed_mask`` (int32 words)."""
    rows, cols = mask.shape
    words = max(1, -(-cols // 32))
    bits = torch.zeros((rows, words * 32), dtype=torch.int64, device=mask.device)
    bits[:, :cols] = mask
    packed = (bits.view(rows, words, 32) << torch.arange(32, device=mask.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31 is the sign bit

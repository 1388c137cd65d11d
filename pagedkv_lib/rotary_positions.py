"""Rotary positions: the position a token is rotated by, given apart from where it is cached.

A plain append rotates token ``i`` of request ``b`` at the position it is cached at,
``past_lens[b] + i``. TensorRT-LLM's write kernel (``applyBiasRopeUpdateKVCache``) takes
the rotary position from three sources that override it::

    rotary_position = (
        helix_position_offsets[global_token_idx]          if helix_position_offsets
        else spec_decoding_position_offsets[b, i] + past  if spec_decoding_position_offsets
        else past + i                                      # the cache position
    ) + (mrope_position_deltas[b] if mrope_position_deltas else 0)

* ``spec_decoding_position_offsets [batch, max_input_seq_len]``: speculative decoding
  verifies several draft tokens in one pass; draft ``i`` sits at ``past + offset[b, i]``.
  For a chain of drafts the offset is ``i``; for a *tree* of drafts it is the node's
  depth (:func:`draft_tree_offsets`), so siblings share a rotary position although each
  has its own cache row.
* ``mrope_position_deltas [batch]``: multimodal M-RoPE. Image tokens take positions on
  a 2-D/3-D grid, fewer than their count, so the text after them is shifted by a
  per-request delta (often negative).
* ``helix_position_offsets [num_tokens]``: Helix context parallelism splits a sequence's
  tokens over ranks; a rank's local token index is not the global position, so the
  position is read from a table. With ``helix_is_inactive_rank [batch]`` a request whose
  KV this rank does not own is *not written* (TensorRT-LLM guards the store with
  ``valid_kv_cache_pos && !helix_inactive``) while its Q is still rotated.

:func:`rotary_positions` builds the suite's ``rope_positions [num_tokens]`` (int64) from
these inputs; the CSR write kernels (``kernels.append_paged_kv_csr`` and its quantized
and MLA twins) take it as ``rope_positions=``, apart from ``positions`` (the cache
position). The slot form's ``positions`` is already only the rotary position (the
cache row comes from ``slot_mapping``): pass the built tensor there.
:func:`inactive_tokens` and :func:`as_padding` turn the inactive-rank flag into
tokens that are not written: ``-1`` in ``slot_mapping`` or in the CSR ``positions``.
"""

from __future__ import annotations

import torch

from pagedkv_lib.draft_tree import check_parents
from pagedkv_lib.formats import get_batch_indices_positions, index_tensor

__all__ = ["draft_tree_offsets", "rotary_positions", "inactive_tokens", "as_padding"]


def _appended(append_indptr, past_lens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch [n], within [n], past [batch])`` (host int64) of the appended tokens:
    each token's request and index among its request's new tokens."""
    indptr = index_tensor("append_indptr", append_indptr, 1)
    past = index_tensor("past_lens", past_lens, 1)
    if indptr.numel() != past.numel() + 1:
        raise ValueError(f"append_indptr needs {past.numel() + 1} entries for {past.numel()} past_lens")
    if indptr.numel() and int(indptr[0]) != 0:
        raise ValueError(f"append_indptr[0] = {int(indptr[0])} must be 0")
    if (past < 0).any():
        b = int(torch.nonzero(past < 0)[0])
        raise ValueError(f"past_lens[{b}] = {int(past[b])} must be >= 0 (tokens already cached)")
    counts = indptr[1:] - indptr[:-1]
    if (counts < 0).any():
        b = int(torch.nonzero(counts < 0)[0])
        raise ValueError(f"append_indptr must be non-decreasing: append_indptr[{b + 1}] < append_indptr[{b}]")
    batch, cache_pos = get_batch_indices_positions(indptr, past + counts)
    batch, cache_pos = batch.long(), cache_pos.long()
    return batch, cache_pos - past[batch], past


def draft_tree_offsets(parents) -> torch.Tensor:
    """Position offsets ``[num_nodes]`` (int64) of a speculative-decoding draft tree: each
    node's depth below the last cached token, counted from 0.

    ``parents [num_nodes]``: the parent node of each node, ``-1`` for a root (node 0, the
    token after the last accepted one, or several alternatives for it), parents listed
    before their children (:func:`pagedkv_lib.draft_tree.check_parents`, the one home of
    the rule). Node ``j`` is then verified at position ``past_len + depth[j]``: siblings
    are alternative drafts for the same position and share a rotary position, each in
    its own cache row. A chain of drafts (``parents = [-1, 0, 1, ...]``) gives ``0, 1,
    2, ...``. Which earlier nodes each one attends to: :func:`pagedkv_lib.draft_tree.tree_mask`.
    """
    par = check_parents(parents).tolist()
    depth = [0] * len(par)
    for j, p in enumerate(par):
        if p >= 0:
            depth[j] = depth[p] + 1
    return torch.tensor(depth, dtype=torch.int64)


def rotary_positions(
    append_indptr,
    past_lens,
    *,
    spec_decoding_position_offsets=None,
    mrope_position_deltas=None,
    helix_position_offsets=None,
) -> torch.Tensor:
    """Rotary position ``[num_tokens]`` (int64, host) of every appended token, by
    TensorRT-LLM's precedence (module docstring).

    ``append_indptr [batch + 1]`` delimits each request's new tokens (``0`` first);
    ``past_lens [batch]`` counts the tokens each request had cached before this step,
    so token ``i`` of request ``b`` is cached at ``past_lens[b] + i``. Optional sources,
    integer tensors or lists:

    * ``helix_position_offsets [num_tokens]``: the position of each token, read
      directly (overrides the rest but the M-RoPE delta);
    * ``spec_decoding_position_offsets [batch, max_input_seq_len]``: the position of
      token ``i`` of request ``b`` is ``past_lens[b] + offsets[b, i]`` (TensorRT-LLM's
      layout; columns past a request's token count are ignored);
    * ``mrope_position_deltas [batch]`` (or ``[batch, 1]``): added to every token of
      request ``b`` after the above.

    Without any source this is the cache position ``past_lens[b] + i``. Raises
    ValueError naming the argument for a wrong shape, a non-integer tensor, or a
    rotary position below 0.
    """
    batch, within, past = _appended(append_indptr, past_lens)
    n, num_req = batch.numel(), past.numel()
    if helix_position_offsets is not None:
        pos = index_tensor("helix_position_offsets", helix_position_offsets, 1)
        if pos.numel() != n:
            raise ValueError(f"helix_position_offsets has {pos.numel()} entries for {n} appended tokens")
    elif spec_decoding_position_offsets is not None:
        offsets = index_tensor("spec_decoding_position_offsets", spec_decoding_position_offsets, 2)
        widest = int(within.max()) + 1 if n else 0
        if offsets.shape[0] != num_req or offsets.shape[1] < widest:
            raise ValueError(
                f"spec_decoding_position_offsets has shape {tuple(offsets.shape)}; expected "
                f"[{num_req}, max_input_seq_len >= {widest}] (batch, the most tokens a request appends)"
            )
        pos = past[batch] + offsets[batch, within]
    else:
        pos = past[batch] + within
    if mrope_position_deltas is not None:
        delta = index_tensor("mrope_position_deltas", torch.as_tensor(mrope_position_deltas).reshape(-1), 1)
        if delta.numel() != num_req:
            raise ValueError(f"mrope_position_deltas has {delta.numel()} entries for {num_req} requests")
        pos = pos + delta[batch]
    if (pos < 0).any():
        i = int(torch.nonzero(pos < 0)[0])
        raise ValueError(f"token {i} (request {int(batch[i])}) gets rotary position {int(pos[i])} < 0")
    return pos.long()


def inactive_tokens(append_indptr, helix_is_inactive_rank) -> torch.Tensor:
    """``[num_tokens]`` bool: the appended tokens of requests flagged in
    ``helix_is_inactive_rank [batch]`` (bool), which this rank must not write to its
    cache (their Q is still rotated)."""
    indptr = index_tensor("append_indptr", append_indptr, 1)
    flag = torch.as_tensor(helix_is_inactive_rank)
    if flag.dtype != torch.bool or flag.dim() != 1 or flag.numel() != indptr.numel() - 1:
        raise ValueError(
            f"helix_is_inactive_rank must be a bool tensor [batch={indptr.numel() - 1}], "
            f"got {flag.dtype} of shape {tuple(flag.shape)}"
        )
    return torch.repeat_interleave(flag.cpu(), indptr[1:] - indptr[:-1])


def as_padding(index: torch.Tensor, inactive: torch.Tensor) -> torch.Tensor:
    """``index`` (a ``slot_mapping`` or the CSR ``positions``, ``[num_tokens]``) with
    ``-1`` at the ``inactive`` tokens, so that a write kernel stores nothing of them.
    A new tensor on ``index``'s device and dtype. With the CSR form and separate
    ``rope_positions`` the kernel still rotates those tokens' ``q``; with the slot form
    (where ``-1`` is plain padding) it leaves their ``q`` rows as they are."""
    if inactive.dtype != torch.bool or inactive.shape != index.shape:
        raise ValueError(
            f"inactive must be bool of shape {tuple(index.shape)}, got {inactive.dtype} {tuple(inactive.shape)}"
        )
    return torch.where(inactive.to(index.device), torch.full_like(index, -1), index)

"""The float64 reference of merging attention states (FlashInfer's ``merge_state`` /
``merge_states``; the Triton kernels are in :mod:`pagedkv_kernels.cascade`).

A state ``(v, s)`` of a row over a key set is its softmax-normalised output ``v`` and
the base-2 log-sum-exp ``s = log2(sum_j 2**(s_j))`` of the scaled scores ``s_j = scale *
log2(e) * q.k_j``. States of disjoint key sets merge into the union's:
``s = log2(sum_i 2**s_i)``, ``v = sum_i 2**(s_i - s) v_i``, computed here with the max
subtracted first (:func:`merge_lse_weighted`, also the split-KV merge's reference).

NaN is never an empty state: empty states (``s = -inf``) weigh 0 and their ``v`` is
never multiplied (NaN included), and all-empty rows give ``v = 0``, ``s = -inf``; a
state whose ``s`` is NaN (its keys held a NaN) or ``+inf`` makes its row NaN, ``v``
and ``s``; every other state's ``v`` is multiplied by its weight, even one that
underflows to 0, so a NaN in it reaches the row.
"""

from __future__ import annotations

import torch

from pagedkv_lib.checks import check_state_pair, check_states_args

__all__ = ["merge_states", "merge_state", "merge_lse_weighted"]


def merge_lse_weighted(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge states along one axis, in float64 on the CPU: ``v [..., n, head_dim]`` and
    their base-2 ``s [..., n]`` -> ``(v [..., head_dim], s [...])`` by the rules of the
    module docstring."""
    v, s = v.detach().cpu().double(), s.detach().cpu().double()
    nan_row = ~(s < float("inf"))  # NaN or +inf: an ordered comparison, as the kernel's
    nan_row = nan_row.any(-1)
    s = torch.where(s < float("inf"), s, float("-inf"))
    m = s.max(dim=-1, keepdim=True).values
    w = torch.exp2(s - torch.where(m == float("-inf"), 0.0, m))  # exactly 0 for -inf states
    v = torch.where(s[..., None] == float("-inf"), 0.0, v)  # an empty state's v is never multiplied
    den = w.sum(-1)
    out = (w[..., None] * v).sum(-2) / torch.where(den > 0, den, 1.0)[..., None]
    lse = torch.where(den > 0, m[..., 0] + torch.log2(torch.where(den > 0, den, 1.0)), float("-inf"))
    return out.masked_fill(nan_row[..., None], float("nan")), lse.masked_fill(nan_row, float("nan"))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [seq_len, num_states, num_heads, head_dim]``, ``s [seq_len, num_states,
    num_heads]`` fp32 -> ``(v [seq_len, num_heads, head_dim], s [seq_len, num_heads])``,
    both float64 on the CPU. ValueError naming the argument on bad input."""
    check_states_args(v, s)
    return merge_lse_weighted(v.transpose(1, 2), s.transpose(1, 2))


def merge_state(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two states ``v_a, v_b [seq_len, num_heads, head_dim]``, ``s_a, s_b [seq_len,
    num_heads]`` fp32 -> their merge ``(v, s)`` in float64 (:func:`merge_states`)."""
    check_state_pair(v_a, s_a, v_b, s_b)
    return merge_states(torch.stack((v_a, v_b), dim=1), torch.stack((s_a, s_b), dim=1))

"""Attention states and their merge (FlashInfer's ``merge_state`` / ``merge_states``), and
cascade attention, their use.

An *attention state* of a row (one query, one head) over a set of keys is the pair
``(v, s)``: ``v [head_dim]`` the softmax-normalised output over those keys and ``s`` the
base-2 log-sum-exp of their scaled scores, ``s = log2(sum_j 2**(s_j))`` with ``s_j =
scale * log2(e) * q.k_j`` (FlashInfer's definition, what ``return_lse=True`` of
:func:`pagedkv_kernels.prefill.paged_prefill_attention` and :func:`pagedkv_kernels.decode.paged_decode_attention`
returns). The states of disjoint key sets merge into the state of their union:

    s = m + log2(sum_i 2**(s_i - m)),   v = sum_i 2**(s_i - s) * v_i,   m = max_i s_i

An empty state (no keys: ``s = -inf``) weighs exactly 0 and its ``v`` is never
multiplied (``0 * NaN`` would be NaN); a row whose states are all empty merges to ``v =
0``, ``s = -inf`` (FlashInfer leaves that case undefined). The merge is the
split-KV merge's kernel (:func:`pagedkv_kernels.merge.merge_kernel`), with the merged log-sum-exp
written too; :func:`pagedkv_lib.merge_state.merge_states` is the float64 twin.

Cascade attention (:func:`cascade_attention`): requests that share a prefix (a system
prompt) read it once for all of them: one non-causal pass of *all* requests' queries
over the shared prefix's pages (one request of ``total_q`` queries, so each K/V tile
of the prefix serves every request's queries), one causal pass of each request's
queries over its own suffix pages, and the merge of the two states per row. The
result equals attention over the whole sequence (prefix then suffix).
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import torch

from pagedkv_lib import checks

from .host.validate import MAX_SPLITS, check_device
from .merge import launch_merge
from .prefill import paged_prefill_attention

__all__ = ["merge_state", "merge_states", "cascade_attention"]


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row (FlashInfer's ``merge_states``).

    Args:
        v: ``[seq_len, num_states, num_heads, head_dim]`` fp32/fp16/bf16, each state's
            normalised output.
        s: ``[seq_len, num_states, num_heads]`` fp32, each state's base-2 log-sum-exp
            (``-inf``: an empty state).

    Returns:
        ``(v_merged [seq_len, num_heads, head_dim]`` in ``v.dtype``, ``s_merged
        [seq_len, num_heads]`` fp32``)`` by the formula of the module docstring; all
        states empty gives zeros and ``-inf``.

    Raises:
        ValueError naming the argument (shapes, dtypes, device, 1 to ``MAX_SPLITS``
        states) before anything is allocated.
    """
    checks.check_states_args(v, s)
    check_device("v", v)
    check_device("s", s)
    if v.shape[1] > MAX_SPLITS:
        raise ValueError(f"v has {v.shape[1]} states; 1 to {MAX_SPLITS} are supported")
    seq_len, _, heads, head_dim = v.shape
    out = torch.empty((seq_len, heads, head_dim), dtype=v.dtype, device=v.device)
    lse = torch.empty((seq_len, heads), dtype=torch.float32, device=v.device)
    launch_merge(v.permute(0, 2, 1, 3), s.permute(0, 2, 1), out, lse)
    return out, lse


def merge_state(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states (FlashInfer's ``merge_state``): ``v_a, v_b [seq_len,
    num_heads, head_dim]`` (one dtype), ``s_a, s_b [seq_len, num_heads]`` fp32 base-2
    log-sum-exps. Returns ``(v [seq_len, num_heads, head_dim]`` in ``v_a.dtype``, ``s
    [seq_len, num_heads]`` fp32``)`` as :func:`merge_states` of the two; ValueError
    naming the argument on bad input."""
    checks.check_state_pair(v_a, s_a, v_b, s_b)
    return merge_states(torch.stack((v_a, v_b), dim=1), torch.stack((s_a, s_b), dim=1))


def cascade_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    shared_pages: torch.Tensor,
    shared_len: int,
    suffix_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    layout: str = "NHD",
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over a shared prefix plus each request's own suffix, in two passes merged.

    Args:
        q: ``[total_q, num_q_heads, head_dim]`` ragged by ``qo_indptr [batch + 1]`` (as
            :func:`pagedkv_kernels.prefill.paged_prefill_attention`); the queries are each
            request's newest tokens, inside its suffix.
        cache: the 5-D pool (NHD or HND).
        shared_pages: ``[ceil(shared_len / page_size)]`` page ids of the prefix every
            request shares (positions ``0 .. shared_len - 1``).
        shared_len: tokens of the shared prefix, >= 0.
        suffix_tables: ``[batch, max_blocks]`` page ids of each request's own tokens
            (positions ``shared_len ..``), ``-1`` padded; row 0 of a request's first
            suffix page is position ``shared_len``.
        suffix_lens: ``[batch]`` suffix lengths including the new tokens (at least
            ``q_len``).

    Query ``i`` of request ``b`` (position ``shared_len + suffix_lens[b] - q_len + i``)
    sees the whole prefix (a non-causal pass of all ``total_q`` queries as one request,
    so every prefix K/V tile is loaded once for all requests) and its suffix up to
    itself (a causal pass); :func:`merge_state` joins the two. Returns ``[total_q,
    num_q_heads, head_dim]`` in ``q.dtype``, equal within the prefill tolerances to
    attention over ``prefix + suffix``. ValueError naming the argument from either pass.
    """
    checks.check_int("shared_len", shared_len)
    prefix_table = torch.as_tensor(shared_pages).reshape(1, -1)
    prefix_lens = torch.tensor([shared_len], dtype=torch.int32, device=prefix_table.device)
    all_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=prefix_table.device)
    v_suf, s_suf = paged_prefill_attention(
        q, cache, qo_indptr, suffix_tables, suffix_lens, layout, None, scale, causal=True, return_lse=True
    )
    v_pre, s_pre = paged_prefill_attention(
        q, cache, all_q, prefix_table, prefix_lens, layout, None, scale, causal=False, return_lse=True
    )
    return merge_state(v_pre, s_pre, v_suf, s_suf)[0]

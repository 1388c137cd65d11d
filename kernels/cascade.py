"""Attention states and their merge (FlashInfer's ``merge_state`` / ``merge_states``), and
cascade attention, their use.

An *attention state* of a row (one query, one head) over a set of keys is the pair
``(v, s)``: ``v [head_dim]`` the softmax-normalised output over those keys and ``s`` the
base-2 log-sum-exp of their scaled scores, ``s = log2(sum_j 2**(s_j))`` with ``s_j =
scale * log2(e) * q.k_j`` (FlashInfer's definition, what ``return_lse=True`` of
:func:`kernels.prefill.paged_prefill_attention` and :func:`kernels.decode.paged_decode_attention`
returns). The states of disjoint key sets merge into the state of their union:

    s = m + log2(sum_i 2**(s_i - m)),   v = sum_i 2**(s_i - s) * v_i,   m = max_i s_i

An empty state (no keys: ``s = -inf``) weighs exactly 0 and its ``v`` is never
multiplied (``0 * NaN`` would be NaN); a row whose states are all empty merges to ``v =
0``, ``s = -inf`` (FlashInfer leaves that case undefined). The split-KV merge of
:mod:`kernels.merge` is the same formula without the merged ``s``; it is kept as it is
(notebook 07 shows its source), and :func:`merge_states_kernel` is the general one:
any number of states, any strides, the merged log-sum-exp written too.
:func:`pagedkv_lib.merge_state.merge_states` is the float64 twin.

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
import triton
import triton.language as tl

from pagedkv_lib import checks

from .prefill import paged_prefill_attention
from .rounding import round_to
from .tiles import merge_tiles
from .validate import MAX_SPLITS, check_device

__all__ = ["merge_states_kernel", "launch_merge_states", "merge_state", "merge_states", "cascade_attention"]


@triton.jit
def merge_states_kernel(
    # pointers: the states v [rows, heads, states, dim] and s [rows, heads, states] (any
    # strides), the merged v [rows, heads, dim] and s [rows, heads]
    v_ptr, s_ptr, out_ptr, lse_ptr,
    # strides (elements)
    stride_vr, stride_vh, stride_vs, stride_vd,
    stride_sr, stride_sh, stride_ss,
    stride_or, stride_oh, stride_od,
    stride_lr, stride_lh,
    # sizes
    num_states, head_dim,
    # constexprs
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program ``(row, head)``: merge the row's ``num_states`` states (fp32 arithmetic)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_states
    d_mask = offs_d < head_dim
    s = tl.load(s_ptr + r * stride_sr + h * stride_sh + offs_s * stride_ss, mask=s_mask, other=float("-inf"))
    m = tl.max(s, axis=0)
    w = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m))  # empty states weigh exactly 0
    v_ptrs = v_ptr + r * stride_vr + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :] * stride_vd
    v = tl.load(v_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    v = tl.where(w[:, None] > 0.0, v, 0.0)  # a weightless state adds nothing, NaN included
    den = tl.sum(w, axis=0)
    has = den > 0.0
    o = tl.sum(w[:, None] * v, axis=0) / tl.where(has, den, 1.0)  # all empty: zeros, not NaN
    tl.store(out_ptr + r * stride_or + h * stride_oh + offs_d * stride_od, round_to(o, out_ptr.dtype.element_ty),
             mask=d_mask)  # fmt: skip
    lse = tl.where(has, m + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
    tl.store(lse_ptr + r * stride_lr + h * stride_lh, lse)


def launch_merge_states(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Launch :func:`merge_states_kernel` without checks: ``v [rows, heads, states,
    head_dim]``, ``s [rows, heads, states]`` fp32 (views of any strides) into ``out
    [rows, heads, head_dim]`` and ``lse [rows, heads]`` fp32."""
    rows, heads, states, head_dim = v.shape
    if rows == 0 or heads == 0:
        return
    block_s, block_d = merge_tiles(states, head_dim)
    # fmt: off
    merge_states_kernel[(rows, heads)](
        v, s, out, lse,
        *v.stride(), *s.stride(), *out.stride(), *lse.stride(),
        states, head_dim,
        BLOCK_S=block_s, BLOCK_D=block_d,
    )
    # fmt: on


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
    launch_merge_states(v.permute(0, 2, 1, 3), s.permute(0, 2, 1), out, lse)
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
            :func:`kernels.prefill.paged_prefill_attention`); the queries are each
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
    if not isinstance(shared_len, int) or isinstance(shared_len, bool) or shared_len < 0:
        raise ValueError(f"shared_len={shared_len!r} must be an int >= 0")
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

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
0``, ``s = -inf`` (FlashInfer leaves that case undefined). NaN is never an empty state:
a state whose ``s`` is NaN (its keys held a NaN) or ``+inf`` makes the merged row NaN,
``v`` and ``s`` (:mod:`pagedkv_kernels.merge` says how it is detected). The merge is the
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
import re

import torch

from pagedkv_lib import checks
from pagedkv_lib.cache_layouts import kv_cache_view
from pagedkv_lib.formats import index_tensor

from .host.validate import MAX_SPLITS, check_device, host_copy
from .merge import launch_merge
from .prefill import plan_prefill, run_prefill

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
        states empty gives zeros and ``-inf``; a state with ``s`` NaN or ``+inf`` gives
        NaN for its row's ``v_merged`` and ``s_merged``.

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
    [seq_len, num_heads]`` fp32``)`` as :func:`merge_states` of the two (empty states,
    NaN and ``+inf`` as there); ValueError naming the argument on bad input."""
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
    attention over ``prefix + suffix``; a NaN in a query, or in a key it sees (prefix or
    suffix), makes its row NaN. Raises ValueError naming the argument (these names, not
    the passes' own) before either pass is launched.
    """
    prefix_table, prefix_lens, all_q = _prefix_pass_args(q, cache, layout, shared_pages, shared_len)
    suffix_names = {"block_tables": "suffix_tables", "seq_lens": "suffix_lens"}
    with _named_as(suffix_names):
        suffix = plan_prefill(q, cache, qo_indptr, suffix_tables, suffix_lens, layout, None, scale, causal=True)
    with _named_as({"block_tables[0, ": "shared_pages[", "seq_lens[0]": "shared_len"}):
        prefix = plan_prefill(q, cache, all_q, prefix_table, prefix_lens, layout, None, scale, causal=False)
    v_suf, s_suf = run_prefill(suffix, q, cache, return_lse=True)
    v_pre, s_pre = run_prefill(prefix, q, cache, return_lse=True)
    return merge_state(v_pre, s_pre, v_suf, s_suf)[0]


def _prefix_pass_args(q, cache, layout: str, shared_pages, shared_len: int) -> tuple:
    """``(block_tables [1, pages], seq_lens [1], qo_indptr [2])`` of the prefix pass (one
    request of every query, on ``q``'s device), after checking ``shared_len`` and that
    ``shared_pages`` is a 1-D integer tensor with a page for every prefix token."""
    checks.check_int("shared_len", shared_len)
    pages = index_tensor("shared_pages", host_copy(shared_pages), 1)
    page_size = kv_cache_view(cache, layout).dims.page_size
    if pages.numel() * page_size < shared_len:
        raise ValueError(f"shared_pages has {pages.numel()} pages of {page_size} tokens; shared_len={shared_len}")
    device = shared_pages.device if isinstance(shared_pages, torch.Tensor) else q.device
    table = torch.as_tensor(shared_pages, device=device).reshape(1, -1)
    lens = torch.tensor([shared_len], dtype=torch.int32, device=device)
    return table, lens, torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device)


class _named_as:
    """Re-raise a ValueError of a pass with the cascade's names for its arguments
    (``names``: the pass's text -> the cascade's)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.pattern = re.compile("|".join(rf"\b{re.escape(k)}" for k in names))
        self.names = names

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        if kind is ValueError:
            raise ValueError(self.pattern.sub(lambda m: self.names[m.group(0)], str(err))) from None
        return False

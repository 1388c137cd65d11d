"""The suite's prefill kernel under vLLM's name and arguments: ``context_attention_fwd``.

vLLM's prefix-prefill kernel (``vllm/attention/ops/prefix_prefill.py``) attends a batch
of new tokens to their cached context plus themselves. Its caches are vLLM's original
paged layout, the ``"vllm_x"`` pair of :mod:`pagedkv_lib.cache_layouts` (the key packs
``x = 16 // element_size`` features together), and the new tokens' K/V are *not* in the
cache: they come as ragged ``k, v [total_q, num_kv_heads, head_dim]``, and the cache
holds only the context, positions ``0 .. b_seq_len[b] - q_len[b] - 1``.

The suite's :func:`pagedkv_kernels.prefill.paged_prefill_attention` reads both natively (the
pair in place, the new tokens through ``k_new``/``v_new``), so the wrapper below only
renames arguments and refuses what vLLM's kernel does and the suite's does not (FP8
caches, ALiBi); no tensor is copied.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import torch

from pagedkv_lib import checks
from pagedkv_lib.window import LinearWindow

from ..prefill import PrefillPlan, plan_prefill, run_prefill

__all__ = ["VLLM_NAMES", "plan_context_attention", "context_attention_fwd"]

# vLLM's argument -> the suite's (pagedkv_kernels.prefill.paged_prefill_attention).
VLLM_NAMES = {
    "q": "q",
    "k": "k_new",
    "v": "v_new",
    "o": "out (run_prefill)",
    "(k_cache, v_cache)": "cache",
    "b_loc": "block_tables",
    "b_start_loc": "qo_indptr",
    "b_seq_len": "seq_lens",
    "sliding_window": "window (LinearWindow.from_sliding_window)",
    "sm_scale": "scale",
}


def _check_unit_scale(name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        ok = value.numel() == 1 and float(value.reshape(()).cpu()) == 1.0
    else:
        ok = checks.is_number(value) and value == 1.0
    if not ok:
        raise ValueError(
            f"{name}={value!r}: with kv_cache_dtype='auto' the cache is stored unscaled; only 1.0 is meaningful "
            "(FP8 caches are pagedkv_kernels.quant_decode's)"
        )


def plan_context_attention(
    q, k, v, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, k_scale=1.0, v_scale=1.0,
    alibi_slopes=None, sliding_window=None, sm_scale=None,
) -> PrefillPlan:  # fmt: skip
    """Validate a :func:`context_attention_fwd` call (vLLM's rules, then
    :func:`pagedkv_kernels.prefill.plan_prefill`'s); nothing is launched. A ValueError from the
    suite's checks names the suite's argument and ends with vLLM's name for it."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: only 'auto' (the cache in q's float dtypes)")
    _check_unit_scale("k_scale", k_scale)
    _check_unit_scale("v_scale", v_scale)
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not implemented by the suite's prefill; pass None")
    window = None
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window <= 0):
        window = LinearWindow.from_sliding_window(sliding_window)  # vLLM: None or <= 0 is no window
    try:
        return plan_prefill(q, (k_cache, v_cache), b_start_loc, b_loc, b_seq_len, window=window, scale=sm_scale,
                            k_new=k, v_new=v)  # fmt: skip
    except ValueError as err:
        names = ", ".join(f"{a} is {b}" for a, b in VLLM_NAMES.items() if a != b)
        raise ValueError(f"{err} (context_attention_fwd's names: {names})") from None


def context_attention_fwd(
    q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, max_input_len, k_scale=1.0,
    v_scale=1.0, alibi_slopes=None, sliding_window=None, sm_scale=None,
):  # fmt: skip
    """vLLM's ``context_attention_fwd``: attention of the new tokens over their cached
    context and themselves, written into ``o``; returns ``o`` (vLLM's returns None).

    Arguments, as vLLM names them, and the suite's equivalents
    (:func:`pagedkv_kernels.prefill.paged_prefill_attention`):

    * ``q [total_q, num_q_heads, head_dim]``: ``q``;
    * ``k, v [total_q, num_kv_heads, head_dim]``: the new tokens' K/V, ``k_new``, ``v_new``
      (not in the cache);
    * ``o [total_q, num_q_heads, head_dim]``, ``q``'s dtype: the output, written in place
      (``run_prefill(..., out=o)``);
    * ``kv_cache_dtype``: ``"auto"`` only; ``k_scale``, ``v_scale``: 1.0 (unused then);
    * ``k_cache [num_blocks, num_kv_heads, head_dim // x, block_size, x]``, ``v_cache
      [num_blocks, num_kv_heads, head_dim, block_size]``: ``cache=(k_cache, v_cache)``, the
      ``"vllm_x"`` layout, holding the context only;
    * ``b_loc [batch, max_blocks]``: ``block_tables`` (covering the context);
    * ``b_start_loc [batch + 1]``: ``qo_indptr``;
    * ``b_seq_len [batch]``: ``seq_lens``, context plus new tokens;
    * ``max_input_len``: unused (the plan derives the tiles from ``b_start_loc``);
    * ``alibi_slopes``: None only;
    * ``sliding_window = w``: ``window=LinearWindow.from_sliding_window(w)`` (each query
      sees ``w`` keys, its own included); None or ``<= 0``: no window;
    * ``sm_scale``: ``scale`` (default ``1 / sqrt(head_dim)``).

    Causal, GQA by ``num_q_heads // num_kv_heads``. Raises ValueError (naming the
    argument, with vLLM's names appended) before anything is launched.
    """
    return run_prefill(
        plan_context_attention(q, k, v, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, k_scale,
                               v_scale, alibi_slopes, sliding_window, sm_scale),
        q, (k_cache, v_cache), False, k, v, o,
    )  # fmt: skip

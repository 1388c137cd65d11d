"""Score modifiers some attention kernels apply: a logit soft cap, ALiBi biases and
per-head sink logits, in float64 for the references (:mod:`pagedkv_lib.reference`).

With ``s = scale * q.k`` (natural units), in the order vLLM's Triton attention applies
them:

* ``logits_soft_cap = c`` (Gemma 2, Grok; FlashInfer's ``logits_soft_cap``, vLLM's
  ``softcap``): ``s = c * tanh(s / c)``, a float ``c > 0``;
* ``alibi_slopes [num_q_heads]`` (ALiBi; vLLM's ``alibi_slopes``): ``s += slope[h] *
  (key_pos - query_pos)``, non-positive for the keys a causal query sees, so a key
  ``d`` positions back is ``slope * d`` down;
* ``sinks [num_q_heads]`` (gpt-oss's attention sinks; vLLM's ``sinks``): a logit per
  head joins each row's softmax as one more column with no value: ``p_j = exp(s_j) /
  (exp(sink[h]) + sum_k exp(s_k))``. It only takes mass away, so the output shrinks
  towards 0; a row with no visible key still gives 0.

The log-sum-exp a kernel returns (``return_lse``) is over the keys only, after the soft
cap and the ALiBi bias, without the sink.
"""

from __future__ import annotations

import torch

from pagedkv_lib.checks.scalars import is_number

__all__ = ["SCORE_MODS", "check_score_mods", "soft_cap", "alibi_bias", "sink_share", "alibi_slopes_for"]

SCORE_MODS = ("softcap", "alibi", "sinks")  # as a kernel's contract names them


def _per_head(name: str, t, num_q_heads: int) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (num_q_heads,):
        raise ValueError(
            f"{name} must be a float32 tensor [num_q_heads] = [{num_q_heads}], "
            f"got {getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}"
        )


def check_score_mods(num_q_heads: int, logits_soft_cap=None, alibi_slopes=None, sinks=None) -> None:
    """ValueError naming the argument: ``logits_soft_cap`` None or a float > 0,
    ``alibi_slopes`` and ``sinks`` None or float32 ``[num_q_heads]``."""
    cap = logits_soft_cap
    if cap is not None:
        if not is_number(cap) or not cap > 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be None or a number > 0")
    _per_head("alibi_slopes", alibi_slopes, num_q_heads)
    _per_head("sinks", sinks, num_q_heads)


def soft_cap(scores: torch.Tensor, logits_soft_cap) -> torch.Tensor:
    """``c * tanh(scores / c)``; ``scores`` unchanged when ``logits_soft_cap`` is None."""
    if logits_soft_cap is None:
        return scores
    return logits_soft_cap * torch.tanh(scores / logits_soft_cap)


def alibi_bias(alibi_slopes, key_minus_query: torch.Tensor, head_dim_index: int, ndim: int, dtype) -> torch.Tensor:
    """``slope[h] * (key_pos - query_pos)`` shaped to add to scores of ``ndim`` dims whose
    head axis is ``head_dim_index``; ``key_minus_query`` broadcasts over the others (a
    size-1 head axis). 0 when ``alibi_slopes`` is None."""
    if alibi_slopes is None:
        return torch.zeros((), dtype=dtype)
    shape = [1] * ndim
    shape[head_dim_index] = -1
    return alibi_slopes.cpu().to(dtype).view(shape) * key_minus_query.to(dtype)


def sink_share(scores: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The factor that turns a softmax over the visible keys into one with the sink in
    its denominator: ``sum_k e^{s_k} / (e^{sink} + sum_k e^{s_k}) = sigmoid(lse - sink)``
    with ``lse`` the natural log-sum-exp of the visible ``scores`` (``mask``); shaped
    ``scores[..., :1]`` (``sinks`` broadcast to it). 0 for a row without keys, NaN for
    a row whose scores hold NaN."""
    lse = torch.logsumexp(scores.masked_fill(~mask.expand_as(scores), float("-inf")), dim=-1, keepdim=True)
    return torch.sigmoid(lse - sinks.to(scores.dtype))


def alibi_slopes_for(num_q_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes ``2 ** (-8 (h + 1) / num_q_heads)``, float32 ``[num_q_heads]``
    (for a power-of-two head count; others get the same formula, as a test input)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_q_heads) for h in range(num_q_heads)], dtype=torch.float32)

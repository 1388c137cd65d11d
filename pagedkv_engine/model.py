"""A Llama forward pass over a paged KV cache: RMSNorm, RoPE, GQA attention, SwiGLU.

The weights are transformers' own tensors (read from its ``LlamaForCausalLM``): the
embedding and the norms as they are, every projection and the LM head as a row-major
``[in, out]`` copy (:func:`row_major_weights`, multiplied as ``x @ w``: faster on one
CPU thread for the few rows of a decode step; engines over one model share them).
Every operation outside attention follows transformers' op order
(``modeling_llama.py``), so the fp32 logits of the two implementations differ only by
the attention arithmetic and by matrix products over a different number of rows and
another weight layout.

One forward call serves a whole engine step: a flat batch of ``num_tokens`` tokens
from several sequences, prefill chunks first (``num_prefill_tokens`` rows, ragged by
``qo_indptr``), then one token per decoding sequence. Per layer: project Q, K, V; the
backend's ``write`` rotates Q and K and stores K, V in the layer's pool; ``prefill``
and ``decode`` attend over the pool through the block tables.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["StepInput", "LlamaModel", "PROJECTIONS", "transposed", "row_major_weights"]


@dataclass
class StepInput:
    """The tensors of one engine step (all int64 unless noted, on the model's device).

    * ``input_ids, positions, slot_mapping [num_tokens]``: prefill rows first, then decodes;
    * ``qo_indptr [num_prefill + 1]``, ``prefill_block_tables [num_prefill, max_blocks]``
      (int32, ``-1`` padded), ``prefill_seq_lens [num_prefill]`` (KV length including
      the chunk) for the prefill part;
    * ``decode_block_tables [num_decode, max_blocks]``, ``decode_seq_lens [num_decode]``;
    * ``logit_rows [num_logits]``: rows whose next-token logits are wanted.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    qo_indptr: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    logit_rows: torch.Tensor


#: The projections of a transformers Llama layer, by the engine's names.
PROJECTIONS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}

# hf model -> (device and weight versions, layers' copies, LM head's copy); see row_major_weights.
_ROW_MAJOR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def transposed(weight: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``weight [out, in]`` as a row-major ``[in, out]`` copy on ``device``, for ``x @ w``.

    One CPU thread multiplies a few rows by a weight 1.2x (layers) to 1.7x (LM head)
    faster in this layout than through ``F.linear``'s ``[out, in]`` (measured on
    SmolLM2's shapes, 8 rows)."""
    return weight.detach().t().contiguous().to(device)


def row_major_weights(hf_model, device: torch.device | str) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """``(layers, lm_head)``: per layer ``{name: [in, out]}`` copies of the
    :data:`PROJECTIONS`, and the LM head's ``[hidden, vocab]`` copy (:func:`transposed`).

    The copies cost a second set of weights (540 MB fp32 for SmolLM2-135M), made once:
    engines built over the same model on the same device share them for as long as
    the model lives and none of its weights is changed in place (version counters)."""
    weights = [[layer.get_submodule(path).weight for path in PROJECTIONS.values()] for layer in hf_model.model.layers]
    key = (str(torch.device(device)), [w._version for ws in weights for w in ws], hf_model.lm_head.weight._version)
    held = _ROW_MAJOR.get(hf_model)
    if held is None or held[0] != key:
        layers = [{name: transposed(w, device) for name, w in zip(PROJECTIONS, ws)} for ws in weights]
        held = _ROW_MAJOR[hf_model] = (key, layers, transposed(hf_model.lm_head.weight, device))
    return held[1], held[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` for fp32 input, op for op."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


class LlamaModel:
    """Llama over paged pools, with weights taken from a transformers ``LlamaForCausalLM``.

    ``attention`` is a backend from :mod:`pagedkv_engine.attention`. The model holds no
    KV itself: :meth:`forward` gets one pool tensor per layer.
    """

    def __init__(self, hf_model, attention, device: torch.device | str = "cpu") -> None:
        cfg = hf_model.config
        self.config = cfg
        self.attention = attention
        self.device = torch.device(device)
        self.num_layers = cfg.num_hidden_layers
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.dtype = torch.float32
        if cfg.hidden_act != "silu" or getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("LlamaModel supports the SmolLM2/Llama variant: SiLU, no biases")
        rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={rope['rope_type']!r} is not supported (only the default RoPE)")
        self.rope_theta = float(rope["rope_theta"])

        m = hf_model.model
        self.embed = m.embed_tokens.weight.detach().to(self.device)
        self.norm = m.norm.weight.detach().to(self.device)
        projections, self.lm_head = row_major_weights(hf_model, self.device)
        self.layers = [
            {
                "input_norm": layer.input_layernorm.weight.detach().to(self.device),
                "post_norm": layer.post_attention_layernorm.weight.detach().to(self.device),
                **mine,
            }
            for layer, mine in zip(m.layers, projections)
        ]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies over all layers (fp32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @torch.inference_mode()
    def forward(self, step: StepInput, caches: list[torch.Tensor]) -> torch.Tensor:
        """Run one step; return the logits ``[num_logits, vocab_size]`` (fp32) of
        ``step.logit_rows``. Writes every token's K and V into ``caches[layer]``."""
        n, p = step.input_ids.numel(), step.num_prefill_tokens
        x = F.embedding(step.input_ids, self.embed)
        for layer, cache in zip(self.layers, caches):
            h = rms_norm(x, layer["input_norm"], self.eps)
            q = (h @ layer["q"]).view(n, self.num_q_heads, self.head_dim)
            k = (h @ layer["k"]).view(n, self.num_kv_heads, self.head_dim)
            v = (h @ layer["v"]).view(n, self.num_kv_heads, self.head_dim)
            self.attention.write(q, k, v, cache, step.slot_mapping, step.positions)
            parts = []  # the references return CPU tensors: bring each part to x's device
            if p:
                out = self.attention.prefill(
                    q[:p], cache, step.qo_indptr, step.prefill_block_tables, step.prefill_seq_lens
                )
                parts.append(out.to(x.device))
            if n > p:
                out = self.attention.decode(q[p:], cache, step.decode_block_tables, step.decode_seq_lens)
                parts.append(out.to(x.device))
            o = torch.cat(parts) if len(parts) > 1 else parts[0]
            x = x + o.reshape(n, -1) @ layer["o"]
            h = rms_norm(x, layer["post_norm"], self.eps)
            x = x + (F.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        x = rms_norm(x[step.logit_rows], self.norm, self.eps)
        return x @ self.lm_head

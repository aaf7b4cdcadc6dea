"""Dense decoder models: Llama, Mistral (no sliding window), Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Follows HF ``modeling_llama`` / ``modeling_qwen2`` / ``modeling_qwen3`` with the layout's fused tensors:
``self_attn.qkv_proj`` (q ‖ k ‖ v rows) and ``mlp.gate_up_proj`` (gate ‖ up rows). Attention is paged GQA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.errors import ConfigError
from atomtool.inspect.memory import effective_sliding_window, layer_attention_kinds
from atomtool.serve.engine.batch import ForwardBatch, KVPlaneSpec
from atomtool.serve.layers.attention import PagedAttention
from atomtool.serve.layers.embedding import LMHead, VocabEmbedding
from atomtool.serve.layers.linear import fused_row_ranges, make_linear
from atomtool.serve.layers.norm import RMSNorm
from atomtool.serve.layers.rotary import RotaryEmbedding
from atomtool.serve.models.base import CausalLM
from atomtool.serve.ops import get_op


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: missing or bad attention field: {exc}") from exc
    if heads % kv_heads:
        raise ConfigError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{kv_heads}")
    return hidden, heads, kv_heads, head_dim


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional q/k norm (Qwen3), rope, paged GQA, o_proj."""

    def __init__(self, cfg: dict[str, Any], prefix: str, specs, dtype, device, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, self.num_heads, self.num_kv_heads, self.head_dim = _dims(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = make_linear(f"{prefix}.qkv_proj", hidden, q_size + 2 * kv_size, bias=qkv_bias,
                                    dtype=dtype, device=device, specs=specs, config_flat=cfg)
        self.ranges = fused_row_ranges(f"{prefix}.qkv_proj", specs, [q_size, kv_size, kv_size])
        o_bias = bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2"
        self.o_proj = make_linear(f"{prefix}.o_proj", q_size, hidden, bias=o_bias, dtype=dtype, device=device,
                                  specs=specs, config_flat=cfg)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        if cfg.get("model_type") == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.norm_eps = eps
        self.rotary = rotary
        self._prologue = get_op("qk_rope_store_kv", device)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, device)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                kv_cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """cos, sin: the step's rotary tables ([T, D/2] float32, :meth:`RotaryEmbedding.cos_sin`, computed
        once per step by the model); x: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)
        T = qkv.shape[0]
        (qs, qe), (ks, ke), (vs, ve) = self.ranges
        q = qkv[:, qs:qe].reshape(T, self.num_heads, self.head_dim)
        k = qkv[:, ks:ke].reshape(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, vs:ve].reshape(T, self.num_kv_heads, self.head_dim)
        # q/k norm (Qwen3), rope and the K/V store in one op, then attention over the cache
        qn, kn = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        q = self._prologue(q, k, v, qn, kn, self.norm_eps, cos, sin, self.rotary.interleaved, kv_cache["k"],
                           kv_cache["v"], batch.slot_mapping)
        return self.o_proj(self.attn.attend(q, batch, kv_cache))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with the fused ``gate_up_proj``."""

    def __init__(self, cfg: dict[str, Any], prefix: str, specs, dtype, device) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (only silu)")
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_up_proj = make_linear(f"{prefix}.gate_up_proj", hidden, 2 * inter, bias=bias, dtype=dtype,
                                        device=device, specs=specs, config_flat=cfg)
        (gs, ge), (us, ue) = fused_row_ranges(f"{prefix}.gate_up_proj", specs, [inter, inter])
        self.contiguous = gs == 0 and ue == self.gate_up_proj.out_features and ge == us and ge - gs == ue - us
        self.ranges = ((gs, ge), (us, ue))
        self.down_proj = make_linear(f"{prefix}.down_proj", inter, hidden, bias=bias, dtype=dtype, device=device,
                                     specs=specs, config_flat=cfg)
        self._act = get_op("silu_and_mul", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if not self.contiguous:  # padded parts (FP8 alignment): drop the padding rows first
            (gs, ge), (us, ue) = self.ranges
            gu = torch.cat((gu[:, gs:ge], gu[:, us:ue]), dim=-1)
        return self.down_proj(self._act(gu))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, i: int, specs, dtype, device, rotary) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", specs, dtype, device, rotary)
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", specs, dtype, device)
        self.input_layernorm = RMSNorm(int(cfg["hidden_size"]), eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(int(cfg["hidden_size"]), eps, dtype, device)

    def forward(self, cos, sin, x, residual, batch, kv_cache):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(cos, sin, h, batch, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, specs, dtype, device) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.rotary = rotary = RotaryEmbedding(cfg, device)
        self.embed_tokens = VocabEmbedding(int(cfg["vocab_size"]), hidden, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, specs, dtype, device, rotary)
                                    for i in range(int(cfg["num_hidden_layers"])))
        self.norm = RMSNorm(hidden, float(cfg.get("rms_norm_eps", 1e-6)), dtype, device)

    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        residual = None
        # rotary tables once per step (a row gather from the precomputed table), not once per layer
        cos, sin = self.rotary.cos_sin(batch.positions, max(batch.seq_lens_cpu, default=0))
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(cos, sin, x, residual, batch, cache)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM (variant read from ``model_type`` and the config flags).

    Parameters (= layout tensor names): ``model.embed_tokens.weight`` [V, H]; per layer
    ``model.layers.{i}.self_attn.qkv_proj.weight`` [(Hq + 2 Hkv) D, H] (+ ``.bias`` for Qwen2),
    ``self_attn.o_proj.weight``, ``self_attn.{q,k}_norm.weight`` [D] (Qwen3), ``mlp.gate_up_proj.weight``
    [2I, H], ``mlp.down_proj.weight``, ``input_layernorm.weight``, ``post_attention_layernorm.weight``;
    ``model.norm.weight``; ``lm_head.weight`` unless ``tie_word_embeddings``.
    """

    def __init__(self, config_flat: dict[str, Any], specs: dict[str, OutputTensor] | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(config_flat, specs, dtype, device)
        cfg = config_flat
        window = effective_sliding_window(cfg)
        if window is not None and "sliding" in layer_attention_kinds(cfg):
            # Sliding-window attention is not implemented: within the window it equals full attention, so
            # serve at most ``sliding_window`` tokens per sequence instead of refusing the model. Whether the
            # window applies is read as transformers' config classes read it (Mistral ignores
            # ``use_sliding_window``; Qwen2/Qwen3 apply the window only when it is true).
            self.context_limit = window
            self.context_limit_reason = (f"sliding_window {window}: sliding-window attention is not implemented, "
                                         "so sequences are served within the window, where it is exact")
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = _dims(cfg)
        self.model = LlamaModel(cfg, specs, dtype, device)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if specs is not None and "lm_head.weight" not in specs:
            self.tied = True
        self.lm_head = LMHead(int(cfg["vocab_size"]), self.hidden_size, dtype, device)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tied_weight_names(self) -> list[str]:
        return ["lm_head.weight"] if self.tied else []

    def kv_plane_specs(self) -> list[list[KVPlaneSpec]]:
        shape = (self.num_kv_heads, self.head_dim)
        return [[KVPlaneSpec("k", shape, self.dtype), KVPlaneSpec("v", shape, self.dtype)]
                for _ in self.model.layers]

    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return self.model(batch, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

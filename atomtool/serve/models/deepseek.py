"""The MLA + MoE (+ DSA) family: DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM.

One decoder for all three (HF transformers ``deepseek_v3`` / ``deepseek_v32`` / ``glm_moe_dsa`` modeling,
which these reproduce in float32):

    h = embed(ids); for each layer: h += MLA(RMSNorm(h)); h += MLP_or_MoE(RMSNorm(h)); logits = lm_head(norm(h))

Per-layer facts and where they come from:
- DSA role (dense / full / shared): :func:`atomtool.inspect.dsa.layer_roles` only (config ``indexer_types``);
  a shared layer reuses the top-k of :func:`atomtool.inspect.dsa.previous_full_layer`.
- MLP kind: ``mlp_layer_types`` when present ("dense"/"sparse"), else ``i >= first_k_dense_replace`` is MoE.
- Rotary pairing: MLA q_pe/k_pe interleaved (DeepSeek-V3 follows ``rope_interleave``, default true; HF's
  V3.2 and GLM always interleave); indexer NeoX for DeepSeek-V3.2 (vllm#28968), interleaved for GLM.
- Fused input projection: ``fused_qkv_a_proj`` rows = q_a ‖ kv_a (‖ indexer.wk ‖ indexer.weights_proj on
  full layers when the converter fused them). The conversion plan's :class:`OutputTensor` specs (parts and
  row ranges, padding rows excluded) say which; without specs the BF16 converter layout is assumed.

Weights: the atomtool layout names (see :meth:`DeepseekV3ForCausalLM.load_weights`). FP8 block weights
(``.weight`` float8_e4m3fn + ``.weight_scale_inv``) stay FP8 and the ops dequantize (the torch reference
backend) or compute in FP8; only FP8 experts whose gate/up parts the converter padded are dequantized at load.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.errors import EngineError
from atomtool.inspect.dsa import FULL, SHARED, layer_roles, previous_full_layer
from atomtool.serve.engine.batch import ForwardBatch, KVPlaneSpec
from atomtool.serve.layers.embedding import LMHead, VocabEmbedding
from atomtool.serve.layers.linear import fp8_block_size
from atomtool.serve.layers.mla import MLAAttention
from atomtool.serve.layers.moe import DeepseekMoE, SwiGLUMLP
from atomtool.serve.layers.norm import RMSNorm
from atomtool.serve.layers.overlap import aux_stream_for
from atomtool.serve.layers.rotary import RotaryEmbedding
from atomtool.serve.models.base import CausalLM

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
                    if hasattr(torch, n))
#: stacked expert tensors (FP8 ones are kept, or dequantized at load when the layout padded them)
_EXPERT_SUFFIXES = (".mlp.experts.w13.weight", ".mlp.experts.w2.weight")


def dequant_fp8_block_nd(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``W[..., i, j] = fp8[..., i, j] * scale_inv[..., i // b0, j // b1]`` for 2-D weights and stacked
    ``[E, N, K]`` experts (DeepSeek-V3 FP8 block format; ``_inv`` is a multiplier). Returns float32."""
    b0, b1 = block
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(b0, -2)[..., :n, :].repeat_interleave(b1, -1)[..., :k]
    return weight.float() * s


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h += self_attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``."""

    def __init__(self, attn: MLAAttention, mlp: nn.Module, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)


class _Backbone(nn.Module):
    def __init__(self, vocab: int, hidden: int, eps: float, layers: list[DecoderLayer], dtype, device):
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab, hidden, dtype, device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, dtype, device)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 / V3.2 / GLM-MoE-DSA decoder (one class; the variant comes from the config).

    DeepSeek-V3: MLA + MoE (noaux_tc routing, shared experts, first_k_dense_replace, YaRN). V3.2 and GLM add
    the DSA indexer per the schedule of :func:`atomtool.inspect.dsa.layer_roles`.

    Args:
        config_flat: the flattened text config (:func:`atomtool.inspect.dsa.flatten_dsa_config` output).
        specs: the layout's output-tensor specs by name (parts, row ranges, FP8), or None.
        dtype: parameter / activation / KV dtype; device: where parameters live.
    Raises:
        EngineError: an unsupported config (no q_lora_rank, attention bias, non-SiLU MLP, bad fusion).
    """

    def __init__(self, config_flat: dict[str, Any], specs: dict[str, OutputTensor] | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(config_flat, specs, dtype, device)
        cfg = config_flat
        model_type = cfg.get("model_type")
        self.roles = layer_roles(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise EngineError(f"{type(self).__name__} supports hidden_act 'silu', got {cfg['hidden_act']!r}")
        hidden = cfg["hidden_size"]
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        # HF's DeepSeek-V3 follows `rope_interleave` (default true); its V3.2 and GLM always interleave MLA rope.
        mla_interleave = bool(cfg.get("rope_interleave", True)) if model_type == "deepseek_v3" else True
        # Indexer rope: NeoX for DeepSeek-V3.2 (vllm#28968); GLM interleaves (real configs say
        # indexer_rope_interleave: true, and HF's GlmMoeDsaIndexer interleaves even when the flag is absent).
        idx_interleave = bool(cfg.get("indexer_rope_interleave"))  # resolved once by flatten_dsa_config
        mlp_types = cfg.get("mlp_layer_types")
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        layers = []
        for i in range(cfg["num_hidden_layers"]):
            prefix = f"model.layers.{i}"
            attn = MLAAttention(cfg, f"{prefix}.self_attn", specs, self.roles[i], mla_interleave, idx_interleave,
                                dtype, device)
            is_moe = (mlp_types[i] == "sparse") if mlp_types else i >= first_dense
            if is_moe and cfg.get("n_routed_experts"):
                mlp = DeepseekMoE(cfg, f"{prefix}.mlp", specs, dtype, device)
            else:
                mlp = SwiGLUMLP(cfg, f"{prefix}.mlp", specs, cfg["intermediate_size"], dtype, device)
            layers.append(DecoderLayer(attn, mlp, hidden, eps, dtype, device))
        self.model = _Backbone(cfg["vocab_size"], hidden, eps, layers, dtype, device)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = LMHead(cfg["vocab_size"], hidden, dtype, device)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        rope = int(cfg["qk_rope_head_dim"])
        self.rotary = RotaryEmbedding(cfg, device, head_dim=rope, interleaved=mla_interleave)
        self._idx_rope = int(cfg.get("index_rope_dim", rope)) if FULL in self.roles else 0
        #: side stream for the indexer and the shared experts (overlap.aux_stream_for; None on CPU)
        self.aux_stream = aux_stream_for(self.device)
        self.index_rotary = None
        if self._idx_rope and self._idx_rope != rope:
            self.index_rotary = RotaryEmbedding(cfg, device, head_dim=self._idx_rope, interleaved=idx_interleave)

    # ------------------------------------------------------------------ engine interface

    def kv_plane_specs(self) -> list[list[KVPlaneSpec]]:
        """Per layer: the ``latent`` plane (kv_lora_rank + qk_rope_head_dim) and, on full DSA layers, the
        ``index_k`` plane (index_head_dim). Shared and non-DSA layers have no index plane."""
        cfg = self.config_flat
        latent = KVPlaneSpec("latent", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],), self.dtype)
        out = []
        for role in self.roles:
            planes = [latent]
            if role == FULL:
                planes.append(KVPlaneSpec("index_k", (int(cfg["index_head_dim"]),), self.dtype))
            out.append(planes)
        return out

    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One engine step. Returns the final-normed hidden states [T, hidden] of every scheduled token."""
        h = self.model.embed_tokens(batch.input_ids)
        bound = max(batch.seq_lens_cpu, default=0)  # host-side: every position is below it
        cos, sin = self.rotary.cos_sin(batch.positions, bound)
        if self.index_rotary is not None:
            icos, isin = self.index_rotary.cos_sin(batch.positions, bound)
        elif self._idx_rope:
            icos, isin = cos, sin
        else:
            icos = isin = None
        topks: dict[int, torch.Tensor | None] = {}
        # The residual adds ride in the RMSNorm op (``rms_norm(x, residual)`` -> (norm(x + residual),
        # x + residual)): one kernel instead of an add and a norm, bit-identical to ``h = h + x; norm(h)``.
        # A MoE block hands back (routed, shared) and the next norm adds ``residual + (routed + shared)``.
        # Attention, a dense MLP and the routed experts may hand back float32 planes (split-K partials, expert
        # slots) that the next norm sums in order: the same bits as summing first, one launch fewer.
        residual = extra = None
        for i, layer in enumerate(self.model.layers):
            role = self.roles[i]
            prev = topks[previous_full_layer(self.roles, i)] if role == SHARED else None
            if residual is None:
                x, residual = layer.input_layernorm(h), h
            else:
                x, residual = layer.input_layernorm(h, residual, extra)
            a, topk = layer.self_attn(x, cos, sin, icos, isin, batch, kv_caches[i], prev, self.aux_stream)
            if role == FULL:
                topks[i] = topk
            x, residual = layer.post_attention_layernorm(a, residual)
            if isinstance(layer.mlp, DeepseekMoE):
                h, extra = layer.mlp(x, split=True, aux_stream=self.aux_stream)
            else:
                h, extra = layer.mlp(x, sum_splits=False), None
        if residual is None:
            return self.model.norm(h)
        return self.model.norm(h, residual, extra)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden)

    # ------------------------------------------------------------------ weights

    def tied_weight_names(self) -> list[str]:
        return ["lm_head.weight"] if self.tie_word_embeddings else []

    def _skipped(self, name: str) -> bool:
        """MTP layers (index >= num_hidden_layers; HF ignores them too), a tied lm_head, and indexer tensors of
        non-full layers (an IndexCache override on a checkpoint with an indexer everywhere; dsa.md §2,
        vllm#46600)."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return True
        if not name.startswith("model.layers."):
            return False
        idx = int(name.split(".")[2])
        if idx >= len(self.roles):
            return True
        return self.roles[idx] != FULL and ".self_attn.indexer." in name

    def _empty_shared_expert(self, name: str, t: torch.Tensor) -> bool:
        """A zero-element shared-expert tensor of a MoE layer built without shared experts
        (``n_shared_experts: 0``): transformers' ``DeepseekV3MoE`` always builds ``shared_experts`` with
        ``moe_intermediate_size * n_shared_experts`` = 0 rows and ``save_pretrained`` writes those empty
        tensors; they compute nothing, so the engine leaves them out rather than refuse them as unexpected."""
        if t.numel() != 0 or ".mlp.shared_experts." not in name or not name.startswith("model.layers."):
            return False
        idx = int(name.split(".")[2])
        mlp = self.model.layers[idx].mlp if idx < len(self.model.layers) else None
        return isinstance(mlp, DeepseekMoE) and mlp.shared_experts is None

    def _strip_padding(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Drop the converter's FP8-alignment zero rows between stacked gate/up parts (spec row ranges)."""
        spec = (self.specs or {}).get(name)
        if spec is None or not any(p.pad_rows for p in spec.parts):
            return t
        first = min(p.stack_index or 0 for p in spec.parts)
        ranges = [p.rows for p in spec.parts if (p.stack_index or 0) == first and p.rows]
        return torch.cat([t[:, s:e] for s, e in ranges], dim=1) if ranges else t

    def _prepare(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Filter skipped tensors. FP8 stacked experts whose module is float (the layout padded gate/up for
        block alignment) are dequantized and un-padded here (weight + weight_scale_inv, any order)."""
        params = dict(self.named_parameters())
        pending: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        block = fp8_block_size(self.config_flat)

        def ready(base: str) -> tuple[str, torch.Tensor]:
            w = dequant_fp8_block_nd(pending.pop(base), scales.pop(base), block)
            return base, self._strip_padding(base, w)

        for name, t in weights:
            if self._skipped(name) or self._empty_shared_expert(name, t):
                continue
            expert = name.endswith(_EXPERT_SUFFIXES)
            expert_scale = name.endswith(tuple(s + "_scale_inv" for s in _EXPERT_SUFFIXES))
            if name in params and (expert_scale or (expert and params[name].dtype in _FP8_DTYPES)):
                # FP8 experts kept as stored
                yield name, t
            elif expert and t.dtype in _FP8_DTYPES:
                pending[name] = t
                if name in scales:
                    yield ready(name)
            elif expert:
                yield name, self._strip_padding(name, t)
            elif expert_scale:
                base = name[: -len("_scale_inv")]
                scales[base] = t
                if base in pending:
                    yield ready(base)
            else:
                yield name, t
        if pending or scales:
            raise EngineError("FP8 expert weights and weight_scale_inv do not pair up: "
                              f"{sorted(set(pending) ^ set(scales))[:5]}")

    def direct_load_ok(self, name: str, target: torch.Tensor) -> bool:
        """Stored as served: everything :meth:`_prepare` passes through unchanged (not skipped; stacked
        experts and their scales only when the module keeps them in FP8)."""
        if self._skipped(name):
            return False
        if name.endswith(_EXPERT_SUFFIXES):
            return target.dtype in _FP8_DTYPES
        if name.endswith(tuple(s + "_scale_inv" for s in _EXPERT_SUFFIXES)):
            return isinstance(target, nn.Parameter)  # a float module's scale is not one: dequantized
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     preloaded: Collection[str] = ()) -> None:
        """Load layout tensors ``(name, tensor)`` in any order (see the module docstring for the names).

        Linear modules and unpadded stacked experts keep FP8 block weights with their ``weight_scale_inv``;
        padded FP8 experts are dequantized here. MTP layers are ignored.

        Raises:
            EngineError: unexpected, missing or mis-shaped tensors (named), or unpaired FP8 expert scales.
        """
        super().load_weights(self._prepare(weights), preloaded=preloaded)

    def post_load(self) -> None:
        """Per-layer tensors derived from the weights: MLA's absorbed kv_b_proj and the indexer's float32 head
        weights, the MoE router's float32 weight copy (torch path only: :meth:`TopkRouter.post_load`)."""
        for layer in self.model.layers:
            layer.self_attn.post_load()
            if isinstance(layer.mlp, DeepseekMoE):
                layer.mlp.gate.post_load()


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2(-Exp): DeepSeek-V3 + the DSA lightning indexer (NeoX indexer rotary)."""


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    """GLM-5 / GLM-5.2: MLA + DSA + MoE with IndexShare (shared layers reuse the previous full layer's top-k)."""

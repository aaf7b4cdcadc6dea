"""Multi-head Latent Attention (DeepSeek-V2/V3) with optional DeepSeek Sparse Attention (V3.2, GLM-5).

Math: research/dsa.md §5.1 and §5.4, matching HF transformers ``DeepseekV3Attention`` /
``DeepseekV32Attention`` / ``GlmMoeDsaAttention`` in float32:

    [q_c | c_kv_raw | k_pe (| idx_k | idx_w)] = fused_qkv_a_proj(x)
    c_q = RMSNorm(q_c);  q = q_b_proj(c_q) -> [T, H, dn + dr] (nope first);  c_kv = RMSNorm(c_kv_raw)
    rotary on q_pe and k_pe; cache row = [c_kv | k_pe]
    absorbed attention: q~ = q_nope W_UK; o_lat = softmax(σ(q~·c_kv + q_pe·k_pe)) c_kv; o = W_UV o_lat
    out = o_proj(o);  σ = qk_head_dim^-0.5 · mscale²

The KV cache holds the latent only (plane ``latent``, kv_lora_rank + qk_rope_head_dim per token). Full DSA
layers add an ``index_k`` plane; shared layers reuse the previous full layer's top-k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.errors import EngineError
from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.layers.indexer import Indexer, fp32_head_weight
from atomtool.serve.layers.linear import fused_row_ranges, make_linear
from atomtool.serve.layers.norm import RMSNorm
from atomtool.serve.layers.overlap import fork
from atomtool.serve.ops import get_op
from atomtool.serve.ops.torch_ref_mla import (
    HeadWeights,  # (importing it registers mla_attention / mla_absorb_q)
)

#: names of the parts of ``fused_qkv_a_proj`` (module paths under ``self_attn``), in the converter's order
Q_A, KV_A, IDX_WK, IDX_WPROJ = "q_a_proj", "kv_a_proj_with_mqa", "indexer.wk", "indexer.weights_proj"


def rope_parameters(cfg: dict) -> dict:
    """The rope parameter dict of a config in either HF form (v5 ``rope_parameters``, v4 ``rope_scaling`` +
    ``rope_theta``), with ``rope_type`` and ``rope_theta`` always set."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if rp["rope_type"] in ("yarn", "llama3", "longrope"):
        rp.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return rp


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: dict) -> float:
    """σ = qk_head_dim^-0.5, times mscale² when YaRN sets ``mscale_all_dim`` (HF ``yarn_apply_mscale``)."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rp = rope_parameters(cfg)
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
        factor = rp.get("factor") or cfg["max_position_embeddings"] / rp["original_max_position_embeddings"]
        m = _yarn_mscale(factor, rp["mscale_all_dim"])
        scale = scale * m * m
    return scale


class MLAAttention(nn.Module):
    """One MLA (+ DSA) attention layer.

    Args:
        cfg: flattened config (hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank,
            qk_nope_head_dim, qk_rope_head_dim, v_head_dim; index_* for DSA).
        prefix: layout module path of this layer's attention (``model.layers.3.self_attn``).
        specs: the layout's tensor specs (FP8 vs float, fused part row ranges), or None.
        role: ``dense`` (no DSA), ``full`` (owns an indexer) or ``shared`` (reuses the previous full layer's
            top-k) -- from :func:`atomtool.inspect.dsa.layer_roles`.
        rope_interleaved / indexer_rope_interleaved: rotary pairing of MLA's q_pe/k_pe and of the indexer.
    Raises:
        EngineError: no q_lora_rank, attention bias, or a fused projection whose parts do not fit the role.
    """

    def __init__(self, cfg: dict, prefix: str, specs: dict[str, OutputTensor] | None, role: str,
                 rope_interleaved: bool, indexer_rope_interleaved: bool, dtype: torch.dtype, device):
        super().__init__()
        if cfg.get("q_lora_rank") is None:
            raise EngineError("MLA without q_lora_rank (a plain q_proj) is not supported")
        if cfg.get("attention_bias"):
            raise EngineError("MLA with attention_bias=true is not supported")
        hidden = cfg["hidden_size"]
        self.num_heads = H = cfg["num_attention_heads"]
        self.q_lora_rank = cfg["q_lora_rank"]
        self.kv_lora_rank = cfg["kv_lora_rank"]
        self.nope = cfg["qk_nope_head_dim"]
        self.rope = cfg["qk_rope_head_dim"]
        self.v_head_dim = cfg["v_head_dim"]
        self.role = role
        self.rope_interleaved = rope_interleaved
        self.scale = mla_softmax_scale(cfg)
        sizes = {Q_A: self.q_lora_rank, KV_A: self.kv_lora_rank + self.rope}
        if role == "full":
            sizes[IDX_WK] = int(cfg["index_head_dim"])
            sizes[IDX_WPROJ] = int(cfg["index_n_heads"])
        fused = f"{prefix}.fused_qkv_a_proj"
        spec = (specs or {}).get(f"{fused}.weight")
        parts = ([_part_key(p.source) for p in spec.parts] if spec is not None
                 else [Q_A, KV_A, IDX_WK, IDX_WPROJ] if role == "full" else [Q_A, KV_A])
        if parts[:2] != [Q_A, KV_A] or any(p not in sizes for p in parts):
            raise EngineError(f"{fused}: parts {parts} do not fit a {role} MLA layer")
        ranges = fused_row_ranges(fused, specs, [sizes[p] for p in parts])
        self.splits = dict(zip(parts, ranges, strict=True))
        for p, (s, e) in self.splits.items():
            if e - s != sizes[p]:
                raise EngineError(f"{fused}: part {p} has {e - s} rows, the config says {sizes[p]}")
        # sized from the config: make_linear adds the converter's FP8 padding rows; a spec whose own shape
        # disagrees meets a config-sized parameter and load_weights names the mismatch
        total = sum(sizes[p] for p in parts)

        def lin(name: str, n_in: int, n_out: int):
            return make_linear(f"{prefix}.{name}", n_in, n_out, bias=False, dtype=dtype, device=device,
                               specs=specs, config_flat=cfg)

        self.fused_qkv_a_proj = lin("fused_qkv_a_proj", hidden, total)
        # HF builds q_a_layernorm / kv_a_layernorm as DeepseekV3RMSNorm(rank): eps 1e-6, not rms_norm_eps.
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, dtype, device)
        self.q_b_proj = lin("q_b_proj", self.q_lora_rank, H * (self.nope + self.rope))
        self.kv_b_proj = lin("kv_b_proj", self.kv_lora_rank, H * (self.nope + self.v_head_dim))
        self.kv_b_proj.w8a8_eligible = False  # used only dequantized, in the absorbed form (post_load)
        self.o_proj = lin("o_proj", H * self.v_head_dim, hidden)
        self.indexer = None
        if role == "full":
            fused_idx = IDX_WK in self.splits
            if fused_idx != (IDX_WPROJ in self.splits):
                raise EngineError(f"{fused}: indexer.wk and indexer.weights_proj must both be fused or both not")
            self.indexer = Indexer(cfg, f"{prefix}.indexer", specs, fused_idx, indexer_rope_interleaved,
                                   dtype, device)
        self._w_uk: torch.Tensor | HeadWeights | None = None  # post_load
        self._w_uv: torch.Tensor | HeadWeights | None = None
        self._w_heads32: torch.Tensor | None = None  # fused indexer weights_proj rows in float32 (post_load)

    def post_load(self) -> None:
        """Views of kv_b_proj as the absorbed form's per-head weights, W_UK [H, dn, R] and W_UV [H, dv, R]
        (:class:`HeadWeights`: FP8 block weights stay FP8, with their scales repeated per row, and are widened
        inside the kernels; nothing is copied). Also caches the indexer's float32 ``weights_proj`` (fused rows
        here, or the indexer's own; :func:`fp32_head_weight`) so a step does not re-cast it."""
        if self.indexer is not None:
            self.indexer.post_load()
            if self.indexer.fused:
                s, e = self.splits[IDX_WPROJ]
                self._w_heads32 = fp32_head_weight(self.fused_qkv_a_proj.weight[s:e])
        H, dn, R = self.num_heads, self.nope, self.kv_lora_rank
        n = H * (dn + self.v_head_dim)
        w = self.kv_b_proj.weight[:n].view(H, dn + self.v_head_dim, R)
        if self.kv_b_proj.block_size is None:
            self._w_uk, self._w_uv = w[:, :dn], w[:, dn:]
            return
        bn, bk = self.kv_b_proj.block_size
        rows = self.kv_b_proj.weight_scale_inv.float().repeat_interleave(bn, 0)[:n].view(H, dn + self.v_head_dim, -1)
        dtype = self.q_a_layernorm.weight.dtype
        self._w_uk = HeadWeights(w[:, :dn], rows[:, :dn], bk, dtype)
        self._w_uv = HeadWeights(w[:, dn:], rows[:, dn:], bk, dtype)

    def _part(self, y: torch.Tensor, name: str) -> torch.Tensor:
        s, e = self.splits[name]
        return y[:, s:e]

    def _index_key_inputs(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_raw, w_raw) of a full layer's indexer from the fused projection ``y``, or (None, None) when its
        wk / weights_proj are separate (the indexer computes them)."""
        if not self.indexer.fused:
            return None, None
        # float32 head weights for a bf16/fp16 model (fp32_head_weight, cast at load)
        w_raw = F.linear(x.float(), self._w_heads32) if self._w_heads32 is not None else self._part(y, IDX_WPROJ)
        return self._part(y, IDX_WK), w_raw

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx_cos: torch.Tensor | None,
                idx_sin: torch.Tensor | None, batch: ForwardBatch, kv_cache: dict[str, torch.Tensor],
                prev_topk: torch.Tensor | None,
                aux_stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [T, hidden] (post input_layernorm); cos/sin: [T, rope/2] MLA rotary tables; idx_cos/idx_sin:
        the indexer's; kv_cache: this layer's planes; prev_topk: the previous full layer's selection
        (used by shared layers); aux_stream: where a full layer runs its indexer beside the query path
        (:mod:`atomtool.serve.layers.overlap`; None: in order). Returns (out [T, hidden], or o_proj's float32
        split-K planes [S, T, hidden] for the next ``RMSNorm(out, residual)`` to sum, and the top-k this layer
        used or None for dense)."""
        dev = x.device
        T = x.shape[0]
        H = self.num_heads
        if self._w_uv is None:
            self.post_load()
        y = self.fused_qkv_a_proj(x)
        c_q = self.q_a_layernorm(self._part(y, Q_A))
        latent = kv_cache["latent"]
        # a full layer's indexer depends on nothing below until sparse attention: its query half (wq_b, then the
        # scoring with the query rope inside and the top-k) runs beside MLA's query path; the key store runs on
        # this stream meanwhile (it has slack here, while on the side stream it would sit between wq_b and the
        # scoring), and the scoring waits for it
        selection = None
        if self.role == "full":
            k_raw, w_raw = self._index_key_inputs(x, y)
            index_k = kv_cache["index_k"]
            selection = fork(aux_stream, self.indexer.project_queries, c_q)
            weights = self.indexer.store_keys(x, k_raw, w_raw, idx_cos, idx_sin, batch, index_k)
            selection = selection.then(self.indexer.select, weights, idx_cos, idx_sin, batch, index_k)
        q = self.q_b_proj(c_q).view(T, H, self.nope + self.rope)
        q_nope = q[..., : self.nope]
        # one fused op: rope(q_pe), and the cache row [RMSNorm(c_kv) | rope(k_pe)] stored at the token's slot
        q_pe = get_op("mla_rope_store", dev)(q[..., self.nope:], self._part(y, KV_A), self.kv_a_layernorm.weight,
                                             self.kv_a_layernorm.eps, cos, sin, self.rope_interleaved, latent,
                                             batch.slot_mapping)
        q_abs = get_op("mla_absorb_q", dev)(q_nope, self._w_uk)
        topk = selection.join() if selection is not None else prev_topk if self.role == "shared" else None
        # o[t, h] = W_UV[h] o_lat[t, h] inside the op (the Triton backend folds it into the split-KV merge)
        o = get_op("mla_attention", dev)(q_abs, q_pe, latent, batch.cu_seqlens_q, batch.seq_lens,
                                         batch.block_tables, self.scale, topk, w_uv=self._w_uv)
        # o_proj's split-K planes go unsummed to the next norm, which sums them (one launch fewer per layer)
        return self.o_proj(o.view(T, H * self.v_head_dim), sum_splits=False), topk


def _part_key(source: str) -> str:
    """``model.layers.3.self_attn.indexer.wk.weight`` -> ``indexer.wk``."""
    tail = source.split(".self_attn.", 1)[-1]
    return tail[: -len(".weight")] if tail.endswith(".weight") else tail

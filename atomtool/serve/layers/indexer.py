"""The DSA lightning indexer of one *full* layer (DeepSeek-V3.2-Exp; research/dsa.md §5.2-5.3).

Shared (IndexShare) layers build no indexer: they reuse the top-k of the previous full layer, decided by
:func:`atomtool.inspect.dsa.layer_roles` and nothing else.

Math (HF transformers ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``, float32):

    q_i = wq_b(c_q) -> [T, Hi, Di]               c_q: the normed q latent shared with MLA
    k_i = LayerNorm(wk(x); eps 1e-6) -> [T, Di]  x: the attention input (post input_layernorm)
    w   = float(weights_proj(x)) * Hi^-0.5 * Di^-0.5
    rotary on the FIRST ``index_rope_dim`` dims of every q_i head and of k_i ("pe first"), NeoX pairing for
    DeepSeek-V3.2, interleaved for GLM; I[t,s] = Σ_h w[t,h] ReLU(q_i[t,h]·k_i[s]); top-k causal.

``wk`` and ``weights_proj`` consume the same x as the MLA down-projections, so the converter may fuse them
into ``fused_qkv_a_proj``; then the attention layer hands their outputs in (``k_raw``, ``w_raw``). Otherwise
they are separate tensors here (FP8 checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.layers.linear import make_linear
from atomtool.serve.ops import (
    get_op,
    torch_ref_mla,  # noqa: F401  (registers indexer_topk)
)


def fp32_head_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weights_proj`` in float32 for a float16/bfloat16 model, as HF computes it (``_keep_in_fp32_modules =
    ["indexer.weights_proj"]``; dsa.md §5.2: rounding the head weights to bf16 flips near-tied selections):
    the layers compute ``F.linear(x.float(), fp32_head_weight(W))``, the weight cast once after loading rather
    than every step. weight: [Hi, hidden] float rows. Returns [Hi, hidden] float32, or None when the model
    already runs in float32 or the weight is FP8 (then the regular projection is used)."""
    if weight.dtype not in (torch.float16, torch.bfloat16):
        return None
    return weight.detach().float()


class Indexer(nn.Module):
    """Lightning indexer: writes this step's index keys into the ``index_k`` plane and selects top-k, in three
    steps the attention layer schedules on two streams (:meth:`store_keys` on its own stream;
    :meth:`project_queries` then :meth:`select` beside its query path, :mod:`atomtool.serve.layers.overlap`).

    Args:
        cfg: flattened config (hidden_size, q_lora_rank, index_n_heads, index_head_dim, index_topk,
            index_rope_dim).
        prefix: layout module path (``model.layers.0.self_attn.indexer``); specs: layout specs or None.
        fused: wk / weights_proj live in the attention's fused input projection (no own tensors).
        interleaved: rotary pairing of the indexer (True: GPT-J pairs (2i, 2i+1); False: NeoX half split).
    """

    def __init__(self, cfg: dict, prefix: str, specs: dict[str, OutputTensor] | None, fused: bool,
                 interleaved: bool, dtype: torch.dtype, device):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.n_heads = int(cfg["index_n_heads"])
        self.head_dim = int(cfg["index_head_dim"])
        self.topk = int(cfg["index_topk"])
        self.rope_dim = int(cfg.get("index_rope_dim", cfg["qk_rope_head_dim"]))
        self.interleaved = interleaved
        self.fused = fused

        def lin(name: str, n_in: int, n_out: int):
            return make_linear(f"{prefix}.{name}", n_in, n_out, bias=False, dtype=dtype, device=device,
                               specs=specs, config_flat=cfg)

        self.wq_b = lin("wq_b", cfg["q_lora_rank"], self.n_heads * self.head_dim)
        # HF: nn.LayerNorm(index_head_dim, eps=1e-6), with bias (dsa.md §3).
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        if not fused:
            self.wk = lin("wk", hidden, self.head_dim)
            self.weights_proj = lin("weights_proj", hidden, self.n_heads)
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        self._w_heads32: torch.Tensor | None = None  # fp32 weights_proj (post_load), non-fused layout only

    def post_load(self) -> None:
        """Cache the float32 ``weights_proj`` of a bf16/fp16 model (non-fused layout; see
        :func:`fp32_head_weight`). Called by the attention layer's ``post_load``."""
        if not self.fused:
            self._w_heads32 = fp32_head_weight(self.weights_proj.weight)

    def project_queries(self, c_q: torch.Tensor) -> torch.Tensor:
        """The index queries before rope: ``wq_b(c_q)`` as [T, Hi, Di]. c_q: [T, q_lora_rank] normed q latent."""
        return self.wq_b(c_q).view(c_q.shape[0], self.n_heads, self.head_dim)

    def store_keys(self, x: torch.Tensor, k_raw: torch.Tensor | None, w_raw: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                   index_k_cache: torch.Tensor) -> torch.Tensor:
        """Store the step's index keys (LayerNorm, rope, slot) and return the head weights [T, Hi] float32.

        x: [T, hidden] attention input; k_raw [T, Di] / w_raw [T, Hi]: the fused projection's indexer outputs
        (None when not fused: computed here from x); cos, sin: [T, index_rope_dim/2] float32; index_k_cache:
        [N, bs, Di]. One fused op (``indexer_rope_store`` without queries: they are rotated by the scoring)."""
        if k_raw is None:
            k_raw = self.wk(x)
            w_raw = (F.linear(x.float(), self._w_heads32) if self._w_heads32 is not None
                     else self.weights_proj(x))
        r = self.rope_dim
        _, weights = get_op("indexer_rope_store", x.device)(
            None, k_raw, w_raw, self.weight_scale, self.k_norm.weight, self.k_norm.bias, self.k_norm.eps,
            cos if r else None, sin if r else None, self.interleaved, index_k_cache, batch.slot_mapping)
        return weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: ForwardBatch, index_k_cache: torch.Tensor) -> torch.Tensor | None:
        """The top-k of this step's queries over the stored keys (:meth:`store_keys` ran first).

        q: [T, Hi, Di] from :meth:`project_queries` (unrotated: the scoring op applies the rope as it loads
        them); weights: [T, Hi] float32. Returns [T, index_topk] int32 request-local positions (-1 padded), or
        None when every sequence of the batch has at most ``index_topk`` tokens (attention is then dense)."""
        if max(batch.seq_lens_cpu) <= self.topk:
            return None
        r = self.rope_dim
        return get_op("indexer_topk", q.device)(q, weights, index_k_cache, batch.cu_seqlens_q, batch.seq_lens,
                                                batch.block_tables, self.topk, cos if r else None,
                                                sin if r else None, self.interleaved)

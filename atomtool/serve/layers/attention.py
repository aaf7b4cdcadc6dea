"""Paged causal attention layer for MHA / GQA (dense models): store the step's K/V, attend over the cache."""

from __future__ import annotations

import torch
from torch import nn

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.ops import get_op


class PagedAttention(nn.Module):
    """Attention of one layer over its paged ``k``/``v`` cache planes (no parameters).

    forward(q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv], batch, kv_cache {"k": [N, bs, Hkv, D], "v": [...]})
    -> [T, H * Dv] in q's dtype. Writes the step's K/V at ``batch.slot_mapping`` first, so prefill, cached
    context, chunked prefill and decode are all one ``paged_attention`` call.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self._store = get_op("store_kv", device)
        self._attn = get_op("paged_attention", device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                kv_cache: dict[str, torch.Tensor]) -> torch.Tensor:
        self._store(k, v, kv_cache["k"], kv_cache["v"], batch.slot_mapping)
        return self.attend(q, batch, kv_cache)

    def attend(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """Attention only, for a caller that stored the step's K/V itself (e.g. with ``qk_rope_store_kv``):
        q [T, H, D] -> [T, H * Dv]."""
        out = self._attn(q, kv_cache["k"], kv_cache["v"], batch.cu_seqlens_q, batch.seq_lens,
                         batch.block_tables, self.scale)
        return out.reshape(out.shape[0], -1)

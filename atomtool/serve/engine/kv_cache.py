"""The paged KV cache pool: per layer, per declared plane, one ``[num_blocks, block_size, *shape]`` tensor.

Layers declare what they cache (:class:`KVPlaneSpec`): dense GQA layers ``k``/``v`` (Hkv, D); MLA layers the
``latent`` (kv_lora_rank + rope dims); DSA layers whose schedule is full also ``index_k``. The pool is sized
from a byte budget and every plane shares the same block ids, so one block table serves every layer.
"""

from __future__ import annotations

import math

import torch

from atomtool.errors import EngineError
from atomtool.serve.engine.batch import KVPlaneSpec

#: KV budget on CPU when ``kv_cache_memory`` is not given
DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(plane_specs: list[list[KVPlaneSpec]], block_size: int) -> int:
    """Bytes one block occupies across every layer and plane."""
    total = 0
    for layer in plane_specs:
        for p in layer:
            total += block_size * math.prod(p.shape) * torch.empty((), dtype=p.dtype).element_size()
    return total


def kv_budget_bytes(device: torch.device, *, kv_cache_memory: int | None, gpu_memory_utilization: float,
                    activation_reserve: int = 0) -> int:
    """Bytes available for the KV pool.

    ``kv_cache_memory`` wins when given. On CUDA (after the weights are loaded): ``total *
    gpu_memory_utilization - memory already in use - activation_reserve``. Elsewhere
    :data:`DEFAULT_CPU_KV_BYTES`.
    """
    if kv_cache_memory is not None:
        return int(kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return int(total * gpu_memory_utilization - used - activation_reserve)
    return DEFAULT_CPU_KV_BYTES


def activation_reserve_bytes(config: dict, dtype: torch.dtype, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """Estimated peak activation memory of one step, kept out of the GPU KV budget.

    Per scheduled token: residual + hidden + attention in/out + the widest MLP (dense ``intermediate_size`` or
    routed ``moe_intermediate_size * num_experts_per_tok``, gate+up+act), times 2 for temporaries; plus
    float32 logits and sampling buffers for ``max_num_seqs`` rows; plus a 512 MiB floor for the allocator and
    kernels' workspaces. (The torch reference attention also materialises [H, q, L] float32 scores per
    sequence; on a GPU it is meant for checks, with small token budgets.)
    """
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 1))
    inter = max(int(config.get("intermediate_size", 0) or 0),
                int(config.get("moe_intermediate_size", 0) or 0) * int(config.get("num_experts_per_tok", 1) or 1))
    per_token = (4 * hidden + 3 * inter + 4 * heads * 192) * torch.empty((), dtype=dtype).element_size() * 2
    vocab = int(config.get("vocab_size", 0))
    return max_num_batched_tokens * per_token + max_num_seqs * vocab * 4 * 4 + (512 << 20)


class KVCachePool:
    """Allocates the planes. ``caches[i][name]`` is layer i's plane ``[num_blocks, block_size, *shape]``."""

    def __init__(self, plane_specs: list[list[KVPlaneSpec]], num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        if num_blocks < 1:
            raise EngineError("the KV cache budget holds no block; raise --kv-cache-memory / "
                              "--gpu-memory-utilization or lower --block-size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.plane_specs = plane_specs
        self.caches: list[dict[str, torch.Tensor]] = [
            {p.name: torch.zeros(num_blocks, block_size, *p.shape, dtype=p.dtype, device=device) for p in layer}
            for layer in plane_specs
        ]

    @staticmethod
    def num_blocks_for(plane_specs: list[list[KVPlaneSpec]], block_size: int, budget_bytes: int,
                       max_blocks: int | None = None) -> int:
        """How many blocks fit in ``budget_bytes`` (capped at ``max_blocks``)."""
        per = bytes_per_block(plane_specs, block_size)
        n = budget_bytes // per if per else (max_blocks or 0)
        return int(min(n, max_blocks) if max_blocks is not None else n)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.caches for t in layer.values())

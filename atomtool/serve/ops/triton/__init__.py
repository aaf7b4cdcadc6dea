"""Triton backend of the op dispatch (CUDA and ROCm): kernels with the torch reference's signatures.

Importing this package registers every kernel with :func:`atomtool.serve.ops.register_op` under the
backend name ``triton`` (:func:`register`); ops it does not provide (``gather_cache``, sampling) fall
back to the torch reference. Each kernel is tested against the reference on CPU under
``TRITON_INTERPRET=1`` (tests/test_triton_ops.py) and on a GPU in bf16 (tests/gpu/).

Modules, one kernel family each: norm (RMSNorm + residual), rotary, activation (SiLU-and-mul),
attention (paged GQA attention, KV store), mla (absorbed MLA, dense and DSA-sparse), indexer (DSA scores
+ deterministic top-k), linear (FP8 block GEMM), moe (fused MoE grouped GEMM, BF16 and FP8 block),
moe_align (its expert-sorted row layout), router (DeepSeek-V3 ``noaux_tc`` grouped top-k routing),
router_gemv (the MoE gate's float32 logits from bf16/fp16 x and weight).
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here tells the dispatch that this backend is unavailable)

from atomtool.serve.ops.triton import fused_norm, fused_rope  # noqa: F401  (register their fused ops on import)
from atomtool.serve.ops.triton.activation import silu_and_mul
from atomtool.serve.ops.triton.attention import paged_attention, store_cache, store_kv
from atomtool.serve.ops.triton.indexer import indexer_topk
from atomtool.serve.ops.triton.linear import linear
from atomtool.serve.ops.triton.mla import mla_absorb_q, mla_attention
from atomtool.serve.ops.triton.moe import fused_moe
from atomtool.serve.ops.triton.norm import rms_norm
from atomtool.serve.ops.triton.rotary import rotary_embedding
from atomtool.serve.ops.triton.router import grouped_topk
from atomtool.serve.ops.triton.router_gemv import router_logits

#: op name -> Triton implementation (signatures identical to the torch reference)
OPS = {
    "rms_norm": rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "linear": linear,
    "store_kv": store_kv,
    "store_cache": store_cache,
    "paged_attention": paged_attention,
    "mla_attention": mla_attention,
    "mla_absorb_q": mla_absorb_q,
    "indexer_topk": indexer_topk,
    "fused_moe": fused_moe,
    "grouped_topk": grouped_topk,
    "router_logits": router_logits,
}


def register() -> None:
    """Register every op of :data:`OPS` as backend ``triton`` in the dispatch (idempotent)."""
    from atomtool.serve.ops import register_op

    for name, fn in OPS.items():
        register_op(name, "triton", fn)


register()

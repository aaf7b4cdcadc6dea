"""Sizes from a config alone: KV-cache bytes per token (MLA/DSA- and GQA-aware), parameter estimates,
and the longest context that fits a memory budget.

KV layout facts: research/dsa.md §6. MLA caches one latent ``[c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]`` per token per layer (shared layers included); DSA adds an indexer key plane of
``index_head_dim`` FP8 values + one FP32 scale per 128 dims, only on layers whose schedule role is
``full`` (:func:`atomtool.inspect.dsa.layer_roles`). Dense GQA caches K and V: ``2 * num_key_value_heads *
head_dim`` per attention layer; MiniMax-M3 adds one sparse index key per sparse layer. Hybrid models:
linear-attention layers cache nothing (Qwen3-Next ``full_attention_interval``, ``layer_types``), and
sliding-window layers (gpt-oss) hold at most ``sliding_window`` tokens (see :func:`kv_cache_bytes`).
"""

from __future__ import annotations

import math
from typing import Any

from atomtool.inspect.dsa import FULL, MAX_LAYERS

#: config ``dtype``/``torch_dtype`` string -> safetensors tag
TORCH_TO_TAG = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "half": "F16",
                "float": "F32"}
TAG_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def model_dtype_tag(flat: dict[str, Any], raw: dict[str, Any] | None = None) -> str | None:
    """The model's float dtype as a safetensors tag (``BF16``...) from ``dtype``/``torch_dtype``, or None."""
    for cfg in (flat, raw or {}):
        for key in ("dtype", "torch_dtype"):
            v = cfg.get(key)
            if isinstance(v, str):
                tag = TORCH_TO_TAG.get(v.removeprefix("torch."))
                if tag:
                    return tag
    return None


def _int(flat: dict[str, Any], key: str, default: int = 0) -> int:
    """An integer config field (bools, floats, strings -> ``default``); layer counts are bounded by
    :data:`atomtool.inspect.dsa.MAX_LAYERS` so a hostile config cannot make us loop 10^12 times."""
    v = flat.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        return default
    if key in ("num_hidden_layers", "num_nextn_predict_layers") and not 0 <= v <= MAX_LAYERS:
        return default
    return v


def is_mla(flat: dict[str, Any]) -> bool:
    """MLA attention: the config has a latent ``kv_lora_rank``."""
    return bool(flat.get("kv_lora_rank"))


#: ``layer_types`` entries of layers that keep no growing KV cache (recurrent / linear attention)
LINEAR_LAYER_TYPES = ("linear_attention", "kda")
#: ``layer_types`` entries of sliding-window attention layers (gpt-oss, Gemma, Mistral-style SWA)
SLIDING_LAYER_TYPES = ("sliding_attention", "sliding_window_attention", "local_attention")


def layer_attention_kinds(flat: dict[str, Any]) -> list[str]:
    """Per decoder layer: ``full`` (global attention, KV grows with the context), ``sliding`` (KV bounded by
    ``sliding_window``) or ``linear`` (linear attention / recurrent state: no KV cache).

    Sources, as HF transformers' configs define them: an explicit ``layer_types`` list (gpt-oss, Qwen3.5,
    Kimi-Linear ``kda``); Qwen3-Next's ``full_attention_interval`` (layer i is full iff ``(i + 1) %
    interval == 0``, Qwen3NextConfig); Kimi-Linear's ``linear_attn_config.full_attn_layers`` (1-based layer
    numbers). Otherwise every layer is ``full``. Empty when ``num_hidden_layers`` is unusable.
    """
    n = _int(flat, "num_hidden_layers")
    types = flat.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return ["linear" if t in LINEAR_LAYER_TYPES else "sliding" if t in SLIDING_LAYER_TYPES else "full"
                for t in types]
    interval = flat.get("full_attention_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1:
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    lac = flat.get("linear_attn_config")
    if isinstance(lac, dict) and isinstance(lac.get("full_attn_layers"), list):
        full = {x - 1 for x in lac["full_attn_layers"] if isinstance(x, int)}  # 1-based in Kimi-Linear
        return ["full" if i in full else "linear" for i in range(n)]
    return ["full"] * n


def attention_layers(flat: dict[str, Any]) -> int:
    """Decoder layers that keep a KV cache (full and sliding-window attention; hybrid linear-attention
    layers excluded): see :func:`layer_attention_kinds`."""
    return sum(1 for k in layer_attention_kinds(flat) if k != "linear")


def sparse_index_layers(flat: dict[str, Any]) -> tuple[int, int]:
    """MiniMax-M3 block-sparse attention (``sparse_attention_config``, research/dsa.md §5.5): (number of
    sparse layers, index key dim). Each sparse layer caches one index key of ``sparse_index_dim`` values per
    token next to its K/V (the index keys are shared by the ``sparse_num_index_heads`` query heads);
    a layer is sparse where ``sparse_attention_freq[i] == 1`` (every layer when the list is absent).
    (0, 0) for models without it."""
    sac = flat.get("sparse_attention_config")
    if not isinstance(sac, dict) or sac.get("use_sparse_attention") is False:
        return 0, 0
    dim = sac.get("sparse_index_dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
        return 0, 0
    n = _int(flat, "num_hidden_layers")
    freq = sac.get("sparse_attention_freq")
    layers = sum(1 for f in freq if f == 1) if isinstance(freq, list) and len(freq) == n else n
    return layers, dim


def head_dim(flat: dict[str, Any]) -> int:
    """Attention head dim for GQA models: ``head_dim`` or ``hidden_size / num_attention_heads``."""
    hd = flat.get("head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    heads = _int(flat, "num_attention_heads", 1) or 1
    return _int(flat, "hidden_size") // heads


def index_plane_bytes(index_head_dim: int) -> int:
    """Bytes per token of one DSA indexer key plane: FP8 values + one FP32 scale per 128 dims (132 for 128)."""
    return index_head_dim + 4 * math.ceil(index_head_dim / 128)


def kv_cache_bytes(flat: dict[str, Any], roles: list[str] | None, kv_dtype_bytes: int = 2) -> dict[str, Any]:
    """KV-cache bytes per token, MLA/DSA- or GQA-aware, hybrid- and sliding-window-aware.

    Args:
        flat: the flattened text config (:func:`atomtool.inspect.dsa.flatten_dsa_config`).
        roles: the DSA schedule (None / all ``dense`` for non-DSA models).
        kv_dtype_bytes: bytes per cached element of the main KV (2 for BF16/FP16).
    Returns:
        ``{"kv_bytes_per_token", "kv_layout", "kv_layers", "kv_bytes_per_token_per_layer",
        "index_layers", "index_bytes_per_token_per_layer", "swa_layers", "sliding_window",
        "swa_bytes_per_token_per_layer", "linear_layers"}`` (layout ``mla`` or ``gqa``).
        ``kv_bytes_per_token`` is what every further token of context adds: full-attention layers
        (``kv_layers``) plus index planes (DSA indexer keys on ``full`` layers; MiniMax-M3 sparse index keys
        in the model dtype). Sliding-window layers (``swa_layers``) hold at most ``sliding_window`` tokens:
        ``swa_bytes_per_token_per_layer`` each, not in ``kv_bytes_per_token``. Linear-attention layers
        (``linear_layers``) keep a fixed-size state, no KV cache.
    """
    kinds = layer_attention_kinds(flat)
    layers = sum(1 for k in kinds if k == "full")
    swa = sum(1 for k in kinds if k == "sliding")
    window = _int(flat, "sliding_window")
    if swa and window <= 0:  # sliding layers without a window: they cache everything
        layers, swa = layers + swa, 0
    extra = {"swa_layers": swa, "sliding_window": window if swa else None,
             "linear_layers": sum(1 for k in kinds if k == "linear")}
    if is_mla(flat):
        per_layer = (_int(flat, "kv_lora_rank") + _int(flat, "qk_rope_head_dim")) * kv_dtype_bytes
        full = sum(1 for r in roles or [] if r == FULL)
        idx = index_plane_bytes(_int(flat, "index_head_dim", 128)) if full else 0
        return {"kv_bytes_per_token": per_layer * layers + idx * full, "kv_layout": "mla",
                "kv_layers": layers, "kv_bytes_per_token_per_layer": per_layer,
                "index_layers": full, "index_bytes_per_token_per_layer": idx,
                "swa_bytes_per_token_per_layer": per_layer if swa else 0, **extra}
    kv_heads = _int(flat, "num_key_value_heads") or _int(flat, "num_attention_heads")
    per_layer = 2 * kv_heads * head_dim(flat) * kv_dtype_bytes
    idx_layers, idx_dim = sparse_index_layers(flat)
    idx = idx_dim * kv_dtype_bytes
    return {"kv_bytes_per_token": per_layer * layers + idx * idx_layers, "kv_layout": "gqa", "kv_layers": layers,
            "kv_bytes_per_token_per_layer": per_layer, "index_layers": idx_layers,
            "index_bytes_per_token_per_layer": idx, "swa_bytes_per_token_per_layer": per_layer if swa else 0,
            **extra}


def max_context_tokens(gpu_memory_gb: float, weights_bytes: int, kv_bytes_per_token: int,
                       swa_bytes_per_token: int = 0, sliding_window: int | None = None) -> int | None:
    """Longest context (tokens of KV cache) fitting ``gpu_memory_gb`` (10^9 bytes) after the weights.

    A context of T tokens costs ``T * kv_bytes_per_token + min(T, sliding_window) * swa_bytes_per_token``
    (``swa_bytes_per_token``: all sliding-window layers together). 0 when the weights alone do not fit;
    None when the cache does not grow with the context (no full-attention layer: unbounded).
    Activations and workspace are not counted.
    """
    free = int(gpu_memory_gb * 1e9) - weights_bytes
    if free <= 0:
        return 0
    window = sliding_window or 0
    if swa_bytes_per_token and window:
        if free < window * (kv_bytes_per_token + swa_bytes_per_token):  # shorter than one window
            return free // (kv_bytes_per_token + swa_bytes_per_token)
        free -= window * swa_bytes_per_token
    if kv_bytes_per_token <= 0:
        return None
    return free // kv_bytes_per_token


def _mlp_kinds(flat: dict[str, Any]) -> list[str]:
    """Per layer ``dense`` or ``sparse`` (MoE) MLP."""
    n = _int(flat, "num_hidden_layers")
    kinds = flat.get("mlp_layer_types")
    if isinstance(kinds, list) and len(kinds) == n:
        return ["sparse" if k == "sparse" else "dense" for k in kinds]
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    if not experts:
        return ["dense"] * n
    first = _int(flat, "first_k_dense_replace")
    step = _int(flat, "decoder_sparse_step", 1) or 1
    only_v = flat.get("mlp_only_layers")
    only = {i for i in only_v if isinstance(i, int)} if isinstance(only_v, list) else set()
    out = []
    for i in range(n):
        moe = i >= first and (i + 1) % step == 0 and i not in only
        out.append("sparse" if moe else "dense")
    return out


def estimate_parameters(flat: dict[str, Any], roles: list[str] | None = None) -> int | None:
    """Parameter count from the config alone (config-only directories), for Llama/Qwen-style GQA and
    DeepSeek/GLM-style MLA(+DSA)+MoE models, MTP layers included (``num_nextn_predict_layers``).

    Counts what HF checkpoints store: embeddings, lm_head unless tied, attention and MLP projections,
    norms, q/k norms (Qwen3), qkv biases (Qwen2), routers and ``e_score_correction_bias``, DSA indexers on
    ``full`` layers. Returns None for layouts it does not model (hybrid linear attention).
    """
    h = _int(flat, "hidden_size")
    v = _int(flat, "vocab_size")
    n = _int(flat, "num_hidden_layers")
    if not (h and v and n) or attention_layers(flat) != n:
        return None
    nh = _int(flat, "num_attention_heads")
    inter = _int(flat, "intermediate_size")
    moe_i = _int(flat, "moe_intermediate_size") or inter
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    shared = _int(flat, "n_shared_experts")
    mt = str(flat.get("model_type", ""))

    def attn(layer: int) -> int:
        if is_mla(flat):
            rq, rkv = _int(flat, "q_lora_rank"), _int(flat, "kv_lora_rank")
            dn, dr, dv = _int(flat, "qk_nope_head_dim"), _int(flat, "qk_rope_head_dim"), _int(flat, "v_head_dim")
            q = (h * rq + rq + rq * nh * (dn + dr)) if rq else h * nh * (dn + dr)
            a = q + h * (rkv + dr) + rkv + rkv * nh * (dn + dv) + nh * dv * h
            full = roles is None or layer >= len(roles) or roles[layer] == FULL
            if flat.get("index_topk") is not None and full:
                hi, di = _int(flat, "index_n_heads"), _int(flat, "index_head_dim")
                a += (rq or h) * hi * di + h * di + 2 * di + h * hi
            return a
        hd, kvh = head_dim(flat), _int(flat, "num_key_value_heads") or nh
        a = h * nh * hd + 2 * h * kvh * hd + nh * hd * h
        if mt == "qwen2" or flat.get("attention_bias"):
            a += nh * hd + 2 * kvh * hd + (h if flat.get("attention_bias") and mt != "qwen2" else 0)
        if mt.startswith("qwen3"):
            a += 2 * hd
        return a

    def mlp(kind: str) -> int:
        if kind == "dense":
            return 3 * h * inter
        m = experts * 3 * h * moe_i + experts * h
        if mt in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2") or flat.get("topk_method") == "noaux_tc":
            m += experts  # e_score_correction_bias
        si = _int(flat, "shared_expert_intermediate_size")
        if si:
            m += 3 * h * si + h  # Qwen2-MoE style shared expert + its gate
        elif shared:
            m += 3 * h * moe_i * shared
        return m

    kinds = _mlp_kinds(flat)
    total = v * h + h  # embeddings + final norm
    if not flat.get("tie_word_embeddings", False):
        total += v * h
    for i in range(n):
        total += attn(i) + mlp(kinds[i]) + 2 * h  # + input/post-attention norms
    for _ in range(_int(flat, "num_nextn_predict_layers")):
        # MTP block: a full MoE decoder layer + enorm/hnorm + eh_proj [h, 2h] + shared_head.norm
        total += attn(n) + mlp("sparse" if experts else "dense") + 2 * h + 2 * h + 2 * h * h + h
    return total

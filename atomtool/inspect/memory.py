"""Sizes from a config alone: KV-cache bytes per token (MLA/DSA- and GQA-aware), parameter estimates,
and the longest context that fits a memory budget.

KV layout facts: research/dsa.md §6. MLA caches one latent ``[c_kv (kv_lora_rank) | k_pe
(qk_rope_head_dim)]`` per token per layer (shared layers included); DSA adds an indexer key plane of
``index_head_dim`` FP8 values + one FP32 scale per 128 dims, only on layers whose schedule role is
``full`` (:func:`atomtool.inspect.dsa.layer_roles`). Dense GQA caches K and V: ``2 * num_key_value_heads *
head_dim`` per attention layer; MiniMax-M3 adds one sparse index key per sparse layer. Hybrid models:
linear-attention layers cache nothing (Qwen3-Next ``full_attention_interval``, ``layer_types``, MiniMax-M1
``attn_type_list``), and sliding-window layers hold at most ``sliding_window`` tokens (see
:func:`kv_cache_bytes`); which layers slide follows each config family's convention as its transformers
config class reads it (:func:`layer_attention_kinds`: Mistral every layer, Qwen ``use_sliding_window`` +
``max_window_layers``, Gemma2/gpt-oss alternating, Gemma3 ``sliding_window_pattern``).
"""

from __future__ import annotations

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
#: (``mamba`` / ``conv``: legacy names transformers remaps to ``linear_attention``; ``kda``: Kimi-Linear)
LINEAR_LAYER_TYPES = ("linear_attention", "kda", "mamba", "conv")
#: ``layer_types`` entries of sliding-window attention layers (gpt-oss, Gemma, Mistral-style SWA)
SLIDING_LAYER_TYPES = ("sliding_attention", "sliding_window_attention", "local_attention")

#: Hand rules below apply only to model_types transformers does not know (remote-code configs, or a transformers
#: without the class); for every model_type it knows, its config class decides (:func:`effective_sliding_window`).
#: model_type prefixes whose config gates ``sliding_window`` behind ``use_sliding_window`` (default False), as
#: Qwen2Config / Qwen2MoeConfig / Qwen3Config / Qwen3MoeConfig (and their VL text configs), SmolLM3Config do
USE_SLIDING_WINDOW_TYPES = ("qwen2", "qwen3", "smollm3", "deepseek_ocr2")
#: model_types whose default ``layer_types`` alternate sliding/full (layer i sliding iff ``(i + 1) % 2``):
#: Gemma2Config, GptOssConfig, VaultGemmaConfig, T5GemmaConfig
ALTERNATING_SWA_TYPES = frozenset({"gemma2", "gpt_oss", "vaultgemma", "t5_gemma_module"})
#: default ``sliding_window_pattern`` when the config has none (Gemma3TextConfig / Gemma4 6, Cohere2Config,
#: Olmo3Config, Exaone4Config 4): layer i is sliding iff ``(i + 1) % pattern``
DEFAULT_SWA_PATTERN = {"gemma3": 6, "gemma3_text": 6, "gemma4": 6, "gemma4_text": 6, "cohere2": 4, "olmo3": 4,
                       "exaone4": 4}
#: model_types that slide layers ``i >= max_window_layers`` (Qwen2Config's rule; Dots1Config copies it)
MAX_WINDOW_LAYERS_TYPES = ("qwen2", "qwen3", "dots1")


#: model_types (transformers-unknown ones only, see above) whose window applies whatever an (ignored)
#: ``use_sliding_window`` says
WINDOW_ALWAYS_TYPES = frozenset({"mistral", "mixtral", "phi3", "starcoder2", "gemma2", "gemma3", "gemma3_text",
                                 "gemma4", "gemma4_text", "cohere2", "olmo3", "exaone4", "gpt_oss", "vaultgemma",
                                 "afmoe", "minimax", "ministral", "ministral3", "phimoe", "dots1"})


def valid_window(value: Any) -> bool:
    """A usable ``sliding_window`` value: an integer >= 1 (not a bool). ``null`` means no window; anything
    else (``"4096"``, 0, -1, ``true``, ``[4096]``) is malformed (:mod:`atomtool.inspect.config_check`)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def reads_sliding_window(flat: dict[str, Any]) -> bool:
    """Whether the config family reads ``sliding_window`` at all: transformers' config class for the
    ``model_type`` declares the field (``MistralConfig`` does, ``LlamaConfig`` / ``GemmaConfig`` /
    ``DeepseekV3Config`` / ``GlmMoeDsaConfig`` do not), or transformers does not know the model_type
    (then the window is honoured)."""
    from atomtool.inspect.hf_registry import config_fields

    fields = config_fields(str(flat.get("model_type", "")))
    return fields is None or "sliding_window" in fields


def window_switched_off(flat: dict[str, Any]) -> bool:
    """Whether ``use_sliding_window`` switches the window off for a model_type transformers knows: its config
    class declares the flag (Qwen2 / Qwen2-MoE / Qwen3 / ...) and config.json sets it false (or leaves it out:
    the class default, false). transformers then never reads ``sliding_window`` (``Qwen2Config``:
    ``sliding_window = sliding_window if use_sliding_window else None``; ``Qwen2MoeConfig`` even defaults
    the window to 0), so its value is not judged."""
    from atomtool.inspect.hf_registry import config_field_default, config_fields

    model_type = str(flat.get("model_type", ""))
    fields = config_fields(model_type)
    if fields is None or "use_sliding_window" not in fields:
        return False
    flag = flat["use_sliding_window"] if "use_sliding_window" in flat else config_field_default(
        model_type, "use_sliding_window")
    return flag is False or flag is None


def effective_sliding_window(flat: dict[str, Any]) -> int | None:
    """The attention window in tokens that sliding-window layers use, or None (no sliding window).

    As transformers' config classes read it (:func:`atomtool.inspect.hf_registry.config_fields` of the
    ``model_type``): ``sliding_window`` must be a positive integer (:func:`valid_window`), and

    - the config class must declare a ``sliding_window`` field (:func:`reads_sliding_window`): ``LlamaConfig``,
      ``GemmaConfig``, ``DeepseekV3Config``, ``GlmMoeDsaConfig`` have none, so a window in their config.json
      is ignored (their attention never slides);
    - where the class declares ``use_sliding_window`` (Qwen2/Qwen2-MoE/Qwen3/Qwen3-MoE/SmolLM3, default
      False) the window only counts when that flag is true (Qwen2Config: ``self.sliding_window =
      self.sliding_window if self.use_sliding_window else None``); classes without the flag (Mistral, Gemma,
      gpt-oss, Phi-3, Starcoder2, ...) apply the window whatever an extra ``use_sliding_window`` key says.

    For a model_type transformers does not know, hand rules: :data:`USE_SLIDING_WINDOW_TYPES` need
    ``use_sliding_window: true``; otherwise an explicit ``use_sliding_window: false`` switches the window
    off (except for :data:`WINDOW_ALWAYS_TYPES`).
    """
    from atomtool.inspect.hf_registry import config_field_default, config_fields

    window = flat.get("sliding_window")
    if not valid_window(window):
        return None
    mt = str(flat.get("model_type", ""))
    fields = config_fields(mt)
    if fields is not None:  # transformers knows this model_type: its config class decides
        if "sliding_window" not in fields:
            return None
        if "use_sliding_window" in fields:
            flag = flat.get("use_sliding_window", config_field_default(mt, "use_sliding_window"))
            return window if flag is True else None
        return window
    if mt.startswith(USE_SLIDING_WINDOW_TYPES):
        return window if flat.get("use_sliding_window") is True else None
    if flat.get("use_sliding_window") is False and mt not in WINDOW_ALWAYS_TYPES:
        return None  # a family transformers does not know, whose config says the window is off
    return window


def _default_swa_kinds(flat: dict[str, Any], n: int) -> list[str]:
    """Per layer ``full``/``sliding`` for a config without an explicit ``layer_types`` list, as the
    transformers config class of its ``model_type`` fills ``layer_types`` in (or, with none, as
    ``cache_utils.get_layer_types_and_kwargs`` does: every layer sliding when ``sliding_window`` is set).

    - Qwen2 / Qwen3 / dots1 (and Qwen2-VL text configs): layer i sliding iff
      ``i >= max_window_layers`` (default 28);
    - Qwen2-MoE: sliding iff ``(i + 1) % 2`` and ``i < max_window_layers``;
    - Gemma2 / gpt-oss: alternating, layer i sliding iff ``(i + 1) % 2``;
    - SmolLM3: the NoPE layers (``no_rope_layers[i] == 0``, default every ``no_rope_layer_interval`` = 4th);
    - ``sliding_window_pattern`` p (Gemma3/Gemma4, default 6; Cohere2/Olmo3/Exaone4, default 4; AFMoE's
      ``global_attn_every_n_layers``): sliding iff ``(i + 1) % p``;
    - MiniMax (``model_type: minimax``, no ``layer_types``): MiniMaxConfig alternates full / linear;
    - everything else (Mistral incl. Mistral-7B-v0.1, Mixtral, Phi-3, Starcoder2, Qwen3-MoE, unknown types):
      every layer sliding.
    """
    mt = str(flat.get("model_type", ""))
    if mt == "minimax":  # MiniMaxConfig (Text-01/M1 in transformers' form) without layer_types
        return ["full" if (i + 1) % 2 else "linear" for i in range(n)]
    if effective_sliding_window(flat) is None:
        return ["full"] * n
    mwl = flat.get("max_window_layers")
    mwl = mwl if isinstance(mwl, int) and not isinstance(mwl, bool) else 28
    if mt == "qwen2_moe":
        return ["sliding" if (i + 1) % 2 and i < mwl else "full" for i in range(n)]
    if mt.startswith(MAX_WINDOW_LAYERS_TYPES) and "moe" not in mt:
        return ["sliding" if i >= mwl else "full" for i in range(n)]
    if mt in ALTERNATING_SWA_TYPES:
        return ["sliding" if (i + 1) % 2 else "full" for i in range(n)]
    if mt == "smollm3":  # SmolLM3Config: the NoPE layers slide (no_rope_layers[i] == 0; default every 4th)
        nope = flat.get("no_rope_layers")
        interval = flat.get("no_rope_layer_interval", 4)
        interval = interval if isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1 else 4
        if not (isinstance(nope, list) and len(nope) == n):
            nope = [int((i + 1) % interval != 0) for i in range(n)]
        return ["full" if has_rope else "sliding" for has_rope in nope]
    pattern = flat.get("sliding_window_pattern", DEFAULT_SWA_PATTERN.get(mt))
    if mt == "afmoe":  # AfmoeConfig: global (full) attention every global_attn_every_n_layers (default 4)
        pattern = flat.get("global_attn_every_n_layers", 4)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        return ["sliding" if (i + 1) % pattern else "full" for i in range(n)]
    return ["sliding"] * n


def layer_attention_kinds(flat: dict[str, Any]) -> list[str]:
    """Per decoder layer: ``full`` (global attention, KV grows with the context), ``sliding`` (KV bounded by
    ``sliding_window``) or ``linear`` (linear attention / recurrent state: no KV cache).

    Sources, as HF transformers' configs define them: an explicit ``layer_types`` list (gpt-oss, Gemma,
    Qwen3.5, Kimi-Linear ``kda``); Qwen3-Next's ``full_attention_interval`` (layer i is full iff ``(i + 1) %
    interval == 0``, Qwen3NextConfig); Kimi-Linear's ``linear_attn_config.full_attn_layers`` (1-based layer
    numbers); MiniMax-Text-01/M1/M2's ``attn_type_list`` (0 = lightning (linear) attention, 1 = softmax
    attention). Otherwise the sliding-window conventions of :func:`_default_swa_kinds`. A ``sliding`` layer
    without an effective window (:func:`effective_sliding_window`; e.g. Qwen2 with ``use_sliding_window:
    false``) attends to everything and is ``full``. Empty when ``num_hidden_layers`` is unusable.
    """
    n = _int(flat, "num_hidden_layers")
    types = flat.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        window = effective_sliding_window(flat)
        return ["linear" if t in LINEAR_LAYER_TYPES else "sliding" if t in SLIDING_LAYER_TYPES and window else "full"
                for t in types]
    interval = flat.get("full_attention_interval")
    if isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1:
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]
    lac = flat.get("linear_attn_config")
    if isinstance(lac, dict) and isinstance(lac.get("full_attn_layers"), list):
        full = {x - 1 for x in lac["full_attn_layers"] if isinstance(x, int)}  # 1-based in Kimi-Linear
        return ["full" if i in full else "linear" for i in range(n)]
    atl = flat.get("attn_type_list")
    if isinstance(atl, list) and len(atl) == n:
        return ["linear" if t == 0 else "full" for t in atl]
    return _default_swa_kinds(flat, n)


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


def index_plane_bytes(index_head_dim: int, kv_dtype_bytes: int = 2) -> int:
    """Bytes per token of one DSA indexer key plane as atomtool's engine stores it: ``index_head_dim``
    elements in the KV dtype (``atomtool.serve.models.deepseek``'s ``index_k`` plane; 256 B for 128 in BF16).
    DeepSeek's reference inference keeps FP8 keys + an FP32 scale per 128 dims (132 B); the estimate is what
    ``serve`` will allocate."""
    return index_head_dim * kv_dtype_bytes


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
        in the model dtype). Sliding-window layers (``swa_layers``) hold at most ``sliding_window`` tokens
        (the config's window capped at ``max_position_embeddings``: a longer window never fills):
        ``swa_bytes_per_token_per_layer`` each, not in ``kv_bytes_per_token``. Linear-attention layers
        (``linear_layers``) keep a fixed-size state, no KV cache.
    """
    kinds = layer_attention_kinds(flat)
    layers = sum(1 for k in kinds if k == "full")
    swa = sum(1 for k in kinds if k == "sliding")
    window = effective_sliding_window(flat)  # never None when swa > 0 (layer_attention_kinds checks it)
    mpe = flat.get("max_position_embeddings")
    if window is not None and valid_window(mpe):
        window = min(window, mpe)  # a window beyond the model's context never fills: KV of mpe tokens at most
    extra = {"swa_layers": swa, "sliding_window": window if swa else None,
             "linear_layers": sum(1 for k in kinds if k == "linear")}
    if is_mla(flat):
        per_layer = (_int(flat, "kv_lora_rank") + _int(flat, "qk_rope_head_dim")) * kv_dtype_bytes
        full = sum(1 for r in roles or [] if r == FULL)
        idx = index_plane_bytes(_int(flat, "index_head_dim", 128), kv_dtype_bytes) if full else 0
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


def kv_bytes_for_context(kv: dict[str, Any], tokens: int) -> int:
    """KV-cache bytes one sequence of ``tokens`` tokens holds, from a :func:`kv_cache_bytes` result:
    ``tokens * kv_bytes_per_token`` (full-attention layers and index planes) plus
    ``min(tokens, sliding_window) * swa_layers * swa_bytes_per_token_per_layer`` (sliding-window layers keep
    the last ``sliding_window`` tokens at most). Linear-attention state is not counted."""
    window = kv.get("sliding_window") or 0
    swa = kv.get("swa_layers", 0) * kv.get("swa_bytes_per_token_per_layer", 0)
    return tokens * kv["kv_bytes_per_token"] + min(tokens, window) * swa


#: model_types whose MTP layer stores no copy of the embeddings and output head: GLM-5.x's MTP layer holds
#: ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm`` only; MiMo-7B's ``model.mtp_layers.N`` hold
#: ``input_proj`` [h, 2h] and five norms (the same count). DeepSeek-V3/V3.2 (and GLM-4.5) store an
#: ``embed_tokens`` and a ``shared_head.head`` copy in every MTP layer; that is the default.
MTP_SHARES_EMBED_HEAD = frozenset({"glm_moe_dsa", "mimo"})
#: model_types whose transformers config ties ``lm_head`` to the embeddings by default
#: (``tie_word_embeddings: bool = True``); Gemma's config.json usually omits the field
TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "vaultgemma",
                             "cohere", "cohere2", "starcoder2", "smollm3", "ernie4_5", "ernie4_5_moe", "minicpm3",
                             "granite_swa"})
#: model_types with four norms per decoder layer (input, post-attention, pre- and post-feedforward: Gemma2/3)
FOUR_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "vaultgemma"})
#: model_types whose routers carry an ``e_score_correction_bias`` (noaux_tc routing)
ROUTER_BIAS_TYPES = frozenset({"deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe", "kimi_k2"})
# (MiniMax-M2/M3 say so with ``use_routing_bias``; transformers' MiniMaxM2 always has the bias)


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def is_minimax(flat: dict[str, Any]) -> bool:
    """A MiniMax text config: ``model_type`` ``minimax*`` or, for MiniMax-M3's ``text_config`` (which has no
    ``model_type``), an architecture named ``MiniMax*`` (``MiniMaxM3SparseForCausalLM``)."""
    archs = flat.get("architectures")
    archs = archs if isinstance(archs, list) else []
    return str(flat.get("model_type", "")).startswith("minimax") or any(
        isinstance(a, str) and a.lower().startswith("minimax") for a in archs)


#: model_types transformers knows whose config class turns an integer ``moe_layer_freq`` into its MLP
#: schedule (``AXK2Config``: MoE iff ``i >= first_k_dense_replace and i % moe_layer_freq == 0``); every other
#: model_type transformers knows ignores it (``DeepseekV3Config`` / ``DeepseekV2Config`` keep it as a plain
#: attribute their modeling never reads; only DeepSeek's own remote code does)
INT_MOE_LAYER_FREQ_TYPES = frozenset({"axk2"})


def _reads_field(flat: dict[str, Any], key: str) -> bool:
    """Whether the model transformers builds for ``flat`` reads ``key``: its config class declares it, or the
    model_type is unknown to transformers (remote code: inspect reads the field as the remote code does)."""
    from atomtool.inspect.hf_registry import config_fields

    fields = config_fields(str(flat.get("model_type", "")))
    return fields is None or key in fields


def _reads_int_moe_layer_freq(flat: dict[str, Any]) -> bool:
    """An integer ``moe_layer_freq`` shapes the MLP schedule: remote-code model_types (DeepSeek's
    ``modeling_deepseek.py``) and :data:`INT_MOE_LAYER_FREQ_TYPES`; not transformers' DeepSeek-V2/V3."""
    return str(flat.get("model_type", "")) in INT_MOE_LAYER_FREQ_TYPES or _reads_field(flat, "moe_layer_freq")


#: fields of the MLP schedule whose absence means transformers' default, not "none"
#: (``DeepseekV3Config.first_k_dense_replace`` 3: the first three layers have dense MLPs)
SCHEDULE_DEFAULT_FIELDS = ("first_k_dense_replace",)


def schedule_default(flat: dict[str, Any], key: str) -> Any:
    """transformers' default for MLP-schedule field ``key`` (:data:`SCHEDULE_DEFAULT_FIELDS`) of the
    model_type's config class, or None (not a known model_type / no default)."""
    from atomtool.inspect.hf_registry import config_field_default

    return config_field_default(str(flat.get("model_type", "")), key)


def mlp_kinds(flat: dict[str, Any]) -> list[str]:
    """Per layer ``dense`` or ``sparse`` (MoE) MLP: ``mlp_layer_types``; MiniMax-M3's ``moe_layer_freq``
    list (1 = MoE); else MoE iff ``i >= first_k_dense_replace``, ``(i + 1) % decoder_sparse_step == 0``
    (Qwen-MoE), ``i % moe_layer_freq == 0`` (an int; DeepSeek's remote code, not transformers' DeepseekV3,
    which ignores it: :func:`_reads_int_moe_layer_freq`) and ``i`` not in ``mlp_only_layers``, each field
    only where the model transformers builds reads it; an absent ``first_k_dense_replace`` is transformers'
    default for the model_type (:func:`schedule_default`), as the engine completes the config."""
    n = _int(flat, "num_hidden_layers")
    kinds = flat.get("mlp_layer_types")
    if isinstance(kinds, list) and len(kinds) == n:
        return ["sparse" if k == "sparse" else "dense" for k in kinds]
    freq = flat.get("moe_layer_freq")
    if isinstance(freq, list) and len(freq) == n:
        return ["sparse" if f == 1 else "dense" for f in freq]
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    if not experts:
        return ["dense"] * n
    key = "first_k_dense_replace"
    first = _int(flat if key in flat else {key: schedule_default(flat, key)}, key)
    step = (_int(flat, "decoder_sparse_step", 1) or 1) if _reads_field(flat, "decoder_sparse_step") else 1
    every = freq if _is_pos_int(freq) and _reads_int_moe_layer_freq(flat) else 1
    only_v = flat.get("mlp_only_layers") if _reads_field(flat, "mlp_only_layers") else None
    only = {i for i in only_v if isinstance(i, int)} if isinstance(only_v, list) else set()
    out = []
    for i in range(n):
        moe = i >= first and (i + 1) % step == 0 and i % every == 0 and i not in only
        out.append("sparse" if moe else "dense")
    return out


def _sparse_index_layer_set(flat: dict[str, Any]) -> set[int]:
    """Layers carrying MiniMax-M3 sparse-attention index projections (see :func:`sparse_index_layers`)."""
    n = _int(flat, "num_hidden_layers")
    sac = flat.get("sparse_attention_config")
    if sparse_index_layers(flat) == (0, 0) or not isinstance(sac, dict):
        return set()
    freq = sac.get("sparse_attention_freq")
    if isinstance(freq, list) and len(freq) == n:
        return {i for i, f in enumerate(freq) if f == 1}
    return set(range(n))


def _gqa_attention_params(flat: dict[str, Any], h: int, layer: int, index_layers: set[int]) -> int:
    """One softmax-attention layer (q/k/v/o) of a GQA model: biases (Qwen2 and MiMo (a Qwen2 subclass),
    Qwen2-MoE ``qkv_bias``,
    ``attention_bias``: q/k/v, plus o_proj except GLM-4.5), q/k norms (Qwen3 per head; ``use_qk_norm`` with
    ``qk_norm_type`` ``per_head`` [head_dim] or ``per_layer`` [heads x head_dim], MiniMax-M2) and MiniMax-M3
    sparse index projections (``index_q_proj`` [index heads x index dim, h], ``index_k_proj`` [index dim, h],
    ``index_q_norm``/``index_k_norm`` [index dim])."""
    mt = str(flat.get("model_type", ""))
    nh = _int(flat, "num_attention_heads")
    hd, kvh = head_dim(flat), _int(flat, "num_key_value_heads") or nh
    a = h * nh * hd + 2 * h * kvh * hd + nh * hd * h
    qkv_bias = (mt in ("qwen2", "mimo") or (mt == "qwen2_moe" and flat.get("qkv_bias", True) is not False)
                or bool(flat.get("attention_bias")))
    if qkv_bias:
        a += nh * hd + 2 * kvh * hd
        if flat.get("attention_bias") and mt not in ("qwen2", "qwen2_moe", "glm4_moe", "mimo"):
            a += h  # o_proj bias (LlamaAttention: bias=config.attention_bias)
    m2 = mt == "minimax_m2"  # MiniMaxM2Attention always has per-layer q/k norms (no config field in transformers)
    if mt.startswith(("qwen3", "gemma3")) or flat.get("use_qk_norm", m2):
        a += (nh + kvh) * hd if flat.get("qk_norm_type", "per_layer" if m2 else "per_head") == "per_layer" else 2 * hd
    if layer in index_layers:
        sac = flat["sparse_attention_config"]
        dim = sac["sparse_index_dim"]
        heads = sac.get("sparse_num_index_heads")
        heads = heads if _is_pos_int(heads) else 1
        a += h * heads * dim + h * dim + 2 * dim
    return a


def _lightning_attention_params(flat: dict[str, Any], h: int) -> int:
    """One MiniMax lightning (linear) attention layer (MiniMax-Text-01/M1; transformers
    MiniMaxLightningAttention): ``qkv_proj`` [3 x heads x head_dim, h], ``output_gate`` [heads x head_dim, h],
    ``out_proj`` [h, heads x head_dim], ``norm`` [heads x head_dim]."""
    inner = _int(flat, "num_attention_heads") * head_dim(flat)
    return 3 * inner * h + inner * h + h * inner + inner


def estimate_parameters(flat: dict[str, Any], roles: list[str] | None = None) -> int | None:
    """Parameter count from the config alone (config-only directories), for Llama/Qwen/Mistral/Gemma-style
    GQA, DeepSeek/GLM/Kimi-style MLA(+DSA)+MoE and MiniMax (Text-01/M1 lightning hybrid, M2, M3) models.

    Counts what the published HF checkpoints store: embeddings, lm_head unless tied, attention and MLP
    projections, norms, q/k norms, qkv biases, routers and ``e_score_correction_bias``, shared experts, DSA
    indexers on ``full`` layers, MiniMax-M3 sparse index projections, and the MTP layers
    (``num_nextn_predict_layers``) the way each family publishes them: a full decoder layer (MoE when the
    model has experts) + ``enorm``/``hnorm`` + ``eh_proj`` [h, 2h] + ``shared_head.norm``, plus an
    ``embed_tokens`` and ``shared_head.head`` copy ([vocab, h] each) except for GLM-5 and MiMo
    (:data:`MTP_SHARES_EMBED_HEAD`); MiniMax checkpoints ship no MTP weights
    (MiniMax-M2.7 declares ``num_mtp_modules: 3``, MiniMax-M3 ``num_nextn_predict_layers: 1``, and neither
    published tensor table has an MTP tensor). Family details: Gemma ties lm_head by default and has four
    norms per layer (Gemma3 also q/k norms), gpt-oss has expert/router biases and attention sinks.
    Checked exactly against the real tensor tables of DeepSeek-V3/V3.2, GLM-5.1/5.2, Kimi-K2, MiniMax-M2.7/M3
    and against transformers' models of real configs built on the meta device (Llama-3.1, Mistral, Qwen2.5/3,
    Qwen1.5-MoE, Gemma2/3, gpt-oss, MiniMax-M1/M2, DeepSeek-V3 and GLM-5 without MTP;
    tests/test_inspect_swa_params.py). Not counted: vision towers and projectors of multimodal checkpoints
    (text model only), buffers such as ``rotary_emb.inv_freq``. Returns None for layouts it does not model
    (linear attention other than MiniMax lightning: Qwen3-Next, Kimi-Linear).
    """
    h = _int(flat, "hidden_size")
    v = _int(flat, "vocab_size")
    n = _int(flat, "num_hidden_layers")
    if not (h and v and n):
        return None
    mt = str(flat.get("model_type", ""))
    kinds_attn = layer_attention_kinds(flat)
    lightning = is_minimax(flat) or "attn_type_list" in flat
    if "linear" in kinds_attn and not lightning:
        return None
    nh = _int(flat, "num_attention_heads")
    inter = _int(flat, "intermediate_size")
    dense_i = _int(flat, "dense_intermediate_size") or inter  # MiniMax-M3: dense layers 0-2 are wider
    moe_i = _int(flat, "moe_intermediate_size") or inter  # MiniMax: routed experts use intermediate_size
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    shared = _int(flat, "n_shared_experts")
    index_layers = _sparse_index_layer_set(flat)

    def attn(layer: int) -> int:
        if layer < n and kinds_attn[layer] == "linear":
            return _lightning_attention_params(flat, h)
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
        return _gqa_attention_params(flat, h, layer, index_layers) + (nh if mt == "gpt_oss" else 0)  # + sinks

    def mlp(kind: str) -> int:
        if kind == "dense":
            return 3 * h * dense_i
        m = experts * 3 * h * moe_i + experts * h  # experts + router gate [experts, h]
        if mt == "gpt_oss":  # GptOssExperts: gate_up_proj_bias [E, 2i], down_proj_bias [E, h]; router bias [E]
            m += experts * (2 * moe_i + h) + experts
        if (mt in ROUTER_BIAS_TYPES or flat.get("topk_method") == "noaux_tc"
                or flat.get("use_routing_bias", mt == "minimax_m2") is True):
            m += experts  # e_score_correction_bias
        msi = _int(flat, "shared_intermediate_size")  # MiniMax: the shared expert's width (0 = none)
        si = _int(flat, "shared_expert_intermediate_size")
        if msi:
            m += 3 * h * msi
        elif si:
            m += 3 * h * si + h  # Qwen2-MoE style shared expert + its gate
        elif shared:
            m += 3 * h * moe_i * shared
        return m

    kinds = mlp_kinds(flat)
    total = v * h + h  # embeddings + final norm
    if not flat.get("tie_word_embeddings", mt in TIED_BY_DEFAULT):
        total += v * h
    norms = (4 if mt in FOUR_NORM_TYPES else 2) * h  # input/post-attention (+ pre/post-feedforward) norms
    for i in range(n):
        total += attn(i) + mlp(kinds[i]) + norms
    mtp = 0 if is_minimax(flat) else _int(flat, "num_nextn_predict_layers")
    for k in range(mtp):
        # MTP block: a decoder layer + enorm/hnorm + eh_proj [h, 2h] + shared_head.norm (+ embed/head copies)
        total += attn(n + k) + mlp("sparse" if experts else "dense") + 2 * h + 2 * h + 2 * h * h + h
        if mt not in MTP_SHARES_EMBED_HEAD:
            total += 2 * v * h  # embed_tokens + shared_head.head
    return total

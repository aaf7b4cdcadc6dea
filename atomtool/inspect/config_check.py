"""Sanity of the size fields (and the rope base ``rope_theta``) of a (flattened text) config: every stage sizes tensors, the KV cache and
the schedule from them, so a nonsense value (``num_hidden_layers: "four"``, ``hidden_size: 0``, ``-3``) is
an error finding naming the field instead of a report with zero or negative sizes.

Field names follow HF transformers' configs (LlamaConfig, Qwen3Config, DeepseekV3Config, GlmMoeDsaConfig).
``null`` is accepted wherever HF allows it (e.g. ``q_lora_rank: null`` = no q LoRA, ``head_dim: null``).
"""

from __future__ import annotations

import math
from typing import Any

from atomtool.inspect import memory as mem
from atomtool.inspect.dsa import MAX_LAYERS, text_config
from atomtool.inspect.hf_registry import allowed_layer_types, config_fields
from atomtool.inspect.types import Finding

#: must be integers >= 1 when present (and not null)
POSITIVE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "index_n_heads",
                   "index_head_dim", "index_topk")
#: must be integers >= 0 when present (and not null); 0 means "none" (e.g. no routed experts)
NONNEGATIVE_FIELDS = ("intermediate_size", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank",
                      "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts",
                      "num_local_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                      "num_nextn_predict_layers", "index_rope_dim")

#: RMSNorm / LayerNorm epsilons: positive finite numbers when present
NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
#: the routed-expert count, by family (DeepSeek/GLM, Qwen-MoE, Mixtral)
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")

#: layer counts, bounded by :data:`atomtool.inspect.dsa.MAX_LAYERS` (real models have < 200 layers)
LAYER_FIELDS = ("num_hidden_layers", "num_nextn_predict_layers")


def invalid_size_fields(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` error findings, one per size field of ``flat`` that is not a suitable integer,
    one per ``rope_theta`` (top level or in ``rope_parameters``) or norm epsilon that is not a positive finite
    number, and one when ``num_experts_per_tok`` exceeds the routed-expert count.
    (The attention-layout fields are :func:`invalid_attention_fields`; the engine's loader leaves those to
    transformers' own config validation.)

    flat: the flattened text config (:func:`atomtool.inspect.dsa.flatten_dsa_config`, or the text config
    when flattening failed). Booleans and floats are refused (``True`` is not a layer count). Returns [] for
    a sane config.
    """
    out = []
    for fields, lo, what in ((POSITIVE_FIELDS, 1, "a positive integer"),
                             (NONNEGATIVE_FIELDS, 0, "a non-negative integer")):
        for key in fields:
            if key not in flat or flat[key] is None:
                continue
            v = flat[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                out.append(Finding("config-invalid", "error", None,
                                   f"config.json: {key} must be {what}, got {v!r}"))
            elif key in LAYER_FIELDS and v > MAX_LAYERS:  # sizes, schedule and estimates would be meaningless
                out.append(Finding("config-invalid", "error", None,
                                   f"config.json: {key} must be at most {MAX_LAYERS}, got {v!r}"))
    # the rope base (inv_freq = theta ** (-2i / d) is NaN or inverted for theta <= 0, all ones for inf) and the
    # norm epsilon (x / sqrt(mean(x^2) + eps): NaN, or a division by ~0, for a NaN, negative or infinite eps)
    # (an epsilon of the wrong type is left to transformers' config validation, whose message names the type)
    eps = [(k, flat[k]) for k in NORM_EPS_FIELDS
           if isinstance(flat.get(k), int | float) and not isinstance(flat.get(k), bool)]
    for key, v in [*_rope_thetas(flat), *eps]:
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or not math.isfinite(v):
            out.append(Finding("config-invalid", "error", None,
                               f"config.json: {key} must be a positive finite number, got {v!r}"))
    k = flat.get("num_experts_per_tok")
    experts = next((flat[f] for f in EXPERT_COUNT_FIELDS if isinstance(flat.get(f), int)
                    and not isinstance(flat.get(f), bool) and flat[f] > 0), None)
    if isinstance(k, int) and not isinstance(k, bool) and experts is not None and k > experts:
        out.append(Finding("config-invalid", "error", None,
                           f"config.json: num_experts_per_tok ({k}) exceeds the number of routed experts "
                           f"({experts})"))
    out.extend(invalid_router_groups(flat))
    return out


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: model_types whose router rates each expert group by the sum of its two best scores (transformers'
#: ``DeepseekV3TopkRouter``, ``noaux_tc``; DeepSeek-V3 report §2.1.2): a group needs at least two experts
GROUP_TOP2_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")


def invalid_router_groups(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` findings for a group-limited MoE router (``n_group`` / ``topk_group``, DeepSeek-V2/V3,
    V3.2, GLM-MoE-DSA, Kimi) that cannot run: transformers' router views the ``n_routed_experts`` scores as
    ``[n_group, n_routed_experts // n_group]`` and keeps the ``topk_group`` best groups, so

    - ``n_group`` must be a positive integer dividing ``n_routed_experts`` (8 experts in 3 groups: a reshape
      error in transformers and in the engine's router; 0: a division by zero);
    - ``topk_group`` must be between 1 and ``n_group`` (more: ``torch.topk`` index out of range; 0: no group,
      hence no expert, is eligible);
    - for the ``noaux_tc`` router (:data:`GROUP_TOP2_MODEL_TYPES`) each group must hold at least two experts
      (a group is rated by its two best scores: ``topk(2)`` out of range in transformers).

    Only where there are routed experts (``n_routed_experts`` > 0) and the family reads the fields
    (transformers' config class declares ``n_group``, or the model_type is unknown to transformers); null is
    left to the family's default. ``num_experts_per_tok: 0`` is accepted: transformers runs it (the routed
    experts then add nothing). Returns [] for a router that runs.
    """
    from atomtool.inspect.hf_registry import config_field_default, config_fields

    experts = flat.get("n_routed_experts")
    if not _int(experts) or experts <= 0:
        return []
    fields = config_fields(str(flat.get("model_type", "")))
    if fields is not None and "n_group" not in fields:
        return []
    out: list[Finding] = []
    model_type = str(flat.get("model_type", ""))
    defaulted = []
    for key in ("n_group", "topk_group"):
        if key not in flat and config_field_default(model_type, key) is not None:
            defaulted.append(f"{key}={config_field_default(model_type, key)!r}")
    groups = flat["n_group"] if "n_group" in flat else config_field_default(model_type, "n_group")
    topk_group = flat["topk_group"] if "topk_group" in flat else config_field_default(model_type, "topk_group")
    note = (f" ({', '.join(defaulted)} is transformers' default: config.json does not set it)"
            if defaulted else "")

    def bad(msg: str) -> None:
        out.append(Finding("config-invalid", "error", None, f"config.json: {msg}{note}"))

    groups_ok = False
    if groups is not None:
        if not _int(groups) or groups < 1:
            bad(f"n_group must be a positive integer (the number of expert groups the router splits "
                f"n_routed_experts into), got {groups!r}")
        elif experts % groups:
            bad(f"n_group ({groups}) must divide n_routed_experts ({experts}): the router splits the routed "
                f"experts into n_group groups of equal size")
        elif experts // groups < 2 and model_type in GROUP_TOP2_MODEL_TYPES:
            bad(f"n_group ({groups}) leaves {experts // groups} routed expert per group (n_routed_experts "
                f"{experts}); the router rates each group by its two best experts, so a group needs at least 2")
        else:
            groups_ok = True
    if topk_group is not None:
        if not _int(topk_group) or topk_group < 1:
            bad(f"topk_group must be a positive integer (how many expert groups the router keeps), got "
                f"{topk_group!r}")
        elif groups_ok and topk_group > groups:
            bad(f"topk_group ({topk_group}) exceeds n_group ({groups}): the router cannot keep more expert "
                f"groups than there are")
    return out


def _rope_thetas(flat: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every ``rope_theta`` of a config with its dotted field name: top level (older configs), inside
    ``rope_parameters`` / ``rope_scaling`` (transformers 5), or in their per-layer-type dicts."""
    found = []
    if flat.get("rope_theta") is not None:
        found.append(("rope_theta", flat["rope_theta"]))
    for field in ("rope_parameters", "rope_scaling"):
        rp = flat.get(field)
        if not isinstance(rp, dict):
            continue
        nested = [("", rp)] + [(f"{k}.", v) for k, v in rp.items() if isinstance(v, dict)]
        for prefix, d in nested:
            if d.get("rope_theta") is not None:
                found.append((f"{field}.{prefix}rope_theta", d["rope_theta"]))
    return found


def invalid_attention_fields(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` error findings for the fields that decide which layers slide and how far
    (:func:`atomtool.inspect.memory.layer_attention_kinds`), checked the way transformers' config classes
    check them (strict dataclass field types, ``PreTrainedConfig.validate_layer_type``):

    - ``sliding_window``: an integer >= 1 or null (``"4096"``, ``true``, ``[4096]`` are type errors in
      transformers; 0 and negatives it keeps, but a window of no tokens is meaningless). Only where the
      config family reads the field (:func:`atomtool.inspect.memory.reads_sliding_window`): ``LlamaConfig``
      has no sliding window, so its value is never used and not judged; nor is it where
      ``use_sliding_window`` switches the window off (:func:`atomtool.inspect.memory.window_switched_off`:
      Qwen2/Qwen3 with the flag false; ``Qwen2MoeConfig`` writes ``sliding_window: 0`` itself);
    - ``use_sliding_window``: true, false or null, where the config class declares it (Qwen2/Qwen3/...), or
      for a model_type transformers does not know (``"true"`` and ``1`` are type errors in transformers);
    - ``layer_types``: a list with one entry per decoder layer (``num_hidden_layers``), each one of
      transformers' allowed layer types (:func:`atomtool.inspect.hf_registry.allowed_layer_types`; for a
      model_type transformers does not know, also the names inspect reads, e.g. Kimi-Linear's ``kda``).
    """
    out: list[Finding] = []

    def bad(msg: str) -> None:
        out.append(Finding("config-invalid", "error", None, f"config.json: {msg}"))

    sw = flat.get("sliding_window")
    if (sw is not None and not mem.valid_window(sw) and mem.reads_sliding_window(flat)
            and not mem.window_switched_off(flat)):
        bad(f"sliding_window must be a positive integer (tokens) or null, got {sw!r}")
    usw = flat.get("use_sliding_window")
    if usw is not None and not isinstance(usw, bool):
        fields = config_fields(str(flat.get("model_type", "")))
        if fields is None or "use_sliding_window" in fields:
            bad(f"use_sliding_window must be true or false, got {usw!r}")
    lt = flat.get("layer_types")
    if lt is None:
        return out
    n = flat.get("num_hidden_layers")
    if not isinstance(lt, list):
        bad(f"layer_types must be a list with one layer type per layer, got {lt!r}")
        return out
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0 and len(lt) != n:
        bad(f"layer_types has {len(lt)} entries but num_hidden_layers is {n} (one entry per decoder layer)")
    allowed = set(allowed_layer_types())
    if allowed and config_fields(str(flat.get("model_type", ""))) is None:
        # a remote-code family: also the names inspect itself reads (Kimi-Linear ``kda``, ...)
        allowed |= set(mem.LINEAR_LAYER_TYPES + mem.SLIDING_LAYER_TYPES)
    unknown = sorted({repr(t) for t in lt if not isinstance(t, str) or (allowed and t not in allowed)})
    if unknown:
        bad(f"layer_types has unknown layer type(s) {', '.join(unknown[:5])}; transformers accepts "
            f"{', '.join(sorted(allowed))}")
    return out


def invalid_quantization_config(raw: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` (error) when config.json's ``quantization_config`` (top level, or in the
    ``text_config`` of a multimodal config) is present but not a JSON object (a string such as ``"fp8"``, a
    list, a number): HF transformers reads it as a dict of ``quant_method``, ``weight_block_size``, ...;
    ``null`` means "not quantized" and is accepted. The engine's loader refuses the same config with the same
    message. raw: config.json as a dict."""
    out = []
    tc = text_config(raw)
    for where, cfg in (("", raw), ("text_config.", tc if tc is not raw else {})):
        q = cfg.get("quantization_config")
        if q is not None and not isinstance(q, dict):
            out.append(Finding("config-invalid", "error", None,
                               f"config.json: {where}quantization_config must be a JSON object (e.g. "
                               f"{{\"quant_method\": \"fp8\", ...}}), got {type(q).__name__} {q!r}"))
    return out

"""Sanity of the size fields (and the rope base ``rope_theta``) of a (flattened text) config: every stage sizes tensors, the KV cache and
the schedule from them, so a nonsense value (``num_hidden_layers: "four"``, ``hidden_size: 0``, ``-3``) is
an error finding naming the field instead of a report with zero or negative sizes.

Field names follow HF transformers' configs (LlamaConfig, Qwen3Config, DeepseekV3Config, GlmMoeDsaConfig).
``null`` is accepted wherever HF allows it (e.g. ``q_lora_rank: null`` = no q LoRA, ``head_dim: null``).
"""

from __future__ import annotations

from typing import Any

from atomtool.inspect.dsa import MAX_LAYERS
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

#: layer counts, bounded by :data:`atomtool.inspect.dsa.MAX_LAYERS` (real models have < 200 layers)
LAYER_FIELDS = ("num_hidden_layers", "num_nextn_predict_layers")


def invalid_size_fields(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` error findings, one per size field of ``flat`` that is not a suitable integer,
    and one per ``rope_theta`` (top level or in ``rope_parameters``) that is not a positive number.

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
    for key, v in _rope_thetas(flat):
        # the rope base: inv_freq = theta ** (-2i / d) is NaN or inverted for theta <= 0
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            out.append(Finding("config-invalid", "error", None,
                               f"config.json: {key} must be a positive number, got {v!r}"))
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

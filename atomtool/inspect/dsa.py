"""DeepSeek Sparse Attention config flattening and THE per-layer indexer schedule.

Every stage (inspect, convert, serve) reads the schedule from :func:`layer_roles`; nothing else
re-derives it (DESIGN.md principle 1). Facts: research/dsa.md §1-2 (HF transformers / vLLM / SGLang
precedence: ``indexer_types`` > ``index_topk_pattern`` > ``index_topk_freq`` + ``index_skip_topk_offset``).
"""

from __future__ import annotations

import copy
from typing import Any

from atomtool.errors import ConfigError

#: model_types whose attention is MLA + DSA (every decoder layer is a DSA layer).
DSA_MODEL_TYPES = frozenset({"deepseek_v32", "glm_moe_dsa"})
#: keys that runtime overrides may place at top level while the model reads ``text_config``.
_SCHEDULE_KEYS = ("use_index_cache", "index_topk_freq", "index_topk_pattern", "index_skip_topk_offset")

FULL, SHARED, DENSE = "full", "shared", "dense"
#: sanity bound on num_hidden_layers (real models have < 200); a hostile config must not allocate 10^12 roles
MAX_LAYERS = 100_000


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Return the language-model part of a config: ``raw["text_config"]`` if present, else ``raw``."""
    tc = raw.get("text_config")
    return tc if isinstance(tc, dict) else raw


def is_dsa_config(flat: dict[str, Any]) -> bool:
    """True when the (flattened) config describes MLA + DSA attention (index_* fields or a DSA model_type)."""
    mt = flat.get("model_type")
    return (isinstance(mt, str) and mt in DSA_MODEL_TYPES) or "index_topk" in flat or "indexer_types" in flat


def flatten_dsa_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Flatten every DSA config form into one flat text-config dict.

    Accepts flat top-level ``index_*`` fields (DeepSeek-V3.2, GLM-5.x), fields under ``text_config``,
    and a nested ``dsa_config`` dict (keys with or without the ``index_`` prefix). Top-level schedule
    keys override ``text_config`` ones (runtime overrides). Returns a deep copy of the text config with
    ``index_topk``, ``index_n_heads``, ``index_head_dim``, ``index_rope_dim`` (default
    ``qk_rope_head_dim``), ``indexer_rope_interleave`` and a resolved ``indexer_types`` list for DSA
    models; non-DSA configs come back as a plain copy of the text config.

    Raises:
        ConfigError: the schedule fields are inconsistent (see :func:`layer_roles`).
    """
    if not isinstance(raw, dict):
        raise ConfigError("config.json: top level is not a JSON object")
    flat = copy.deepcopy(text_config(raw))
    if flat is not raw:
        for key in _SCHEDULE_KEYS:
            if raw.get(key) is not None:
                flat[key] = raw[key]
    nested = flat.get("dsa_config") or (raw.get("dsa_config") if isinstance(raw.get("dsa_config"), dict) else None)
    if isinstance(nested, dict):
        for key, value in nested.items():
            name = key if key.startswith("index") or key in _SCHEDULE_KEYS else f"index_{key}"
            flat.setdefault(name, value)
    if not is_dsa_config(flat):
        return flat
    defaults = {"index_topk": 2048, "index_n_heads": 64 if flat.get("model_type") == "deepseek_v32" else 32,
                "index_head_dim": 128}
    for key, default in defaults.items():
        if flat.get(key) is None:
            flat[key] = default
        if not _is_int(flat[key]) or flat[key] < 1:
            raise ConfigError(f"config.json: {key} must be a positive integer, got {flat[key]!r}")
    if flat.get("index_rope_dim") is None:
        rope = flat.get("qk_rope_head_dim", 64)
        flat["index_rope_dim"] = 64 if rope is None else rope
    if not _is_int(flat["index_rope_dim"]) or not 0 <= flat["index_rope_dim"] <= flat["index_head_dim"]:
        raise ConfigError(f"config.json: index_rope_dim (default qk_rope_head_dim) must be an integer in "
                          f"[0, index_head_dim={flat['index_head_dim']}], got {flat['index_rope_dim']!r}")
    # DeepSeek-V3.2's indexer uses NeoX rope (vllm#28968); GLM's is interleaved (ik_llama.cpp#2099): GLM
    # configs set indexer_rope_interleave: true, and HF's GlmMoeDsaIndexer interleaves when the flag is absent.
    default_interleave = flat.get("model_type") == "glm_moe_dsa"
    flat["indexer_rope_interleave"] = bool(flat.get("indexer_rope_interleave", default_interleave))
    flat["indexer_types"] = layer_roles(flat)
    return flat


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_roles(flat: dict[str, Any]) -> list[str]:
    """THE per-layer sparse-attention schedule: ``full`` | ``shared`` | ``dense`` per decoder layer.

    Precedence (research/dsa.md §2): explicit ``indexer_types`` list, then ``index_topk_pattern``
    ("F"/"S" string or list), then ``index_topk_freq`` with ``index_skip_topk_offset`` (default 2):
    layer i is full iff ``max(i - offset + 1, 0) % freq == 0`` (HF transformers / vLLM / SGLang).
    Non-DSA configs get ``dense`` for every layer. MTP layers (index >= num_hidden_layers) are not part
    of the list; they always own an indexer.

    Args:
        flat: a text config (already flattened or not) with ``num_hidden_layers``.
    Returns:
        list of length ``num_hidden_layers``.
    Raises:
        ConfigError: wrong length, unknown role, layer 0 shared, offset < 1, freq < 1.
    """
    n = flat.get("num_hidden_layers")
    if not _is_int(n) or not 0 < n <= MAX_LAYERS:
        raise ConfigError(f"config.json: num_hidden_layers must be a positive integer (at most {MAX_LAYERS}), "
                          f"got {n!r}")
    if not is_dsa_config(flat):
        return [DENSE] * n
    explicit = flat.get("indexer_types")
    pattern = flat.get("index_topk_pattern")
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != n:
            got = len(explicit) if isinstance(explicit, list) else type(explicit).__name__
            raise ConfigError(f"config.json: indexer_types must list {n} layers (num_hidden_layers), got {got}")
        bad = sorted({str(v) for v in explicit} - {FULL, SHARED})
        if bad:
            raise ConfigError(f"config.json: indexer_types holds unknown roles {bad}; expected 'full' or 'shared'")
        roles = list(explicit)
    elif pattern is not None:
        # HF accepts a string of 'F'/'S' or a list (of 'F'/'S' or of 'full'/'shared').
        short = {"F": FULL, "S": SHARED, FULL: FULL, SHARED: SHARED}
        chars = list(pattern) if isinstance(pattern, str | list) else []
        if len(chars) != n or any(not isinstance(c, str) or c not in short for c in chars):
            raise ConfigError(
                f"config.json: index_topk_pattern must be {n} characters of 'F'/'S', got {pattern!r}")
        roles = [short[c] for c in chars]
    else:
        freq = flat.get("index_topk_freq")
        freq = 1 if freq is None else freq
        offset = flat.get("index_skip_topk_offset")
        offset = 2 if offset is None else offset
        if not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"config.json: index_topk_freq must be an integer >= 1, got {freq!r}")
        if not isinstance(offset, int) or offset < 1:
            raise ConfigError(
                f"config.json: index_skip_topk_offset must be an integer >= 1 (layer 0 owns the first indexer), got {offset!r}")
        roles = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]
    if roles[0] != FULL:
        raise ConfigError("config.json: layer 0 must own an indexer ('full'); a shared layer has no earlier top-k to reuse")
    return roles


def previous_full_layer(roles: list[str], layer: int) -> int:
    """Index of the full layer whose top-k a shared ``layer`` reuses (the nearest earlier full layer)."""
    for i in range(layer, -1, -1):
        if roles[i] == FULL:
            return i
    raise ConfigError(f"layer {layer} is shared but no earlier layer owns an indexer")

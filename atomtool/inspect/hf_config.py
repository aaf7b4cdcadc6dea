"""Build HF transformers' own config object from a (flattened text) config dict, the way the engine's
loader does (``atomtool.serve.layers.rotary.hf_config_from_flat``), so inspect refuses what transformers
refuses and reads the defaults transformers fills in.

Why here: the data flows inspect <- convert <- serve, so the shared rule lives in inspect (serve may import
it; inspect never imports serve). transformers 5 configs are strict dataclasses: a field of the wrong type
(``max_window_layers: "0"``, ``rms_norm_eps: "1e-6"``, ``tie_word_embeddings: "no"``, ``rope_parameters:
"x"``) raises at construction, so building the config is the whole validation (libraries first).
transformers is imported lazily (:mod:`atomtool.inspect.hf_registry`).
"""

from __future__ import annotations

from typing import Any

from atomtool.errors import one_line
from atomtool.inspect.hf_registry import config_class, config_fields
from atomtool.inspect.types import Finding

#: fields whose value is a weight-matrix dimension or count: the engine's loader
#: (``atomtool.serve.model_config.check_size_fields``) refuses a config.json without them rather than assume
#: transformers' defaults (one reference model's sizes, e.g. ``LlamaConfig.vocab_size`` 32000). Checked where
#: the model_type's config class declares them; for a model_type transformers does not know,
#: :data:`DENSE_SIZE_FIELDS` only.
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "moe_intermediate_size", "index_n_heads", "index_head_dim")
#: :data:`SIZE_FIELDS` that inspect and the engine's loader refuse a config.json without: all but
#: ``num_key_value_heads``, which both take from transformers' config class exactly as transformers does
#: (``MistralConfig`` 8, ``Qwen2Config``/``Qwen3Config`` 32, ``LlamaConfig`` = ``num_attention_heads``;
#: inspect says so with a warning) and then check against the k_proj / v_proj shapes
#: (:func:`atomtool.inspect.shapes.shape_findings`): weights that disagree are a ``shape-mismatch`` error
#: naming the field, its default and the tensor, in inspect and in the loader alike.
WEIGHT_SIZE_FIELDS = tuple(f for f in SIZE_FIELDS if f != "num_key_value_heads")
DENSE_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

#: keys transformers' config classes take from config.json but not as constructor arguments
_NOT_KWARGS = ("model_type", "transformers_version")


def config_kwargs(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` as keyword arguments of a transformers config class (without ``model_type`` and
    ``transformers_version``, which config.json carries but the classes do not take)."""
    return {k: v for k, v in flat.items() if k not in _NOT_KWARGS}


def build_hf_config(flat: dict[str, Any]) -> tuple[Any | None, str | None]:
    """``(config object, None)`` when transformers' config class for ``flat["model_type"]``
    (``CONFIG_MAPPING``) accepts ``flat`` as keyword arguments, ``(None, message)`` when it raises
    (message: transformers' own, on one line), ``(None, None)`` when transformers does not know the
    model_type (remote-code configs: nothing to validate against)."""
    cls = config_class(str(flat.get("model_type", "")))
    if cls is None:
        return None, None
    try:
        return cls(**config_kwargs(flat)), None
    except Exception as exc:  # any refusal by transformers: its message is the finding
        return None, one_line(exc)


def transformers_config_findings(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` (error) when transformers' config class for the model_type cannot be built from
    ``flat`` (the engine's loader would refuse the config with the same message), else []."""
    _, err = build_hf_config(flat)
    if err is None:
        return []
    return [Finding("config-invalid", "error", None, f"config.json: transformers cannot build its config: {err}")]


def head_count_findings(flat: dict[str, Any]) -> list[Finding]:
    """``config-invalid`` (error) when ``num_attention_heads`` is not a multiple of ``num_key_value_heads``
    (grouped-query attention shares each K/V head between ``heads / kv_heads`` query heads; transformers'
    configs accept the pair, its attention then fails on the first forward). Only for valid positive ints
    (other values are :func:`atomtool.inspect.config_check.invalid_size_fields`). Not for MLA configs
    (``kv_lora_rank``): every query head gets its own key/value from the shared latent (``kv_b_proj`` has
    ``num_attention_heads`` heads), the engine never reads ``num_key_value_heads`` there, and transformers'
    DeepseekV3 runs e.g. 3 or 8 key/value heads for 4 query heads with the same logits."""
    from atomtool.inspect.memory import is_mla

    if is_mla(flat):
        return []
    heads, kv = flat.get("num_attention_heads"), flat.get("num_key_value_heads")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, kv))
    if not ok or heads % kv == 0:
        return []
    return [Finding("config-invalid", "error", None,
                    f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv} "
                    f"(each key/value head serves a whole group of query heads)")]


def engine_missing_size_fields(text_cfg: dict[str, Any]) -> list[str]:
    """The :data:`WEIGHT_SIZE_FIELDS` that the text config (``atomtool.inspect.dsa.text_config`` of
    config.json, before any default is filled in) lacks and that its model_type's transformers config class
    declares with a fixed default (a None default means transformers derives the value from the others):
    the fields the engine's loader (``atomtool.serve.model_config.check_size_fields``) refuses the config
    without. A model_type transformers does not know is checked against :data:`DENSE_SIZE_FIELDS` only."""
    cls = config_class(str(text_cfg.get("model_type", "")))
    declared = config_fields(str(text_cfg.get("model_type", ""))) or frozenset(DENSE_SIZE_FIELDS)
    return [f for f in WEIGHT_SIZE_FIELDS if f in declared and f not in text_cfg
            and (cls is None or getattr(cls, f, None) is not None)]


def fill_transformers_defaults(flat: dict[str, Any], fields: tuple[str, ...]) -> list[tuple[str, Any, str]]:
    """Fill ``fields`` that ``flat`` lacks (absent; an explicit null is left to the validation) with the value transformers' config class for the
    model_type gives them (e.g. ``MistralConfig``: 32 layers, 8 key/value heads), in place, as transformers
    and the engine (which reads the report's ``config_flat``) would use them.

    Returns ``[(field, value, config class name)]`` for each field filled; [] when transformers does not know
    the model_type or cannot build the config."""
    missing = [k for k in fields if k not in flat]
    if not missing:
        return []
    cfg, _ = build_hf_config({k: v for k, v in flat.items() if k not in missing})
    if cfg is None:
        return []
    filled = []
    for key in missing:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            flat[key] = value
            filled.append((key, value, type(cfg).__name__))
    return filled


#: config-class fields never copied from transformers' defaults by :func:`complete_config_dict`: token ids and
#: generation settings (the engine reads those from the checkpoint's generation_config / tokenizer),
#: training-only knobs, the rope dict (the rotary layer already reads it through transformers' config object),
#: and the per-layer schedules, which :func:`atomtool.inspect.dsa.flatten_dsa_config` alone derives (one
#: schedule, DESIGN.md).
NOT_FILLED = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
                        "attention_dropout", "pretraining_tp", "rope_parameters", "layer_types",
                        "mlp_layer_types", "indexer_types", "dtype", "torch_dtype"})


def class_fields(cls: type) -> set[str]:
    """The fields a transformers config class declares itself (its annotations, base ``PreTrainedConfig``'s
    excluded)."""
    from transformers import PretrainedConfig

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is PretrainedConfig or not (isinstance(klass, type) and issubclass(klass, PretrainedConfig)):
            continue
        names.update(getattr(klass, "__annotations__", {}))
    return names


def complete_config_dict(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str | None, str | None]:
    """``flat`` (a flattened text config) with every absent field of its model_type's transformers config
    class filled in with the value transformers gives it (``Qwen3Config.head_dim`` 128, ``LlamaConfig.head_dim``
    = hidden_size // num_attention_heads, ``MistralConfig.num_key_value_heads`` 8; fields in
    :data:`NOT_FILLED` excepted): the config the engine builds its model from, and the one inspect computes
    the expected tensor shapes from (:mod:`atomtool.inspect.shapes`).

    Returns:
        (the completed config -- a new dict, the input is left alone --, ``{field: value}`` for the fields
        filled in, the config class name (None when transformers does not know the model_type: nothing is
        filled), transformers' refusal message on one line or None).
    """
    cls = config_class(str(flat.get("model_type", "")))
    if cls is None:
        return dict(flat), {}, None, None
    hf, err = build_hf_config(flat)
    if err is not None:
        return dict(flat), {}, cls.__name__, err
    absent = sorted(f for f in class_fields(cls) - NOT_FILLED if f not in flat)
    filled = {f: getattr(hf, f) for f in absent if hasattr(hf, f)}
    return {**flat, **filled}, filled, cls.__name__, None

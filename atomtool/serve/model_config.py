"""config.json fields the engine model reads: transformers' defaults for the absent ones, refusal for absent sizes.

The engine models read the flattened text config as a dict. A field the checkpoint's config.json leaves out
means what transformers' config class for its ``model_type`` says it means (e.g. ``Qwen3Config.head_dim``
defaults to 128, not ``hidden_size // num_attention_heads``; ``LlamaConfig.head_dim`` is derived), so
:func:`complete_config` takes every absent field from that class (one source of truth, the oracle is HF).

The exception are the fields that size the weight matrices (``atomtool.inspect.hf_config.SIZE_FIELDS``): transformers' defaults for
them are one reference model's sizes (``LlamaConfig.vocab_size`` 32000, ``DeepseekV3Config.hidden_size``
7168), which a checkpoint that omits them almost never has, and building a model from them would allocate a
full-size model only to fail on the first mis-shaped tensor. :func:`check_size_fields` refuses them up front,
naming the field and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atomtool.errors import ConfigError
from atomtool.inspect.hf_config import SIZE_FIELDS, build_hf_config
from atomtool.inspect.hf_registry import config_class

#: config-class fields never copied from transformers' defaults: token ids and generation settings (the engine
#: reads those from the checkpoint's generation_config / tokenizer), training-only knobs, the rope dict (the
#: rotary layer already reads it through transformers' config object), and the per-layer schedules, which
#: :func:`atomtool.inspect.dsa.flatten_dsa_config` alone derives (one schedule, DESIGN.md).
_NOT_FILLED = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
                         "attention_dropout", "pretraining_tp", "rope_parameters", "layer_types",
                         "mlp_layer_types", "indexer_types", "dtype", "torch_dtype"})


def _class_fields(cls) -> set[str]:
    """The fields a config class declares itself (its annotations, base ``PreTrainedConfig``'s excluded)."""
    from transformers import PretrainedConfig

    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is PretrainedConfig or not (isinstance(klass, type) and issubclass(klass, PretrainedConfig)):
            continue
        names.update(getattr(klass, "__annotations__", {}))
    return names


def check_size_fields(text_config: dict[str, Any], config_path: Path | str) -> None:
    """Refuse a config.json that leaves out a field sizing the weights (``atomtool.inspect.hf_config.SIZE_FIELDS``,
    checked only where the model_type's transformers config class declares them with a fixed default: a None
    default means transformers derives the value from the others, e.g. ``LlamaConfig.num_key_value_heads`` =
    ``num_attention_heads``, which :func:`complete_config` takes).

    text_config: the text config dict (``atomtool.inspect.dsa.text_config`` of config.json).
    A model_type transformers does not know is checked against the dense fields only.

    Raises:
        ConfigError: one line naming the file, every absent field, and transformers' default for it.
    """
    cls = config_class(text_config.get("model_type"))
    declared = _class_fields(cls) if cls is not None else {"vocab_size", "hidden_size", "num_hidden_layers",
                                                            "num_attention_heads"}
    if "kv_lora_rank" in declared:  # MLA: the latent cache, not num_key_value_heads, shapes the weights
        declared = declared - {"num_key_value_heads"}
    missing = [f for f in SIZE_FIELDS if f in declared and f not in text_config
               and (cls is None or getattr(cls, f, None) is not None)]
    if not missing:
        return
    defaults = {f: getattr(cls, f, None) for f in missing} if cls is not None else {}
    shown = ", ".join(f"{f} (transformers' {cls.__name__} default: {defaults[f]!r})"
                      if cls is not None and defaults.get(f) is not None else f for f in missing)
    raise ConfigError(f"{config_path}: missing required field{'s' if len(missing) > 1 else ''} {shown}; the "
                      "engine does not assume a reference model's size for a field that shapes the weights: "
                      "add it to config.json")


def complete_config(config_flat: dict[str, Any], config_path: Path | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config_flat`` with every absent field of its model_type's transformers config class filled in with
    the value that class gives it (so the model is built as transformers would build it).

    Returns:
        (the completed config -- a new dict, the input is left alone --, ``{field: default}`` for the fields
        that were filled in, for messages).
    Raises:
        ConfigError: transformers cannot build a config from it (names the file; one line).
    """
    cls = config_class(config_flat.get("model_type"))
    if cls is None:
        return dict(config_flat), {}
    # size fields reach here absent only where transformers derives them (a None class default)
    fields = _class_fields(cls) - _NOT_FILLED
    absent = sorted(f for f in fields if f not in config_flat)
    # building it also validates the present fields' types, before any model is built (named file, one line)
    hf, err = build_hf_config(config_flat)
    if err is not None:  # a config transformers cannot parse: its message, on one line
        raise ConfigError(f"{config_path}: transformers cannot build its config ({cls.__name__}): {err}")
    filled = {f: getattr(hf, f) for f in absent if hasattr(hf, f)}
    return {**config_flat, **filled}, filled

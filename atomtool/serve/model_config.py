"""config.json fields the engine model reads: transformers' defaults for the absent ones, refusal for absent sizes.

The engine models read the flattened text config as a dict. A field the checkpoint's config.json leaves out
means what transformers' config class for its ``model_type`` says it means (e.g. ``Qwen3Config.head_dim``
defaults to 128, not ``hidden_size // num_attention_heads``; ``LlamaConfig.head_dim`` is derived), so
:func:`complete_config` takes every absent field from that class (one source of truth, the oracle is HF;
the completion itself is inspect's :func:`atomtool.inspect.hf_config.complete_config_dict`, which inspect
also computes the expected tensor shapes from).

The exception are the fields that size the weights (``atomtool.inspect.hf_config.WEIGHT_SIZE_FIELDS``):
transformers' defaults for them are one reference model's sizes (``LlamaConfig.vocab_size`` 32000,
``DeepseekV3Config.hidden_size`` 7168), which a checkpoint that omits them almost never has, and building a
model from them would allocate a full-size model only to fail on the first mis-shaped tensor.
:func:`check_size_fields` refuses them up front, naming the field and the file. ``num_key_value_heads`` is
not among them: it is taken from transformers (``MistralConfig`` 8, ``Qwen3Config`` 32) as inspect takes it,
and a raw checkpoint whose k_proj / v_proj disagree with it is refused by the loader with inspect's
``shape-mismatch`` message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from atomtool.errors import ConfigError
from atomtool.inspect.hf_config import complete_config_dict, engine_missing_size_fields
from atomtool.inspect.hf_registry import config_class


def check_size_fields(text_config: dict[str, Any], config_path: Path | str) -> None:
    """Refuse a config.json that leaves out a field sizing the weights
    (:func:`atomtool.inspect.hf_config.engine_missing_size_fields`: ``WEIGHT_SIZE_FIELDS`` its model_type's
    transformers config class declares with a fixed default; a None default means transformers derives the
    value from the others, which :func:`complete_config` takes).

    text_config: the text config dict (``atomtool.inspect.dsa.text_config`` of config.json).
    A model_type transformers does not know is checked against the dense fields only.

    Raises:
        ConfigError: one line naming the file, every absent field, and transformers' default for it.
    """
    missing = engine_missing_size_fields(text_config)
    if not missing:
        return
    cls = config_class(str(text_config.get("model_type", "")))
    shown = ", ".join(f"{f} (transformers' {cls.__name__} default: {getattr(cls, f)!r})"
                      if cls is not None and getattr(cls, f, None) is not None else f for f in missing)
    raise ConfigError(f"{config_path}: missing required field{'s' if len(missing) > 1 else ''} {shown}; the "
                      "engine does not assume a reference model's size for a field that shapes the weights: "
                      "add it to config.json")


def complete_config(config_flat: dict[str, Any], config_path: Path | str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config_flat`` with every absent field of its model_type's transformers config class filled in with
    the value that class gives it (so the model is built as transformers would build it;
    :func:`atomtool.inspect.hf_config.complete_config_dict`).

    Returns:
        (the completed config -- a new dict, the input is left alone --, ``{field: default}`` for the fields
        that were filled in, for messages).
    Raises:
        ConfigError: transformers cannot build a config from it (names the file; one line).
    """
    # building it also validates the present fields' types, before any model is built (named file, one line)
    completed, filled, cls_name, err = complete_config_dict(config_flat)
    if err is not None:  # a config transformers cannot parse: its message, on one line
        raise ConfigError(f"{config_path}: transformers cannot build its config ({cls_name}): {err}")
    return completed, filled

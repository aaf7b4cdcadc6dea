"""What HF transformers itself knows about a config: its config class's fields (by ``model_type``), the
layer types its configs accept, and the architecture (model class) names of its auto mappings.

Inspect decides from these instead of hand lists where it can (libraries first): e.g. whether a
``sliding_window`` in config.json is read at all (``LlamaConfig`` declares no such field, so Llama's
attention never slides; ``MistralConfig`` does), or whether an architecture it has no family for is a
real model (Gemma2) or a typo. transformers is imported lazily (about a second), only when a config needs
one of these answers; every function degrades to "unknown" (None / False) if transformers is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect as _inspect
from typing import Any


@functools.lru_cache(maxsize=256)
def config_fields(model_type: str) -> frozenset[str] | None:
    """The declared fields of transformers' config class for ``model_type`` (``CONFIG_MAPPING``), or None
    when transformers does not know that model_type (remote-code configs, typos).

    Fields are the class's dataclass fields (transformers 5 configs are strict dataclasses; the
    ``__init__`` signature for older classes). Keys a config.json adds beyond them are kept as plain
    attributes by transformers but never read by its modeling code (e.g. ``sliding_window`` on
    ``LlamaConfig``: logits are bitwise identical with and without it). For a composite (multimodal) config
    class, the fields of its ``text_config`` sub-config are included: the text model is what inspect sizes.
    """
    cls = config_class(model_type)
    if cls is None:
        return None
    names = set(_fields(cls))
    sub = getattr(cls, "sub_configs", None)
    text = sub.get("text_config") if isinstance(sub, dict) else None
    if isinstance(text, type):
        names |= _fields(text)
    return frozenset(names)


def config_class(model_type: str) -> type | None:
    """transformers' config class for ``model_type`` (``CONFIG_MAPPING``: ``LlamaConfig``, ``DeepseekV3Config``,
    ...), or None when transformers does not know it (or is missing)."""
    if not isinstance(model_type, str) or not model_type:
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:  # transformers is a dependency; without it every model_type is "unknown"
        return None
    try:
        return CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    except Exception:  # a broken optional import inside transformers: treat as unknown
        return None


def _fields(cls: type) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:  # not a dataclass (transformers < 5)
        return set(_inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def config_field_default(model_type: str, name: str) -> Any:
    """The default of field ``name`` in transformers' config class for ``model_type`` (None if unknown)."""
    cls = config_class(model_type)
    if cls is None:
        return None
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return None


@functools.lru_cache(maxsize=1)
def allowed_layer_types() -> frozenset[str]:
    """``layer_types`` entries transformers' configs accept (``configuration_utils.ALLOWED_ATTN_LAYER_TYPES``,
    checked by ``PreTrainedConfig.validate_layer_type``), plus the legacy names it remaps for remote-code
    configs (``mamba``, ``attention``, ``conv``). Empty when transformers is missing."""
    try:
        from transformers import configuration_utils as cu
    except ImportError:
        return frozenset()
    allowed = set(getattr(cu, "ALLOWED_ATTN_LAYER_TYPES", ()) or getattr(cu, "ALLOWED_LAYER_TYPES", ()))
    allowed |= set(getattr(cu, "_LEGACY_LAYER_TYPE_REMAP", {}))
    return frozenset(allowed)


@functools.lru_cache(maxsize=1)
def _known_architectures() -> frozenset[str]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return frozenset()
    names: set[str] = set()
    for key, mapping in vars(modeling_auto).items():
        if not (key.startswith("MODEL") and key.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)):
            continue
        for value in mapping.values():
            names.update([value] if isinstance(value, str) else [v for v in value if isinstance(v, str)])
    return frozenset(names)


def is_transformers_architecture(architecture: str) -> bool:
    """True when ``architecture`` (config.json ``architectures[0]``, e.g. ``Gemma2ForCausalLM``) is a model
    class of transformers' auto mappings (``modeling_auto.*_MAPPING_NAMES``: causal LM, image-text-to-text,
    ...). False for names nobody knows (typos, remote-code classes transformers does not ship)."""
    return isinstance(architecture, str) and architecture in _known_architectures()

"""HF ``architectures`` name -> engine model class (lazy imports, so a dense model never imports MoE code)."""

from __future__ import annotations

import importlib

from atomtool.errors import UnsupportedArchitectureError
from atomtool.inspect.families import supported_architectures
from atomtool.serve.models.base import CausalLM

#: architecture -> (module, class). One class may serve several architectures; it reads the variant
#: (qk-norm, biases, DSA schedule, ...) from the config it is given.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("atomtool.serve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("atomtool.serve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("atomtool.serve.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atomtool.serve.models.llama", "LlamaForCausalLM"),
    "DeepseekV3ForCausalLM": ("atomtool.serve.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("atomtool.serve.models.deepseek", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("atomtool.serve.models.deepseek", "GlmMoeDsaForCausalLM"),
}


def engine_architectures() -> list[str]:
    """Architectures that have an engine model class, sorted."""
    return sorted(_MODELS)


def resolve_architecture(config: dict) -> str:
    """The first entry of ``config["architectures"]`` that the engine serves.

    Raises:
        UnsupportedArchitectureError: none is served; the message lists the supported architectures.
    """
    archs = config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in _MODELS:
            return arch
    supported = ", ".join(sorted(set(supported_architectures()) & set(_MODELS)))
    # quoted as convert / inspect quote it (atomtool.inspect.families): 'GemmaForCausalLM'
    if isinstance(archs, list) and archs:
        found = ", ".join(repr(a) for a in archs)
        plural = "s" if len(archs) > 1 else ""
    else:
        found, plural = "none (config.json has no 'architectures')", ""
    raise UnsupportedArchitectureError(f"unsupported architecture{plural} {found}; supported: {supported}")


def get_model_class(architecture: str) -> type[CausalLM]:
    """Return the engine model class for an HF architecture name.

    Raises:
        UnsupportedArchitectureError: unknown architecture (lists the supported ones).
    """
    entry = _MODELS.get(architecture)
    if entry is None:
        resolve_architecture({"architectures": [architecture]})
    module, cls = entry
    return getattr(importlib.import_module(module), cls)

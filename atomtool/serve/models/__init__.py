"""Engine model implementations and their registry (HF architecture name -> model class)."""

from atomtool.serve.models.base import CausalLM
from atomtool.serve.models.registry import engine_architectures, get_model_class, resolve_architecture

__all__ = ["CausalLM", "engine_architectures", "get_model_class", "resolve_architecture"]

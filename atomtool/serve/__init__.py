"""Serving: ``from atomtool.serve import LLM, SamplingParams, StructuredOutputsParams`` (engine, models, layers,
ops, HTTP API)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atomtool.serve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from atomtool.serve.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from atomtool.serve.llm import LLM

        return LLM
    raise AttributeError(name)

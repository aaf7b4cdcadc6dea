"""Default sampling parameters from a checkpoint's ``generation_config.json`` (vLLM's ``--generation-config``).

vLLM (``--generation-config auto``, its default) reads the model's Hugging Face generation config and uses
its sampling fields as the defaults of every request that leaves them unset; ``--generation-config vllm``
turns that off. atomtool does the same with ``--generation-config auto|none`` on ``serve`` and ``generate``
and ``LLM(..., generation_config="auto"|"none")``, for the fields vLLM takes from it: temperature, top_p, top_k,
min_p, repetition_penalty, and ``max_new_tokens`` as the default ``max_tokens``. DeepSeek-V3's config, for example, sets
temperature 0.6 and top_p 0.95, so a request without sampling fields samples at 0.6 / 0.95, as under vLLM.

``do_sample`` is ignored, as vLLM ignores it: ``do_sample: false`` next to ``temperature: 0.6`` still gives
the default temperature 0.6 (and a config with ``do_sample: false`` alone sets no sampling default).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomtool.errors import ConfigError, InvalidArgumentError, InvalidRequestError
from atomtool.serve.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "none")

#: generation_config.json field -> SamplingParams field: the fields vLLM's ``--generation-config auto`` applies
#: (its ``get_diff_sampling_param``: repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens)
_APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
#: fields vLLM would also apply but SamplingParams does not have: reported, not applied (none left today; the
#: report stays for a field a future vLLM adds)
_NOT_SUPPORTED: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults a model's generation config gives.

    values: SamplingParams field name -> value (``max_tokens`` from ``max_new_tokens``), only the fields the
        file sets; empty with ``--generation-config none`` or no file.
    unsupported: fields the file sets that vLLM would apply but atomtool's sampler does not have (none
        today, see ``_NOT_SUPPORTED``); they are not applied.
    source: the generation_config.json read, or None.
    """

    values: dict[str, Any] = field(default_factory=dict)
    unsupported: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    def get(self, name: str, fallback: Any = None) -> Any:
        """The default for SamplingParams field ``name`` (the config's, else ``fallback``)."""
        return self.values.get(name, fallback)

    def sampling_params(self, explicit: dict[str, Any], fallback: dict[str, Any] | None = None) -> SamplingParams:
        """Build validated :class:`SamplingParams`: ``explicit`` (the fields the caller set; None values count as
        unset) over the generation config's defaults over ``fallback`` (the entry point's own defaults) over
        SamplingParams' defaults.

        Raises:
            InvalidRequestError: a value out of range (from :meth:`SamplingParams.validate`).
        """
        merged = dict(fallback or {})
        merged.update(self.values)
        merged.update({k: v for k, v in explicit.items() if v is not None})
        return SamplingParams(**merged).validate()

    def describe(self, overridden: Iterable[str] = ()) -> str | None:
        """One line for the startup log naming the defaults taken (None when there are none); ``overridden``:
        fields the caller set explicitly (a one-shot ``generate``'s flags), which take none of them."""
        values = {k: v for k, v in self.values.items() if k not in set(overridden)}
        if not values and not self.unsupported:
            return None
        parts = []
        if values:
            taken = ", ".join(f"{k}={v}" for k, v in values.items())
            parts.append(f"default sampling parameters from the model's generation config ({self.source}): {taken}"
                         " (requests that set them override them; --generation-config none ignores the file)")
        if self.unsupported:
            skipped = ", ".join(f"{k}={v}" for k, v in self.unsupported.items())
            parts.append(f"generation config fields not supported by atomtool's sampler, ignored: {skipped}")
        return "; ".join(parts)


def load_generation_defaults(model_dir: str | Path | None, mode: str = "auto") -> GenerationDefaults:
    """Read ``model_dir/generation_config.json`` with transformers' :class:`GenerationConfig` (``mode``
    ``auto``) or nothing (``none``). ``model_dir``: the loaded model's local directory (raw HF checkpoint or
    atomtool layout; convert copies the file). A missing file gives no defaults.

    Raises:
        ConfigError: an unknown ``mode``; a generation_config.json that is not valid JSON, not a JSON object, or
            whose temperature / top_p / top_k / min_p / repetition_penalty / max_new_tokens is out of range (the
            message names the file and field and suggests ``--generation-config none``).
    """
    if mode not in GENERATION_CONFIG_MODES:
        raise InvalidArgumentError(f"--generation-config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    if mode == "none" or model_dir is None:
        return GenerationDefaults()
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return GenerationDefaults()
    hint = "fix the file or pass --generation-config none (generation_config=\"none\") to ignore it"
    config = _read_generation_config(path, hint)
    values = {ours: getattr(config, theirs) for theirs, ours in _APPLIED.items()
              if getattr(config, theirs, None) is not None}
    unsupported = {name: getattr(config, name) for name in _NOT_SUPPORTED if getattr(config, name, None) is not None}
    try:
        SamplingParams(**values).validate()
    except InvalidRequestError as exc:
        theirs = {v: k for k, v in _APPLIED.items()}.get(exc.param or "", exc.param)
        raise ConfigError(f"{path}: {theirs}: {exc}; {hint}") from None
    return GenerationDefaults(values=values, unsupported=unsupported, source=path)


def _read_generation_config(path: Path, hint: str) -> Any:
    """``GenerationConfig.from_pretrained(path.parent)`` with transformers' own warnings about flags that
    ``do_sample`` leaves unused silenced (vLLM ignores do_sample, so they do not apply here)."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            data = {}  # not JSON: transformers' own message below names the problem
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a generation config must be a JSON object, got "
                              f"{type(data).__name__}; {hint}")
        return GenerationConfig.from_pretrained(str(path.parent))
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a valid generation config ({exc}); {hint}") from None
    finally:
        hf_logging.set_verbosity(previous)

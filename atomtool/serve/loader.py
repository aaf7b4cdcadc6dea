"""Load a servable model: from an atomtool layout, or from a raw HF checkpoint through convert's plan in memory.

Both paths end in the same place -- a model built from the layout's tensor specs and fed ``(name, tensor)``
pairs whose names are the layout's names -- because the raw path runs the very conversion plan that
``atomtool convert`` writes to disk (DESIGN.md principle 2; no second copy of the fusion rules).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atomtool.errors import ConfigError, EngineError, InvalidArgumentError, LayoutError, SourceError, one_line
from atomtool.serve.model_config import check_size_fields, complete_config
from atomtool.serve.models.base import CausalLM
from atomtool.serve.models.registry import get_model_class, resolve_architecture

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model with its weights, plus what the engine needs to know about it."""

    model: CausalLM
    config: dict[str, Any]          # flattened text config
    architecture: str
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    act_quant: str | None = None    # W8A8 mode of the FP8 block layers (None: weight-only / no FP8 layers)
    act_quant_note: str | None = None  # why an explicit --fp8-activations dynamic was not honoured


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises EngineError for cuda without a GPU,
    InvalidArgumentError (a ValueError) for a string torch does not read as a device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}; choose auto, cpu or cuda (cuda:N)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("device 'cuda' was requested but no CUDA/ROCm GPU is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype, config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (exact, and fast there); on GPU the checkpoint's float16/bfloat16, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        tag = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
        return torch.float16 if tag == "float16" else torch.bfloat16
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def check_model_argument(model: str | os.PathLike) -> None:
    """Refuse an empty MODEL (an unset ``"$MODEL"``): ``Path("")`` is the current directory, which would be
    read as the checkpoint (as inspect / convert / verify refuse empty paths). Raises SourceError."""
    from atomtool.inspect.source import check_path_argument

    check_path_argument(model, "MODEL", "pass an atomtool layout, a checkpoint directory or a Hub repo id")


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """The local directory of ``model``: an existing path as is; a Hub repo id (``org/name``, not an existing
    path) through convert's :func:`~atomtool.convert.commands.resolve_source` (the HF cache, else a download
    of weights, configs and tokenizer). Raises SourceError when a repo id can be neither found nor downloaded,
    or ``model`` is empty (:func:`check_model_argument`).
    """
    from atomtool.convert.commands import resolve_source
    from atomtool.inspect.source import looks_like_path

    check_model_argument(model)
    path = Path(model).expanduser()
    if isinstance(model, str) and not path.exists() and not looks_like_path(model):
        return resolve_source(model)[0]
    return path


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict. Raises SourceError / ConfigError."""
    if model_dir.is_file():  # e.g. the checkpoint's config.json: the message inspect and convert give
        raise SourceError(f"{model_dir}: is a file; pass the checkpoint directory (holding config.json)")
    if not model_dir.is_dir():
        raise SourceError(f"model directory {str(model_dir)!r} does not exist (as given: a path relative to the "
                          f"current directory {os.getcwd()!r})" if not model_dir.is_absolute() else
                          f"model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise SourceError(f"{path}: no config.json (not a checkpoint or atomtool layout)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {one_line(exc)}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: top level is not a JSON object")
    return config


def _layout_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a layout, shard by shard (index from convert's layout module, data via safetensors)."""
    from safetensors import safe_open

    from atomtool.convert.layout import tensor_files

    by_file: dict[str, list[str]] = {}
    for name, fname in tensor_files(model_dir).items():
        by_file.setdefault(fname, []).append(name)
    for fname, names in by_file.items():
        path = model_dir / fname
        if not path.is_file():
            raise EngineError(f"{path}: layout shard is missing (tensors {', '.join(names[:5])}, ...)")
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def load_model(model_path: str | os.PathLike, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", fp8_activations: str = "auto") -> LoadedModel:
    """Build the engine model for ``model_path`` and load its weights.

    ``model_path``: a directory, or a Hub repo id (:func:`resolve_model_dir`). A directory with an
    ``atomtool.json`` manifest is a layout (specs from the manifest, tensors from its shards); anything else
    is treated as a raw HF checkpoint: ``inspect_checkpoint`` -> ``build_plan`` -> ``iter_output_tensors``
    in memory. Inputs that cannot load (no weights, missing shards, unservable schemes) are refused before
    the model is built.

    Raises:
        SourceError / ConfigError: unreadable directory or config, a config with a nonsense size field or
            rope_theta (named), a repo id neither cached nor downloadable.
        LayoutError: an unreadable, malformed or unsupported-version ``atomtool.json``.
        UnsupportedArchitectureError: the architecture is not served (lists the supported ones).
        EngineError: no weights, a scheme outside ``SERVABLE_SCHEMES``, a ``hidden_act`` or another config
            feature the engine does not run (inspect's ``activation-not-servable`` / ``feature-not-servable``
            words: MLA without q_lora_rank, MLA attention_bias, dynamic / longrope rope), FP8 scale grids that
            fit no block, missing / unexpected / mis-shaped tensors (named; a raw checkpoint's with inspect's
            ``shape-mismatch`` message, before the model is built), bad dtype or device.

    An FP8 block checkpoint whose config.json declares no ``weight_block_size`` is served with the block its
    scale grids imply (:func:`inferred_fp8_block`, :func:`layout_fp8_block`). ``fp8_activations``
    (``auto`` | ``dynamic`` | ``weight-only``) picks W8A8 or weight-only numerics for FP8 block layers
    (:mod:`atomtool.serve.layers.fp8_activations`; an unknown value is an EngineError).
    """
    model_dir = resolve_model_dir(model_path)
    raw_config = read_config(model_dir)
    arch = resolve_architecture(raw_config)
    _check_config_values(raw_config)  # raw checkpoints and layouts alike, before anything is sized from it
    config_path = model_dir / "config.json"
    from atomtool.inspect.dsa import text_config
    from atomtool.inspect.families import family_for, unsupported_activation, unsupported_features

    text, family = text_config(raw_config), family_for(arch)
    check_size_fields(text, config_path)
    act = unsupported_activation(family, text)  # inspect's activation-not-servable
    if act is not None:
        raise EngineError(act)
    features = unsupported_features(family, text)  # inspect's feature-not-servable
    if features:
        raise EngineError(f"{config_path}: {'; '.join(features)}; atomtool cannot serve this checkpoint")
    dev = resolve_device(device)
    from atomtool.convert.layout import MANIFEST_NAME
    from atomtool.serve.layers.fp8_activations import (
        apply_fp8_activations,
        fp8_activations_note,
        resolve_fp8_activations,
    )

    # the value (and, for an explicit "dynamic", the device) checked before any weight is read
    resolve_fp8_activations(fp8_activations, raw_config, torch.float32, dev)
    from atomtool.inspect.dsa import flatten_dsa_config

    # a manifest makes the directory a layout: an unreadable or unsupported one is a LayoutError, never a
    # silent fallback to loading the directory as a raw checkpoint
    if (model_dir / MANIFEST_NAME).exists():
        from atomtool.convert.layout import (
            check_manifest_matches_files,
            check_parts_order,
            entry_to_spec,
            read_manifest,
        )

        config = flatten_dsa_config(raw_config)
        manifest = read_manifest(model_dir)
        specs = {name: entry_to_spec(name, entry) for name, entry in manifest["tensors"].items()}
        _check_layout_servable(model_path, model_dir, specs)
        # the model is built from the manifest, the bytes come from the shards: they must agree (headers only)
        headers = check_manifest_matches_files(model_dir, manifest)
        bad_parts = check_parts_order(specs, family)
        if bad_parts:
            raise LayoutError(f"{model_dir / MANIFEST_NAME}: {bad_parts[0]}"
                              + (f" (+{len(bad_parts) - 1} more)" if len(bad_parts) > 1 else "")
                              + "; the engine would split the fused tensor at the wrong rows (the manifest was "
                              f"edited?); `atomtool verify {model_path}` checks the layout, converting again "
                              "rewrites it")
        _check_layout_shapes(model_path, arch, config, specs)  # before building (allocating) the model
        torch_dtype = resolve_dtype(dtype, config, dev)
        config = _with_fp8_block(config, layout_fp8_block(model_path, config, specs))
        config, defaulted = complete_config(config, config_path)
        config = _canonical_activation(config)
        model = _build_model(arch, config, specs, torch_dtype, dev, config_path)
        from atomtool.serve.layout_load import load_layout_weights

        with _name_defaults(defaulted, config_path):
            load_layout_weights(model, model_dir, headers=headers)
    else:
        from atomtool.convert.materialize import iter_output_tensors
        from atomtool.convert.plan import build_plan
        from atomtool.inspect.classify import inspect_checkpoint

        report = inspect_checkpoint(str(model_dir))
        _check_raw_servable(model_path, report)  # before building (allocating) the model
        config = report.config_flat
        torch_dtype = resolve_dtype(dtype, config, dev)
        plan_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[torch_dtype]
        plan = build_plan(report, plan_dtype)
        config = flatten_dsa_config(plan.config) if plan.config else config
        config = _with_fp8_block(config, inferred_fp8_block(model_path, report))
        config, defaulted = complete_config(config, config_path)
        config = _canonical_activation(config)
        model = _build_model(arch, config, plan.tensors, torch_dtype, dev, config_path)
        with _name_defaults(defaulted, config_path):
            model.load_weights((spec.name, t) for spec, t in iter_output_tensors(plan, model_dir, dev))
    act_quant = resolve_fp8_activations(fp8_activations, config, torch_dtype, dev)
    n_w8a8 = apply_fp8_activations(model, act_quant)
    note = fp8_activations_note(fp8_activations, model, n_w8a8)
    model.eval()
    return LoadedModel(model, config, arch, model_dir, torch_dtype, dev, act_quant if n_w8a8 else None, note)


def inferred_fp8_block(model_path: str | os.PathLike, report: Any) -> tuple[int, int] | None:
    """The FP8 block (rows, cols) of a raw checkpoint whose config.json does not declare one
    (no ``quantization_config.weight_block_size``) but whose FP8 weights carry 2-D ``weight_scale_inv`` grids:
    the block inspect inferred from the scale shapes (``ModuleInfo.block_size`` of the ``fp8_block``
    modules), checked by :func:`_one_fp8_block`. None when config.json declares a block or no module is
    FP8-block.

    Raises:
        EngineError: the grids fit no single block.
    """
    if _declares_block(report.config_flat):
        return None
    grids = []
    for m in report.modules:
        scale = m.tensors.get("weight_scale_inv") or m.tensors.get("weight_scale")
        if m.scheme == "fp8_block" and m.block_size and scale is not None and len(scale.shape) >= 2:
            grids.append((m.name, tuple(m.shape[-2:]), tuple(scale.shape[-2:]), tuple(m.block_size[:2])))
    return _one_fp8_block(model_path, grids)


def layout_fp8_block(model_path: str | os.PathLike, config: dict[str, Any],
                     specs: dict[str, Any]) -> tuple[int, int] | None:
    """The layout counterpart of :func:`inferred_fp8_block`: a layout converted from such a checkpoint keeps
    config.json without ``weight_block_size``, and its manifest records each FP8 output's ``block_size``
    (with the weight and ``weight_scale_inv`` shapes, checked by :func:`_one_fp8_block`). Raises EngineError
    as it does."""
    if _declares_block(config):
        return None
    grids = []
    for name, spec in specs.items():
        scale = specs.get(f"{name}_scale_inv")
        if (name.endswith(".weight") and spec.scheme == "fp8_block" and spec.block_size and scale is not None
                and len(spec.shape) >= 2 and len(scale.shape) >= 2):
            grids.append((name, tuple(spec.shape[-2:]), tuple(scale.shape[-2:]), tuple(spec.block_size[:2])))
    return _one_fp8_block(model_path, grids)


def _declares_block(config: dict[str, Any]) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and bool(qc.get("weight_block_size"))


def _one_fp8_block(model_path: str | os.PathLike,
                   grids: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
                   ) -> tuple[int, int] | None:
    """The one FP8 block that fits every ``(name, (N, K), scale grid, inferred block)``: the engine sizes
    every FP8 linear's and expert's ``[ceil(N / b0), ceil(K / b1)]`` scale grid from one block
    (``atomtool.serve.layers.linear.fp8_block_size``). Of the inferred (power-of-two) candidates the largest
    that fits all is taken: two power-of-two blocks that both fit every grid dequantize identically (they
    differ only where a weight fits inside one block). None for no grids.

    Raises:
        EngineError: the grids fit no single block (two modules and their blocks named).
    """
    if not grids:
        return None

    def fits(b: tuple[int, ...]) -> bool:
        return all((-(-n // b[0]), -(-k // b[1])) == g for _, (n, k), g, _ in grids)

    for block in sorted({g[3] for g in grids}, reverse=True):
        if fits(block):
            return int(block[0]), int(block[1])
    (a, _, _, ba), (c, _, _, bc) = grids[0], next(g for g in grids if g[3] != grids[0][3])
    raise EngineError(f"{model_path}: config.json declares no FP8 block size (quantization_config."
                      f"weight_block_size) and the weight_scale_inv grids fit no single one ({a}: "
                      f"{list(ba)}, {c}: {list(bc)}); add quantization_config to config.json")


def _with_fp8_block(config: dict[str, Any], block: tuple[int, int] | None) -> dict[str, Any]:
    """``config`` with ``quantization_config.weight_block_size`` = ``block`` (quant_method ``fp8`` unless it
    names one), as transformers' FP8 checkpoints declare it, so the engine's FP8 linears and experts size
    their scale grids with it; the input is left alone. ``block`` None: ``config`` unchanged."""
    if block is None:
        return config
    qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else {}
    return {**config, "quantization_config": {"quant_method": "fp8", **qc, "weight_block_size": list(block)}}


def _canonical_activation(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with an aliased ``hidden_act`` (``swish``) replaced by the name the engine's models read
    (``silu``; :data:`atomtool.inspect.families.ACTIVATION_ALIASES`, the same function in transformers'
    ``ACT2FN``); the input is left alone."""
    from atomtool.inspect.families import ACTIVATION_ALIASES

    act = config.get("hidden_act")
    return {**config, "hidden_act": ACTIVATION_ALIASES[act]} if isinstance(act, str) and act in ACTIVATION_ALIASES \
        else config


def _build_model(arch: str, config: dict[str, Any], specs: Any, dtype: torch.dtype, device: torch.device,
                 config_path: Path) -> CausalLM:
    """The engine model for ``arch`` built from ``config``; the safety net for a config the checks before it
    let through: a KeyError / TypeError / ValueError while the model reads its config (a field absent or of
    the wrong type) becomes one ConfigError line naming the config file.

    Raises:
        ConfigError: as above. AtomtoolError subclasses the model raises itself pass through unchanged.
    """
    cls = get_model_class(arch)
    try:
        return cls(config, specs, dtype, device)
    except KeyError as exc:
        raise ConfigError(f"{config_path}: cannot build {arch}: missing field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{config_path}: cannot build {arch} from it: {one_line(exc)}") from exc


@contextmanager
def _name_defaults(defaulted: dict[str, Any], config_path: Path) -> Iterator[None]:
    """Weights that do not fit a model built with transformers' defaults for fields config.json left out
    (e.g. ``Qwen3Config.head_dim`` 128): the load error says which fields were defaulted and to what -- only
    the fields that size the tensors or the MLP schedule, the plausible causes."""
    from atomtool.inspect.hf_config import SIZE_FIELDS
    from atomtool.inspect.memory import SCHEDULE_DEFAULT_FIELDS

    # only fields that shape the tensors or decide which layers carry which (a defaulted num_mtp_layers, read
    # by no engine model, is never the cause)
    shaping = {*SIZE_FIELDS, *SCHEDULE_DEFAULT_FIELDS, "head_dim", "n_shared_experts"}
    try:
        yield
    except EngineError as exc:
        sizes = {k: v for k, v in defaulted.items()
                 if k in shaping and isinstance(v, int) and not isinstance(v, bool)}
        if not sizes:
            raise
        shown = ", ".join(f"{k}={v!r}" for k, v in sizes.items())
        raise EngineError(f"{exc}; note: {config_path} leaves out fields that transformers' config class "
                          f"defaults: {shown}") from exc


def _check_config_values(raw_config: dict[str, Any]) -> None:
    """Refuse a config whose size fields or rope base are nonsense (``num_attention_heads: -4``,
    ``max_position_embeddings: 0``, ``rope_theta: -1``) or whose ``quantization_config`` is not a JSON object,
    with inspect's own checks (:func:`atomtool.inspect.config_check.invalid_size_fields` and
    :func:`~atomtool.inspect.config_check.invalid_quantization_config`, the ``config-invalid`` findings), so
    the engine never sizes a model, KV cache or rope table from them (nor the tokenizer trips over them).

    Raises:
        ConfigError: one line naming every bad field and its value.
    """
    from atomtool.inspect.config_check import invalid_quantization_config, invalid_size_fields
    from atomtool.inspect.dsa import flatten_dsa_config, text_config

    try:
        flat = flatten_dsa_config(raw_config)
    except ConfigError:  # a bad DSA schedule is refused where the loader flattens the config
        flat = text_config(raw_config)
    bad = invalid_size_fields(flat) + invalid_quantization_config(raw_config)
    if bad:
        raise ConfigError("; ".join(dict.fromkeys(one_line(f.message) for f in bad)))


def _check_raw_servable(model_path: str | os.PathLike, report: Any) -> None:
    """Refuse a raw checkpoint the engine cannot run, before the model is built: no safetensors weights
    (config.json only), tensors whose shapes disagree with config.json (inspect's ``shape-mismatch``
    finding, the same message: the field, its value -- and when it is transformers' default --, the tensor
    and its shape), a linear stored in a scheme outside ``SERVABLE_SCHEMES`` (AWQ, GPTQ, NVFP4, ...), or
    parts of one fused / stacked module stored in schemes that cannot be fused (inspect's error findings
    ``fused-shards-disagree`` / ``experts-disagree``: the reason convert refuses it with, not the fused
    names the engine would then lack), FP8 scales that fit no block (``scale-shape-mismatch``), or tensors
    the engine's model does not have (``unexpected-tensors``: q/k norms under a model_type without them).

    Raises:
        EngineError: one line naming the directory (and the first mis-shaped tensor, the first unservable
            module with its scheme, or the first unfusable module with inspect's message).
    """
    from atomtool.inspect.classify import unservable_modules
    from atomtool.inspect.quant import UNFUSABLE_CODES
    from atomtool.inspect.shapes import SHAPE_MISMATCH

    if not report.tensors:
        raise EngineError(f"{model_path}: no safetensors weights (*.safetensors) found; config.json alone "
                          "describes the model but there is nothing to load")
    _refuse_shape_mismatch(model_path, [f for f in report.findings if f.code == SHAPE_MISMATCH])
    bad = unservable_modules(report.modules)
    if bad:
        raise EngineError(f"{model_path}: layer {bad[0].name} is stored as {bad[0].scheme}; {_SCHEME_HINT}")
    # (a scale grid that fits no block: the engine could only guess one, so it refuses as inspect does)
    unfusable = [f for f in report.findings
                 if f.code in (*UNFUSABLE_CODES, "scale-shape-mismatch", "unexpected-tensors")
                 and f.severity == "error"]
    if unfusable:
        more = f" (+{len(unfusable) - 1} more)" if len(unfusable) > 1 else ""
        raise EngineError(f"{model_path}: {unfusable[0].code}: {unfusable[0].message}{more}; see "
                          f"`atomtool inspect {model_path}`")


def _refuse_shape_mismatch(model_path: str | os.PathLike, mismatch: list[Any]) -> None:
    """Raise EngineError with the first ``shape-mismatch`` finding's message (inspect's own words: the
    tensor, its stored and implied shape, the config fields and which are transformers' defaults), naming
    the directory and how many more there are; nothing when ``mismatch`` is empty."""
    if mismatch:
        more = f" (+{len(mismatch) - 1} more, see `atomtool inspect {model_path}`)" if len(mismatch) > 1 else ""
        raise EngineError(f"{model_path}: {mismatch[0].message}{more}")


def _check_layout_shapes(model_path: str | os.PathLike, arch: str, config: dict[str, Any],
                         specs: dict[str, Any]) -> None:
    """The layout counterpart of the raw path's shape check: the tensors the manifest records (and the
    sources inside its fused / stacked ones) against the shapes the config implies, by inspect's
    :func:`~atomtool.inspect.shapes.config_shape_findings` (a config.json edited after convert, or a
    ``--force``d conversion). Raises EngineError (one line, the message ``atomtool inspect`` prints)."""
    from atomtool.inspect.families import family_for
    from atomtool.inspect.shapes import config_shape_findings, layout_source_tensors

    roles = config.get("indexer_types")
    found = config_shape_findings({}, config, family_for(arch), [], roles if isinstance(roles, list) else None,
                                  layout_source_tensors(specs))
    _refuse_shape_mismatch(model_path, found)


def _check_layout_servable(model_path: str | os.PathLike, model_dir: Path, specs: dict[str, Any]) -> None:
    """The layout counterpart of :func:`_check_raw_servable`: every shard its index names exists, and every
    tensor's scheme is one the engine runs. Raises LayoutError (index) / EngineError (one line)."""
    from atomtool.convert.layout import tensor_files
    from atomtool.inspect.families import SERVABLE_SCHEMES
    from atomtool.inspect.quant import QUANTIZED_SCHEMES

    if not specs:
        raise EngineError(f"{model_path}: the layout manifest lists no tensors; nothing to load")
    missing = sorted({f for f in tensor_files(model_dir).values() if not (model_dir / f).is_file()})
    if missing:
        raise EngineError(f"{model_path}: layout shard(s) missing: {', '.join(missing[:5])}"
                          + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    bad = [s for s in specs.values() if s.scheme in QUANTIZED_SCHEMES and s.scheme not in SERVABLE_SCHEMES]
    if bad:
        raise EngineError(f"{model_path}: tensor {bad[0].name} is stored as {bad[0].scheme}; {_SCHEME_HINT}")


_SCHEME_HINT = "the engine runs bf16/fp16/fp32 and fp8_block weights (convert cannot change that)"

"""Build the :class:`~atomtool.inspect.types.InspectReport` of a checkpoint: the one classification every
stage reads (DESIGN.md principle 1).

:func:`build_report` is pure (config dict + header tensors -> report); :func:`inspect_checkpoint` adds the
I/O (:class:`atomtool.inspect.source.CheckpointSource`: local directory or Hub repo, headers only).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from atomtool.errors import ConfigError, LayoutError, SourceError, clip, one_line
from atomtool.inspect import memory as mem
from atomtool.inspect.config_check import (
    invalid_attention_fields,
    invalid_quantization_config,
    invalid_size_fields,
)
from atomtool.inspect.dsa import DENSE, FULL, SHARED, flatten_dsa_config, is_dsa_config, text_config
from atomtool.inspect.families import (
    SERVABLE_SCHEMES,
    Family,
    family_for,
    supported_architectures,
    unsupported_activation,
    unsupported_features,
)
from atomtool.inspect.hf_config import (
    WEIGHT_SIZE_FIELDS,
    engine_missing_size_fields,
    fill_transformers_defaults,
    head_count_findings,
    transformers_config_findings,
)
from atomtool.inspect.hf_registry import config_field_default, is_transformers_architecture
from atomtool.inspect.quant import (
    QUANTIZED_SCHEMES,
    SCALE_ROLES,
    QuantSpec,
    classify_modules,
    dtype_findings,
    fusion_findings,
    logical_numel,
    natural_key,
    parse_quant_config,
)
from atomtool.inspect.required import (
    DECODER_LAYER,
    extra_layer_findings,
    missing_tensor_findings,
    tied_head_findings,
)
from atomtool.inspect.shapes import config_shape_findings, layout_source_tensors
from atomtool.inspect.types import DsaInfo, Finding, InspectReport, ModuleInfo, TensorInfo

_INDEXER_RE = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.indexer\.")
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def _architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    tc = text_config(config)
    archs = tc.get("architectures") if tc is not config else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return "unknown"


#: keys of DeepSeek's inference-demo configs (``inference/configs/config_671B.json``: ModelArgs of its model.py)
_DEMO_CONFIG_KEYS = ("dim", "n_layers", "n_heads", "inter_dim", "moe_inter_dim", "n_routed_experts")


def looks_like_inference_demo_config(config: dict[str, Any]) -> bool:
    """True for DeepSeek's inference-demo config format (``dim``, ``n_layers``, ``n_heads`` ..., from the
    GitHub repo's ``inference/configs/``), which is not a Hugging Face config.json: no ``architectures`` /
    ``model_type``."""
    return ("architectures" not in config and "model_type" not in config
            and sum(1 for k in _DEMO_CONFIG_KEYS if k in config) >= 2)


def not_hf_config_reason(config: dict[str, Any]) -> str | None:
    """What a config.json that is not a Hugging Face model config looks like instead (DeepSeek's
    inference-demo config, ModelOpt's hf_quant_config.json), or None."""
    if "architectures" in config or "model_type" in config:
        return None
    if looks_like_inference_demo_config(config):
        return "DeepSeek's inference-demo config: 'dim', 'n_layers', ... keys, no 'architectures'"
    if "producer" in config and "quantization" in config:
        return "ModelOpt's hf_quant_config.json: 'producer' and 'quantization' keys"
    return None


def dsa_findings(tensors: dict[str, TensorInfo], roles: list[str]) -> list[Finding]:
    """Cross-check the DSA schedule with the stored tensors: a ``full`` layer without indexer tensors
    (error: nothing to compute its top-k with) and a ``shared`` layer with them (warning: they are unused
    and dropped at load). MTP layers (index >= num_hidden_layers) always own an indexer and are skipped."""
    if not tensors:
        return []
    owners: dict[int, str] = {}
    prefix = None
    for name in tensors:
        m = _INDEXER_RE.match(name)
        if m:
            owners.setdefault(int(m.group(2)), m.group(1))
            prefix = prefix or m.group(1)
    if prefix is None:  # where do the layers live? (model.layers.N. / language_model.model.layers.N.)
        for name in tensors:
            m = re.match(r"^(.*?)layers\.\d+\.self_attn\.", name)
            if m:
                prefix = m.group(1)
                break
    prefix = prefix or "model."
    out = []
    missing = [i for i, r in enumerate(roles) if r == FULL and i not in owners]
    extra = [i for i, r in enumerate(roles) if r == SHARED and i in owners]
    for i in missing:
        out.append(Finding("dsa-full-layer-without-indexer", "error", f"{prefix}layers.{i}.self_attn.indexer",
                           f"{prefix}layers.{i}: schedule role 'full' (owns an indexer) but the checkpoint has no "
                           f"{prefix}layers.{i}.self_attn.indexer.* tensors"))
    for i in extra:
        out.append(Finding("dsa-shared-layer-with-indexer", "warning", f"{owners[i]}layers.{i}.self_attn.indexer",
                           f"{owners[i]}layers.{i}: schedule role 'shared' (reuses the top-k of layer "
                           f"{_prev_full(roles, i)}) but the checkpoint has indexer tensors for it; they are unused"))
    return out


def _prev_full(roles: list[str], i: int) -> int:
    while i > 0 and roles[i] != FULL:
        i -= 1
    return i


#: the FP8 format the engine's block-FP8 kernels and parameters hold (DeepSeek-V3's): E5M2 bytes copied into
#: them would saturate every value above E4M3's 448 (and the layout fast path would reinterpret the bits)
SERVABLE_FP8_DTYPE = "F8_E4M3"


def _served_bytes(name: str, t: TensorInfo, serve_tag: str, fp32_keep: tuple[str, ...]) -> int:
    """Bytes tensor ``name`` takes once serve loaded it in ``serve_tag``: float weights (F32/F16/BF16) in that
    dtype; quantization scales / companions, the family's float32 keeps and every other dtype as stored."""
    if (t.dtype in ("F32", "F16", "BF16") and name.rsplit(".", 1)[-1] not in SCALE_ROLES
            and not any(k in name for k in fp32_keep)):
        return t.numel * mem.TAG_BYTES[serve_tag]
    return t.nbytes


def unservable_modules(modules: list[ModuleInfo]) -> list[ModuleInfo]:
    """Modules treated as quantized whose storage the engine cannot run: a scheme outside
    :data:`~atomtool.inspect.families.SERVABLE_SCHEMES`, or FP8 blocks stored in another FP8 format than
    :data:`SERVABLE_FP8_DTYPE` (e.g. F8_E5M2), in the given order."""
    return [m for m in modules if m.treated_as == "quantized" and (
        m.scheme not in SERVABLE_SCHEMES or (m.scheme == "fp8_block" and m.dtype != SERVABLE_FP8_DTYPE))]


def _scheme_label(m: ModuleInfo) -> str:
    """``fp8_block`` stored in an unservable FP8 format reads ``fp8_block (F8_E5M2)``; other schemes as is."""
    return f"{m.scheme} ({m.dtype})" if m.scheme == "fp8_block" and m.dtype != SERVABLE_FP8_DTYPE else m.scheme


def declared_unservable_schemes(spec: QuantSpec | None) -> list[str]:
    """Storage schemes a quantization config declares that the engine cannot run (not in
    :data:`~atomtool.inspect.families.SERVABLE_SCHEMES`), sorted; used when there are no weights to check.
    A config whose method atomtool does not recognise (no scheme parsed) yields ``["unknown (<method>)"]``:
    nothing says its weights are servable."""
    if spec is None:
        return []
    if not spec.schemes:
        return [f"unknown ({spec.method})"]
    return sorted(s for s in spec.schemes if s not in SERVABLE_SCHEMES)


def _totals(modules: list[ModuleInfo], other: list[str], tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "elements": 0, "bytes": 0})
    for t in tensors.values():
        d = by_dtype[t.dtype]
        d["tensors"] += 1
        d["elements"] += t.numel
        d["bytes"] += t.nbytes
    by_scheme: dict[str, dict[str, int]] = defaultdict(lambda: {"modules": 0, "parameters": 0, "bytes": 0})
    params = 0
    for m in modules:
        s = by_scheme[m.scheme]
        n = logical_numel(m)
        s["modules"] += 1
        s["parameters"] += n
        s["bytes"] += sum(t.nbytes for t in m.tensors.values())
        params += n
    for name in other:  # norms, embeddings, router biases: stored as they are
        t = tensors[name]
        key = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}.get(t.dtype, t.dtype.lower())
        s = by_scheme[key]
        s["parameters"] += t.numel
        s["bytes"] += t.nbytes
        params += t.numel
    return {"parameters": params, "bytes": sum(t.nbytes for t in tensors.values()),
            "by_dtype": dict(sorted(by_dtype.items())), "by_scheme": dict(sorted(by_scheme.items())),
            "estimated": False}


#: fields without which inspect cannot size the model (shown as "?" in the tables, null in --json)
SIZE_FIELDS = {"num_hidden_layers": "the layer count, KV cache per token and parameter estimate",
               "hidden_size": "the parameter estimate", "vocab_size": "the parameter estimate",
               "num_attention_heads": "the KV cache per token and parameter estimate"}


def serving_window_cap(flat: dict[str, Any], fam: Family | None) -> int | None:
    """The most tokens per sequence atomtool serves when the engine caps sequences at the sliding window, or
    None (no cap): the architecture is servable, some layers slide
    (:func:`~atomtool.inspect.memory.layer_attention_kinds`), and the window
    (:func:`~atomtool.inspect.memory.effective_sliding_window`) is shorter than ``max_position_embeddings``
    (sliding-window attention is not implemented; the engine, ``atomtool.serve.models.llama``, applies the
    same rule)."""
    if fam is None or not fam.servable or not isinstance(flat.get("num_hidden_layers"), int):
        return None
    window = mem.effective_sliding_window(flat)
    mpe = flat.get("max_position_embeddings")
    if window is None or "sliding" not in mem.layer_attention_kinds(flat) or (
            mem.valid_window(mpe) and mpe <= window):
        return None
    return window


def attention_notes(flat: dict[str, Any], fam: Family | None,
                    filled: list[tuple[str, Any, str]] | None = None,
                    engine_missing: list[str] | None = None) -> list[Finding]:
    """Findings about how a (valid) config's attention layout is read:

    - ``config-missing-field``: a size field is absent or null. Where transformers' config class has a
      default for it (``filled``: ``(field, value, class name)`` from
      :func:`atomtool.inspect.hf_config.fill_transformers_defaults`) inspect sizes the model with it, as
      transformers does; otherwise the figures that need it are unknown ("?" in the tables). Severity
      ``error`` for a servable architecture when the field shapes the weights (``engine_missing``:
      :func:`atomtool.inspect.hf_config.engine_missing_size_fields`): the engine's loader refuses such a
      config.json rather than assume a reference model's size; ``warning`` otherwise;
    - ``sliding-window-ignored`` (info): ``sliding_window`` is set but the config family has no sliding-window
      attention (transformers' ``LlamaConfig`` / ``DeepseekV3Config`` ... declare no such field:
      :func:`atomtool.inspect.memory.reads_sliding_window`), so every layer attends to the whole context;
    - ``context-capped-at-window`` (warning): atomtool serves the architecture, some layers slide, and the
      window is shorter than the model's context: the engine caps each sequence at the window
      (:func:`serving_window_cap`).
    """
    out = []
    defaults = {key: (value, cls) for key, value, cls in filled or []}
    refused = [k for k in engine_missing or [] if fam is not None and fam.servable]
    for key in refused:
        used = (f" (inspect sizes the model with transformers' {defaults[key][1]} default {defaults[key][0]})"
                if key in defaults else " (shown as '?')")
        out.append(Finding("config-missing-field", "error", None,
                           f"config.json has no {key}{used}: the engine refuses a config without it (it does not "
                           f"assume a reference model's size for a field that shapes the weights); add it to "
                           f"config.json"))
    for key, (value, cls) in defaults.items():
        if key in refused or (key == "num_key_value_heads" and value == flat.get("num_attention_heads")
                              and config_field_default(str(flat.get("model_type", "")), key) is None):
            continue  # (transformers derives as many key/value heads as query heads: plain multi-head attention)
        out.append(Finding("config-missing-field", "warning", None,
                           f"config.json has no {key}: using transformers' {cls} default {value}, as transformers "
                           f"does; set it in config.json if the checkpoint differs"))
    missing = [k for k in SIZE_FIELDS if flat.get(k) is None and k not in refused]
    for key in missing:
        out.append(Finding("config-missing-field", "warning", None,
                           f"config.json has no {key}: {SIZE_FIELDS[key]} cannot be computed (shown as '?')"))
    sw = flat.get("sliding_window")
    if mem.valid_window(sw) and not mem.reads_sliding_window(flat):
        out.append(Finding("sliding-window-ignored", "info", None,
                           f"config.json: sliding_window {sw} is ignored: transformers' config for model_type "
                           f"{flat.get('model_type')!r} has no sliding-window attention, every layer attends to the "
                           f"whole context"))
    window = serving_window_cap(flat, fam)
    mpe = flat.get("max_position_embeddings")
    if window is not None:
        out.append(Finding("context-capped-at-window", "warning", None,
                           f"atomtool serves at most {window:,} tokens per sequence: sliding-window attention is "
                           f"not implemented (exact within the window)"
                           + (f"; the model's max_position_embeddings is {mpe:,}" if mem.valid_window(mpe) else "")))
    return out


def _name_schedule_defaults(found: list[Finding], flat: dict[str, Any]) -> list[Finding]:
    """``found`` with each ``missing-tensors`` message naming the MLP-schedule fields config.json leaves out
    whose transformers default decided which layers are MoE (:data:`atomtool.inspect.memory.SCHEDULE_DEFAULT_FIELDS`:
    ``first_k_dense_replace`` absent -> ``DeepseekV3Config``'s 3 dense layers), the likely cause."""
    from atomtool.inspect.hf_registry import config_class

    cls = config_class(str(flat.get("model_type", "")))
    named = [f"{k}={mem.schedule_default(flat, k)!r}" for k in mem.SCHEDULE_DEFAULT_FIELDS
             if k not in flat and mem.schedule_default(flat, k) is not None]
    if not named or cls is None:
        return found
    note = (f"; {', '.join(named)} is transformers' {cls.__name__} default (config.json does not set it): set it "
            f"in config.json if the checkpoint differs")
    return [Finding(f.code, f.severity, f.module, f.message + note) if f.code == "missing-tensors" else f
            for f in found]


def _unknown_quant_method(spec: QuantSpec | None, qcfg: dict[str, Any] | None) -> list[Finding]:
    """``quant-method-unknown`` (warning) when config.json's ``quantization_config`` names a ``quant_method``
    that neither atomtool (:func:`atomtool.inspect.quant.parse_quant_config` gives it no scheme) nor
    transformers knows (``AutoQuantizationConfig.from_dict`` raises "Unknown quantization type", so
    ``from_pretrained`` refuses the checkpoint): nothing it declares (``weight_block_size``, exclusions) is
    read, the modules are classified from the stored tensors alone."""
    if spec is None or spec.scheme is not None or qcfg is None:
        return []
    try:
        from transformers.quantizers.auto import AutoQuantizationConfig

        AutoQuantizationConfig.from_dict(dict(qcfg))
        return []
    except ImportError:
        return []
    except Exception as exc:  # transformers' refusal (ValueError) or a config it cannot parse
        why = one_line(exc)
    return [Finding("quant-method-unknown", "warning", None,
                    f"config.json: quantization_config.quant_method {spec.method!r} is known neither to atomtool "
                    f"nor to transformers (which refuses to load the checkpoint: {clip(why, 120)}); its other "
                    f"fields (weight_block_size, exclusions) are not read, modules are classified from the stored "
                    f"tensors alone")]


_QK_NORM = re.compile(r"^model\.layers\.\d+\.self_attn\.[qk]_norm\.weight$")


def unread_qk_norm_findings(tensors: dict[str, TensorInfo], flat: dict[str, Any], fam: Family | None
                            ) -> list[Finding]:
    """``unexpected-tensors`` (error) for per-head q/k RMSNorm weights (``self_attn.q_norm`` / ``k_norm``, a
    Qwen3 feature) stored in a ``llama``-family checkpoint whose model_type has none (``llama``, ``qwen2``,
    ``mistral``; e.g. a Qwen3 checkpoint whose config.json says ``model_type: llama``): transformers builds
    that model_type's model and leaves them unused, the engine's model has no such parameters and refuses
    them (the loader refuses with this message)."""
    mt = str(flat.get("model_type", ""))
    if fam is None or fam.name != "llama" or mt == "qwen3":
        return []
    names = sorted((n for n in tensors if _QK_NORM.match(n)), key=lambda n: (int(n.split(".")[2]), n))
    if not names:
        return []
    more = f" (+{len(names) - 2} more)" if len(names) > 2 else ""
    return [Finding("unexpected-tensors", "error", None,
                    f"{len(names)} q/k norm tensor(s) the model of model_type {mt!r} does not have: "
                    f"{', '.join(names[:2])}{more}; transformers leaves them unused, the engine refuses them. A "
                    f"Qwen3 checkpoint needs model_type \"qwen3\" in config.json")]


_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.[a-z_]+$")


def _bias_allowed(rel: str, flat: dict[str, Any]) -> bool:
    """Whether transformers' model (and the engine's) has a bias on linear module ``rel`` (``self_attn.q_proj``,
    ``mlp.down_proj``, ...) under this config: Llama-style ``attention_bias`` on q/k/v/o (and on MLA's
    projections), Qwen2's q/k/v bias (no o bias), ``mlp_bias`` on a dense MLP; nothing else (experts,
    routers)."""
    mt = str(flat.get("model_type", ""))
    att = bool(flat.get("attention_bias", False))
    if rel in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        return att or mt == "qwen2"
    if rel == "self_attn.o_proj":
        return att and mt != "qwen2"
    if rel in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return bool(flat.get("mlp_bias", False))
    return att and rel.startswith("self_attn.")  # MLA projections (their own finding refuses the feature)


def unused_tensor_findings(tensors: dict[str, TensorInfo], flat: dict[str, Any], fam: Family | None,
                           roles: list[str] | None) -> list[Finding]:
    """``unexpected-tensors`` (error) for tensors the model transformers builds from config.json has no place
    for: names outside the family's layout (:func:`atomtool.inspect.required.layout_entries`), and biases on
    linears the config builds without one (``attention_bias`` / ``mlp_bias`` false). transformers leaves them
    unused with a warning; the engine's loader refuses them with this message (it would otherwise have to
    guess). Not here: indexer tensors of layers the DSA schedule makes ``shared``
    (``dsa-shared-layer-with-indexer`` reports them; they are dropped, e.g. under an IndexCache override),
    layers past num_hidden_layers (``extra-layers``), a tied lm_head
    (``lm-head-with-tied-embeddings``), rotary ``inv_freq`` buffers, empty tensors (transformers' 0-row shared experts for
    ``n_shared_experts: 0``), quantization companions of known modules (classified with their module). [] for a family whose layout is not known here."""
    from atomtool.inspect.required import layout_entries

    if fam is None or not fam.servable:
        return []
    entries = layout_entries(flat, fam, roles)
    if entries is None:
        return []
    n = int(flat.get("num_hidden_layers") or 0)
    plain = {name for name, kind, _ in entries if kind != "module"}
    modules = {name: rel for name, kind, rel in entries if kind == "module"}
    tied = bool(flat.get("tie_word_embeddings", False))
    bad = []
    for t in tensors:
        m = DECODER_LAYER.match(t)
        if (t in plain or t.endswith("rotary_emb.inv_freq") or (m and int(m.group(1)) >= n)
                or (tied and t.startswith("lm_head.")) or 0 in tuple(tensors[t].shape)):  # empty: nothing to load
            continue
        module, _, suffix = t.rpartition(".")
        if _STACKED_EXPERTS.search(t):  # stacked expert tensors (gpt-oss style): classified as experts
            continue
        if m and ".self_attn.indexer." in t and roles is not None:  # an indexer the schedule shares or drops:
            continue  # dsa_findings reports it, convert and the loader drop it (IndexCache overrides)
        rel = modules.get(module)
        if rel is not None and (suffix != "bias" or _bias_allowed(rel, flat)):
            continue
        bad.append(t)
    if not bad:
        return []
    bad.sort(key=natural_key)
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    return [Finding("unexpected-tensors", "error", None,
                    f"{len(bad)} tensor(s) the {flat.get('model_type')!r} model built from config.json has no "
                    f"place for: {', '.join(bad[:3])}{more}; transformers leaves them unused, the engine refuses "
                    "them (a bias needs attention_bias / mlp_bias in config.json)")]


#: size fields the DSA schedule (:func:`atomtool.inspect.dsa.flatten_dsa_config`) is read from: the layer
#: count, and ``qk_rope_head_dim`` (the indexer's rope dim defaults to it)
DSA_SCHEDULE_SIZE_FIELDS = ("num_hidden_layers", "qk_rope_head_dim")


def _absent_schedule_fields(absent: list[str], model_type: str) -> list[Finding]:
    """``config-missing-field`` errors for :data:`DSA_SCHEDULE_SIZE_FIELDS` config.json leaves out, naming
    transformers' default for each as the engine's loader does
    (``atomtool.serve.model_config.check_size_fields``) -- rather than the schedule error the missing field
    causes (``got None``; an indexer rope dim from a default the user never wrote)."""
    from atomtool.inspect.hf_registry import config_class

    cls = config_class(model_type)
    out = []
    for key in absent:
        default = getattr(cls, key, None) if cls is not None else None
        named = f" (transformers' {cls.__name__} default: {default!r})" if default is not None else ""
        out.append(Finding("config-missing-field", "error", None,
                           f"config.json has no {key}{named}: the engine refuses a config without it (it does not "
                           f"assume a reference model's size for a field that shapes the weights), and the DSA "
                           f"schedule is read from it; add it to config.json"))
    return out


def build_report(
    source: str,
    config: dict[str, Any] | None,
    tensors: dict[str, TensorInfo],
    root: str | None = None,
    *,
    hf_quant_config: dict[str, Any] | None = None,
    gpu_memory_gb: float | None = None,
    extra_findings: list[Finding] | None = None,
    padding: dict[str, tuple[int, int]] | None = None,
    layout_sources: tuple[dict[str, TensorInfo], dict[str, str]] | None = None,
) -> InspectReport:
    """Classify a checkpoint from its config and header tensors (pure; no I/O).

    Args:
        source: what the user passed (directory or repo id), echoed in the report.
        config: config.json as a dict; None when the checkpoint has none (finding ``no-config``).
        tensors: every tensor from the safetensors headers, by name; empty for a config-only directory
            (schedule and sizes then come from the config, totals are estimated).
        root: local directory of the files, if any.
        hf_quant_config: a ModelOpt ``hf_quant_config.json`` (takes precedence, as in vLLM).
        gpu_memory_gb: when given, ``memory.max_context_tokens`` is the longest context whose KV cache fits
            next to the weights in this many GB (10^9 bytes).
        extra_findings: findings from reading the source (e.g. a stale index.json), appended.
        padding: an atomtool layout's zero rows added for FP8 block alignment, scheme -> (rows, elements)
            (:func:`layout_padding`); subtracted from the parameter totals (``totals["padding_rows"]``).
        layout_sources: an atomtool layout's source tensors inside its fused / stacked tensors, and where each
            lives (:func:`atomtool.inspect.shapes.layout_source_tensors`), so their shapes are checked too.
    Returns:
        the :class:`InspectReport` (modules in natural name order, findings sorted by severity).
    Raises:
        ConfigError: the DSA schedule fields are invalid (see :func:`atomtool.inspect.dsa.layer_roles`).
    """
    findings: list[Finding] = list(extra_findings or [])
    raw = config if isinstance(config, dict) else {}
    if config is None:
        findings.append(Finding("no-config", "warning", None,
                                f"{source}: no config.json; architecture and schedule unknown"))
    arch = _architecture(raw)
    tc = text_config(raw)
    model_type = str(raw.get("model_type") or tc.get("model_type") or "unknown")
    fam = family_for(arch)
    not_hf = not_hf_config_reason(raw) if config is not None else None
    if not_hf is not None:
        findings.append(Finding("not-hf-config", "error", None,
                                f"config.json: this is not a Hugging Face config.json (looks like {not_hf}); use "
                                f"the config.json of the Hugging Face repo"))
    elif fam is None and config is not None and is_transformers_architecture(arch):
        # a real model (Gemma2, Phi-3, ...) atomtool has no family for: inspect still sizes it from the
        # config, like the recognised-but-not-served families (gpt-oss); only serve cannot run it
        findings.append(Finding("architecture-not-servable", "warning", None,
                                f"{arch} (model_type {model_type}) is a transformers architecture that atomtool "
                                f"does not serve; inspect reports what it can from config.json and the headers; "
                                f"serve supports: {', '.join(supported_architectures())}"))
    elif fam is None and config is not None and arch == "unknown" and raw.get("architectures") not in (None, []):
        given = raw.get("architectures")
        hint = f"[{json.dumps(given)}]" if isinstance(given, str) else '["LlamaForCausalLM"]'
        findings.append(Finding("unknown-architecture", "error", None,
                                f"config.json: 'architectures' must be a list of model class names, got "
                                f"{type(given).__name__} {given!r}; write \"architectures\": {hint}"))
    elif fam is None and config is not None and arch == "unknown":
        findings.append(Finding("unknown-architecture", "error", None,
                                f"config.json has no 'architectures' (model_type {model_type!r}): name the model "
                                f"class, e.g. \"architectures\": [\"LlamaForCausalLM\"]; serve supports: "
                                f"{', '.join(supported_architectures())}"))
    elif fam is None and config is not None:
        findings.append(Finding("unknown-architecture", "error", None,
                                f"config.json: unknown architecture {arch!r} (neither atomtool nor transformers "
                                f"knows it); inspect reports what it can, serve "
                                f"supports: {', '.join(supported_architectures())}"))
    elif fam is not None and not fam.servable:
        findings.append(Finding("architecture-not-servable", "warning", None,
                                f"{arch} ({fam.name} family) is recognised by inspect, but serve does not run it "
                                f"yet; serve supports: {', '.join(supported_architectures())}"))
    flat: dict[str, Any] = dict(tc)
    schedule_ok = False
    schedule_unreadable = False  # the DSA schedule failed for want of a field: nothing is sized from it
    if config is not None and not_hf is None:  # a non-HF config's fields mean something else: not read
        try:
            flat = flatten_dsa_config(raw)
            schedule_ok = True
        except ConfigError as exc:  # report what can be known; the schedule itself is unusable
            absent = [k for k in engine_missing_size_fields(tc) if k in DSA_SCHEDULE_SIZE_FIELDS]
            if absent and fam is not None and fam.servable:  # the cause: a field left out (as generate says)
                findings.extend(_absent_schedule_fields(absent, model_type))
                schedule_unreadable = True
            else:
                findings.append(Finding("config-invalid", "error", None, str(exc)))
    bad_sizes = (invalid_size_fields(flat) + invalid_attention_fields(flat) + invalid_quantization_config(raw)
                 if config is not None and not_hf is None else [])  # no sizes computed from these
    findings.extend(bad_sizes)
    filled: list[tuple[str, Any, str]] = []
    engine_missing: list[str] = []
    if (config is not None and not_hf is None and not schedule_unreadable
            and not any(f.code == "config-invalid" for f in findings)):
        # transformers' config class (as the engine's loader builds it) fills absent sizes and refuses what
        # its strict field types refuse; our own messages above are more specific, so only when they passed
        flat = dict(flat)
        engine_missing = engine_missing_size_fields(tc)
        fields = tuple(dict.fromkeys((*SIZE_FIELDS, *WEIGHT_SIZE_FIELDS)))
        fields += () if mem.is_mla(flat) else ("num_key_value_heads",)
        filled = fill_transformers_defaults(flat, fields)
        invalid = transformers_config_findings(flat)
        # weights that disagree with the config as the engine completes it (first: they name the tensors)
        roles_now = list(flat["indexer_types"]) if schedule_ok and "indexer_types" in flat else None
        shapes = [] if invalid else config_shape_findings(tensors, flat, fam, filled, roles_now, layout_sources)
        findings.extend(invalid or shapes + head_count_findings(flat))
    dsa = None
    roles: list[str] | None = None
    if schedule_ok and is_dsa_config(flat) and "indexer_types" in flat:
        roles = list(flat["indexer_types"])
        dsa = DsaInfo(int(flat["index_topk"]), int(flat["index_n_heads"]), int(flat["index_head_dim"]),
                      int(flat["index_rope_dim"]), bool(flat["indexer_rope_interleave"]), roles)
        findings.extend(dsa_findings(tensors, roles))
    # no sizes computed from this config
    config_bad = schedule_unreadable or any(f.code == "config-invalid" for f in findings)
    if config is not None and not_hf is None and not config_bad:
        findings.extend(attention_notes(flat, fam, filled, engine_missing))
    if config is not None and not config_bad:
        missing = _name_schedule_defaults(missing_tensor_findings(tensors, flat, fam, roles), flat)
        findings.extend(missing)
        findings.extend(extra_layer_findings(tensors, flat, fam))
        qk = unread_qk_norm_findings(tensors, flat, fam)
        # a layer kind the config gets wrong shows as missing and unused tensors at once: the missing ones
        # (with the defaulted field named) are the message, as the loader's
        # (an atomtool layout holds fused / stacked names: the loader checks its manifest against the model)
        unused = [] if missing or layout_sources is not None else unused_tensor_findings(tensors, flat, fam, roles)
        findings.extend(qk or unused)
        findings.extend(tied_head_findings(tensors, flat))

    qcfg = raw.get("quantization_config") or tc.get("quantization_config")
    spec = parse_quant_config(qcfg if isinstance(qcfg, dict) else None, hf_quant_config)
    findings.extend(_unknown_quant_method(spec, qcfg if isinstance(qcfg, dict) else None))
    modules, other, qf = classify_modules(tensors, spec)
    findings.extend(qf)
    undeclared = [m for m in modules if m.treated_as == "quantized" and m.scheme != "unknown"] if spec is None else []
    if undeclared:  # transformers / vLLM read quantization from the config: without it they load the raw bytes
        blocks = sorted({tuple(m.block_size) for m in undeclared if m.block_size})
        findings.append(Finding(
            "quantized-without-config", "warning", undeclared[0].name,
            f"{len(undeclared)} module(s) are stored quantized ({', '.join(sorted({m.scheme for m in undeclared}))}, "
            f"e.g. {undeclared[0].name}) but config.json declares no quantization_config: transformers and vLLM "
            "would load them as plain weights (wrong outputs); atomtool reads their scales"
            + (f", with the block {', '.join(str(list(b)) for b in blocks)} inferred from the scale shapes"
               if blocks else "") + "; declare it in config.json"))
    findings.extend(fusion_findings({m.name: m for m in modules}, fam))
    model_dtype = mem.model_dtype_tag(flat, raw)
    keep = tuple(fam.fp32_keep) if fam is not None else ()
    findings.extend(dtype_findings(tensors, model_dtype, keep))
    act = unsupported_activation(fam, flat) if config is not None and not config_bad else None
    if act is not None:
        findings.append(Finding("activation-not-servable", "warning", None, act))
    features = unsupported_features(fam, tc) if config is not None and not config_bad else []
    for msg in features:  # the loader refuses the same config with the same words
        findings.append(Finding("feature-not-servable", "warning", None, f"config.json: {msg}"))
    unservable = unservable_modules(modules)
    if unservable:
        schemes = sorted({_scheme_label(m) for m in unservable})
        findings.append(Finding(
            "scheme-not-servable", "warning", unservable[0].name,
            f"{len(unservable)} module(s) stored as {', '.join(schemes)} (e.g. {unservable[0].name}); serve runs "
            f"{', '.join(sorted(SERVABLE_SCHEMES))} weights only, fp8_block as {SERVABLE_FP8_DTYPE} (convert "
            "cannot change that)"))
    # Config-only directory: no modules to judge, so the declared quantization decides (the same spec the
    # classification above used, hf_quant_config.json included).
    declared_bad = declared_unservable_schemes(spec) if not tensors else []
    if declared_bad:
        assert spec is not None
        findings.append(Finding(
            "scheme-not-servable", "warning", None,
            f"quant_method {spec.method!r} stores quantized weights as {', '.join(declared_bad)}, declared by "
            f"{'quantization_config' if isinstance(qcfg, dict) else 'hf_quant_config.json'}; no weights to check. serve runs {', '.join(sorted(SERVABLE_SCHEMES))} "
            f"weights only (convert cannot change that)"))

    if tensors:
        totals = _totals(modules, other, tensors)
        for scheme, (rows, elements) in (padding or {}).items():  # stored zeros, not parameters
            totals["parameters"] -= elements
            totals["padding_rows"] = totals.get("padding_rows", 0) + rows
            if scheme in totals["by_scheme"]:
                totals["by_scheme"][scheme]["parameters"] -= elements
        weights_bytes = totals["bytes"]
        config_mtp_bytes = 0
    else:
        est = mem.estimate_parameters(flat, roles) if config is not None and not config_bad else None
        per_param = mem.TAG_BYTES.get(model_dtype or "BF16", 2)
        nbytes = est * per_param if est is not None and spec is None else None
        trunk = mem.estimate_parameters({**flat, "num_nextn_predict_layers": 0}, roles) if nbytes else None
        config_mtp_bytes = (est - trunk) * per_param if trunk else 0
        totals = {"parameters": est, "bytes": nbytes, "by_dtype": {}, "by_scheme": {}, "estimated": True}
        weights_bytes = nbytes
        if config is not None:
            towers = [k for k in ("vision_config", "audio_config") if isinstance(raw.get(k), dict)]
            findings.append(Finding("config-only", "info", None,
                                    f"{source}: no safetensors weights; schedule and sizes come from config.json"
                                    + (" (no quantization_config: sizes assume the config's dtype; a quantization "
                                       "declared elsewhere, e.g. NVIDIA ModelOpt's hf_quant_config.json, or only "
                                       "in the tensors, is not seen without the weights)" if spec is None
                                       else " (quantized: weight bytes unknown)")
                                    + (f"; the estimate counts the language model only ({' and '.join(towers)}"
                                       " present: that tower is not counted)" if towers else "")))
    memory: dict[str, Any] = {"weights_bytes": weights_bytes, "kv_bytes_per_token": None}
    if config is not None and not config_bad and isinstance(flat.get("num_hidden_layers"), int):
        kv_tag = model_dtype if model_dtype in mem.TAG_BYTES else "BF16"
        if gpu_memory_gb is not None:  # a GPU question: serve's --dtype auto there is FP16 or else BF16
            kv_tag = "F16" if model_dtype == "F16" else "BF16"
        memory.update(mem.kv_cache_bytes(flat, roles, mem.TAG_BYTES[kv_tag]))
        memory["kv_dtype"] = kv_tag
        if gpu_memory_gb is not None:
            memory["gpu_memory_gb"] = gpu_memory_gb
            memory["max_context_tokens"] = None
            memory["weights_exceed_gpu_memory"] = None
            if weights_bytes is not None:
                # serve loads no layer past num_hidden_layers (MTP): their bytes stay on disk; float weights
                # arrive in serve's GPU dtype (a float32 checkpoint is served in BF16), FP8 weights, their
                # scales and the family's float32 keeps as stored
                n_layers = flat["num_hidden_layers"]

                def saved(name: str, t: TensorInfo) -> int:  # stored bytes serve does not hold on the GPU
                    if (m := DECODER_LAYER.match(name)) and int(m.group(1)) >= n_layers:
                        return t.nbytes
                    return t.nbytes - _served_bytes(name, t, kv_tag, keep)

                loaded = weights_bytes - sum(saved(name, t) for name, t in tensors.items())
                loaded -= config_mtp_bytes  # a config-only estimate counts the MTP layers' weights too
                memory["gpu_weights_bytes"] = loaded  # what the context below is computed from
                memory["weights_exceed_gpu_memory"] = loaded >= int(gpu_memory_gb * 1e9)
                memory["max_context_tokens"] = mem.max_context_tokens(
                    gpu_memory_gb, loaded, memory["kv_bytes_per_token"],
                    memory["swa_layers"] * memory["swa_bytes_per_token_per_layer"], memory["sliding_window"])
                cap = serving_window_cap(flat, fam)
                if cap is not None and not memory["weights_exceed_gpu_memory"]:
                    # the engine serves at most the window per sequence (context-capped-at-window)
                    fit = memory["max_context_tokens"]
                    memory["max_context_tokens"] = cap if fit is None else min(fit, cap)
                    memory["context_capped_at_window"] = cap
        mpe = flat.get("max_position_embeddings")
        memory["max_position_embeddings"] = mpe if isinstance(mpe, int) else None

    # one finding per fact: two checks that refuse the same field say it once (index_topk: 0 is refused both
    # by the DSA schedule and by the size-field check, in the same words)
    findings = list(dict.fromkeys(findings))
    findings.sort(key=lambda f: SEVERITY_ORDER.get(f.severity, 3))
    return InspectReport(
        source=source, architecture=arch, model_type=model_type, family=fam.name if fam else "unknown",
        # any error finding (invalid config, missing tensors, broken layout, ...) means serve refuses it
        servable=bool(fam and fam.servable) and not unservable and not declared_bad and act is None
        and not features
        and not any(f.severity == "error" for f in findings),
        config=raw, config_flat=flat,
        dsa=dsa, tensors=dict(tensors),
        modules=modules, other_tensors=other, totals=totals, memory=memory, findings=findings,
        root=None if root is None else str(root),
        quant_method=spec.method if spec is not None else None,
        quant_scheme=spec.scheme if spec is not None else None,
    )


def inspect_checkpoint(source: str, revision: str | None = None, *, gpu_memory_gb: float | None = None
                       ) -> InspectReport:
    """Open ``source`` (local directory or Hub repo id) through :class:`CheckpointSource` (config.json and
    safetensors headers only, never tensor data) and classify it with :func:`build_report`.

    Raises:
        SourceError, ConfigError, HeaderError: unreadable source, bad config.json, hostile header.
    """
    from atomtool.inspect.source import CheckpointSource

    src = CheckpointSource.open(source, revision)
    # ModelOpt's hf_quant_config.json (nvidia/* NVFP4 releases ship it instead of quantization_config).
    # Read locally always; remotely only for modelopt configs (keeps requests at config + index + headers).
    hf_quant = None
    extra = [Finding("source-warning", "warning", None, w) for w in getattr(src, "warnings", [])]
    ignored = getattr(src, "ignored_weights", [])
    if ignored:
        listed = ", ".join(ignored[:3]) + (f" (+{len(ignored) - 3} more)" if len(ignored) > 3 else "")
        extra.append(Finding("pickle-weights-ignored", "warning", None,
                             f"{source}: weights in {listed} were NOT read: pickle checkpoints (torch.save / .bin / "
                             f".pt) are not supported, only safetensors; convert them to *.safetensors first "
                             f"(e.g. safetensors.torch.save_file); everything below comes from config.json"))
    if src.config is not None:
        q = text_config(src.config).get("quantization_config") or src.config.get("quantization_config")
        modelopt = isinstance(q, dict) and q.get("quant_method") == "modelopt"
        if src.root is not None or modelopt:
            try:
                hf_quant = src.read_json("hf_quant_config.json")
            except SourceError:  # a Hub repo cached file by file, network down: not needed unless modelopt
                if modelopt:
                    raise
                # whether the repo has the file at all is unknown offline (most repos never had one):
                # say nothing about it; the stored dtypes still classify every module
    padding = layout_sources = None
    if src.root is not None and not src.is_remote:
        try:
            specs = layout_specs(src.root)
        except LayoutError as exc:  # generate/verify refuse this directory: say so, with convert's message
            extra.append(Finding("layout-manifest-invalid", "error", None,
                                 f"{exc}; generate and verify refuse this layout (re-run atomtool convert)"))
        else:
            if specs is not None:
                padding, layout_sources = layout_padding(specs), layout_source_tensors(specs)
    # the index is authoritative (transformers loads by it): tensors only a shard header declares are not
    # part of the model (the source-warning above names them)
    unlisted = set(src.unlisted)
    tensors = {n: t for n, t in src.tensors.items() if n not in unlisted} if unlisted else src.tensors
    report = build_report(source, src.config, tensors, src.root, hf_quant_config=hf_quant,
                          gpu_memory_gb=gpu_memory_gb, extra_findings=extra, padding=padding,
                          layout_sources=layout_sources)
    report.layout = layout_sources is not None
    return report


def layout_specs(root: Any) -> dict[str, Any] | None:
    """An atomtool layout's tensor specs by name (``OutputTensor``, from its ``atomtool.json`` manifest through
    :func:`atomtool.convert.layout.load_layout_specs`), or None when ``root`` is not a layout.

    Raises LayoutError (an AtomtoolError) when ``root`` has an ``atomtool.json`` that convert's own reader
    refuses: not JSON, wrong format, unsupported version, malformed tensor entries.
    """
    from pathlib import Path

    from atomtool.convert.layout import MANIFEST_NAME, load_layout_specs

    if not (Path(root) / MANIFEST_NAME).exists():
        return None
    return load_layout_specs(root)


def layout_padding(specs: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Zero rows ``atomtool convert`` appended to FP8 block parts (so each part starts on a block
    boundary), from the layout's tensor specs (:func:`layout_specs`): scheme -> (padding rows, padding
    elements of the weights)."""
    out: dict[str, tuple[int, int]] = {}
    for name, spec in specs.items():
        rows = sum(p.pad_rows for p in spec.parts)
        if rows and name.endswith(".weight") and len(spec.shape) >= 2:  # scales are not parameters
            r, e = out.get(spec.scheme, (0, 0))
            out[spec.scheme] = (r + rows, e + rows * spec.shape[-1])
    return out


__all__ = ["build_report", "inspect_checkpoint", "dsa_findings", "QUANTIZED_SCHEMES", "DENSE"]

"""Per-linear-module storage scheme from safetensors headers, reconciled with ``quantization_config``.

Implements research/quant.md §3: group tensors into modules by role suffix (§3.2), decide the STORED
scheme per module from dtypes and shapes alone (§3.3), compute what ``quantization_config`` DECLARES with
each producer's own exclusion semantics (§2.7, §3.5), and emit findings (§3.6). The verdict
``treated_as`` follows storage: a module stored in a plain float dtype is unquantized whatever the config
says (the rule of ATOM PR #2776); everything downstream (convert, serve) reads these verdicts.

Pure functions over :class:`~atomtool.inspect.types.TensorInfo`; no I/O.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from atomtool.errors import ConfigError
from atomtool.inspect.families import Family
from atomtool.inspect.types import FLOAT_DTYPES, Finding, ModuleInfo, TensorInfo

# ---------------------------------------------------------------------------------------------------
# §3.2 roles

#: dotted role suffixes (``<module>.<role>``), longest first so ``weight.absmax`` wins over ``weight``.
_DOTTED_ROLES = tuple(sorted((
    "weight", "qweight", "weight_packed",
    "weight_scale", "weight_scale_inv", "scale", "scales", "weight_scale_2", "weight_global_scale",
    "weight.absmax", "weight.SCB",
    "input_scale", "input_global_scale", "weight_zero_point", "qzeros", "g_idx", "weight_g_idx",
    "weight_shape", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
    "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4", "bias",
    "output_scale",
), key=len, reverse=True))
#: gpt-oss stacked-expert suffixes (``mlp.experts.gate_up_proj_blocks``)
_UNDERSCORE_ROLES = ("blocks", "scales", "bias")
WEIGHT_ROLES = frozenset({"weight", "qweight", "weight_packed", "blocks"})
#: roles that carry a weight's quantization (their presence makes a float weight suspicious)
SCALE_ROLES = frozenset({
    "weight_scale", "weight_scale_inv", "scale", "scales", "weight_scale_2", "weight_global_scale",
    "weight.absmax", "weight.SCB", "qzeros", "g_idx", "weight_g_idx", "weight_zero_point", "weight_shape",
    "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
    "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4", "input_scale",
    "input_global_scale",
})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
FLOAT_SCHEME = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
QUANTIZED_SCHEMES = frozenset({"fp8_block", "fp8_tensor", "fp8_channel", "mxfp8", "mxfp4", "nvfp4",
                               "int4_pack", "int8", "awq", "gptq", "bnb4", "unknown"})
_EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "embeddings", "embed")
#: module-name endings producers commonly leave in float (Q1 is only ``info`` for them, quant.md §3.6)
COMMONLY_FLOAT = ("lm_head", "weights_proj", "eh_proj", "shared_head.head", "mlp.gate", "shared_expert_gate",
                  "in_proj_ba", "router")
_LAYER_RE = re.compile(r"^(.*?\blayers\.(\d+)\.)(.*)$")


_ROLE_SET = frozenset(_DOTTED_ROLES)


def split_role(name: str) -> tuple[str, str] | None:
    """Split a tensor name into ``(module, role)`` by the longest known role suffix, or None."""
    parts = name.rsplit(".", 3)
    for k in (3, 2, 1):  # roles have up to 3 dotted components (weight.quant_state.bitsandbytes__nf4)
        if len(parts) > k:
            role = ".".join(parts[-k:])
            if role in _ROLE_SET:
                return name[: -len(role) - 1], role
    for role in _UNDERSCORE_ROLES:
        if name.endswith("_" + role) and "." in name:
            return name[: -len(role) - 1], role
    return None


def is_router(module: str) -> bool:
    """MoE router (``mlp.gate`` / ``mlp.router``): a linear that quantization schemes never target."""
    return module.endswith((".mlp.gate", ".mlp.router", ".block_sparse_moe.gate", "shared_expert_gate"))


def is_embedding(module: str) -> bool:
    """Token embedding tables (``model.embed_tokens``, ``transformer.wte``, ...)."""
    return module.rsplit(".", 1)[-1] in _EMBEDDING_NAMES


@dataclass
class Grouping:
    """Result of :func:`group_modules`: module -> role -> tensor, plus names belonging to no linear module."""

    modules: dict[str, dict[str, TensorInfo]]
    other: list[str]
    orphans: dict[str, dict[str, TensorInfo]]


def group_modules(tensors: dict[str, TensorInfo]) -> Grouping:
    """Group tensors into linear modules (a weight role plus companions), research/quant.md §3.2.

    A ``.weight`` of rank < 2 (norms), embedding tables and ``.scale`` without a sibling ``.weight`` are
    not linear modules; a module holding only companions (scale/zero/input_scale) is an orphan.
    """
    by_module: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    other: list[str] = []
    for name, t in tensors.items():
        split = split_role(name)
        if split is None:
            other.append(name)
            continue
        by_module[split[0]][split[1]] = t
    modules: dict[str, dict[str, TensorInfo]] = {}
    orphans: dict[str, dict[str, TensorInfo]] = {}
    for module, roles in by_module.items():
        weight = roles.get("weight")
        has_weight = any(r in roles for r in WEIGHT_ROLES)
        if "scale" in roles and weight is None:  # ambiguity rule: a norm parameter named ``scale``
            other.append(f"{module}.scale")
            roles = {r: t for r, t in roles.items() if r != "scale"}
        if not has_weight:
            names = [t.name for t in roles.values()]
            if any(r in SCALE_ROLES for r in roles):
                orphans[module] = roles
            other.extend(names)
            continue
        if (weight is not None and len(weight.shape) < 2 and weight.dtype in FLOAT_DTYPES) or is_embedding(module):
            other.extend(t.name for t in roles.values())
            continue
        modules[module] = roles
    return Grouping(modules, sorted(other), orphans)


# ---------------------------------------------------------------------------------------------------
# quantization_config: what the producer declares


@dataclass
class QuantSpec:
    """The parts of ``quantization_config`` classification needs (one global scheme + exclusion rules).

    method: ``quant_method``; scheme: the scheme quantized modules are expected to be stored in (None when
    the config does not say); block: fp8 ``weight_block_size``; group_size: int4/fp4 group; bits: packed
    bits; exclusions: the raw exclusion entries (for Q9); raw: the dict. schemes: every scheme the config
    allows (several compressed-tensors config_groups); per_module: ModelOpt ``MIXED_PRECISION``
    ``quantized_layers`` (module -> scheme), None otherwise.
    """

    method: str
    scheme: str | None
    block: tuple[int, int] | None
    group_size: int | None
    bits: int
    exclusions: list[str]
    raw: dict[str, Any]
    schemes: frozenset[str] = frozenset()
    per_module: dict[str, str] | None = None


def parse_quant_config(qcfg: dict[str, Any] | None, hf_quant_config: dict[str, Any] | None = None) -> QuantSpec | None:
    """Read ``quantization_config`` (or a ModelOpt ``hf_quant_config.json``, which vLLM prefers) into a
    :class:`QuantSpec`. Returns None when neither is present.

    Raises:
        ConfigError: a field has the wrong type (e.g. ``weight_block_size: [128, "x"]``).
    """
    try:
        return _parse_quant_config(qcfg, hf_quant_config)
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError) as exc:  # (int(inf))
        src = "hf_quant_config.json" if hf_quant_config else "config.json: quantization_config"
        raise ConfigError(f"{src}: malformed ({type(exc).__name__}: {exc})") from None


def _parse_quant_config(qcfg: dict[str, Any] | None, hf_quant_config: dict[str, Any] | None) -> QuantSpec | None:
    if hf_quant_config and isinstance(hf_quant_config.get("quantization"), dict):
        q = hf_quant_config["quantization"]
        qcfg = {"quant_method": "modelopt", **q}
    if not isinstance(qcfg, dict) or not qcfg:
        return None
    method = str(qcfg.get("quant_method", "unknown")).lower()
    block = None
    group = None
    bits = int(qcfg.get("bits") or 4)
    scheme: str | None = None
    excl: list[str] = []
    extra: set[str] = set()
    per_module: dict[str, str] | None = None
    if method in ("fp8", "fbgemm_fp8"):
        wbs = qcfg.get("weight_block_size")
        if wbs is not None:  # "128", 128 or [128] is malformed (transformers refuses it), not per-tensor FP8
            block = _block(wbs, "weight_block_size")
            scheme = "fp8_block"
        else:
            scheme = "fp8_channel" if method == "fbgemm_fp8" else "fp8_tensor"
        excl = _exclusions(qcfg, "ignored_layers", "modules_to_not_convert")
    elif method == "compressed-tensors":
        groups = qcfg.get("config_groups") or {}
        for g in groups.values():
            if not (isinstance(g, dict) and isinstance(g.get("weights"), dict)):
                continue
            w = g["weights"]
            g_scheme = _ct_scheme(g.get("format") or qcfg.get("format"), w)
            if scheme is None:  # the first group gives the headline facts
                scheme = g_scheme
                bits = int(w.get("num_bits") or 8)
                group = w.get("group_size")
                if w.get("block_structure"):
                    block = _block(w["block_structure"], "block_structure")
            if g_scheme:
                extra.add(g_scheme)
        excl = _exclusions(qcfg, "ignore")
    elif method == "modelopt":
        algo = str(qcfg.get("quant_algo", "")).upper()
        scheme = _MODELOPT_SCHEMES.get(algo)
        group = qcfg.get("group_size") or (16 if algo == "NVFP4" else None)
        excl = _exclusions(qcfg, "exclude_modules", "ignore")
        layers = qcfg.get("quantized_layers")
        if algo == "MIXED_PRECISION" and isinstance(layers, dict):
            per_module = {str(k): _MODELOPT_SCHEMES.get(str(v.get("quant_algo", "")).upper(), "unknown")
                          for k, v in layers.items() if isinstance(v, dict)}
            extra.update(per_module.values())
    elif method == "mxfp8":  # MiniMax-M3-MXFP8: {weight_block_size [1, 32], ignored_layers}
        scheme, group = "mxfp8", 32
        excl = _exclusions(qcfg, "ignored_layers", "modules_to_not_convert")
    elif method == "mxfp4":
        scheme, group = "mxfp4", 32
        excl = _exclusions(qcfg, "modules_to_not_convert")
    elif method in ("awq", "gptq"):
        scheme = method
        group = qcfg.get("group_size")
        excl = _exclusions(qcfg, "modules_to_not_convert")
        if method == "gptq":
            excl += [k for k in (qcfg.get("dynamic") or {}) if str(k).startswith("-:")]
    elif method == "bitsandbytes":
        scheme = "bnb4" if qcfg.get("load_in_4bit") else "int8"
        excl = _exclusions(qcfg, "llm_int8_skip_modules")
    elif method == "quark":
        wq = ((qcfg.get("global_quant_config") or {}).get("weight") or {})
        dtype = str(wq.get("dtype", ""))
        scheme = {"fp4": "mxfp4", "fp8_e4m3": "fp8_tensor", "int4": "int4_pack", "int8": "int8"}.get(dtype)
        group = wq.get("group_size")
        excl = _exclusions(qcfg, "exclude")
    if scheme:
        extra.add(scheme)
    return QuantSpec(method, scheme, block, group if isinstance(group, int) else None, bits,
                     [str(e) for e in excl], qcfg, frozenset(extra), per_module)


def _exclusions(qcfg: dict[str, Any], *keys: str) -> list[Any]:
    """The exclusion list under the first of ``keys`` that is set (``modules_to_not_convert``, ``ignore``, ...);
    a string is a ValueError: read as a list it would be single characters, each matching nearly every module."""
    for key in keys:
        v = qcfg.get(key)
        if v:
            if isinstance(v, str):
                raise ValueError(f"{key} must be a list of module names, got the string {v!r}")
            return list(v)
    return []


def _block(v: Any, key: str) -> tuple[int, int]:
    """A (rows, cols) quantization block: two positive integers (0, False, inf or 1.5 raise ValueError)."""
    if not (isinstance(v, list) and len(v) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
        raise ValueError(f"{key} must be two positive integers, got {v!r}")
    return (v[0], v[1])


_MODELOPT_SCHEMES = {"NVFP4": "nvfp4", "FP8": "fp8_tensor", "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel",
                     "FP8_PB_WO": "fp8_block", "MXFP8": "mxfp8", "W4A16_AWQ": "awq"}


def _ct_scheme(fmt: Any, weights: dict[str, Any]) -> str | None:
    """Storage scheme of one compressed-tensors config group (its ``format`` and ``weights`` args)."""
    if fmt == "float-quantized":
        return {"tensor": "fp8_tensor", "channel": "fp8_channel", "block": "fp8_block"}.get(
            weights.get("strategy"), "fp8_channel")
    if fmt == "pack-quantized":
        return "int4_pack" if (weights.get("num_bits") or 4) == 4 else "int8"
    return {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4", "mxfp8-quantized": "mxfp8",
            "int-quantized": "int8", "naive-quantized": "int8"}.get(fmt)


def _glm_alias(entry: str) -> str:
    # GLM-5 FP8 lists ``...self_attn.indexers_proj``; no tensor has that name, it means indexer.weights_proj
    # (ATOM ``quant_exclude_name_mapping``; research/dsa.md §3).
    return entry.replace("indexers_proj", "indexer.weights_proj")


def exclusion_matches(spec: QuantSpec, entry: str, name: str) -> bool:
    """Does exclusion ``entry`` cover module/tensor ``name`` under the PRODUCER's semantics (quant.md §2.7)?

    fp8 / awq / bitsandbytes (HF ``modules_to_not_convert``): substring; compressed-tensors / quark
    ``ignore``: exact or ``re:`` with ``re.match`` (quark also fnmatch); modelopt ``exclude_modules``:
    fnmatch globs (``X*`` also as ``X`` and ``X.*``), exact, legacy substring; gpt-oss mxfp4: fnmatch on the
    module and its children; gptq ``dynamic`` ``-:`` keys: ``re.match``.
    """
    return _entry_matcher(spec.method, entry)(name)


def _glob(pattern: str) -> Callable[[str], bool]:
    rx = re.compile(fnmatch.translate(pattern))
    return lambda n: rx.match(n) is not None


def _regex(pattern: str, fallback_substring: bool = False) -> Callable[[str], bool]:
    try:
        rx = re.compile(pattern)
    except re.error:
        return (lambda n: pattern in n) if fallback_substring else (lambda n: False)
    return lambda n: rx.match(n) is not None


def _entry_matcher(method: str, entry: str) -> Callable[[str], bool]:
    """Compile one exclusion entry into a predicate over names (see :func:`exclusion_matches`)."""
    if method in ("fp8", "fbgemm_fp8", "awq", "bitsandbytes"):
        lit = _glm_alias(entry)
        return lambda n: lit in n
    wild = any(c in entry for c in "*?[")
    if method in ("compressed-tensors", "quark"):
        if entry.startswith("re:"):
            return _regex(entry[3:])
        if method == "quark" and wild:
            g = _glob(entry)
            return lambda n: n == entry or g(n)
        return lambda n: n == entry
    if method == "modelopt":
        globs = [_glob(entry), _glob(entry + ".*")] + ([_glob(entry[:-1])] if entry.endswith("*") else [])
        if wild:
            return lambda n: n == entry or any(g(n) for g in globs)
        return lambda n: entry in n  # exact and legacy substring
    if method == "mxfp8":  # vLLM is_layer_skipped on ignored_layers: the module or anything under it
        return lambda n: n == entry or n.startswith(entry + ".")
    if method == "mxfp4":
        g1, g2 = _glob(entry), _glob(entry + ".*")
        return lambda n: n == entry or g1(n) or g2(n)
    if method == "gptq":
        return _regex(entry[2:] if entry.startswith("-:") else entry, fallback_substring=True)
    return lambda n: n == entry


_LAYER_LIT = re.compile(r"layers\.(\d+)\.")


class ExclusionIndex:
    """Exclusion entries compiled once and bucketed by the literal ``layers.N.`` they contain, so that
    matching ~100k tensor names against ~600 entries (GLM-5 FP8 lists every norm and router) stays linear:
    an entry whose literal text (alias applied, not a regex) contains ``layers.N.`` can only match names
    containing it."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        self.generic: list[tuple[str, Callable[[str], bool]]] = []
        self.by_layer: dict[str, list[tuple[str, Callable[[str], bool]]]] = defaultdict(list)
        self._cache: dict[tuple[str, ...], list[tuple[str, Callable[[str], bool]]]] = {}
        substring = spec.method in ("fp8", "fbgemm_fp8", "awq", "bitsandbytes")
        for e in spec.exclusions:
            item = (e, _entry_matcher(spec.method, e))
            literal = _glm_alias(e) if substring else e
            m = None if e.startswith(("re:", "-:", "+:")) or spec.method == "gptq" else _LAYER_LIT.search(literal)
            if m:
                self.by_layer[m.group(1)].append(item)
            else:
                self.generic.append(item)

    def candidates(self, name: str) -> list[tuple[str, Callable[[str], bool]]]:
        """(entry, predicate) pairs that could match ``name``."""
        key = tuple(sorted(set(_LAYER_LIT.findall(name))))
        out = self._cache.get(key)
        if out is None:
            out = list(self.generic)
            for n in key:
                out.extend(self.by_layer.get(n, ()))
            self._cache[key] = out
        return out

    def excluded(self, name: str) -> bool:
        return any(match(name) for _, match in self.candidates(name))

    def matched(self, names: Iterable[str]) -> set[str]:
        """Entries matching at least one of ``names``."""
        hit: set[str] = set()
        for n in names:
            for e, match in self.candidates(n):
                if e not in hit and match(n):
                    hit.add(e)
        return hit


def exclusion_index(spec: QuantSpec) -> ExclusionIndex:
    """The (cached) :class:`ExclusionIndex` of ``spec``."""
    idx = spec.__dict__.get("_index")
    if idx is None:
        idx = spec.__dict__["_index"] = ExclusionIndex(spec)
    return idx


_EXPERT_RE = re.compile(r"(^|\.)experts(\.|$)")


def declared_quantized(spec: QuantSpec | None, module: str) -> bool:
    """Whether ``quantization_config`` would quantize linear ``module`` (checkpoint name), quant.md §3.5.

    Scope rules: routers are never targeted; embeddings and ``lm_head`` only where the method targets
    them (compressed-tensors ``Linear`` and ModelOpt include lm_head unless excluded; HF fp8/awq/gptq/bnb
    keep it); gpt-oss ``mxfp4`` quantizes only the routed experts.
    """
    if spec is None or is_router(module) or is_embedding(module):
        return False
    m = spec.method
    if module.endswith("lm_head") and m not in ("compressed-tensors", "modelopt", "quark"):
        return False
    if m == "mxfp4" and not _EXPERT_RE.search(module):
        return False
    if spec.per_module is not None and module not in spec.per_module:
        return False
    if m == "gptq" and spec.raw.get("modules_in_block_to_quantize"):
        wanted = [x for grp in spec.raw["modules_in_block_to_quantize"] for x in (grp if isinstance(grp, list) else [grp])]
        if not any(w in module for w in wanted):
            return False
    if m == "compressed-tensors":
        targets = [t for g in (spec.raw.get("config_groups") or {}).values() if isinstance(g, dict)
                   for t in (g.get("targets") or [])]
        if targets and not any(t == "Linear" or exclusion_matches(spec, t, module) for t in targets):
            return False
    return not exclusion_index(spec).excluded(module)


# ---------------------------------------------------------------------------------------------------
# §3.3 stored scheme


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _infer_block(n: int, s: int) -> int | None:
    """Smallest power-of-two block b with ceil(n / b) == s (None if none exists)."""
    b = 1
    while b <= max(n, 1) * 2:
        if _ceil_div(n, b) == s:
            return b
        b *= 2
    return None


def classify_module(name: str, roles: dict[str, TensorInfo], spec: QuantSpec | None
                    ) -> tuple[ModuleInfo, list[Finding]]:
    """Decide one module's stored scheme and logical shape from its tensors (quant.md §3.3).

    Returns the :class:`ModuleInfo` (``declared_quantized`` and ``treated_as`` filled) and findings:
    fp8-without-scale (error), scale-shape-mismatch (error), float-with-companions (warning),
    unknown-scheme (error), config-quant-stored-float (warning/info), excluded-but-stored-quantized
    (warning), scheme-mismatch (error).
    """
    findings: list[Finding] = []
    w = roles.get("weight")
    scale = roles.get("weight_scale_inv") or roles.get("weight_scale") or roles.get("scale")
    scheme = "unknown"
    shape: tuple[int, ...] = w.shape if w is not None else ()
    dtype = w.dtype if w is not None else ""
    block: tuple[int, ...] | None = None
    companions = sorted(r for r in roles if r in SCALE_ROLES)

    def err(code: str, msg: str, sev: str = "error") -> None:
        findings.append(Finding(code, sev, name, f"{name}: {msg}"))

    if w is not None and w.dtype in FLOAT_DTYPES:
        scheme = FLOAT_SCHEME[w.dtype]
        if companions:
            err("float-with-companions", f"stored {w.dtype} {list(w.shape)} but has quantization companions "
                f"{companions}; treated as unquantized ({w.dtype}), companions ignored", "warning")
    elif w is not None and w.dtype in FP8_DTYPES and len(w.shape) >= 2:
        n, k = w.shape[-2], w.shape[-1]
        if scale is None:
            err("fp8-without-scale", f"stored {w.dtype} {list(w.shape)} without weight_scale_inv/weight_scale; "
                "raw FP8 values cannot be used as a weight")
        elif scale.dtype in ("U8", "F8_E8M0") and scale.shape[-2:] == (n, _ceil_div(k, 32)):
            scheme, block = "mxfp8", (1, 32)
        elif (len(scale.shape) >= 2 and spec is not None and spec.block
              and tuple(scale.shape[-2:]) == (_ceil_div(n, spec.block[0]), _ceil_div(k, spec.block[1]))):
            # A weight no larger than one declared block has a [1, 1] block-scale grid: still fp8_block.
            scheme, block = "fp8_block", spec.block
        elif scale.numel == 1:
            scheme = "fp8_tensor"
        elif tuple(scale.shape[-2:]) == (n, 1) or tuple(scale.shape) == (n,):
            scheme = "fp8_channel"
        elif len(scale.shape) >= 2:
            scheme = "fp8_block"
            s0, s1 = scale.shape[-2], scale.shape[-1]
            want = spec.block if spec is not None and spec.block else None
            if want is not None:
                block = want
                if (s0, s1) != (_ceil_div(n, want[0]), _ceil_div(k, want[1])):
                    err("scale-shape-mismatch", f"scale {list(scale.shape)} does not fit weight {list(w.shape)} "
                        f"with block {list(want)} (expected {[_ceil_div(n, want[0]), _ceil_div(k, want[1])]})")
            else:
                b0, b1 = _infer_block(n, s0), _infer_block(k, s1)
                if b0 is None or b1 is None:
                    err("scale-shape-mismatch", f"scale {list(scale.shape)} for weight {list(w.shape)} fits no "
                        "power-of-two block, and no quantization_config weight_block_size declares the block "
                        "(the block size cannot be inferred; declare it in config.json)")
                else:
                    block = (b0, b1)
        else:
            err("scale-shape-mismatch", f"scale {list(scale.shape)} does not fit FP8 weight {list(w.shape)}")
    elif w is not None and w.dtype == "U8" and len(w.shape) == 2 and scale is not None:
        n, k = w.shape[0], w.shape[1] * 2
        shape = (n, k)
        if scale.dtype in FP8_DTYPES and ("weight_scale_2" in roles or "weight_global_scale" in roles):
            scheme, block = "nvfp4", (1, 16)
            if tuple(scale.shape) != (n, _ceil_div(k, 16)):
                err("scale-shape-mismatch", f"NVFP4 scale {list(scale.shape)} != [{n}, {_ceil_div(k, 16)}] "
                    f"(one e4m3 scale per 16 of K={k})")
        elif scale.dtype in ("U8", "F8_E8M0"):
            scheme, block = "mxfp4", (1, 32)
            if tuple(scale.shape) != (n, _ceil_div(k, 32)):
                err("scale-shape-mismatch", f"MXFP4 scale {list(scale.shape)} != [{n}, {_ceil_div(k, 32)}]")
    elif w is not None and w.dtype == "F4" and scale is not None:
        scheme, block = "mxfp4", (1, 32)
    elif w is not None and w.dtype == "I8":
        if "weight.SCB" in roles or scale is not None:
            scheme = "int8"
    elif w is not None and w.dtype == "U8" and "weight.absmax" in roles:
        scheme = "bnb4"
    elif "blocks" in roles and "scales" in roles:
        b, s = roles["blocks"], roles["scales"]
        dtype = b.dtype
        if len(b.shape) >= 3 and b.shape[-1] == 16:
            shape = (*b.shape[:-2], b.shape[-2] * 32)
            scheme, block = "mxfp4", (1, 32)
            if tuple(s.shape) != tuple(b.shape[:-1]):
                err("scale-shape-mismatch", f"MXFP4 scales {list(s.shape)} != blocks {list(b.shape)} without the last dim")
    elif "qweight" in roles and "scales" in roles:
        qw, sc = roles["qweight"], roles["scales"]
        dtype = qw.dtype
        pack = 32 // (spec.bits if spec is not None and spec.method in ("awq", "gptq") else 4)
        method = spec.method if spec is not None and spec.method in ("awq", "gptq") else None
        if method is None:  # no config: shape rule of quant.md §3.3
            method = "gptq" if sc.shape[-1] == qw.shape[-1] else "awq"
        if method == "awq":
            k, n = qw.shape[0], qw.shape[1] * pack
        else:
            k, n = qw.shape[0] * pack, qw.shape[1]
        shape, scheme = (n, k), method
        groups = sc.shape[0]
        gs = spec.group_size if spec is not None and spec.method == method else None
        want = groups if gs is None else 1 if gs <= 0 else _ceil_div(k, gs)
        block = (1, k // groups if groups else 0)
        if sc.shape[-1] != n or groups != want:
            err("scale-shape-mismatch", f"{method} scales {list(sc.shape)} do not fit logical [{n}, {k}] with "
                f"group_size {gs}")
    elif "weight_packed" in roles:
        wp = roles["weight_packed"]
        dtype = wp.dtype
        bits = spec.bits if spec is not None and spec.method == "compressed-tensors" else 4
        n = wp.shape[0]
        if wp.dtype == "U8":  # CT nvfp4/mxfp4 pack: two e2m1 per byte
            k = wp.shape[1] * 2
            if scale is not None and scale.dtype in FP8_DTYPES:
                scheme, block = "nvfp4", (1, 16)
            else:
                scheme, block = "mxfp4", (1, 32)
        else:
            k = wp.shape[1] * (32 // bits) if len(wp.shape) == 2 else 0
            scheme = "int4_pack" if bits == 4 else "int8" if bits == 8 else "int4_pack"
            if scale is not None and len(scale.shape) == 2 and scale.shape[1]:
                block = (1, k // scale.shape[1])
                gs = spec.group_size if spec is not None else None
                if scale.shape[0] != n or (gs and scale.shape[1] != _ceil_div(k, gs)):
                    err("scale-shape-mismatch", f"weight_scale {list(scale.shape)} does not fit packed weight "
                        f"{list(wp.shape)} (logical [{n}, {k}], group_size {gs})")
        shape = (n, k)
    if scheme == "unknown" and not any(f.code == "fp8-without-scale" for f in findings):
        desc = ", ".join(f"{r} {t.dtype} {list(t.shape)}" for r, t in sorted(roles.items()))
        err("unknown-scheme", f"storage not recognised ({desc})")

    declared = declared_quantized(spec, name)
    is_float = scheme in ("bf16", "fp16", "fp32", "fp64")
    treated = "unquantized" if is_float else "quantized"
    if declared and is_float and not companions:
        commonly = name.endswith(COMMONLY_FLOAT) or ".indexer." in name
        what = _claim(spec)
        err("config-quant-stored-float",
            f"stored {dtype} {list(shape)}, no scale; quantization_config ({what}) would quantize it -> treated "
            f"as unquantized ({dtype})", "info" if commonly else "warning")
    if spec is not None and not declared and not is_float and scheme != "unknown":
        if name in FLOAT_ONLY_MODULES:  # the engine's lm_head / embedding are float tensors only
            err("excluded-but-stored-quantized",
                f"quantization_config ({_claim(spec)}) leaves it unquantized but it is stored {scheme}; the "
                "engine's lm_head and embeddings are float only, so generate/serve refuse it")
        else:
            err("excluded-but-stored-quantized",
                f"quantization_config ({_claim(spec)}) leaves it unquantized but it is stored {scheme}; "
                "loaded as stored (its scales exist)", "warning")
    expected = spec.per_module.get(name) if spec is not None and spec.per_module else None
    allowed = {expected} if expected else (spec.schemes if spec is not None else frozenset())
    if spec is not None and declared and not is_float and allowed and scheme != "unknown" and scheme not in allowed:
        want = expected or " or ".join(sorted(allowed))
        err("scheme-mismatch", f"stored {scheme} but quantization_config ({_claim(spec)}) declares {want}")
    info = ModuleInfo(name=name, scheme=scheme, dtype=dtype, shape=tuple(shape), tensors=dict(roles),
                      block_size=block, declared_quantized=declared, treated_as=treated)
    return info, findings


def _claim(spec: QuantSpec | None) -> str:
    if spec is None:
        return "none"
    parts = [spec.method]
    if spec.block:
        parts.append(f"block {list(spec.block)}")
    elif spec.scheme and spec.scheme != spec.method:
        parts.append(spec.scheme)
    if spec.group_size and spec.method not in ("fp8",):
        parts.append(f"group {spec.group_size}")
    return ", ".join(parts)


def logical_numel(m: ModuleInfo) -> int:
    """Logical parameter count of a module's weight (product of its logical shape) plus its bias."""
    n = math.prod(m.shape) if m.shape else 0
    for r in ("bias",):
        if r in m.tensors:
            n += m.tensors[r].numel
    return n


# ---------------------------------------------------------------------------------------------------
# cross-module findings


def exclusion_findings(spec: QuantSpec | None, tensors: Iterable[str], modules: Iterable[str]) -> list[Finding]:
    """Q9: exclusion entries matching no module and no tensor under the producer's semantics."""
    names = sorted(set(tensors) | set(modules))
    if spec is None or not spec.exclusions or not names:  # config-only: nothing to match against
        return []
    out = []
    hit = exclusion_index(spec).matched(names)
    unmatched = [e for e in spec.exclusions if e not in hit]
    for e in unmatched:
        hint = " (GLM alias: indexers_proj -> indexer.weights_proj)" if "indexers_proj" in e else ""
        out.append(Finding("exclusion-matches-nothing", "warning", None,
                           f"quantization_config exclusion {e!r} matches no tensor{hint}"))
    return out


def fusion_findings(modules: dict[str, ModuleInfo], family: Family | None) -> list[Finding]:
    """Q8: parts of one fusible module (families.FusionRule) whose stored scheme or dtype disagree, and routed
    experts of one MoE layer stored in different schemes.

    Main parts (q_a/kv_a, gate/up, q/k/v) that disagree are an error (they cannot be fused) -- unless every
    part is a plain float (BF16/F16/F32): then they are fused in one float dtype (``--dtype``'s, or with
    ``auto`` the widest, F32: a lossless widening of the others), an info. ``full_only_parts``
    (indexer.wk / weights_proj) differing from the rest are info: convert keeps them separate (weights_proj
    stays BF16 in real FP8 releases). Experts: see :func:`expert_scheme_findings`.
    """
    if family is None or not family.fusions:
        return []
    layers: dict[str, dict[str, ModuleInfo]] = defaultdict(dict)
    for name, m in modules.items():
        mt = _LAYER_RE.match(name)
        if mt:
            layers[mt.group(1)][mt.group(3)] = m
    out: list[Finding] = []
    for prefix, mods in sorted(layers.items(), key=lambda kv: natural_key(kv[0])):
        for rule in family.fusions:
            parts = [mods[p] for p in rule.parts if p in mods]
            if len(parts) >= 2 and len({(m.scheme, m.dtype) for m in parts}) > 1:
                desc = ", ".join(f"{m.name.rsplit('.', 1)[-1]}={m.scheme}" for m in parts)
                if {m.scheme for m in parts} <= _PLAIN_FLOAT_SCHEMES:
                    out.append(Finding("fused-shards-disagree", "info", prefix + rule.output,
                                       f"{prefix}{rule.output}: parts stored in different float dtypes ({desc}); "
                                       "fused in one dtype: --dtype's, or with auto the widest (F32, lossless)"))
                else:
                    out.append(Finding("fused-shards-disagree", "error", prefix + rule.output,
                                       f"{prefix}{rule.output}: parts disagree in storage ({desc}); cannot be fused "
                                       "as is"))
            extra = [mods[p] for p in rule.full_only_parts if p in mods]
            if parts and extra:
                schemes = {m.scheme for m in parts + extra}
                if len(schemes) > 1:
                    desc = ", ".join(f"{m.name.split(prefix, 1)[-1]}={m.scheme}" for m in parts + extra)
                    out.append(Finding("fused-shards-disagree", "info", prefix + rule.output,
                                       f"{prefix}{rule.output}: indexer parts stored differently ({desc}); "
                                       "they stay separate projections"))
    return out + expert_scheme_findings(modules, family)


_PLAIN_FLOAT_SCHEMES = frozenset({"bf16", "fp16", "fp32", "fp64"})
#: a module inside one routed expert: (layer's experts prefix, expert index)
_EXPERT_MODULE_RE = re.compile(r"^(.*?\blayers\.\d+\.(?:.*\.)?experts)\.(\d+)\.")
#: findings that make a checkpoint unloadable as stored (convert refuses, serve's raw loader refuses)
UNFUSABLE_CODES = ("fused-shards-disagree", "experts-disagree")


def expert_scheme_findings(modules: dict[str, ModuleInfo], family: Family | None) -> list[Finding]:
    """``experts-disagree``: one MoE layer's routed experts stored in different schemes, not all plain floats.

    The engine runs a layer's experts as one stacked tensor per projection (``mlp.experts.w13`` / ``w2``,
    [E, ...]) of one scheme. FP8 block experts next to plain-float ones (an FP8 release that leaves an
    expert BF16 through ``modules_to_not_convert``) are a warning: convert and serve dequantize the layer's
    FP8 experts (exact in float32) and stack the layer in the float experts' dtype -- never re-quantize the
    float expert, which would change it for good -- at the cost of the layer's experts growing (2x in
    BF16). Any other mix (a 4-bit scheme next to BF16, ...) is an error: nothing converts one into the
    other exactly. Experts stored in different plain-float dtypes are stacked in one (no finding).
    """
    if family is None or family.experts is None:
        return []
    layers: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for name, m in modules.items():
        mt = _EXPERT_MODULE_RE.match(name)
        if mt:
            layers[mt.group(1)][m.scheme].add(int(mt.group(2)))
    out = []
    for prefix, by_scheme in sorted(layers.items(), key=lambda kv: natural_key(kv[0])):
        if len(by_scheme) < 2 or set(by_scheme) <= _PLAIN_FLOAT_SCHEMES:
            continue
        ranked = sorted(by_scheme.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        total = len(set().union(*by_scheme.values()))
        desc = "; ".join(f"{scheme}: {_experts_desc(sorted(idx), total)}" for scheme, idx in ranked)
        stacks = "the engine stacks a layer's experts into one tensor of one scheme"
        if set(by_scheme) - {"fp8_block"} <= _PLAIN_FLOAT_SCHEMES:
            out.append(Finding("experts-disagree", "warning", prefix,
                               f"{prefix}: routed experts stored in different schemes ({desc}); {stacks}, so "
                               f"convert and serve dequantize this layer's FP8 experts (exact in float32) and stack "
                               f"them in the float experts' dtype (or --dtype's): their weights grow from 1 byte to "
                               f"2 (BF16) or 4 (F32) per parameter"))
            continue
        out.append(Finding("experts-disagree", "error", prefix,
                           f"{prefix}: routed experts stored in different schemes ({desc}); {stacks}, and "
                           f"convert does not change quantized experts' numbers to make them agree; store the "
                           f"layer's experts in one scheme ({ranked[0][0]}, as most are) before converting or serving"))
    return out


def _experts_desc(idx: list[int], total: int) -> str:
    if len(idx) == total:
        return "all"
    if len(idx) > 4:
        return f"{len(idx)} of {total} experts"
    return ("expert " if len(idx) == 1 else "experts ") + ", ".join(map(str, idx))


_DIGITS = re.compile(r"(\d+)")


def natural_key(s: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(s)]


_LOSSLESS = {("F16", "F32"), ("BF16", "F32"), ("F32", "F64"), ("F16", "F64"), ("BF16", "F64")}


#: 1-D normalisation parameters (RMSNorm/LayerNorm weight and bias: ``input_layernorm``, ``q_a_layernorm``,
#: ``indexer.k_norm``, ``enorm``, ``model.norm``, ...): stored F32 on purpose by some releases
_NORM_PARAM = re.compile(r"norm\.(weight|bias)$")


def dtype_findings(tensors: dict[str, TensorInfo], model_dtype: str | None, fp32_keep: Iterable[str] = ()
                   ) -> list[Finding]:
    """Q10: float tensors stored in a dtype other than the model dtype, one finding per stored dtype
    (count and examples). ``fp32_keep`` suffixes (family facts) are expected FP32 and skipped, and so are
    quantization companions (scales, zeros: never a float cast).
    Severity: warning when loading would be a lossy cast (F32 -> BF16, BF16 <-> F16), info otherwise."""
    if model_dtype not in FLOAT_DTYPES:
        return []
    keep = tuple(fp32_keep)
    groups: dict[str, list[str]] = defaultdict(list)
    norms: list[str] = []
    for name, t in tensors.items():
        if t.dtype in FLOAT_DTYPES and t.dtype != model_dtype:
            split = split_role(name)
            if split is not None and split[1] in SCALE_ROLES:  # FP8/int scales: a quantization matter
                continue
            if keep and t.dtype == "F32" and any(name.endswith(k) for k in keep):
                continue
            if t.dtype == "F32" and len(t.shape) == 1 and _NORM_PARAM.search(name):
                norms.append(name)
                continue
            groups[t.dtype].append(name)
    out = []
    if norms:  # DeepSeek-V3.2 stores every RMSNorm/LayerNorm weight F32 on purpose (its reference code does)
        norms.sort(key=natural_key)
        ex = ", ".join(norms[:3]) + (f", ... (+{len(norms) - 3} more)" if len(norms) > 3 else "")
        out.append(Finding("float-dtype-differs", "info", norms[0],
                           f"{len(norms)} norm weight(s) stored F32 while the model dtype is {model_dtype}: kept "
                           f"as stored by convert (--dtype auto), as the release intends, e.g. {ex}"))
    for dt, names in sorted(groups.items()):
        names.sort(key=natural_key)
        lossy = (dt, model_dtype) not in _LOSSLESS
        ex = ", ".join(names[:3]) + (f", ... (+{len(names) - 3} more)" if len(names) > 3 else "")
        how = "lossy cast" if lossy else "lossless upcast"
        if model_dtype == "F16" and dt in ("BF16", "F32", "F64"):  # F16 -> BF16 keeps every magnitude
            how += ", may overflow above 65504"
        out.append(Finding("float-dtype-differs", "warning" if lossy else "info", names[0],
                           f"{len(names)} tensor(s) stored {dt} while the model dtype is {model_dtype} "
                           f"({dt} -> {model_dtype}: {how}), e.g. {ex}"))
    return out


#: modules the engine builds as float tensors only (an FP8 lm_head's scale has nowhere to go)
FLOAT_ONLY_MODULES = ("lm_head", "model.embed_tokens")


def orphan_findings(orphans: dict[str, dict[str, TensorInfo]]) -> list[Finding]:
    """Q7: companions (scale/zero/input_scale) whose layer has no weight."""
    return [Finding("orphan-companion", "error", m,
                    f"{m}: {sorted(roles)} without a weight in the same module; the engine loads no tensor it "
                    "has no place for, so generate/serve refuse it (remove the tensors)")
            for m, roles in sorted(orphans.items(), key=lambda kv: natural_key(kv[0]))]


def classify_modules(tensors: dict[str, TensorInfo], spec: QuantSpec | None
                     ) -> tuple[list[ModuleInfo], list[str], list[Finding]]:
    """Group and classify every linear module. Returns (modules in natural name order, other tensor
    names, findings: per-module + orphans + exclusion entries matching nothing)."""
    grouping = group_modules(tensors)
    modules: list[ModuleInfo] = []
    findings: list[Finding] = []
    for name in sorted(grouping.modules, key=natural_key):
        info, f = classify_module(name, grouping.modules[name], spec)
        modules.append(info)
        findings.extend(f)
    findings.extend(orphan_findings(grouping.orphans))
    findings.extend(exclusion_findings(spec, tensors, grouping.modules))
    return modules, grouping.other, findings

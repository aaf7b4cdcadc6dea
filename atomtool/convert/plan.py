"""Build the pure :class:`ConversionPlan` of a checkpoint from its inspect report.

One function, :func:`build_plan`, turns an :class:`~atomtool.inspect.types.InspectReport` into every output
tensor of the atomtool layout with its sources and one op (``copy``, ``cast``, ``concat`` rows, ``stack``
experts). It reads the fusion rules from :mod:`atomtool.inspect.families` (data, one place), the per-layer
DSA schedule from ``report.dsa.roles`` and the storage scheme of each module from ``report.modules`` -- it
re-derives none of them (DESIGN.md principle 1). Convert writes the plan to disk; serve runs the same
plan in memory (:func:`atomtool.convert.materialize.iter_output_tensors`).

Fusion facts (research/dsa.md §4): parts are row-concatenated only when they share a storage scheme.
Plain-float parts concatenate freely. FP8 block parts (``weight`` F8_E4M3 + ``weight_scale_inv`` F32
``[ceil(N/b0), ceil(K/b1)]``) are exact to concatenate only when every part but the last has a multiple of
``b0`` rows, because one scale row covers ``b0`` fused rows; otherwise the part is followed by zero rows up
to the next block boundary (``PartSpec.pad_rows``) -- its scale rows already cover the padded block, so the
scale tensors concatenate unchanged and dequantizing any part gives exactly the dequantized source.
On MLA layers whose schedule role is ``full`` the indexer's ``wk`` and ``weights_proj`` join
``fused_qkv_a_proj`` only when they share the scheme of ``q_a_proj``/``kv_a_proj_with_mqa`` (all-BF16
checkpoints); in FP8 releases ``weights_proj`` is BF16 and is never requantized, so the indexer parts
stay separate tensors under their source names. Plain-float parts of different dtypes fuse in one (the
``--dtype`` target, else the widest: a lossless widening). An MoE layer whose experts mix FP8 block and plain
float storage is stacked in the float dtype with its FP8 experts dequantized (``PartSpec.scale``).

What transformers does not load is left out (``ConversionPlan.dropped``, with a note or warning): legacy
``rotary_emb.inv_freq`` buffers, layers beyond the decoder and its MTP layers, quantization companions
(``weight_scale_inv``, ``input_scale``, ...) of a weight stored in a plain float dtype, and an ``lm_head.weight`` that
``tie_word_embeddings`` ties to an equal embedding (a different one is kept and the layout untied, as
transformers' ``tie_weights`` does). An atomtool layout is not planned again (:func:`layout_source_message`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from atomtool.convert.cast import FLOAT_SCHEMES, PLAIN_FLOAT_TAGS, cast_messages, output_dtype, target_tag
from atomtool.convert.plan_types import ConversionPlan, OutputTensor, PartSpec
from atomtool.errors import ConversionError
from atomtool.inspect.families import FAMILIES, Family, family_for
from atomtool.inspect.quant import SCALE_ROLES
from atomtool.inspect.report import human_bytes
from atomtool.inspect.required import extra_layer_tensors
from atomtool.inspect.types import InspectReport, ModuleInfo, TensorInfo

_LAYER_RE = re.compile(r"^(?P<layer>(?:.*\.)?layers\.(?P<idx>\d+))\.(?P<rest>.+)$")
_FLOAT_ROLES = frozenset({"weight", "bias"})
_FP8_BLOCK_ROLES = frozenset({"weight", "weight_scale_inv"})
_SCHEME_OF_TAG = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}


def natural_key(name: str) -> tuple:
    """Sort key that orders ``layers.10`` after ``layers.9`` (digit runs compared as integers)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@dataclass
class _Group:
    """Row-concatenation of sibling modules, per tensor role: (parts, total rows, trailing dims)."""

    scheme: str
    block: tuple[int, ...] | None
    roles: dict[str, tuple[list[PartSpec], int, tuple[int, ...]]]
    dtypes: dict[str, str]
    padded: list[tuple[str, int]]


def _family(report: InspectReport) -> Family | None:
    for fam in FAMILIES:
        if fam.name == report.family:
            return fam
    return family_for(report.architecture)


def _block_of(mod: ModuleInfo, report: InspectReport) -> tuple[int, int] | None:
    if mod.block_size and len(mod.block_size) == 2:
        return (int(mod.block_size[0]), int(mod.block_size[1]))
    qc = report.config_flat.get("quantization_config") or report.config.get("quantization_config") or {}
    wbs = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(wbs, list | tuple) and len(wbs) == 2:
        return (int(wbs[0]), int(wbs[1]))
    return None


def _why_not_fusable(mods: Sequence[ModuleInfo], report: InspectReport) -> str | None:
    """None when ``mods`` can be row-concatenated exactly, else the reason. Plain-float parts of different
    dtypes (one projection stored BF16, its siblings F32) can: the fused tensor takes one float dtype
    (:meth:`_Planner._group_dtype`), a cast of the parts that differ."""
    schemes = {m.scheme for m in mods}
    floats = schemes <= FLOAT_SCHEMES
    if len(schemes) != 1 and not floats:
        return "storage schemes differ (" + ", ".join(f"{m.name.rsplit('.', 1)[-1]}={m.scheme}" for m in mods) + ")"
    scheme = mods[0].scheme
    allowed = _FLOAT_ROLES if scheme in FLOAT_SCHEMES else _FP8_BLOCK_ROLES if scheme == "fp8_block" else None
    if allowed is None:
        return f"scheme {scheme} is not concatenated"
    roles = set(mods[0].tensors)
    for m in mods:
        if set(m.tensors) != roles:
            return "tensor roles differ (" + ", ".join(f"{x.name}: {sorted(x.tensors)}" for x in mods) + ")"
    if "weight" not in roles or not roles <= allowed:
        return f"roles {sorted(roles)} are not concatenated for scheme {scheme}"
    for role in roles:
        infos = [m.tensors[role] for m in mods]
        if len({t.dtype for t in infos}) != 1 and not (floats and {t.dtype for t in infos} <= PLAIN_FLOAT_TAGS):
            return f"{role} dtypes differ"
        if len({tuple(t.shape[1:]) for t in infos}) != 1 or any(len(t.shape) < 1 for t in infos):
            return f"{role} trailing dims differ"
    if scheme == "fp8_block":
        blocks = {_block_of(m, report) for m in mods}
        if len(blocks) != 1 or None in blocks:
            return "FP8 block sizes differ or are unknown"
        b0, b1 = blocks.pop()
        for m in mods:
            w, s = m.tensors["weight"], m.tensors["weight_scale_inv"]
            if len(w.shape) != 2 or tuple(s.shape) != (math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)):
                return f"{m.name}: weight_scale_inv {list(s.shape)} does not match weight {list(w.shape)}"
    return None


def _concat(mods: Sequence[ModuleInfo], report: InspectReport, stack_index: int | None = None) -> _Group:
    """Row-concatenate every role of ``mods`` (already checked fusable); FP8 parts padded to blocks."""
    scheme = mods[0].scheme
    block = _block_of(mods[0], report) if scheme == "fp8_block" else None
    roles: dict[str, tuple[list[PartSpec], int, tuple[int, ...]]] = {}
    padded: list[tuple[str, int]] = []
    for role in mods[0].tensors:
        parts: list[PartSpec] = []
        start = 0
        for i, m in enumerate(mods):
            t = m.tensors[role]
            n = t.shape[0]
            pad = 0
            if role == "weight" and block is not None and i < len(mods) - 1 and n % block[0]:
                pad = block[0] - n % block[0]
                padded.append((m.name, pad))
            parts.append(PartSpec(t.name, (start, start + n), stack_index, pad))
            start += n + pad
        roles[role] = (parts, start, tuple(mods[0].tensors[role].shape[1:]))
    dtypes = {role: mods[0].tensors[role].dtype for role in mods[0].tensors}
    return _Group(scheme, block, roles, dtypes, padded)


class _Planner:
    def __init__(self, report: InspectReport, dtype: str):
        self.report = report
        self.target = target_tag(dtype)
        self.dtype_policy = dtype
        self.family = _family(report)
        self.fp32_keep = self.family.fp32_keep if self.family else ()
        #: source tensors left out of the layout -> why (not weights, or ignored by transformers too)
        self.dropped: dict[str, str] = {}
        self.warnings: list[str] = []  # printed as ``warning:`` (and in notes)
        modules = self._without_stray_companions(report.modules)
        self.modules = {m.name: m for m in modules}
        self.module_of_tensor = {t.name: m for m in modules for t in m.tensors.values()}
        self.outputs: list[OutputTensor] = []
        self.consumed: set[str] = set()
        self.casts: list[tuple[str, str, str]] = []
        self.notes: list[str] = []
        self.infos: list[str] = []  # printed as ``note:`` (and in notes)
        self.untie = False  # the layout's config.json says tie_word_embeddings: false
        n = report.config_flat.get("num_hidden_layers")
        self.num_layers = n if isinstance(n, int) else None
        self.roles = list(report.dsa.roles) if report.dsa is not None else None
        self._experts: dict[str, dict[int, dict[str, ModuleInfo]]] | None = None

    def _without_stray_companions(self, modules: Sequence[ModuleInfo]) -> list[ModuleInfo]:
        """``modules`` with the quantization companions of float-stored weights taken out (into
        ``self.dropped``, with a warning): inspect's ``float-with-companions`` treats such a module as
        unquantized, the weight as stored, and transformers ignores the stray scales too (unexpected keys of
        a plain ``nn.Linear``). Kept, they would block the module's fusion or expert stacking and the engine
        would refuse the layout (it loads no tensor it has no place for)."""
        out: list[ModuleInfo] = []
        stray: list[str] = []
        for m in modules:
            extra = [r for r in m.tensors if r in SCALE_ROLES] if m.scheme in FLOAT_SCHEMES else []
            if extra:
                names = [m.tensors[r].name for r in extra]
                stray.extend(names)
                self.dropped.update((n, f"quantization companion of {m.name}, whose weight is stored {m.dtype}")
                                    for n in names)
                m = dataclasses.replace(m, tensors={r: t for r, t in m.tensors.items() if r not in extra})
            out.append(m)
        if stray:
            stray.sort(key=natural_key)
            self.warnings.append(f"left out {len(stray)} quantization companion(s) of float-stored weights "
                                 f"({_listed(stray)}): the weights are used as stored, unquantized, and "
                                 "transformers ignores these tensors too")
        return out

    # ---- dtype policy -------------------------------------------------------------------------
    def _keep_fp32(self, name: str) -> bool:
        module = name.rsplit(".", 1)[0]
        return any(name.endswith(s) or module.endswith(s) for s in self.fp32_keep)

    def _out_dtype(self, t: TensorInfo, scheme: str) -> str:
        dst = output_dtype(t.dtype, target=self.target, scheme=scheme, keep_fp32=self._keep_fp32(t.name))
        if dst != t.dtype:
            self.casts.append((t.name, t.dtype, dst))
        return dst

    def _group_dtype(self, srcs: Sequence[TensorInfo], scheme: str) -> str:
        """The one dtype of a fused / stacked output whose parts are ``srcs`` (recording the casts): the
        ``--dtype`` target, and with ``auto`` the stored dtype -- or, when plain-float parts disagree, the
        widest (F32, F64 if a part is F64: a lossless widening of the others)."""
        dsts = {output_dtype(t.dtype, target=self.target, scheme=scheme, keep_fp32=self._keep_fp32(t.name))
                for t in srcs}
        dst = dsts.pop() if len(dsts) == 1 else ("F64" if "F64" in dsts else "F32")
        self.casts.extend((t.name, t.dtype, dst) for t in srcs if t.dtype != dst)
        return dst

    @staticmethod
    def _out_scheme(scheme: str, dtype: str) -> str:
        return _SCHEME_OF_TAG.get(dtype, scheme) if scheme in FLOAT_SCHEMES or scheme == "float" else scheme

    # ---- outputs ---------------------------------------------------------------------------------
    def _emit_group(self, prefix: str, group: _Group, stacked: int | None = None,
                    per_expert: list[_Group] | None = None) -> None:
        for role, (parts, rows, trailing) in group.roles.items():
            all_parts = [p for g in per_expert for p in g.roles[role][0]] if per_expert else parts
            dst = self._group_dtype([self.report.tensors[p.source] for p in all_parts], group.scheme)
            shape = ((stacked,) if stacked is not None else ()) + (rows,) + trailing
            self.outputs.append(OutputTensor(
                name=f"{prefix}.{role}", dtype=dst, shape=shape, scheme=self._out_scheme(group.scheme, dst),
                op="stack" if stacked is not None else "concat", parts=tuple(all_parts),
                block_size=group.block))
            self.consumed.update(p.source for p in all_parts)

    def _emit_copy(self, t: TensorInfo, name: str | None = None) -> None:
        """Output ``name`` (default: the source's own name) = source tensor ``t``, cast per the dtype policy."""
        mod = self.module_of_tensor.get(t.name)
        scheme = mod.scheme if mod is not None else "float"
        dst = self._out_dtype(t, scheme)
        block = None
        if mod is not None and mod.scheme == "fp8_block":
            block = _block_of(mod, self.report)
        out_scheme = _SCHEME_OF_TAG.get(dst, dst.lower()) if mod is None else self._out_scheme(scheme, dst)
        self.outputs.append(OutputTensor(
            name=name or t.name, dtype=dst, shape=tuple(t.shape), scheme=out_scheme,
            op="copy" if dst == t.dtype else "cast", parts=(PartSpec(t.name),), block_size=block))
        self.consumed.add(t.name)

    # ---- fusions -----------------------------------------------------------------------------------
    def _layers(self) -> dict[str, int]:
        layers: dict[str, int] = {}
        for name in self.modules:
            m = _LAYER_RE.match(name)
            if m:
                layers[m.group("layer")] = int(m.group("idx"))
        return layers

    def _fuse_layer(self, layer: str, idx: int) -> None:
        assert self.family is not None
        role = self.roles[idx] if self.roles is not None and idx < len(self.roles) else "dense"
        for rule in self.family.fusions:
            base = [self.modules.get(f"{layer}.{p}") for p in rule.parts]
            if any(m is None for m in base):
                continue
            out = f"{layer}.{rule.output}"
            extras: list[ModuleInfo] = []
            if rule.full_only_parts and role == "full":
                found = [self.modules.get(f"{layer}.{p}") for p in rule.full_only_parts]
                if all(m is not None for m in found):
                    extras = found  # type: ignore[assignment]
                else:
                    missing = [p for p, m in zip(rule.full_only_parts, found, strict=True) if m is None]
                    self.notes.append(f"{out}: layer {idx} is 'full' but lacks {', '.join(missing)}; "
                                      "indexer parts kept under their source names")
            why = _why_not_fusable(base, self.report)
            if why is not None:
                self.notes.append(f"{out}: not fused, {why}; parts kept under their source names")
                continue
            mods = base
            if extras:
                why_extra = _why_not_fusable(base + extras, self.report)
                if why_extra is None:
                    mods = base + extras
                else:
                    self.notes.append(f"{out}: indexer parts ({', '.join(rule.full_only_parts)}) kept separate, "
                                      f"{why_extra}")
            group = _concat(mods, self.report)
            self._note_group(out, mods, group)
            self._emit_group(out, group)

    def _note_group(self, out: str, mods: Sequence[ModuleInfo], group: _Group, what: str = "") -> None:
        short = [m.name.rsplit(".", 1)[-1] if ".indexer." not in m.name else "indexer." + m.name.rsplit(".", 1)[-1]
                 for m in mods]
        sizes = [m.tensors["weight"].shape[0] for m in mods]
        msg = f"{out}{what}: {' | '.join(short)} rows {sizes} ({group.scheme})"
        if group.padded:
            msg += "; zero rows after " + ", ".join(f"{n.rsplit('.', 1)[-1]} (+{p})" for n, p in group.padded)
            msg += f" to the {group.block[0]}-row FP8 block" if group.block else ""
        self.notes.append(msg)

    def _experts_by_layer(self) -> dict[str, dict[int, dict[str, ModuleInfo]]]:
        """``{layer}.{experts_prefix}.`` -> expert index -> module name inside the expert -> module (once)."""
        if self._experts is None:
            assert self.family is not None and self.family.experts is not None
            prefix = re.escape(self.family.experts.experts_prefix)
            pat = re.compile(rf"^(?P<base>(?:.*\.)?layers\.\d+\.{prefix}\.)(?P<e>\d+)\.(?P<rest>.+)$")
            self._experts = {}
            for name, mod in self.modules.items():
                m = pat.match(name)
                if m:
                    self._experts.setdefault(m.group("base"), {}).setdefault(int(m.group("e")), {})[
                        m.group("rest")] = mod
        return self._experts

    def _stack_experts(self, layer: str, idx: int) -> None:
        assert self.family is not None and self.family.experts is not None
        rule = self.family.experts
        base = f"{layer}.{rule.experts_prefix}."
        experts = self._experts_by_layer().get(base, {})
        if not experts:
            return
        count = len(experts)
        if sorted(experts) != list(range(count)):
            raise ConversionError(f"{base.rstrip('.')}: expert indices are not 0..{count - 1} "
                                  f"(found {sorted(experts)[:8]}...)")
        needed = (*rule.w13, rule.w2)
        for e, mods in experts.items():
            missing = [n for n in needed if n not in mods]
            if missing:
                raise ConversionError(f"{base}{e}: expert lacks {', '.join(missing)}")
        gates = [experts[e][rule.w13[0]] for e in range(count)]
        ups = [experts[e][rule.w13[1]] for e in range(count)]
        downs = [experts[e][rule.w2] for e in range(count)]
        schemes = {m.scheme for m in gates + ups + downs}
        if "fp8_block" in schemes and len(schemes) > 1 and schemes - {"fp8_block"} <= FLOAT_SCHEMES:
            self._stack_dequantized(f"{layer}.{rule.experts_prefix}", gates, ups, downs)
            return
        why = (_why_not_fusable([gates[0], ups[0]], self.report) or _why_not_fusable([downs[0]], self.report)
               or _why_uniform(gates, "gate") or _why_uniform(ups, "up") or _why_uniform(downs, "down")
               or (None if gates[0].scheme == downs[0].scheme or {gates[0].scheme, downs[0].scheme} <= FLOAT_SCHEMES
                   else "experts' storage schemes differ"))
        prefix = f"{layer}.{rule.experts_prefix}"
        if why is not None:
            self.notes.append(f"{prefix}: experts not stacked, {why}; kept under their source names")
            return
        g13 = [_concat([gates[e], ups[e]], self.report, stack_index=e) for e in range(count)]
        g2 = [_concat([downs[e]], self.report, stack_index=e) for e in range(count)]
        self._note_group(f"{prefix}.w13", [gates[0], ups[0]], g13[0], f" [{count} experts]")
        self._emit_group(f"{prefix}.w13", g13[0], stacked=count, per_expert=g13)
        self._emit_group(f"{prefix}.w2", g2[0], stacked=count, per_expert=g2)

    def _stack_dequantized(self, prefix: str, gates: list[ModuleInfo], ups: list[ModuleInfo],
                           downs: list[ModuleInfo]) -> None:
        """Stack one MoE layer whose routed experts mix FP8 block and plain-float storage (an FP8 release that
        leaves an expert BF16 through ``modules_to_not_convert``; inspect's ``experts-disagree`` warning).

        The engine runs a layer's experts as one ``w13`` / ``w2`` tensor of one scheme, so the FP8 experts are
        dequantized (``q * weight_scale_inv`` per block, exact in float32, :class:`PartSpec` ``scale``) and
        the layer is stacked in the float experts' dtype (BF16 in real releases; the widest when they
        disagree) or the ``--dtype`` target: exact values with ``--dtype float32``, rounded to BF16 otherwise.
        Re-quantizing the float expert instead would change it with no way back. A warning gives the size
        the layer's experts grow by. Experts whose shapes or roles do not line up stay unstacked (a note).
        """
        floats = [m for m in gates + ups + downs if m.scheme in FLOAT_SCHEMES]
        fp8 = [m for m in gates + ups + downs if m.scheme == "fp8_block"]
        blocks = {_block_of(m, self.report) for m in fp8}
        why = next((f"{what} projections differ in shape between experts" for what, ms in
                    (("gate", gates), ("up", ups), ("down", downs))
                    if len({tuple(m.tensors["weight"].shape) for m in ms}) != 1), None)
        if why is None and (any(set(m.tensors) != {"weight"} for m in floats)
                            or any(set(m.tensors) != {"weight", "weight_scale_inv"} for m in fp8)):
            why = "tensor roles are not plain weights and FP8 block weight/weight_scale_inv pairs"
        if why is None and (len(blocks) != 1 or None in blocks):
            why = "FP8 block sizes differ or are unknown"
        if why is not None:
            self.notes.append(f"{prefix}: experts not stacked, {why}; kept under their source names")
            return
        block = blocks.pop()
        stored = {m.tensors["weight"].dtype for m in floats}
        dst = self.target or (stored.pop() if len(stored) == 1 else ("F64" if "F64" in stored else "F32"))

        def stacked(rows_of: list[list[ModuleInfo]]) -> tuple[tuple[PartSpec, ...], int, int]:
            parts = []
            for e, mods in enumerate(rows_of):
                start = 0
                for m in mods:
                    w, s = m.tensors["weight"], m.tensors.get("weight_scale_inv")
                    parts.append(PartSpec(w.name, (start, start + w.shape[0]), e, 0, s.name if s else None,
                                          block if s else None))
                    start += w.shape[0]
            return tuple(parts), start, rows_of[0][0].tensors["weight"].shape[1]

        for role, rows_of in (("w13", [[g, u] for g, u in zip(gates, ups, strict=True)]), ("w2", [[d] for d in downs])):
            parts, rows, cols = stacked(rows_of)
            self.outputs.append(OutputTensor(name=f"{prefix}.{role}.weight", dtype=dst, shape=(len(rows_of), rows, cols),
                                             scheme=_SCHEME_OF_TAG.get(dst, dst.lower()), op="stack", parts=parts))
        self.consumed.update(t.name for m in floats + fp8 for t in m.tensors.values())
        self.casts.extend((m.tensors["weight"].name, m.tensors["weight"].dtype, dst) for m in floats
                          if m.tensors["weight"].dtype != dst)
        before = sum(t.nbytes for m in fp8 for t in m.tensors.values())
        after = sum(m.tensors["weight"].numel for m in fp8) * _TAG_BYTES[dst]
        odd = sorted({int(m.name.rsplit(".", 2)[-2]) for m in floats})
        lossless = " (exact)" if dst in ("F32", "F64") else f" (rounded to {dst}; --dtype float32 keeps them exact)"
        self.warnings.append(
            f"{prefix}: routed experts mix fp8_block and {'/'.join(sorted({m.scheme for m in floats}))} "
            f"(expert{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd[:8]))} not quantized); the engine runs a "
            f"layer's experts as one tensor of one scheme, so the FP8 experts are dequantized to {dst}{lossless} "
            f"and the layer stacked in {dst}: {human_bytes(before)} of FP8 weights and scales become "
            f"{human_bytes(after)}")

    # ---- source tensors that are not part of the model --------------------------------------------
    def _drop_ignored(self) -> None:
        """Leave out what transformers does not load either, saying so: legacy ``rotary_emb.inv_freq``
        buffers (a note), tensors of layers beyond the decoder and its MTP layers (a warning naming them,
        inspect's ``extra-layers``), and a stored ``lm_head.weight`` that tying replaces (:meth:`_tie`)."""
        tensors = self.report.tensors
        inv = [n for n in tensors if is_ignored_buffer(n)]
        if inv:
            self.dropped.update((n, "rotary inv_freq buffer") for n in inv)
            self.infos.append(f"left out {len(inv)} rotary_emb.inv_freq buffer(s) ({_listed(inv)}): not weights "
                              "(the engine computes them from config.json's rope parameters; transformers ignores "
                              "them too)")
        extra = [n for n in extra_layer_tensors(tensors, self.report.config_flat, self.family)
                 if n not in self.dropped]
        if extra:
            self.dropped.update((n, "layer beyond num_hidden_layers") for n in extra)
            msg = next((f.message for f in self.report.findings if f.code == "extra-layers"), None)
            self.warnings.append(msg or f"left out {len(extra)} tensor(s) of layers beyond num_hidden_layers: "
                                        f"{_listed(extra)}")
        self._tie()

    def _tie(self) -> None:
        """``tie_word_embeddings: true`` with a stored ``lm_head.weight``: do what transformers'
        ``PreTrainedModel.tie_weights`` does when both tensors are in the checkpoint -- equal values: tie (the
        stored copy is left out, a note); different values: it does NOT tie them and warns, the stored
        ``lm_head`` is the output projection, so the layout keeps it and its config.json says
        ``tie_word_embeddings: false`` (a warning); no stored embedding: it ties the other way round (the
        embedding is the stored ``lm_head.weight``), so the layout stores it as the embedding (a note).
        Values are compared from the files
        (:func:`atomtool.convert.materialize.same_values`); when they cannot be (a remote dry run, a
        quantized lm_head) the tensors are treated as different."""
        flat = self.report.config_flat
        head, embed = "lm_head.weight", f"{self._model_base()}embed_tokens.weight"
        tensors = self.report.tensors
        if flat.get("tie_word_embeddings") is not True or head not in tensors:
            return
        if embed not in tensors:
            self._emit_copy(tensors[head], embed)
            self.infos.append(f"config.json ties the embeddings (tie_word_embeddings: true) and the checkpoint stores "
                              f"only {head}: written as {embed} (the engine ties the output projection to it; "
                              "transformers ties them the same way round)")
            return
        mod = self.modules.get("lm_head")
        same = None
        if self.report.root is not None and (mod is None or set(mod.tensors) == {"weight"}):
            from atomtool.convert.materialize import same_values

            same = same_values(tensors, self.report.root, embed, head)
        if same:
            self.dropped[head] = f"tied to {embed}"
            self.infos.append(f"{head} equals {embed} and config.json ties them (tie_word_embeddings: true): left "
                              "out, the engine ties the output projection to the embedding as transformers does")
            return
        self.untie = True
        why = "differs from" if same is False else "could not be compared with"
        self.warnings.append(
            f"config.json sets tie_word_embeddings: true but the stored {head} {why} {embed}; as transformers "
            f"does (it warns and does not tie them), {head} is kept as the output projection and the layout's "
            "config.json says tie_word_embeddings: false")

    def _model_base(self) -> str:
        """``model.`` (or ``model.language_model.``): where ``embed_tokens`` sits next to the layers."""
        bases = {m.group("layer").rsplit("layers.", 1)[0] for n in self.report.tensors if (m := _LAYER_RE.match(n))}
        return bases.pop() if len(bases) == 1 else "model."

    # ---- entry -----------------------------------------------------------------------------------
    def build(self) -> ConversionPlan:
        self._drop_ignored()
        if self.family is not None and self.num_layers is not None:
            for layer, idx in sorted(self._layers().items(), key=lambda kv: kv[1]):
                if idx >= self.num_layers:
                    continue  # MTP layers are copied unchanged
                self._fuse_layer(layer, idx)
                if self.family.experts is not None:
                    self._stack_experts(layer, idx)
        for name in self.report.tensors:
            if name not in self.consumed and name not in self.dropped:
                self._emit_copy(self.report.tensors[name])
        first = {o.name: natural_key(o.parts[0].source) for o in self.outputs}  # parts are in row order
        ordered = sorted(self.outputs, key=lambda o: first[o.name])
        tensors: dict[str, OutputTensor] = {}
        for o in ordered:
            if o.name in tensors:
                raise ConversionError(f"two output tensors are named {o.name} (a source tensor already has "
                                      "the name of a fused module)")
            tensors[o.name] = o
        warnings, cast_notes = cast_messages(self.casts)
        # what reading the source found (a stale index.json: the tensors it does not list are left out)
        source = [f.message for f in self.report.findings if f.code == "source-warning"]
        warnings = source + self.warnings + warnings
        infos = self.infos + cast_notes
        return ConversionPlan(
            tensors=tensors, config=output_config(self.report, self.target, untie=self.untie),
            dtype_policy=self.dtype_policy, warnings=warnings, sources=dict(self.report.tensors),
            notes=infos + self.warnings + self.notes, infos=infos, dropped=dict(self.dropped))


def _why_uniform(mods: Sequence[ModuleInfo], what: str) -> str | None:
    """None when the experts' ``what`` projections can be stacked: same scheme, roles, dtypes and shapes --
    or all plain floats (any dtypes: the stacked tensor takes one, :meth:`_Planner._group_dtype`)."""
    floats = {m.scheme for m in mods} <= FLOAT_SCHEMES

    def key(m: ModuleInfo) -> dict:
        return {r: (None if floats else t.dtype, t.shape) for r, t in m.tensors.items()}

    first = mods[0]
    for m in mods[1:]:
        if (m.scheme != first.scheme and not floats) or key(m) != key(first):
            return f"{what} projections differ between experts ({first.name} vs {m.name})"
    return None


_TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_TAG_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}



def output_config(report: InspectReport, target: str | None = None, *, untie: bool = False) -> dict:
    """The layout's config.json: the source config plus the flattened ``index_*`` fields and the resolved
    ``indexer_types`` (written into ``text_config`` when the source nests the language model there), and
    ``dtype`` set to the ``--dtype`` target when one is given; ``untie``: ``tie_word_embeddings`` set to
    false (a stored lm_head that differs from the embedding, :meth:`_Planner._tie`)."""
    cfg = copy.deepcopy(report.config)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key, value in report.config_flat.items():
        if key.startswith("index"):
            text[key] = copy.deepcopy(value)
    if target is not None:
        for c in {id(cfg): cfg, id(text): text}.values():
            c["dtype"] = _TORCH_NAMES[target]
            if "torch_dtype" in c:
                c["torch_dtype"] = _TORCH_NAMES[target]
    if untie:
        for c in {id(cfg): cfg, id(text): text}.values():
            if c is text or "tie_word_embeddings" in c:
                c["tie_word_embeddings"] = False
    return cfg


def is_ignored_buffer(name: str) -> bool:
    """A tensor that is not a weight: the legacy ``rotary_emb.inv_freq`` buffer older transformers versions
    saved (recomputed from the rope parameters at load; transformers ignores it)."""
    return name.endswith("rotary_emb.inv_freq")


def _listed(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def _module_of(rest: str) -> str:
    """Module path of a tensor path relative to its layer, expert indices masked (``mlp.experts.#.down_proj``)."""
    return _EXPERT_RE.sub(r"\1#", rest.rsplit(".", 1)[0])


_EXPERT_RE = re.compile(r"((?:^|\.)experts\.)\d+")
#: a layer's module path that belongs to its routed experts: per expert (``mlp.experts.#.down_proj``, indices
#: masked) or stacked (an atomtool layout's ``mlp.experts.w13``; transformers 5's ``mlp.experts.gate_up_proj``)
_MOE_MODULE_RE = re.compile(r"(?:^|\.)experts(?:\.#|\.[A-Za-z_]|$)")


def missing_tensors(report: InspectReport) -> list[str]:
    """Source tensors the engine needs that the checkpoint lacks, by name (natural order); empty when complete.

    Judged from the checkpoint itself, not from a per-architecture name list: the decoder layers of one
    kind hold the same modules (a layer's kind: dense or MoE, i.e. it has ``mlp.experts`` or not, and its
    DSA schedule role from ``report.dsa``), so a module one layer of a kind has and another lacks is missing
    from the latter (its tensors are named after the roles the other layer stores: ``weight``,
    ``weight_scale_inv``, ...); layers at index >= ``num_hidden_layers`` (MTP) are not compared, nor the
    indexer tensors a layer stores that its schedule role does not use (not ``full``). At model
    level the engine (Llama/Qwen and DeepSeek/GLM modules alike) needs ``embed_tokens.weight`` (with
    ``tie_word_embeddings`` a stored ``lm_head.weight`` stands in for it, as in transformers) and
    ``norm.weight`` next to ``layers``, and ``lm_head.weight`` unless ``tie_word_embeddings``. Which tensors
    each *fused* output needs is the plan's own business: a fusion whose parts are only partly present is
    listed here too. Only for families the engine serves (others are refused as unservable anyway).
    """
    fam = _family(report)
    if fam is None or not fam.servable or not report.tensors:
        return []
    n = report.config_flat.get("num_hidden_layers")
    roles = list(report.dsa.roles) if report.dsa is not None else None
    layers: dict[int, tuple[str, dict[str, set[str]]]] = {}  # idx -> (layer prefix, module -> tensor roles)
    for name in report.tensors:
        m = _LAYER_RE.match(name)
        if not m or is_ignored_buffer(name):
            continue
        idx = int(m.group("idx"))
        if isinstance(n, int) and idx >= n:
            continue
        rest = m.group("rest")
        prefix, mods = layers.setdefault(idx, (m.group("layer"), {}))
        module = _module_of(rest)
        if roles is not None and idx < len(roles) and roles[idx] != "full" and "indexer" in module.split("."):
            continue  # a layer that owns no indexer needs none: tensors stored anyway are unused (inspect warns)
        mods.setdefault(module, set()).add(rest.rsplit(".", 1)[-1])
    kinds: dict[tuple, list[int]] = {}
    for idx, (_, mods) in layers.items():
        moe = any(_MOE_MODULE_RE.search(mod) for mod in mods)
        role = roles[idx] if roles is not None and idx < len(roles) else None
        kinds.setdefault((moe, role), []).append(idx)
    missing: list[str] = []
    for idxs in kinds.values():
        union: dict[str, set[str]] = {}
        for idx in idxs:
            for mod, rs in layers[idx][1].items():
                union.setdefault(mod, set()).update(rs)
        for idx in idxs:
            prefix, mods = layers[idx]
            for mod in sorted(set(union) - set(mods)):
                shown = mod.replace("#", "*")  # every expert lacks it
                missing.extend(f"{prefix}.{shown}.{r}" for r in sorted(union[mod]))
    # model level: next to the layers (``model.`` or ``model.language_model.``)
    bases = {layers[i][0].rsplit("layers.", 1)[0] for i in layers}
    base = bases.pop() if len(bases) == 1 else "model."
    tied = report.config_flat.get("tie_word_embeddings", False) is True
    # tied: either copy will do (transformers ties whichever is stored to the other; the plan names it)
    needed = [] if tied and "lm_head.weight" in report.tensors else [f"{base}embed_tokens.weight"]
    needed.append(f"{base}norm.weight")
    if not tied:
        needed.append("lm_head.weight")
    missing.extend(t for t in needed if t not in report.tensors)
    return sorted(set(missing), key=natural_key)


def build_plan(report: InspectReport, dtype: str = "auto", *, require_complete: bool = False) -> ConversionPlan:
    """Plan the conversion of the checkpoint described by ``report`` into the atomtool layout. Pure.

    Output names are the engine's module names: dense ``self_attn.qkv_proj`` / ``mlp.gate_up_proj``; MLA
    ``self_attn.fused_qkv_a_proj`` (+ indexer rows on ``full`` layers when schemes allow),
    ``mlp.gate_up_proj``, ``mlp.shared_experts.gate_up_proj``; MoE ``mlp.experts.w13`` [E, 2I, H] (gate | up
    per expert) and ``mlp.experts.w2`` [E, H, I], each with its ``weight_scale_inv`` stacked when FP8. Every
    other tensor (and every MTP layer, at index >= ``num_hidden_layers``) keeps its source name. Every
    source tensor appears in exactly one output's parts, except those in ``plan.dropped``: what transformers
    does not load either (``rotary_emb.inv_freq`` buffers, layers beyond the decoder and its MTP layers,
    inspect's ``extra-layers``, and an ``lm_head.weight`` that ``tie_word_embeddings`` ties, see
    ``_Planner._tie``). Tensors a stale index.json does not list are not in the report at all; the plan's
    ``warnings`` repeat inspect's ``source-warning`` findings.

    Args:
        report: the inspect result (modules with storage schemes, tensors, DSA schedule, configs).
        dtype: ``auto`` | ``bfloat16`` | ``float16`` | ``float32`` (see :mod:`atomtool.convert.cast`).
        require_complete: refuse a checkpoint that lacks tensors the engine needs (:func:`missing_tensors`);
            ``convert`` sets it (a layout that cannot load is not written), serve's in-memory load does not
            (its loader names missing parameters itself).
    Returns:
        the plan; its ``warnings`` hold one line per lossy (source dtype -> target dtype) cast (lossless
        widenings go to ``infos`` and ``notes``), its ``missing`` the
        names :func:`missing_tensors` found.
    Raises:
        ConversionError: ``report`` is an atomtool layout (:func:`layout_source_message`), unknown dtype,
            incomplete MoE experts, an output name clash, missing tensors (with ``require_complete``:
            :func:`missing_message`).
    """
    if report.layout:
        raise ConversionError(layout_source_message(report.source))
    missing = missing_tensors(report)
    if missing and require_complete:
        raise ConversionError(missing_message(missing))
    plan = _Planner(report, dtype).build()
    plan.missing = missing
    return plan


def layout_source_message(src: str) -> str:
    """Why an atomtool layout is not converted again (one line): its tensors are already fused and stacked,
    and its manifest records the conversion; it is served as it is."""
    return (f"{src} is already an atomtool layout (it has atomtool.json): serve it as it is (`atomtool generate "
            f"{src}` / `atomtool serve {src}`), check it with `atomtool verify {src}`, or copy the directory; to "
            "convert again (another --dtype), run convert on the Hugging Face checkpoint it was converted from")


#: missing tensor names listed in :func:`missing_message` (the rest are counted)
MAX_LISTED = 5


def missing_message(missing: list[str]) -> str:
    """``checkpoint lacks N tensor(s) the engine needs: a, b, ... (and K more)`` (one line)."""
    shown = ", ".join(missing[:MAX_LISTED]) + (f" (and {len(missing) - MAX_LISTED} more)"
                                               if len(missing) > MAX_LISTED else "")
    return f"checkpoint lacks {len(missing)} tensor(s) the engine needs: {shown}"

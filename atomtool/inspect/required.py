"""Tensors a checkpoint must hold for architectures whose layout we know (the ``llama`` family: Llama,
Qwen2, Qwen3, Mistral; ``qwen3_moe``; the ``deepseek_mla`` family: DeepSeek-V3/V3.2, GLM-5.x).

Names follow HF transformers' modeling code (``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``DeepseekV3ForCausalLM``, ...): ``model.embed_tokens``, ``model.norm``, per layer ``input_layernorm``,
``post_attention_layernorm``, the attention and MLP projections, and ``lm_head`` unless
``tie_word_embeddings``. A linear module counts as present when any of its tensors is (``weight``, or a
quantized form: ``qweight``, ``weight_packed``, ...), or when an atomtool layout holds the fused module it
was folded into (:data:`atomtool.inspect.families.FusionRule`, stacked experts ``mlp.experts.w13/w2``).
"""

from __future__ import annotations

import re
from typing import Any

from atomtool.inspect.families import Family
from atomtool.inspect.memory import mlp_kinds
from atomtool.inspect.types import Finding, TensorInfo

#: families whose required tensor set :func:`required_modules` knows
KNOWN_LAYOUT_FAMILIES = frozenset({"llama", "qwen3_moe", "deepseek_mla"})
#: names printed in a finding before "(+N more)"
MAX_LISTED = 8


def _int(flat: dict[str, Any], key: str) -> int:
    v = flat.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def layout_entries(flat: dict[str, Any], family: Family, roles: list[str] | None = None
                   ) -> list[tuple[str, str, str]] | None:
    """Every tensor / linear module of a checkpoint of ``family`` (HF transformers' names), from the flattened
    text config: ``[(name, kind, rel)]`` where kind is ``plain`` (a tensor, required), ``module`` (a linear
    module, required; any storage scheme) or ``optional`` (a tensor checked when present, e.g. the DSA
    indexer's ``k_norm``), and ``rel`` the name without its ``model.layers.N.`` prefix and with expert
    indices as ``*`` (``mlp.experts.*.gate_proj``): the key :mod:`atomtool.inspect.shapes` sizes it by.
    None when the family's layout is not known here or the config lacks the layer count.

    roles: the DSA schedule (:func:`atomtool.inspect.dsa.layer_roles`): ``full`` layers hold
    ``self_attn.indexer.*``. MTP layers (index >= num_hidden_layers) are optional and not listed.
    """
    n = _int(flat, "num_hidden_layers")
    if family.name not in KNOWN_LAYOUT_FAMILIES or not n:
        return None
    mt = str(flat.get("model_type", ""))
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    # one rule with the KV/parameter estimates (mlp_layer_types first, as transformers' configs read it)
    kinds = mlp_kinds(flat)
    out = [(t, "plain", t) for t in ("model.embed_tokens.weight", "model.norm.weight")]
    if not flat.get("tie_word_embeddings", False):
        out.append(("lm_head", "module", "lm_head"))
    for i in range(n):
        p = f"model.layers.{i}."
        plain = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        modules: list[str] = []
        optional: list[str] = []
        if family.attention == "mla":
            q = ["self_attn.q_a_proj", "self_attn.q_b_proj"] if flat.get("q_lora_rank") else ["self_attn.q_proj"]
            if flat.get("q_lora_rank"):
                plain.append("self_attn.q_a_layernorm.weight")
            plain.append("self_attn.kv_a_layernorm.weight")
            modules += [*q, "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"]
            if roles is not None and i < len(roles) and roles[i] == "full":
                modules += ["self_attn.indexer.wq_b", "self_attn.indexer.wk", "self_attn.indexer.weights_proj"]
                # the engine's indexer LayerNorm (and transformers') needs both: missing ones are refused
                plain += ["self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias"]
        else:
            modules += [f"self_attn.{x}_proj" for x in "qkvo"]
            if mt.startswith("qwen3"):
                plain += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        n_attn = len(modules)  # the layer's experts are listed after its attention modules
        expert_entries: list[tuple[str, str, str]] = []
        if experts and i < len(kinds) and kinds[i] == "sparse":
            plain.append("mlp.gate.weight")
            if family.attention == "mla":  # DeepSeek-V3 / GLM routers: the engine refuses the bias absent
                plain.append("mlp.gate.e_score_correction_bias")
            else:
                optional.append("mlp.gate.e_score_correction_bias")
            expert_entries = [(f"{p}mlp.experts.{e}.{x}_proj", "module", f"mlp.experts.*.{x}_proj")
                              for e in range(experts) for x in ("gate", "up", "down")]
            if family.attention == "mla" and _int(flat, "n_shared_experts"):
                modules += [f"mlp.shared_experts.{x}_proj" for x in ("gate", "up", "down")]
        else:
            modules += [f"mlp.{x}_proj" for x in ("gate", "up", "down")]
        out += [(p + r, "plain", r) for r in plain]
        out += [(p + r, "module", r) for r in modules[:n_attn]] + expert_entries
        out += [(p + r, "module", r) for r in modules[n_attn:]]
        out += [(p + r, "optional", r) for r in optional]
    return out


def required_modules(flat: dict[str, Any], family: Family, roles: list[str] | None = None
                     ) -> tuple[list[str], list[str]] | None:
    """(plain tensor names, linear module names) the checkpoint of ``family`` must hold, from the flattened
    text config (:func:`layout_entries` without the optional tensors); None when the family's layout is not
    known here or the config lacks the sizes."""
    entries = layout_entries(flat, family, roles)
    if entries is None:
        return None
    return ([name for name, kind, _ in entries if kind == "plain"],
            [name for name, kind, _ in entries if kind == "module"])


DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def first_extra_layer(flat: dict[str, Any], family: Family | None) -> int | None:
    """Index of the first ``model.layers.N`` that is part of neither the decoder nor its MTP layers, or None
    when that is unknown (no family or layer count; an MLA config without ``num_nextn_predict_layers``,
    where the layers after the decoder may all be MTP layers).

    DeepSeek/GLM/Kimi (MLA) checkpoints store ``num_nextn_predict_layers`` MTP layers after the
    ``num_hidden_layers`` decoder layers under the same ``model.layers.N`` names; the other families have no
    MTP layers there. transformers builds ``num_hidden_layers`` layers and ignores the tensors of any other
    (its "unexpected keys"; DeepseekV3 lists the MTP layer in ``_keys_to_ignore_on_load_unexpected``).
    """
    n = _int(flat, "num_hidden_layers")
    if family is None or not n:
        return None
    if family.attention != "mla":
        return n
    nextn = flat.get("num_nextn_predict_layers")
    return n + nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn >= 0 else None


def first_stored_extra_layer(tensors: dict[str, Any], flat: dict[str, Any], family: Family | None) -> int | None:
    """:func:`first_extra_layer`, or for an MLA config without ``num_nextn_predict_layers`` the first layer
    index past the stored layers right after the decoder (``num_hidden_layers``, +1, ... without a gap: those
    may be MTP layers; a layer after a gap cannot be one). None when unknown (no family or layer count)."""
    first = first_extra_layer(flat, family)
    n = _int(flat, "num_hidden_layers")
    if first is None and family is not None and family.attention == "mla" and n:
        stored = {int(m.group(1)) for name in tensors if (m := DECODER_LAYER.match(name))}
        first = n
        while first in stored:
            first += 1
    return first


def extra_layer_tensors(tensors: dict[str, Any], flat: dict[str, Any], family: Family | None) -> list[str]:
    """Names of the tensors of ``model.layers.N`` with N >= :func:`first_stored_extra_layer` (layers beyond
    the decoder and its MTP layers), in the order of ``tensors``; empty when there are none or it is unknown."""
    first = first_stored_extra_layer(tensors, flat, family)
    if first is None:
        return []
    return [name for name in tensors if (m := DECODER_LAYER.match(name)) and int(m.group(1)) >= first]


def extra_layer_findings(tensors: dict[str, Any], flat: dict[str, Any], family: Family | None) -> list[Finding]:
    """``extra-layers`` (warning): the checkpoint holds tensors of decoder layers beyond ``num_hidden_layers``
    (and beyond the MTP layers of families that have them, :func:`first_stored_extra_layer`). transformers
    ignores them; convert leaves them out of the layout and serve does not load them."""
    extra = extra_layer_tensors(tensors, flat, family)
    if not extra:
        return []
    layers = sorted({int(DECODER_LAYER.match(name).group(1)) for name in extra})  # type: ignore[union-attr]
    first = first_stored_extra_layer(tensors, flat, family)
    assert first is not None  # extra tensors exist only past a known first extra layer
    declared = first_extra_layer(flat, family) is not None
    n = _int(flat, "num_hidden_layers")
    mtp = "" if first == n else f" + {first - n} MTP" + ("" if declared else " (the stored layers right after them)")
    shown = ", ".join(extra[:3]) + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "")
    return [Finding("extra-layers", "warning", f"model.layers.{layers[0]}",
                    f"{len(extra)} tensor(s) of layer(s) {', '.join(map(str, layers[:MAX_LISTED]))} beyond the "
                    f"{flat.get('num_hidden_layers')}{mtp} layers config.json declares (num_hidden_layers"
                    f"{'/num_nextn_predict_layers' if mtp and declared else ''}): transformers ignores them "
                    f"(unexpected keys); convert leaves them out of the layout and serve does not load them: {shown}")]


def tied_head_findings(tensors: dict[str, Any], flat: dict[str, Any]) -> list[Finding]:
    """``lm-head-with-tied-embeddings`` (info): ``tie_word_embeddings: true`` and the checkpoint stores
    ``lm_head.weight`` too. transformers' ``tie_weights`` ties the two only when their values are equal; when
    they differ it warns and keeps both (untied). Inspect reads headers only, so it says what will be decided
    from the values; convert compares them (:meth:`atomtool.convert.plan._Planner._tie`)."""
    if flat.get("tie_word_embeddings") is not True or "lm_head.weight" not in tensors:
        return []
    if "model.embed_tokens.weight" not in tensors:
        how = "the embedding is the stored lm_head.weight (transformers ties them the other way round)"
    else:
        how = ("both are stored: tied if their values are equal (the copy is left out), else kept untied with "
               "the stored lm_head as the output projection, as transformers does")
    return [Finding("lm-head-with-tied-embeddings", "info", "lm_head",
                    f"config.json sets tie_word_embeddings: true and the checkpoint stores lm_head.weight; {how}")]


_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(\w+)$")
_STACKED = re.compile(r"^(.*\.experts)\.[A-Za-z_]")


def _is_present(module: str, present: set[str], family: Family) -> bool:
    """``module`` has a tensor (``present``: module prefixes of every tensor name), or an atomtool layout holds
    the fused/stacked module it was folded into (``self_attn.qkv_proj`` for q/k/v; ``mlp.experts.w13`` for
    every expert's gate/up)."""
    if module in present:
        return True
    layer_prefix, sep, rel = module.partition(".layers.")
    if sep:
        idx, _, rel = rel.partition(".")
        base = f"{layer_prefix}.layers.{idx}."
        for rule in family.fusions:
            if rel in rule.parts or rel in rule.full_only_parts:
                if base + rule.output in present:
                    return True
        m = _EXPERT.match(rel)
        if m and base + m.group(1) + "#stacked" in present:
            return True
    return False


def missing_tensor_findings(tensors: dict[str, TensorInfo], flat: dict[str, Any], family: Family | None,
                            roles: list[str] | None = None) -> list[Finding]:
    """``missing-tensors`` (error) when a checkpoint of a family with a known layout lacks tensors the model
    needs (a truncated download, a bad merge), and ``missing-lm-head`` (error) for
    ``tie_word_embeddings: false`` without ``lm_head``. Checked only when the checkpoint uses the standard
    ``model.layers.N.`` naming (multimodal wrappers and unknown layouts are skipped) and has weights."""
    if not tensors or family is None:
        return []
    if not any(name.startswith("model.layers.") for name in tensors):
        return []
    req = required_modules(flat, family, roles)
    if req is None:
        return []
    plain, modules = req
    present = {name.rsplit(".", 1)[0] for name in tensors}
    # experts stored stacked, [E, ...] per layer (gpt-oss / transformers 5 ``mlp.experts.gate_up_proj``,
    # ``down_proj``, MXFP4 ``*_blocks``; atomtool ``mlp.experts.w13``/``w2``): every expert counts as present
    present |= {m.group(1) + "#stacked" for name in tensors if (m := _STACKED.match(name))}
    # tied embeddings: a stored lm_head.weight stands in for the embedding (transformers ties it either way)
    tied_head = flat.get("tie_word_embeddings") is True and "lm_head.weight" in tensors
    missing_plain = [t for t in plain if t not in tensors and not (tied_head and t == "model.embed_tokens.weight")]
    missing_mod = [m for m in modules if not _is_present(m, present, family)]
    out = []
    if "lm_head" in missing_mod:
        missing_mod.remove("lm_head")
        out.append(Finding("missing-lm-head", "error", "lm_head",
                           "config.json: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
                           "(the output projection is missing; a tied model would set tie_word_embeddings: true)"))
    missing = missing_plain + [m + ".weight" for m in missing_mod]
    if missing:
        listed = ", ".join(missing[:MAX_LISTED]) + (f" (+{len(missing) - MAX_LISTED} more)"
                                                    if len(missing) > MAX_LISTED else "")
        out.append(Finding("missing-tensors", "error", None,
                           f"{len(missing)} required tensor(s) missing for {family.name} "
                           f"({flat.get('num_hidden_layers')} layers per config.json): {listed}"))
    return out

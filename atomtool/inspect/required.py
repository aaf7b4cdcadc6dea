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


def required_modules(flat: dict[str, Any], family: Family, roles: list[str] | None = None
                     ) -> tuple[list[str], list[str]] | None:
    """(plain tensor names, linear module names) the checkpoint of ``family`` must hold, from the flattened
    text config; None when the family's layout is not known here or the config lacks the sizes.

    roles: the DSA schedule (:func:`atomtool.inspect.dsa.layer_roles`): ``full`` layers need
    ``self_attn.indexer.*``. MTP layers (index >= num_hidden_layers) are optional and not required.
    """
    n = _int(flat, "num_hidden_layers")
    if family.name not in KNOWN_LAYOUT_FAMILIES or not n:
        return None
    mt = str(flat.get("model_type", ""))
    experts = _int(flat, "n_routed_experts") or _int(flat, "num_experts") or _int(flat, "num_local_experts")
    # one rule with the KV/parameter estimates (mlp_layer_types first, as transformers' configs read it)
    kinds = mlp_kinds(flat)
    plain = ["model.embed_tokens.weight", "model.norm.weight"]
    modules: list[str] = []
    if not flat.get("tie_word_embeddings", False):
        modules.append("lm_head")
    for i in range(n):
        p = f"model.layers.{i}."
        plain += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if family.attention == "mla":
            q = ["self_attn.q_a_proj", "self_attn.q_b_proj"] if flat.get("q_lora_rank") else ["self_attn.q_proj"]
            if flat.get("q_lora_rank"):
                plain.append(p + "self_attn.q_a_layernorm.weight")
            plain.append(p + "self_attn.kv_a_layernorm.weight")
            modules += [p + m for m in (*q, "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj")]
            if roles is not None and i < len(roles) and roles[i] == "full":
                modules += [p + "self_attn.indexer.wq_b", p + "self_attn.indexer.wk",
                            p + "self_attn.indexer.weights_proj"]
        else:
            modules += [p + f"self_attn.{x}_proj" for x in "qkvo"]
            if mt.startswith("qwen3"):
                plain += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if experts and i < len(kinds) and kinds[i] == "sparse":
            plain.append(p + "mlp.gate.weight")
            modules += [f"{p}mlp.experts.{e}.{x}_proj" for e in range(experts) for x in ("gate", "up", "down")]
            if family.attention == "mla" and _int(flat, "n_shared_experts"):
                modules += [f"{p}mlp.shared_experts.{x}_proj" for x in ("gate", "up", "down")]
        else:
            modules += [f"{p}mlp.{x}_proj" for x in ("gate", "up", "down")]
    return plain, modules


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
    missing_plain = [t for t in plain if t not in tensors]
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

"""The tensor shapes config.json implies, checked against the safetensors headers (``shape-mismatch``).

The engine sizes every parameter from the config (``atomtool.serve.models``), so a config.json that
disagrees with the weights (``head_dim``, ``num_key_value_heads``, ``hidden_size``, ... edited, or left out and
defaulted by transformers to another model's value, e.g. ``Qwen3Config.head_dim`` 128) only fails when the
weights are copied in. This module computes, from the config as the engine builds its model
(:func:`atomtool.inspect.hf_config.complete_config_dict`: transformers' defaults filled in), the shape of each
tensor the engine loads and compares it with the stored one, so inspect says so (and convert and the loader
refuse up front, naming the field, its value and the tensor).

Which tensors exist is :func:`atomtool.inspect.required.layout_entries` (HF transformers' names; one list with
the missing-tensor check); their shapes are the tables below, as HF's modeling code builds them
(``LlamaAttention``/``Qwen3Attention``: q/k/v/o and per-head q/k norms; ``DeepseekV3Attention``: MLA
q_a/q_b/kv_a/kv_b/o; ``DeepseekV32Indexer``/``GlmMoeDsaIndexer``: wq_b/wk/k_norm/weights_proj; MoE router,
experts and shared experts (``moe_intermediate_size x n_shared_experts``)). Only what is exact is compared:
float and FP8 tensors (stored unpacked; an FP8 block ``weight_scale_inv`` is checked against its weight by
:func:`atomtool.inspect.quant.classify_module`, so it follows); packed 4-bit/int payloads (AWQ, GPTQ, NVFP4,
MXFP4, compressed-tensors) are skipped (the engine does not run them anyway), as are an atomtool layout's
fused tensors (convert wrote them from checked sources) and MTP layers (the engine does not load them).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from atomtool.inspect.config_check import EXPERT_COUNT_FIELDS
from atomtool.inspect.families import Family
from atomtool.inspect.hf_config import complete_config_dict
from atomtool.inspect.required import layout_entries
from atomtool.inspect.types import FLOAT_DTYPES, Finding, TensorInfo

#: the finding code (error): a stored tensor's shape is not the one config.json implies
SHAPE_MISMATCH = "shape-mismatch"
#: dtypes stored unpacked (the header shape is the logical shape)
EXACT_DTYPES = FLOAT_DTYPES | {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
#: tensors listed after the first mismatch of a kind
MAX_LISTED = 3

_DENSE_MLP = {
    "mlp.gate_proj": ("intermediate_size", "hidden_size"),
    "mlp.up_proj": ("intermediate_size", "hidden_size"),
    "mlp.down_proj": ("hidden_size", "intermediate_size"),
    "mlp.gate.weight": ("EXPERTS", "hidden_size"),  # EXPERTS: the family's routed-expert count field
    "mlp.gate.e_score_correction_bias": ("EXPERTS",),
    "mlp.experts.*.gate_proj": ("moe_intermediate_size", "hidden_size"),
    "mlp.experts.*.up_proj": ("moe_intermediate_size", "hidden_size"),
    "mlp.experts.*.down_proj": ("hidden_size", "moe_intermediate_size"),
}
_COMMON = {
    "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
    "lm_head": ("vocab_size", "hidden_size"),
    "model.norm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    **_DENSE_MLP,
}
#: GQA families (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE): linear modules as [out, in], tensors as their shape
GQA_SHAPES = {
    **_COMMON,
    "self_attn.q_proj": ("num_attention_heads*head_dim", "hidden_size"),
    "self_attn.k_proj": ("num_key_value_heads*head_dim", "hidden_size"),
    "self_attn.v_proj": ("num_key_value_heads*head_dim", "hidden_size"),
    "self_attn.o_proj": ("hidden_size", "num_attention_heads*head_dim"),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
}
#: MLA (+ DSA indexer, + MoE with shared experts) families: DeepSeek-V3/V3.2, GLM-5.x
MLA_SHAPES = {
    **_COMMON,
    "self_attn.q_a_proj": ("q_lora_rank", "hidden_size"),
    "self_attn.q_a_layernorm.weight": ("q_lora_rank",),
    "self_attn.q_b_proj": ("num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)", "q_lora_rank"),
    "self_attn.q_proj": ("num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)", "hidden_size"),
    "self_attn.kv_a_proj_with_mqa": ("kv_lora_rank+qk_rope_head_dim", "hidden_size"),
    "self_attn.kv_a_layernorm.weight": ("kv_lora_rank",),
    "self_attn.kv_b_proj": ("num_attention_heads*(qk_nope_head_dim+v_head_dim)", "kv_lora_rank"),
    "self_attn.o_proj": ("hidden_size", "num_attention_heads*v_head_dim"),
    "self_attn.indexer.wq_b": ("index_n_heads*index_head_dim", "q_lora_rank"),
    "self_attn.indexer.wk": ("index_head_dim", "hidden_size"),
    "self_attn.indexer.k_norm.weight": ("index_head_dim",),
    "self_attn.indexer.k_norm.bias": ("index_head_dim",),
    "self_attn.indexer.weights_proj": ("index_n_heads", "hidden_size"),
    "mlp.shared_experts.gate_proj": ("moe_intermediate_size*n_shared_experts", "hidden_size"),
    "mlp.shared_experts.up_proj": ("moe_intermediate_size*n_shared_experts", "hidden_size"),
    "mlp.shared_experts.down_proj": ("hidden_size", "moe_intermediate_size*n_shared_experts"),
}

_NAME = re.compile(r"[A-Za-z_]\w*")


def _values(cfg: dict[str, Any]) -> dict[str, int]:
    """The config's non-negative integer fields, with the engine's fallbacks for a model_type transformers
    does not complete (``atomtool.serve.models.llama``: ``head_dim`` = hidden_size // num_attention_heads,
    ``num_key_value_heads`` = num_attention_heads)."""
    vals = {k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    heads = vals.get("num_attention_heads")
    if heads:
        vals.setdefault("num_key_value_heads", heads)
        if "hidden_size" in vals:
            vals.setdefault("head_dim", vals["hidden_size"] // heads)
    return vals


def _eval(expr: str, vals: dict[str, int]) -> int | None:
    """The value of a dimension expression (field names, ``+``, ``*``, parentheses); None when a field is
    absent or not an integer."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Name):
            return vals[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return ev(node.left) + ev(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return ev(node.left) * ev(node.right)
        raise ValueError(expr)

    try:
        return ev(ast.parse(expr, mode="eval").body)
    except KeyError:
        return None


def _render(expr: str, vals: dict[str, int]) -> str:
    """``num_key_value_heads*head_dim`` -> ``num_key_value_heads=8 x head_dim=16`` (with the values)."""
    text = _NAME.sub(lambda m: f"{m.group()}={vals[m.group()]}", expr)
    return text.replace("*", " x ").replace("+", " + ")


_SHARED_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.)(mlp\.shared_experts\.(?:gate|up|down)_proj)\.weight$")


def _stored_shared_experts(tensors: dict[str, TensorInfo], entries: list[tuple[str, str, str]],
                           cfg: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Shape entries for the shared-expert modules stored on a decoder layer of a config with
    ``n_shared_experts: 0``: transformers builds them with ``moe_intermediate_size x 0`` rows (and writes
    such empty tensors), so stored rows disagree with config.json (transformers refuses them as a size
    mismatch, the engine as unexpected tensors) -- only empty ones load."""
    n = cfg.get("num_hidden_layers")
    listed = {name for name, _, _ in entries}
    out = []
    for name in tensors:
        m = _SHARED_EXPERT.match(name)
        if m and isinstance(n, int) and int(m.group(2)) < n and m.group(1) + m.group(3) not in listed:
            out.append((m.group(1) + m.group(3), "module", m.group(3)))
    return out


def shape_findings(tensors: dict[str, TensorInfo], cfg: dict[str, Any], family: Family | None,
                   roles: list[str] | None, defaults: dict[str, str],
                   located: dict[str, str] | None = None) -> list[Finding]:
    """``shape-mismatch`` error findings: stored tensors whose shape is not the one ``cfg`` implies.

    Args:
        tensors: the header tensors by name.
        cfg: the flattened text config completed with transformers' defaults
            (:func:`atomtool.inspect.hf_config.complete_config_dict`), as the engine builds its model from it.
        family: the architecture's family (only ``llama``, ``qwen3_moe`` and ``deepseek_mla`` layouts are
            known: :data:`atomtool.inspect.required.KNOWN_LAYOUT_FAMILIES`).
        roles: the DSA schedule (``full`` layers hold an indexer), or None.
        defaults: field -> where its value comes from when config.json does not set it (``transformers'
            MistralConfig default``), named in the message.
        located: tensor name -> where an atomtool layout stores it (``rows 64:96 of ...qkv_proj.weight``),
            for the messages (:func:`layout_source_tensors`).
    Returns:
        one finding per cause (the defaulted config fields the wrong dimensions come from, else all of their
        fields), naming the first tensor (and how many more), its stored and implied shape, each wrong
        dimension as the config fields and values it is computed from, and the fields that are defaults.
        [] when everything that can be compared agrees.
    """
    if not tensors or family is None or not any(n.startswith("model.layers.") for n in tensors):
        return []
    entries = layout_entries(cfg, family, roles)
    if entries is None:
        return []
    table = MLA_SHAPES if family.attention == "mla" else GQA_SHAPES
    vals = _values(cfg)
    if family.attention == "mla" and vals.get("n_shared_experts") == 0:
        entries = entries + _stored_shared_experts(tensors, entries, cfg)
    # the routed-expert count's field name differs by family (n_routed_experts, num_experts, ...)
    experts = next((f for f in EXPERT_COUNT_FIELDS if vals.get(f)), "n_routed_experts")
    sized: dict[str, tuple[tuple[str, ...], list[int | None]]] = {}  # rel -> (dims, values), once per rel
    for rel, dims in table.items():
        dims = tuple(d.replace("EXPERTS", experts) for d in dims)
        sized[rel] = (dims, [_eval(d, vals) for d in dims])
    groups: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for name, kind, rel in entries:
        dims, expected = sized.get(rel, ((), [None]))
        if None in expected:
            continue
        checks = [(name, dims, expected)] if kind != "module" else [
            (f"{name}.weight", dims, expected), (f"{name}.bias", dims[:1], expected[:1])]
        for tname, tdims, want in checks:
            t = tensors.get(tname)
            if t is None or t.dtype not in EXACT_DTYPES or tuple(t.shape) == tuple(want):
                continue
            if len(t.shape) != len(want):
                wrong = list(range(len(want)))
            else:
                wrong = [i for i, (a, b) in enumerate(zip(t.shape, want, strict=True)) if a != b]
            fields = {f for i in wrong for f in _NAME.findall(tdims[i])}
            # one finding per cause: the defaulted fields involved when there are some, else the fields
            key = tuple(sorted(fields & set(defaults) or fields))
            parts = [f"dim {i} = {_render(tdims[i], vals)}" + ("" if _NAME.fullmatch(tdims[i]) else f" = {want[i]}")
                     for i in wrong]
            where = f" ({located[tname]})" if located and tname in located else ""
            groups.setdefault(key, []).append((tname, f"{tname}{where} is {list(t.shape)} but config.json implies "
                                                      f"{list(want)} ({'; '.join(parts)})"))
    out = []
    for key, items in groups.items():
        first_name, first = items[0]
        notes = [f"; {f}={vals[f]} is {defaults[f]} (config.json does not set it)" for f in key if f in defaults]
        more = ""
        if len(items) > 1:
            listed = ", ".join(n for n, _ in items[1:1 + MAX_LISTED])
            more = (f"; {len(items) - 1} more tensor(s) disagree the same way ({listed}"
                    + (", ..." if len(items) > 1 + MAX_LISTED else "") + ")")
        out.append(Finding(SHAPE_MISMATCH, "error", first_name.rsplit(".", 1)[0],
                           f"shape mismatch between config.json and the weights: {first}{''.join(notes)}{more}; "
                           f"the engine cannot load these weights with this config.json"))
    return out


def config_shape_findings(tensors: dict[str, TensorInfo], flat: dict[str, Any], family: Family | None,
                          filled: list[tuple[str, Any, str]], roles: list[str] | None,
                          layout_sources: tuple[dict[str, TensorInfo], dict[str, str]] | None = None
                          ) -> list[Finding]:
    """:func:`shape_findings` for a (valid) flattened text config as config.json states it: completed with
    transformers' defaults first (:func:`atomtool.inspect.hf_config.complete_config_dict`, as the engine's
    loader completes it), and every field that is such a default named as one in the messages. inspect and
    the engine's loader (raw checkpoints and layouts) both call this.

    filled: ``(field, value, config class name)`` already filled into ``flat``
    (:func:`atomtool.inspect.hf_config.fill_transformers_defaults`: ``num_key_value_heads`` ...).
    layout_sources: for an atomtool layout, :func:`layout_source_tensors` of its specs (the tensors inside
    its fused / stacked ones; the stored tensors in ``tensors`` take precedence).
    """
    if family is None or not (tensors or layout_sources):
        return []
    cfg, more, cls_name, err = complete_config_dict(flat)
    if err is not None:
        return []
    defaults = {f: f"transformers' {cls} default" for f, _, cls in filled}
    defaults.update({f: f"transformers' {cls_name} default" for f in more})
    located = None
    if layout_sources is not None:
        tensors, located = {**layout_sources[0], **tensors}, layout_sources[1]
    return shape_findings(tensors, cfg, family, roles, defaults, located)


def layout_source_tensors(specs: dict[str, Any]) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The source tensors inside an atomtool layout's tensors, as its manifest records them
    (``OutputTensor`` specs, :func:`atomtool.convert.layout.load_layout_specs`): a copied / cast tensor as
    itself; each part of a ``concat`` (rows of a fused tensor, e.g. ``k_proj`` in ``qkv_proj``) or ``stack``
    (rows of one expert's slice of ``mlp.experts.w13``) with its own rows and the fused tensor's trailing
    dims (padding rows excluded), so :func:`shape_findings` checks them by their HF names.

    Returns:
        (tensor by source name, source name -> where it lives in the layout, for messages).
    """
    tensors: dict[str, TensorInfo] = {}
    located: dict[str, str] = {}
    for name, spec in specs.items():
        stacked = spec.op == "stack"
        trailing = tuple(spec.shape[2:] if stacked else spec.shape[1:])
        for part in spec.parts:
            if part.rows is None or (part.source == name and len(spec.parts) == 1):
                tensors.setdefault(part.source, TensorInfo(part.source, spec.dtype, tuple(spec.shape), ""))
                continue
            start, end = part.rows
            tensors[part.source] = TensorInfo(part.source, spec.dtype, (end - start, *trailing), "")
            slice_of = f"expert {part.stack_index} of {name}" if stacked else name
            located[part.source] = f"rows {start}:{end} of {slice_of} in the layout"
    return tensors, located

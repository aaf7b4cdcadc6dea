"""Architecture registry: HF ``architectures`` -> family facts (fusions, FP32 keeps, servability).

Fusion rules are data here and nowhere else; convert builds its plan from them and serve loads through
that plan (DESIGN.md principle 1-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atomtool.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class FusionRule:
    """Row-concatenate sibling linear modules of one layer into one output module.

    output: module path relative to the layer (``self_attn.fused_qkv_a_proj``); parts: module paths
    relative to the layer, in row order; full_only_parts: appended only on layers whose DSA schedule
    role is ``full`` (``indexer.wk``, ``indexer.weights_proj``).
    """

    output: str
    parts: tuple[str, ...]
    full_only_parts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertRule:
    """Stack per-expert modules of an MoE layer into ``[E, ...]`` tensors.

    experts_prefix: path relative to the layer (``mlp.experts``); w13: (gate, up) module names inside
    one expert, row-concatenated per expert into ``{experts_prefix}.w13``; w2: the down projection,
    stacked into ``{experts_prefix}.w2``.
    """

    experts_prefix: str = "mlp.experts"
    w13: tuple[str, str] = ("gate_proj", "up_proj")
    w2: str = "down_proj"


@dataclass(frozen=True)
class Family:
    """Facts about one model family. attention: ``gqa`` | ``mla`` | ``other``."""

    name: str
    architectures: tuple[str, ...]
    attention: str
    servable: bool
    fusions: tuple[FusionRule, ...] = ()
    experts: ExpertRule | None = None
    #: tensor-name suffixes kept in FP32 whatever --dtype says
    fp32_keep: tuple[str, ...] = ()
    notes: str = ""
    extra_model_types: tuple[str, ...] = field(default=())
    #: ``hidden_act`` values (transformers' ``ACT2FN`` names) the engine's MLPs run for a servable family:
    #: the one list inspect's ``activation-not-servable`` and the engine's loader read
    activations: tuple[str, ...] = ("silu",)


_DENSE_FUSIONS = (
    FusionRule("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    FusionRule("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)
_MLA_FUSIONS = (
    FusionRule(
        "self_attn.fused_qkv_a_proj",
        ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
        full_only_parts=("self_attn.indexer.wk", "self_attn.indexer.weights_proj"),
    ),
    FusionRule("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    FusionRule("mlp.shared_experts.gate_up_proj", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"),
           "gqa", True, _DENSE_FUSIONS),
    Family("deepseek_mla",
           ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"),
           "mla", True, _MLA_FUSIONS, ExpertRule(), fp32_keep=("mlp.gate.e_score_correction_bias",)),
    # Recognised for inspect only (classification, totals); serve does not run them yet.
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "gqa", False, _DENSE_FUSIONS, ExpertRule()),
    Family("qwen3_next", ("Qwen3NextForCausalLM",), "other", False),
    Family("kimi", ("DeepseekV2ForCausalLM", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM",
                    "KimiK25ForConditionalGeneration"), "mla", False,
           fp32_keep=("mlp.gate.e_score_correction_bias",)),
    Family("minimax", ("MiniMaxM3ForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3ForConditionalGeneration",
                       "MiniMaxM3SparseForConditionalGeneration"),
           "gqa", False),
    Family("gpt_oss", ("GptOssForCausalLM",), "gqa", False),
)

_BY_ARCH = {arch: fam for fam in FAMILIES for arch in fam.architectures}

#: storage schemes the engine runs (the one definition: inspect's ``servable`` and serve's loader read it).
#: Float weights, plus FP8 with 2-D block scales (``weight_scale_inv``, DeepSeek/GLM releases); every other
#: quantized scheme (awq, gptq, int4_pack, nvfp4, mxfp4, per-tensor/channel fp8, ...) is refused.
SERVABLE_SCHEMES = frozenset({"bf16", "fp16", "fp32", "fp8_block"})


def supported_architectures() -> list[str]:
    """Architectures ``serve`` can run, sorted."""
    return sorted(a for f in FAMILIES if f.servable for a in f.architectures)


def family_for(architecture: str, *, strict: bool = False) -> Family | None:
    """Look up the family of an HF architecture name.

    Returns None for unknown architectures unless ``strict``, in which case
    :class:`UnsupportedArchitectureError` lists the supported ones.
    """
    fam = _BY_ARCH.get(architecture)
    if fam is None and strict:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return fam


#: ``hidden_act`` names that are another name of an activation the engine runs: transformers' ``ACT2FN``
#: maps ``swish`` to ``torch.nn.SiLU``, the same function as ``silu`` (x * sigmoid(x)). The engine's loader
#: hands the model the canonical name.
ACTIVATION_ALIASES = {"swish": "silu"}


def unsupported_activation(family: Family | None, config_flat: dict) -> str | None:
    """Why the engine cannot run a servable ``family``'s checkpoint with config.json's ``hidden_act``
    (transformers' default: silu) -- one line naming the value and the ones it runs (:attr:`Family.activations`,
    as ``atomtool.serve.models`` implements them, and their :data:`ACTIVATION_ALIASES`) --, or None
    (supported, or a family serve does not run)."""
    act = config_flat.get("hidden_act", "silu")
    canonical = ACTIVATION_ALIASES.get(act, act) if isinstance(act, str) else None  # (a list, a number: no)
    if family is None or not family.servable or canonical in family.activations:
        return None
    names = [*family.activations, *(a for a, c in ACTIVATION_ALIASES.items() if c in family.activations)]
    return (f"config.json: hidden_act {act!r} is not supported: the engine runs {family.name}-family MLPs with "
            f"{' or '.join(names)} only, so atomtool cannot serve this checkpoint")


#: rope types whose frequencies depend on the current sequence length (dynamic NTK scaling, Phi-3's longrope):
#: the engine precomputes one static rope table per model (``atomtool.serve.layers.rotary``) and refuses them
SEQUENCE_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def sequence_dependent_rope_message(rope_type: str) -> str:
    """The engine's one-line refusal of a :data:`SEQUENCE_DEPENDENT_ROPE_TYPES` rope type (the rotary layer
    raises it, inspect's ``feature-not-servable`` finding and the loader's early check say it)."""
    return f"rope type {rope_type!r} (sequence-length dependent) is not supported by the engine"


def rope_types(config_flat: dict) -> list[str]:
    """The rope types a config asks for: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older
    configs; ``type`` is the legacy key of ``rope_type``), also inside per-layer-type dicts
    (``{"full_attention": {...}, "sliding_attention": {...}}``). [] for plain rope (no such field)."""
    found: list[str] = []
    for field_name in ("rope_parameters", "rope_scaling"):
        rp = config_flat.get(field_name)
        if not isinstance(rp, dict):
            continue
        for d in [rp, *(v for v in rp.values() if isinstance(v, dict))]:
            t = d.get("rope_type", d.get("type"))
            if isinstance(t, str) and t not in found:
                found.append(t)
    return found


def _declared(config_flat: dict, key: str) -> object:
    """config.json's ``key``, or transformers' default for it (its config class for the model_type) when
    config.json leaves it out -- as the engine's loader completes the config before building the model."""
    if key in config_flat:
        return config_flat[key]
    from atomtool.inspect.hf_registry import config_field_default

    return config_field_default(str(config_flat.get("model_type", "")), key)


def unsupported_features(family: Family | None, config_flat: dict) -> list[str]:
    """Why the engine cannot run a servable ``family``'s checkpoint although transformers can: one line per
    config feature its models refuse, in the words the engine's layers raise them with (the one rule, read by
    inspect's ``feature-not-servable`` finding and by the loader before it builds a model):

    - MLA (``family.attention == "mla"``) without ``q_lora_rank`` (null: a plain ``q_proj``; DeepSeek-V2-Lite
      style) -- ``atomtool.serve.layers.mla`` builds only the q LoRA path;
    - MLA with ``attention_bias: true`` (biases on the MLA projections);
    - a sequence-length-dependent rope type (:data:`SEQUENCE_DEPENDENT_ROPE_TYPES`);
    - ``quantization_config.activation_scheme: static`` (calibrated per-tensor ``input_scale`` tensors): the FP8
      layers quantize activations per token at run time or not at all (``--fp8-activations``).

    An absent field means transformers' default for it (``DeepseekV3Config.q_lora_rank`` 1536). Returns []
    for a config the engine runs, or a family serve does not run (its own finding says so).
    """
    if family is None or not family.servable:
        return []
    out = []
    if family.attention == "mla":
        if _declared(config_flat, "q_lora_rank") is None:
            out.append("MLA without q_lora_rank (a plain q_proj) is not supported")
        if _declared(config_flat, "attention_bias"):
            out.append("MLA with attention_bias=true is not supported")
    out.extend(sequence_dependent_rope_message(t) for t in rope_types(config_flat)
               if t in SEQUENCE_DEPENDENT_ROPE_TYPES)
    qc = config_flat.get("quantization_config")
    if isinstance(qc, dict) and str(qc.get("activation_scheme", "")).lower() == "static":
        out.append("quantization_config activation_scheme 'static' (calibrated input_scale activation scales) is "
                   "not supported, whatever --fp8-activations says: the engine's FP8 layers quantize activations "
                   "per token at run time or not at all")
    return out

"""Two defects a fresh-user tester found in ``atomtool inspect`` (config-only sizes, atomtool/inspect/memory.py).

1. Sliding-window attention counted as full attention in the KV-cache estimate. Each config family marks its
   sliding-window layers its own way; transformers' config classes are the reference:
   - Mistral (``sliding_window`` alone, Mistral-7B-v0.1): every layer keeps the last ``sliding_window`` tokens;
   - Qwen2/Qwen3 (``use_sliding_window``, default false: the window is ignored even when set;
     ``max_window_layers``: layers ``i >= max_window_layers`` slide), Qwen2-MoE (odd-numbered layers below
     ``max_window_layers``), Qwen3-MoE (every layer);
   - Gemma2 / gpt-oss (alternating), Gemma3 (``sliding_window_pattern``, default 6), or an explicit
     ``layer_types`` list;
   - MiniMax-M1's ``attn_type_list`` (0 = lightning attention: no KV cache).
   The configs below use the real published field layout; KV bytes are worked out by hand in each test, and
   the per-layer kinds are also checked against transformers' own config classes
   (``cache_utils.get_layer_types_and_kwargs``, which sizes HF's KV cache).
2. The parameter estimate was a few percent off for MiniMax (M1 lightning layers counted as GQA, M3 dense
   layers counted as MoE and an unpublished MTP layer counted) and for DeepSeek with MTP (its MTP layer's
   ``embed_tokens`` and ``shared_head.head`` copies were missing). Expected counts come from the real tensor
   tables (tests/data/realworld/index, and the MiniMax-M2.7 table below), summed here, or from
   ``state_dict()`` of tiny transformers models.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from transformers.cache_utils import get_layer_types_and_kwargs
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.inspect import memory as mem
from atomtool.inspect.dsa import flatten_dsa_config
from tests.test_inspect_realworld import REALWORLD, SCALE_SUFFIXES, expand_index, table_parameters

# ----------------------------------------------------------------------------- configs (real field layout)

#: mistralai/Mistral-7B-v0.1 config.json: ``sliding_window`` 4096 and no layer_types / use_sliding_window
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
#: Mistral-7B-v0.3 switched the window off (``sliding_window: null``)
MISTRAL_7B_V03 = {**MISTRAL_7B_V01, "sliding_window": None, "vocab_size": 32768, "rope_theta": 1000000.0}
#: Qwen/Qwen2.5-7B-Instruct: a window of 131072 is set but ``use_sliding_window`` is false
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
#: Qwen/Qwen3-8B (36 layers, 8 KV heads x head_dim 128), window off
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
#: Qwen/Qwen1.5-MoE-A2.7B (qwen2_moe): window set, switched off
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
#: google/gemma-2-9b: ``sliding_window`` 4096, no layer_types (Gemma2Config alternates, even layers slide)
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
    "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000,
}
#: google/gemma-3-1b-it (gemma3_text): ``sliding_window`` 512, ``sliding_window_pattern`` 6
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
#: MiniMaxAI/MiniMax-M1-80k config.json (remote code, ``attn_type_list``: 7 lightning layers then 1 softmax)
MINIMAX_M1 = {
    "architectures": ["MiniMaxM1ForCausalLM"], "attention_dropout": 0.0, "attn_type_list": ([0] * 7 + [1]) * 10,
    "auto_map": {"AutoConfig": "configuration_minimax_m1.MiniMaxM1Config",
                 "AutoModelForCausalLM": "modeling_minimax_m1.MiniMaxM1ForCausalLM"},
    "bos_token_id": None, "eos_token_id": None, "head_dim": 128, "hidden_act": "silu", "hidden_size": 6144,
    "initializer_range": 0.02, "intermediate_size": 9216, "layernorm_full_attention_alpha": 3.5565588200778455,
    "layernorm_full_attention_beta": 1.0, "layernorm_linear_attention_alpha": 3.5565588200778455,
    "layernorm_linear_attention_beta": 1.0, "layernorm_mlp_alpha": 3.5565588200778455, "layernorm_mlp_beta": 1.0,
    "max_position_embeddings": 10240000, "model_type": "minimax_m1", "num_attention_heads": 64,
    "num_experts_per_tok": 2, "num_hidden_layers": 80, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "postnorm": True, "rms_norm_eps": 1e-05, "rope_theta": 10000000,
    "rotary_dim": 64, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "shared_intermediate_size": 0,
    "shared_moe_mode": "sigmoid", "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "4.45.2", "use_cache": True, "vocab_size": 200064,
}


def _kv(cfg: dict) -> dict:
    return mem.kv_cache_bytes(flatten_dsa_config(cfg), None, 2)


def _hf_kinds(cfg: dict) -> tuple[list[str], int | None]:
    """Per-layer kinds and window as transformers' config class for ``model_type`` sets up its KV cache."""
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    types, kwargs = get_layer_types_and_kwargs(config)
    kinds = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    return [kinds[t] for t in types], kwargs.get("sliding_window")


# ----------------------------------------------------------------------------- 1. sliding-window KV


def test_mistral_v01_window_applies_to_every_layer():
    kv = _kv(MISTRAL_7B_V01)
    per_layer = 2 * 8 * 128 * 2  # K+V x 8 KV heads x head_dim 4096/32 x BF16 = 4096 B
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (0, 32, 4096)
    assert kv["kv_bytes_per_token"] == 0 and kv["swa_bytes_per_token_per_layer"] == per_layer
    # a 32k-token sequence keeps 4096 tokens per layer: 32 x 4096 x 4096 B = 512 MiB (not 32 x 32768 x 4096 B)
    assert mem.kv_bytes_for_context(kv, 32768) == 32 * 4096 * per_layer == 512 * 2**20
    assert mem.kv_bytes_for_context(kv, 100) == 32 * 100 * per_layer
    assert mem.layer_attention_kinds(MISTRAL_7B_V01) == _hf_kinds(MISTRAL_7B_V01)[0] == ["sliding"] * 32
    # v0.3 has no window: 32 full layers
    kv3 = _kv(MISTRAL_7B_V03)
    assert (kv3["kv_layers"], kv3["swa_layers"], kv3["kv_bytes_per_token"]) == (32, 0, 32 * per_layer)
    assert _hf_kinds(MISTRAL_7B_V03) == (["full"] * 32, None)


def test_mistral_v01_cli_says_the_cache_stops_growing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B_V01))
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--gpu-memory", "24"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "32 layers x 4096 B/token, at most 4,096 tokens each = 512.00 MiB" in out
    assert "no full-attention layer" in out
    row = next(line for line in out.splitlines() if "longest context in 24 GB" in line)
    # servable: the engine caps sequences at the window (context-capped-at-window), so does this line
    assert "4,096 tokens (capped by the sliding window; model max 32,768)" in row
    obj = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path), "--json"]).stdout)
    assert (obj["memory"]["kv_bytes_per_token"], obj["memory"]["swa_layers"]) == (0, 32)
    # a family atomtool does not serve (no cap): the cache alone does not limit the context
    phi = {**MISTRAL_7B_V01, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
    (tmp_path / "config.json").write_text(json.dumps(phi))
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--gpu-memory", "24"], env={"COLUMNS": "200"})
    row = next(line for line in res.stdout.splitlines() if "longest context in 24 GB" in line)
    assert "not limited by the KV cache" in row and "model max 32,768" in row, res.stdout


def test_qwen_use_sliding_window_false_ignores_the_window():
    for cfg, layers, per_layer in ((QWEN25_7B, 28, 2 * 4 * 128 * 2), (QWEN3_8B, 36, 2 * 8 * 128 * 2),
                                   (QWEN15_MOE, 24, 2 * 16 * 128 * 2)):
        kv = _kv(cfg)
        assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (layers, 0, None), cfg["model_type"]
        assert kv["kv_bytes_per_token"] == layers * per_layer
        assert _hf_kinds(cfg) == (["full"] * layers, None)
    # a layer_types list naming sliding layers does not slide either while use_sliding_window is false
    listed = {**QWEN25_7B, "layer_types": ["sliding_attention"] * 28}
    assert mem.layer_attention_kinds(listed) == ["full"] * 28


def test_qwen_use_sliding_window_true_follows_max_window_layers():
    per_layer = 2 * 4 * 128 * 2  # Qwen2.5-7B: 4 KV heads x head_dim 3584/28 = 128
    cfg = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    kv = _kv(cfg)
    # Qwen2Config: layer i slides iff i >= max_window_layers -> layers 20..27 (8) slide, 0..19 (20) are full
    assert mem.layer_attention_kinds(cfg) == ["full"] * 20 + ["sliding"] * 8 == _hf_kinds(cfg)[0]
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (20, 8, 4096)
    assert mem.kv_bytes_for_context(kv, 10_000) == 10_000 * 20 * per_layer + 4096 * 8 * per_layer
    q3 = {**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}
    assert mem.layer_attention_kinds(q3) == ["full"] * 28 + ["sliding"] * 8 == _hf_kinds(q3)[0]
    # Qwen2-MoE: odd-numbered layers (i + 1) % 2 below max_window_layers 21 -> 0, 2, ..., 20 (11 layers)
    moe = {**QWEN15_MOE, "use_sliding_window": True}
    kinds = mem.layer_attention_kinds(moe)
    assert [i for i, k in enumerate(kinds) if k == "sliding"] == list(range(0, 21, 2)) and kinds == _hf_kinds(moe)[0]
    assert _kv(moe)["kv_bytes_per_token"] == 13 * 2 * 16 * 128 * 2
    # Qwen3-MoE (no layer_types in its config class): every layer slides once the flag is on
    qwen3_moe = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048, "max_window_layers": 48,
                 "use_sliding_window": True, "sliding_window": 4096}
    assert mem.layer_attention_kinds(qwen3_moe) == ["sliding"] * 48 == _hf_kinds(qwen3_moe)[0]
    assert mem.layer_attention_kinds({**qwen3_moe, "use_sliding_window": False}) == ["full"] * 48


def test_gemma2_alternates_and_gemma3_uses_the_pattern():
    kv = _kv(GEMMA2_9B)
    per_layer = 2 * 8 * 256 * 2  # 8 KV heads x head_dim 256 -> 8192 B
    kinds = mem.layer_attention_kinds(GEMMA2_9B)
    assert kinds == ["sliding", "full"] * 21 == _hf_kinds(GEMMA2_9B)[0]
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (21, 21, 4096)
    assert mem.kv_bytes_for_context(kv, 8192) == 8192 * 21 * per_layer + 4096 * 21 * per_layer
    # Gemma3: full every 6th layer (5, 11, 17, 23) -> 4 full + 22 sliding of 1 KV head x 256 x 2 x 2 B = 1024 B
    kv3 = _kv(GEMMA3_1B)
    full = [i for i, k in enumerate(mem.layer_attention_kinds(GEMMA3_1B)) if k == "full"]
    assert full == [5, 11, 17, 23]
    assert mem.layer_attention_kinds(GEMMA3_1B) == _hf_kinds(GEMMA3_1B)[0]
    assert (kv3["kv_bytes_per_token"], kv3["swa_layers"], kv3["sliding_window"]) == (4 * 1024, 22, 512)
    # without the field Gemma3TextConfig's default pattern is 6 as well
    no_pattern = {k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"}
    assert mem.layer_attention_kinds(no_pattern) == mem.layer_attention_kinds(GEMMA3_1B) == _hf_kinds(no_pattern)[0]
    # gemma-3 multimodal: the text model sits in text_config
    vl = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": GEMMA3_1B}
    assert _kv(vl)["kv_bytes_per_token"] == 4 * 1024


def test_gpt_oss_without_layer_types_alternates():
    cfg = json.loads((REALWORLD / "configs" / "openai__gpt-oss-20b.json").read_text())
    del cfg["layer_types"]
    assert mem.layer_attention_kinds(cfg) == ["sliding", "full"] * 12 == _hf_kinds(cfg)[0]
    kv = _kv(cfg)
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (12, 12, 128)


def test_minimax_m1_lightning_layers_keep_no_kv():
    kv = _kv(MINIMAX_M1)
    # attn_type_list: 70 lightning (linear) layers, 10 softmax layers of 2 x 8 KV heads x 128 x 2 B = 4096 B
    assert (kv["kv_layers"], kv["linear_layers"], kv["swa_layers"]) == (10, 70, 0)
    assert kv["kv_bytes_per_token"] == 10 * 4096
    # transformers' MiniMaxConfig states the same schedule as layer_types
    hf = {"model_type": "minimax", "num_hidden_layers": 16, "layer_types": (["linear_attention"] * 7
                                                                             + ["full_attention"]) * 2}
    assert mem.layer_attention_kinds(hf) == _hf_kinds(hf)[0] == (["linear"] * 7 + ["full"]) * 2
    # MiniMax-M2.7 lists 62 softmax layers
    assert mem.layer_attention_kinds({"num_hidden_layers": 62, "attn_type_list": [1] * 62}) == ["full"] * 62


#: decoder model_types whose config.json may come without ``layer_types`` (older Hub files): each convention
SWA_FAMILIES = ["mistral", "mixtral", "phi3", "starcoder2", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "dots1",
                "gemma2", "gemma3_text", "cohere2", "olmo3", "exaone4", "gpt_oss", "vaultgemma", "afmoe", "minimax"]


@pytest.mark.parametrize("model_type", SWA_FAMILIES)
@pytest.mark.parametrize("use_flag", [None, True, False])
def test_default_layer_kinds_match_transformers_config_classes(model_type, use_flag):
    """The config as transformers' class writes it, minus the ``layer_types`` it derived (an older
    config.json): our per-layer kinds and window equal the layer types HF sizes its KV cache with."""
    extra = {} if use_flag is None else {"use_sliding_window": use_flag}
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=12, sliding_window=64,
                                               max_window_layers=5, **extra)
    types, kwargs = get_layer_types_and_kwargs(config)
    hf_window = kwargs.get("sliding_window")
    hf = ["linear" if t == "linear_attention" else "sliding" if t == "sliding_attention" and hf_window else "full"
          for t in types]
    raw = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
    raw["model_type"] = model_type
    assert mem.layer_attention_kinds(raw) == hf
    kv = mem.kv_cache_bytes(raw, None, 2)
    assert kv["sliding_window"] == (hf_window if "sliding" in hf else None)
    assert (kv["kv_layers"], kv["swa_layers"], kv["linear_layers"]) == (
        hf.count("full"), hf.count("sliding"), hf.count("linear"))


def test_use_sliding_window_flag_by_family():
    # Mistral's config class has no use_sliding_window: transformers slides every layer whatever it says
    assert mem.layer_attention_kinds({**MISTRAL_7B_V01, "use_sliding_window": False}) == ["sliding"] * 32
    # a model_type transformers does not know: the window applies to every layer unless the config turns it off
    new = {"model_type": "acme_lm", "num_hidden_layers": 4, "sliding_window": 1024}
    assert mem.layer_attention_kinds(new) == ["sliding"] * 4
    assert mem.layer_attention_kinds({**new, "use_sliding_window": False}) == ["full"] * 4


@pytest.mark.parametrize("bad", [0, -5, "4096", True, 4096.0])
def test_unusable_window_means_full_attention(bad):
    kv = _kv({**MISTRAL_7B_V01, "sliding_window": bad})
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (32, 0, None)


# ----------------------------------------------------------------------------- 2. parameter estimates


def test_deepseek_v3_mtp_layer_matches_the_real_table():
    """DeepSeek-V3 publishes 1 MTP layer (layer 61): a full MoE decoder layer + enorm, hnorm, eh_proj
    [7168, 14336], shared_head.norm, and its own embed_tokens / shared_head.head copies [129280, 7168]."""
    cfg = json.loads((REALWORLD / "configs" / "deepseek-ai__DeepSeek-V3.json").read_text())
    flat = flatten_dsa_config(cfg)
    tensors = expand_index("deepseek-ai__DeepSeek-V3.json")
    mtp_table = sum(t.numel for n, t in tensors.items()
                    if n.startswith("model.layers.61.") and not n.endswith(SCALE_SUFFIXES))
    without = mem.estimate_parameters({**flat, "num_nextn_predict_layers": 0})
    assert mem.estimate_parameters(flat) - without == mtp_table
    assert mem.estimate_parameters(flat) == table_parameters("deepseek-ai__DeepSeek-V3.json") == 684_489_845_504
    # the copies alone are 2 x 129280 x 7168 = 1.85B parameters (0.27% of the model)
    copies = sum(t.numel for n, t in tensors.items()
                 if n in ("model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight"))
    assert copies == 2 * 129280 * 7168


def test_minimax_m3_matches_the_real_table():
    """MiniMax-M3: dense layers 0-2 use dense_intermediate_size 12288 (moe_layer_freq), a 3072-wide shared
    expert, sparse index projections on layers 3-59, per-head q/k norms; the checkpoint has no MTP layer
    although the config says num_nextn_predict_layers 1. The vision tower is not estimated."""
    name = "MiniMaxAI__MiniMax-M3.json"
    cfg = json.loads((REALWORLD / "configs" / name).read_text())
    tensors = expand_index(name)
    params = {n: t.numel for n, t in tensors.items() if not n.endswith(SCALE_SUFFIXES)}
    text = sum(v for n, v in params.items() if n.startswith("language_model."))
    assert not [n for n in params if ".mtp" in n or "layers.60." in n]  # no MTP tensor published
    est = mem.estimate_parameters(flatten_dsa_config(cfg))
    assert est == text == 426_174_572_928
    assert abs(est - sum(params.values())) / sum(params.values()) < 0.005  # vision tower + projector: 0.2%


#: MiniMax-M2.7 (FP8) tensor table, from the public report gogongxt/python scripts/models/minimax_m2.7.md
#: (model_inspector.py over the 125 safetensors files; 96,103 tensors, 228,703,644,928 elements incl. scales):
#: (name pattern, shape, number of tensors)
MINIMAX_M27_TABLE = [
    ("lm_head.weight", [200064, 3072], 1),
    ("model.embed_tokens.weight", [200064, 3072], 1),
    ("model.layers.0-61.block_sparse_moe.e_score_correction_bias", [256], 62),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w1.weight", [1536, 3072], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w1.weight_scale_inv", [12, 24], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w2.weight", [3072, 1536], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w2.weight_scale_inv", [24, 12], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w3.weight", [1536, 3072], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.experts.0-255.w3.weight_scale_inv", [12, 24], 62 * 256),
    ("model.layers.0-61.block_sparse_moe.gate.weight", [256, 3072], 62),
    ("model.layers.0-61.input_layernorm.weight", [3072], 62),
    ("model.layers.0-61.post_attention_layernorm.weight", [3072], 62),
    ("model.layers.0-61.self_attn.k_norm.weight", [1024], 62),
    ("model.layers.0-61.self_attn.k_proj.weight", [1024, 3072], 62),
    ("model.layers.0-61.self_attn.k_proj.weight_scale_inv", [8, 24], 62),
    ("model.layers.0-61.self_attn.o_proj.weight", [3072, 6144], 62),
    ("model.layers.0-61.self_attn.o_proj.weight_scale_inv", [24, 48], 62),
    ("model.layers.0-61.self_attn.q_norm.weight", [6144], 62),
    ("model.layers.0-61.self_attn.q_proj.weight", [6144, 3072], 62),
    ("model.layers.0-61.self_attn.q_proj.weight_scale_inv", [48, 24], 62),
    ("model.layers.0-61.self_attn.v_proj.weight", [1024, 3072], 62),
    ("model.layers.0-61.self_attn.v_proj.weight_scale_inv", [8, 24], 62),
    ("model.norm.weight", [3072], 1),
]
#: its config.json fields (same report; ``quantization_config`` trimmed to what matters here)
MINIMAX_M27 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "attention_dropout": 0.0, "attn_type_list": [1] * 62,
    "bos_token_id": 200034, "eos_token_id": 200020, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "max_position_embeddings": 204800, "model_type": "minimax_m2",
    "mtp_transformer_layers": 1, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
    "vocab_size": 200064,
}


def test_minimax_m27_matches_the_real_table():
    rows = MINIMAX_M27_TABLE
    assert sum(c for _, _, c in rows) == 96_103
    assert sum(math.prod(s) * c for _, s, c in rows) == 228_703_644_928  # the report's element total
    params = sum(math.prod(s) * c for n, s, c in rows if not n.endswith(SCALE_SUFFIXES))
    # per-layer q/k norms [48 x 128] / [8 x 128], router bias, no shared expert, no MTP tensors (3 declared)
    assert mem.estimate_parameters(flatten_dsa_config(MINIMAX_M27)) == params


def test_minimax_m1_estimate():
    """MiniMax-M1: 70 lightning layers (qkv_proj [3 x 8192, 6144], output_gate [8192, 6144], out_proj
    [6144, 8192], norm [8192]: the layout sglang/vLLM load) and 10 GQA layers; published as 456B parameters."""
    est = mem.estimate_parameters(MINIMAX_M1)
    h, inner, v = 6144, 64 * 128, 200064
    lightning = 3 * inner * h + inner * h + h * inner + inner
    gqa = h * inner + 2 * h * 8 * 128 + inner * h
    moe = 32 * 3 * h * 9216 + 32 * h  # 32 experts (w1/w2/w3) + router
    assert est == 2 * v * h + h + 70 * lightning + 10 * gqa + 80 * (moe + 2 * h)
    assert abs(est - 456e9) / 456e9 < 0.005


#: persistent buffers transformers' MiniMaxLightningAttention derives from the head count and block_size
#: (ALiBi-style slopes and decay tables); the published MiniMax-Text-01/M1 checkpoints do not store them
DERIVED_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def _tiny_state_dict_params(model_cls, config) -> int:
    """Elements of a tiny model's state_dict (parameters + saved buffers such as MiniMax-M2's
    e_score_correction_bias), without the derived lightning-attention buffers."""
    with torch.device("meta"):
        model = model_cls(config)
    sd = model.state_dict()
    assert any(n.endswith(DERIVED_BUFFERS) for n in sd) == isinstance(config, transformers.MiniMaxConfig)
    return sum(t.numel() for n, t in sd.items() if not n.endswith(DERIVED_BUFFERS))


def test_minimax_hybrid_and_m2_match_transformers_models():
    """Oracle: the parameters a tiny transformers MiniMax (lightning hybrid) / MiniMax-M2 model saves."""
    layer_types = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg = transformers.MiniMaxConfig(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=3, num_experts_per_tok=2, layer_types=layer_types)
    expected = _tiny_state_dict_params(transformers.MiniMaxForCausalLM, cfg)
    assert mem.estimate_parameters(cfg.to_dict()) == expected
    # the same model in MiniMax-M1's own config form (attn_type_list, 0 = lightning)
    m1 = {**{k: v for k, v in cfg.to_dict().items() if k != "layer_types"}, "model_type": "minimax_m1",
          "attn_type_list": [0 if t == "linear_attention" else 1 for t in layer_types], "shared_intermediate_size": 0}
    assert mem.estimate_parameters(m1) == expected

    m2 = transformers.MiniMaxM2Config(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=3, num_experts_per_tok=2)
    expected = _tiny_state_dict_params(transformers.MiniMaxM2ForCausalLM, m2)
    # transformers' config has no qk_norm_type / use_routing_bias: MiniMaxM2 always has both
    assert mem.estimate_parameters(m2.to_dict()) == expected


def _hf_checkpoint_params(cfg: dict) -> int:
    """Parameters a transformers model built from ``cfg`` saves (meta device: no memory): every parameter
    once (tied lm_head not twice) plus persistent buffers that checkpoints store (router biases), without
    derived lightning-attention buffers."""
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "quantization_config", "auto_map")}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    saved = model.state_dict()
    params = {id(p): p.numel() for p in model.parameters()}
    buffers = [b.numel() for n, b in model.named_buffers() if n in saved and not n.endswith(DERIVED_BUFFERS)]
    return sum(params.values()) + sum(buffers)


def _real(name: str) -> dict:
    return json.loads((REALWORLD / "configs" / f"{name}.json").read_text())


#: MiniMax-M1 in transformers' own form (model_type minimax, layer_types), to build the HF model
MINIMAX_M1_HF = {**{k: v for k, v in MINIMAX_M1.items() if k != "attn_type_list"}, "model_type": "minimax",
                 "layer_types": ["linear_attention" if t == 0 else "full_attention" for t in MINIMAX_M1["attn_type_list"]]}


@pytest.mark.parametrize("cfg", [
    pytest.param(GEMMA2_9B, id="gemma-2-9b"), pytest.param(GEMMA3_1B, id="gemma-3-1b"),
    pytest.param(MISTRAL_7B_V01, id="mistral-7b-v0.1"), pytest.param(QWEN25_7B, id="qwen2.5-7b"),
    pytest.param(QWEN3_8B, id="qwen3-8b"), pytest.param(QWEN15_MOE, id="qwen1.5-moe"),
    pytest.param(_real("openai__gpt-oss-20b"), id="gpt-oss-20b"), pytest.param(_real("Qwen__Qwen3-0.6B"), id="qwen3-0.6b"),
    pytest.param(_real("meta-llama__Llama-3.1-8B"), id="llama-3.1-8b"),
    pytest.param(MINIMAX_M1_HF, id="minimax-m1-hf"), pytest.param(MINIMAX_M27, id="minimax-m2.7"),
    # transformers' DeepSeek-V3 / GLM-5 models have no MTP layer: compare without it
    pytest.param({**_real("deepseek-ai__DeepSeek-V3"), "num_nextn_predict_layers": 0}, id="deepseek-v3-no-mtp"),
    pytest.param({**_real("zai-org__GLM-5"), "num_nextn_predict_layers": 0}, id="glm-5-no-mtp"),
])
def test_estimate_equals_transformers_model_of_the_real_config(cfg):
    """Full-size real configs instantiated by transformers on the meta device: the estimate is exact.
    (Gemma ties lm_head by default and has 4 norms per layer, Gemma3 q/k norms; gpt-oss expert/router
    biases and attention sinks; Qwen2 qkv biases; MiniMax-M1 lightning layers; MiniMax-M2 per-layer q/k
    norms and router bias.)"""
    flat = flatten_dsa_config(cfg)
    assert mem.estimate_parameters(flat, flat.get("indexer_types")) == _hf_checkpoint_params(cfg)


#: XiaomiMiMo/MiMo-7B-RL config.json fields that size the model (MiMoForCausalLM subclasses Qwen2ForCausalLM)
MIMO_7B = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": 4096,
           "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
           "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "vocab_size": 151680}


def test_mimo_mtp_layer_has_no_embedding_copy():
    """MiMo-7B publishes ``model.mtp_layers.0``: a Qwen2 decoder layer + ``input_proj`` [h, 2h] +
    token/hidden/final layernorms, sharing the trunk's embeddings and head (unlike DeepSeek-V3)."""
    h = MIMO_7B["hidden_size"]
    qwen2 = {**MIMO_7B, "model_type": "qwen2", "num_nextn_predict_layers": 0}
    trunk = _hf_checkpoint_params(qwen2)
    one_layer = (trunk - _hf_checkpoint_params({**qwen2, "num_hidden_layers": 35}))
    assert mem.estimate_parameters(MIMO_7B) == trunk + one_layer + 2 * h * h + 3 * h


def test_minimax_m1_original_and_hf_forms_agree():
    assert mem.estimate_parameters(MINIMAX_M1) == mem.estimate_parameters(MINIMAX_M1_HF)
    assert mem.layer_attention_kinds(MINIMAX_M1) == mem.layer_attention_kinds(MINIMAX_M1_HF)


def test_estimate_refuses_unmodelled_linear_attention():
    qwen3_next = json.loads((REALWORLD / "configs" / "Qwen__Qwen3-Next-80B-A3B-Thinking.json").read_text())
    assert mem.estimate_parameters(flatten_dsa_config(qwen3_next)) is None


@pytest.mark.parametrize("name", ["zai-org__GLM-5.2-FP8.json", "moonshotai__Kimi-K2-Instruct.json"])
def test_other_real_tables_stay_within_half_a_percent(name):
    cfg = json.loads((REALWORLD / "configs" / name).read_text())
    flat = flatten_dsa_config(cfg)
    real = table_parameters(name)
    est = mem.estimate_parameters(flat, flat.get("indexer_types"))
    # Kimi-K2 stores 61 rotary_emb.inv_freq buffers [56] that are not parameters: 3,416 elements
    assert real - est == (61 * 56 if "Kimi" in name else 0)
    assert abs(est - real) / real < 0.005


def test_config_only_cli_totals_use_the_estimate(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MINIMAX_M1))
    obj = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path), "--json"]).stdout)
    assert obj["totals"]["parameters"] == mem.estimate_parameters(MINIMAX_M1)
    assert obj["memory"]["kv_bytes_per_token"] == 10 * 4096 and obj["memory"]["linear_layers"] == 70


"""The fixture builders themselves (tests/checkpoints.py): what every stage's tests rely on."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.checkpoints import (
    ARCHS,
    FP8_MAX,
    GLM_EXPLICIT_TYPES,
    GLM_FREQ_ROLES,
    build_model,
    dequantize_fp8_block,
    load_state_dict,
    make_tokenizer,
    quantize_fp8_block,
    write_ct_int4_checkpoint,
    write_hf_checkpoint,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_back_exactly(arch, tmp_path):
    path = write_hf_checkpoint(tmp_path / arch, arch, seed=7)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = build_model(arch, seed=7)
    ids = torch.tensor([[5, 9, 23, 40, 41, 7, 3, 60, 61, 62, 63, 64]])  # 12 > index_topk 8
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    # weights are non-trivial: norms are not all ones, router biases not all zero
    sd = load_state_dict(path)
    assert not torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))
    bias = [v for k, v in sd.items() if k.endswith("e_score_correction_bias")]
    assert all(b.abs().sum() > 0 for b in bias)


def test_seed_changes_weights(tmp_path):
    a = load_state_dict(write_hf_checkpoint(tmp_path / "a", "llama", seed=1))
    b = load_state_dict(write_hf_checkpoint(tmp_path / "b", "llama", seed=2))
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_glm_schedules(tmp_path):
    freq = write_hf_checkpoint(tmp_path / "f", "glm_moe_dsa", drop_config_keys=["indexer_types"])
    cfg = json.loads((freq / "config.json").read_text())
    assert "indexer_types" not in cfg and (cfg["index_topk_freq"], cfg["index_skip_topk_offset"]) == (2, 2)
    model = AutoModelForCausalLM.from_pretrained(freq)
    assert model.config.indexer_types == GLM_FREQ_ROLES
    explicit = write_hf_checkpoint(tmp_path / "e", "glm_moe_dsa", indexer_types=GLM_EXPLICIT_TYPES)
    cfg = json.loads((explicit / "config.json").read_text())
    assert cfg["indexer_types"] == GLM_EXPLICIT_TYPES and cfg.get("index_topk_freq") is None
    names = load_state_dict(explicit)
    for i, role in enumerate(GLM_EXPLICIT_TYPES):
        assert (f"model.layers.{i}.self_attn.indexer.wk.weight" in names) == (role == "full")


def test_bf16_keeps_fp32_router_bias_and_shards(tmp_path):
    path = write_hf_checkpoint(tmp_path / "v32", "deepseek_v32", dtype=torch.bfloat16, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    sd = load_state_dict(path)
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_tokenizer(tmp_path):
    path = write_hf_checkpoint(tmp_path / "q", "qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    text = "Hello, world! 42\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 128
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>hi\n<|assistant|>"
    assert len(make_tokenizer()) <= 128


@pytest.mark.parametrize("shape,block", [((40, 64), (16, 16)), ((96, 32), (128, 128)), ((33, 70), (16, 32))])
def test_fp8_block_quantization(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.1
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    deq = dequantize_fp8_block(q, s, block)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's scale range
    err = (deq - w).abs()
    bound = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]] * FP8_MAX / 16
    assert torch.all(err <= bound)
    assert q.float().abs().max() <= FP8_MAX


def test_ct_int4_packing_round_trips(tmp_path):
    src = write_hf_checkpoint(tmp_path / "l", "llama", seed=3)
    dst = write_ct_int4_checkpoint(src, tmp_path / "ct", group_size=32)
    sd, orig = load_state_dict(dst), load_state_dict(src)
    packed = sd["model.layers.0.mlp.up_proj.weight_packed"]
    scale = sd["model.layers.0.mlp.up_proj.weight_scale"].float()
    assert tuple(sd["model.layers.0.mlp.up_proj.weight_shape"].tolist()) == (128, 64)
    p = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], dim=-1).view(128, 64) - 8
    deq = (nibbles.view(128, 2, 32).float() * scale[..., None]).view(128, 64)
    w = orig["model.layers.0.mlp.up_proj.weight"]
    assert (deq - w).abs().max() <= scale.max() / 2 * 1.01  # round-to-nearest error of a 4-bit grid

"""The torch reference ops against independent formulations (HF modeling code, SDPA, complex rotation)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from atomtool.errors import EngineError
from atomtool.serve import ops
from atomtool.serve.layers.rotary import RotaryEmbedding
from atomtool.serve.ops import torch_ref
from tests.checkpoints import dequantize_fp8_block, quantize_fp8_block


def test_rms_norm_matches_hf_and_fuses_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(7, 32, generator=g), torch.randn(7, 32, generator=g)
    hf = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(32, generator=g) + 0.5)
    torch.testing.assert_close(torch_ref.rms_norm(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)
    out, new_res = torch_ref.rms_norm(x, hf.weight, 1e-5, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, hf(x + res), rtol=0, atol=0)
    xb = x.bfloat16()
    assert torch_ref.rms_norm(xb, hf.weight.bfloat16(), 1e-5).dtype == torch.bfloat16


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
])
def test_rotary_neox_matches_hf(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_theta": 500.0, **(rope or {"rope_type": "default"})}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=128,
                      rope_parameters=params)
    hf_rope = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(cfg.to_dict(), "cpu")
    g = torch.Generator().manual_seed(1)
    T = 9
    positions = torch.tensor([0, 1, 2, 5, 17, 31, 64, 100, 127])
    q, k = torch.randn(T, 4, 16, generator=g), torch.randn(T, 2, 16, generator=g)
    cos, sin = hf_rope(q, positions[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    oq, ok = ours(positions, q, k)
    torch.testing.assert_close(oq, hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ok, hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert ours.attention_scaling == pytest.approx(hf_rope.attention_scaling)


def test_rotary_interleaved_is_complex_rotation():
    # GPT-J / original DeepSeek convention: pairs (2i, 2i+1) rotated as complex numbers by e^{i pos theta_i}
    g = torch.Generator().manual_seed(2)
    T, H, R = 5, 3, 8
    x = torch.randn(T, H, R, generator=g)
    inv = 1.0 / (100.0 ** (torch.arange(0, R, 2).float() / R))
    pos = torch.tensor([0, 3, 7, 11, 40])
    ang = pos[:, None].float() * inv[None]
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(T, H, R // 2, 2)) * torch.polar(
        torch.ones_like(ang), ang)[:, None, :]).reshape(T, H, R)
    out = torch_ref.rotary_embedding(x, ang.cos(), ang.sin(), interleaved=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(torch_ref.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("shape,block", [((40, 24), (16, 16)), ((37, 50), (24, 16)), ((128, 64), (128, 128))])
def test_fp8_block_linear_dequantizes(shape, block):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=g) * 0.1
    q, s = quantize_fp8_block(w, block)
    x = torch.randn(3, shape[1], generator=g)
    ref = x @ dequantize_fp8_block(q, s, block).T
    torch.testing.assert_close(torch_ref.linear(x, q, None, s, block), ref, rtol=1e-5, atol=1e-5)
    b = torch.randn(shape[0], generator=g)
    torch.testing.assert_close(torch_ref.linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)


def _paged(seqs, H, Hkv, D, bs, num_blocks, g):
    """Scatter each sequence's contiguous K/V into a shuffled paged cache; returns everything needed."""
    k_cache = torch.zeros(num_blocks, bs, Hkv, D)
    v_cache = torch.zeros(num_blocks, bs, Hkv, D)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, kvs = [], []
    for L, _ in seqs:
        n = math.ceil(L / bs)
        blocks, perm = perm[:n], perm[n:]
        tables.append(blocks)
        k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(L)])
        torch_ref.store_kv(k, v, k_cache, v_cache, slots)
        kvs.append((k, v))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache, v_cache, bt, kvs


def test_paged_attention_prefill_chunk_decode_mixed():
    """One call covering a full prefill, a chunk on top of cached context, and decodes, with GQA, vs SDPA."""
    g = torch.Generator().manual_seed(4)
    H, Hkv, D, bs = 4, 2, 8, 4
    seqs = [(11, 11), (18, 5), (30, 1), (1, 1)]  # (kv length after the step, query length)
    k_cache, v_cache, bt, kvs = _paged(seqs, H, Hkv, D, bs, 32, g)
    qs = [torch.randn(ql, H, D, generator=g) for _, ql in seqs]
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([ql for _, ql in seqs]), 0)), dtype=torch.int32)
    lens = torch.tensor([L for L, _ in seqs], dtype=torch.int32)
    out = torch_ref.paged_attention(torch.cat(qs), k_cache, v_cache, cu, lens, bt, D ** -0.5)
    for i, ((L, ql), q, (k, v)) in enumerate(zip(seqs, qs, kvs, strict=True)):
        mask = torch.ones(ql, L, dtype=torch.bool).tril(diagonal=L - ql)
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, rtol=1e-5, atol=1e-5)


def test_store_cache_skips_padding_slots_and_gather_cache():
    cache = torch.zeros(3, 2, 4)
    x = torch.arange(12.0).reshape(3, 4)
    torch_ref.store_cache(x, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache.view(-1, 4)[5], x[0]) and torch.equal(cache.view(-1, 4)[0], x[2])
    assert int((cache != 0).any(-1).sum()) == 2  # only slots 5 and 0 were written
    got = torch_ref.gather_cache(cache, torch.tensor([2, 0, -1], dtype=torch.int32), 3)
    assert torch.equal(got, torch.stack([cache[2, 0], cache[2, 1], cache[0, 0]]))


def test_dispatch_reference_on_cpu_and_errors(monkeypatch):
    assert ops.get_op("rms_norm", "cpu") is torch_ref.rms_norm
    assert ops.backend_for("cpu") == "torch"
    with pytest.raises(EngineError, match="unknown op 'nope'"):
        ops.get_op("nope", "cpu")
    with pytest.raises(EngineError, match="unknown op backend 'cudnn'"):
        ops.set_backend("cudnn")
    monkeypatch.setenv("ATOMTOOL_BACKEND", "torch")
    assert ops.backend_for("cuda") == "torch"  # the explicit override forces the reference on a GPU device
    monkeypatch.setenv("ATOMTOOL_BACKEND", "fast")
    with pytest.raises(EngineError, match="ATOMTOOL_BACKEND='fast'"):
        ops.backend_for("cuda")


def test_dispatch_prefers_backend_and_falls_back(monkeypatch):
    def fake(*a):
        return "fake"

    monkeypatch.setitem(ops._REGISTRY, ("rms_norm", "aiter"), fake)
    monkeypatch.setattr(ops, "_loaded", {"aiter"})
    ops.set_backend("aiter")
    try:
        assert ops.get_op("rms_norm", "cuda") is fake
        assert ops.get_op("silu_and_mul", "cuda") is torch_ref.silu_and_mul  # not provided -> reference
        assert ops.get_op("rms_norm", "cpu") is torch_ref.rms_norm  # CPU tensors always use the reference
    finally:
        ops.set_backend(None)


@pytest.mark.parametrize("name", [
    "deepseek-ai__DeepSeek-V3.2.json", "deepseek-ai__DeepSeek-V3.json", "deepseek-ai__DeepSeek-R1.json",
    "zai-org__GLM-5-FP8.json", "Qwen__Qwen3-0.6B.json", "meta-llama__Llama-3.1-8B.json",
])
def test_rope_tables_build_from_published_configs(name):
    """Published configs (rope_scaling with YaRN / llama3 keys) build HF's own rope tables."""
    import json
    from pathlib import Path

    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.layers.rotary import rope_inv_freq

    raw = json.loads((Path(__file__).resolve().parent / "data/realworld/configs" / name).read_text())
    flat = flatten_dsa_config(raw)
    rope_dim = flat.get("qk_rope_head_dim")
    inv, scaling = rope_inv_freq(flat, rope_dim)
    # The oracle: transformers' own config class and rope init function on the same file.
    cfg = AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "transformers_version"})
    if rope_dim is not None:
        cfg.head_dim = rope_dim
    rope_type = (cfg.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        ref_inv, ref_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        torch.testing.assert_close(inv, ref_inv.float())
        assert scaling == pytest.approx(float(ref_scaling))
    assert inv.numel() == (rope_dim or cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads) // 2

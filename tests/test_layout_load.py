"""The layout fast path (atomtool.serve.layout_load) against the generic path (safe_open -> load_weights).

Oracle: the same model class fed by ``CausalLM.load_weights(loader._layout_tensors(...))`` -- the path every
layout took before the fast path -- compared bit for bit (parameters and buffers, as raw bytes). Cases cover
tensors loaded directly (dtype as stored), tensors cast on the way (float32 model over a bfloat16 layout),
FP8 block linears and FP8 experts kept as stored, padded FP8 experts dequantized by the model, several
shards, chunks that split tensors, several reader threads and the staged (CUDA-style) path on CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from atomtool.errors import EngineError, HeaderError
from atomtool.serve.layout_load import load_layout_weights
from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint
from tests.engine_fixtures import convert_checkpoint


def _build(layout, dtype, device="cpu"):
    from atomtool.convert.layout import load_layout_specs
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.loader import read_config
    from atomtool.serve.models.registry import get_model_class, resolve_architecture

    raw = read_config(layout)
    model = get_model_class(resolve_architecture(raw))(flatten_dsa_config(raw), load_layout_specs(layout),
                                                       dtype, torch.device(device))
    # poison every parameter so a tensor the loader forgets cannot match by accident
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.view(torch.uint8).fill_(0x5A) if t.numel() else None
    return model


def _old(layout, dtype, device="cpu"):
    from atomtool.serve.loader import _layout_tensors

    model = _build(layout, dtype, device)
    model.load_weights(_layout_tensors(layout))
    return model


def _bytes_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                           y.contiguous().reshape(-1).view(torch.uint8)), k


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    src = write_hf_checkpoint(root / "src", "qwen3", seed=2, dtype=torch.bfloat16, tokenizer=False)
    return convert_checkpoint(src, root / "layout")


@pytest.fixture(scope="module", params=[(24, 16), (16, 16)], ids=["padded-experts", "fp8-experts"])
def mla_fp8(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    src = write_hf_checkpoint(root / "src", "deepseek_v3", seed=4, tokenizer=False)
    dst = write_fp8_block_checkpoint(src, root / "fp8", block=request.param, float_dtype=torch.bfloat16,
                                     shards=2)
    return convert_checkpoint(dst, root / "layout")


@pytest.mark.parametrize("kw", [{}, dict(chunk_bytes=1000, workers=3), dict(staged=True, chunk_bytes=4096, workers=2),
                                dict(staged=True, direct_io=True, chunk_bytes=5000, workers=2)],
                         ids=["default", "small-chunks-3-threads", "staged", "staged-o-direct"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-direct", "fp32-cast"])
def test_dense_fast_path_is_bitwise_identical(dense, dtype, kw):
    new = _build(dense, dtype)
    stats = load_layout_weights(new, dense, **kw)
    _bytes_equal(new, _old(dense, dtype))
    if kw.get("direct_io") and dtype == torch.bfloat16:
        assert stats["o_direct_files"] == 1  # (tmp_path is on a file system with O_DIRECT)
    if dtype == torch.bfloat16:
        assert stats["fallback"] == 0 and stats["direct"] == len(new.expected_weight_names())
    else:  # float32 model over a bfloat16 layout: every float tensor is cast by load_weights
        assert stats["direct"] == 0


@pytest.mark.parametrize("kw", [{}, dict(staged=True, chunk_bytes=3000, workers=2),
                                dict(staged=True, direct_io=True, chunk_bytes=70000, workers=3)],
                         ids=["default", "staged", "staged-o-direct"])
def test_mla_fp8_fast_path_is_bitwise_identical(mla_fp8, kw):
    new = _build(mla_fp8, torch.bfloat16)
    stats = load_layout_weights(new, mla_fp8, **kw)
    _bytes_equal(new, _old(mla_fp8, torch.bfloat16))
    fp8 = [n for n, p in new.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert fp8 and stats["direct"] > len(fp8)
    experts_fp8 = any(".mlp.experts." in n for n in fp8)
    # padded experts are dequantized by the model: their weights and scales take the generic path
    assert (stats["fallback"] > 0) != experts_fp8


def test_load_model_uses_fast_path(dense, monkeypatch):
    from atomtool.serve import layout_load
    from atomtool.serve.loader import load_model

    calls = []
    real = layout_load.load_layout_weights
    monkeypatch.setattr(layout_load, "load_layout_weights", lambda *a, **k: calls.append(real(*a, **k)))
    loaded = load_model(dense, dtype="bfloat16", device="cpu")
    assert calls and calls[0]["fallback"] == 0
    _bytes_equal(loaded.model, _old(dense, torch.bfloat16))


def _shard(layout):
    return sorted(layout.glob("*.safetensors"))[0]


def _copy(layout, tmp_path):
    import shutil

    return shutil.copytree(layout, tmp_path / "copy")


def test_truncated_shard_is_a_header_error(dense, tmp_path):
    layout = _copy(dense, tmp_path)
    shard = _shard(layout)
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(HeaderError, match=rf"{shard.name}.*truncated"):
        load_layout_weights(_build(layout, torch.bfloat16), layout)


def test_corrupt_header_is_a_header_error(dense, tmp_path):
    layout = _copy(dense, tmp_path)
    shard = _shard(layout)
    with open(shard, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    with pytest.raises(HeaderError, match=rf"{shard.name}: declared header length"):
        load_layout_weights(_build(layout, torch.bfloat16), layout)


def test_missing_shard_and_tensor_not_in_shard(dense, tmp_path):
    layout = _copy(dense, tmp_path)
    index = json.loads((layout / "model.safetensors.index.json").read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"]["model.extra.weight"] = index["weight_map"][name]
    (layout / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match=r"index puts tensor model\.extra\.weight in this shard"):
        load_layout_weights(_build(layout, torch.bfloat16), layout)
    del index["weight_map"]["model.extra.weight"]
    (layout / "model.safetensors.index.json").write_text(json.dumps(index))
    _shard(layout).unlink()
    with pytest.raises(EngineError, match="layout shard is missing"):
        load_layout_weights(_build(layout, torch.bfloat16), layout)


def test_missing_and_misshaped_tensors_named_like_the_generic_path(dense, tmp_path):
    """A name the model lacks and a tensor the layout lacks: the same EngineError as load_weights gives."""
    layout = _copy(dense, tmp_path)
    index = json.loads((layout / "model.safetensors.index.json").read_text())
    gone = "model.norm.weight"
    del index["weight_map"][gone]
    (layout / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match=rf"missing tensors \(1\): {gone}"):
        load_layout_weights(_build(layout, torch.bfloat16), layout)
    model = _build(layout, torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    index["weight_map"][gone] = _shard(layout).name
    (layout / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match=rf"shape mismatches: {gone} \(\d+,\) \(model expects \(3,\)\)"):
        load_layout_weights(model, layout)


def test_model_without_preloaded_takes_the_generic_path(dense):
    """A load_weights override that predates ``preloaded`` still loads (every tensor through it)."""
    model = _build(dense, torch.bfloat16)
    generic = type(model).load_weights
    model.load_weights = lambda weights: generic(model, weights)
    stats = load_layout_weights(model, dense)
    assert stats["direct"] == 0 and stats["fallback"] == len(model.expected_weight_names())
    _bytes_equal(model, _old(dense, torch.bfloat16))


@pytest.fixture(scope="module")
def dsv32_fp8(tmp_path_factory):
    """A DeepSeek-V3.2 (MLA + DSA indexer + MoE) FP8 block checkpoint in DeepSeek's on-disk format: per-expert
    ``mlp.experts.{j}.*_proj.weight`` F8_E4M3 + ``weight_scale_inv``, two shards; and its layout."""
    root = tmp_path_factory.mktemp("dsv32")
    src = write_hf_checkpoint(root / "src", "deepseek_v32", seed=7, tokenizer=False)
    raw = write_fp8_block_checkpoint(src, root / "fp8", block=16, float_dtype=torch.bfloat16, shards=2)
    return raw, convert_checkpoint(raw, root / "layout")


def test_fp8_moe_layout_loads_stacked_experts_directly_and_equals_the_raw_load(dsv32_fp8, monkeypatch):
    """The layout's stacked FP8 experts and fused ``q_a ‖ kv_a`` go straight into the parameters (no tensor
    takes the generic path), and raw and layout loads give the same parameters, byte for byte. Oracle for
    the values: the source checkpoint's own per-expert tensors read with safetensors."""
    from atomtool.serve import layout_load
    from atomtool.serve.loader import load_model
    from tests.checkpoints import load_state_dict

    raw, layout = dsv32_fp8
    calls = []
    real = layout_load.load_layout_weights
    monkeypatch.setattr(layout_load, "load_layout_weights", lambda *a, **k: calls.append(real(*a, **k)))
    fast = load_model(layout, dtype="bfloat16", device="cpu").model
    assert calls and calls[0]["fallback"] == 0 and calls[0]["direct"] == len(fast.expected_weight_names())
    from_raw = load_model(raw, dtype="bfloat16", device="cpu").model
    _bytes_equal(fast, from_raw)

    src = load_state_dict(raw)
    params = dict(fast.named_parameters())
    moe = [i for i in range(len(fast.model.layers)) if f"model.layers.{i}.mlp.experts.w13.weight" in params]
    assert moe and params[f"model.layers.{moe[0]}.mlp.experts.w13.weight"].dtype == torch.float8_e4m3fn

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    for i in moe:
        e = f"model.layers.{i}.mlp.experts"
        for suffix in ("weight", "weight_scale_inv"):
            w13, w2 = params[f"{e}.w13.{suffix}"], params[f"{e}.w2.{suffix}"]
            half = w13.shape[1] // 2
            for j in range(w13.shape[0]):
                assert same(w13[j, :half], src[f"model.layers.{i}.mlp.experts.{j}.gate_proj.{suffix}"])
                assert same(w13[j, half:], src[f"model.layers.{i}.mlp.experts.{j}.up_proj.{suffix}"])
                assert same(w2[j], src[f"model.layers.{i}.mlp.experts.{j}.down_proj.{suffix}"])
    a = "model.layers.0.self_attn"
    fused = params[f"{a}.fused_qkv_a_proj.weight"]
    q_a, kv_a = src[f"{a}.q_a_proj.weight"], src[f"{a}.kv_a_proj_with_mqa.weight"]
    assert same(fused[:q_a.shape[0]], q_a) and same(fused[q_a.shape[0]:q_a.shape[0] + kv_a.shape[0]], kv_a)
    assert same(params[f"{a}.indexer.wk.weight"], src[f"{a}.indexer.wk.weight"])


def test_load_workers_from_the_environment(dense, monkeypatch):
    """``ATOMTOOL_LOAD_WORKERS`` sets the reader threads (same bytes); a bad value is a named EngineError."""
    from atomtool.serve import layout_load

    pools = []
    real = layout_load.ThreadPoolExecutor

    def spy(n, **kw):
        pools.append(n)
        return real(n, **kw)

    monkeypatch.setattr(layout_load, "ThreadPoolExecutor", spy)
    monkeypatch.setenv("ATOMTOOL_LOAD_WORKERS", "3")
    model = _build(dense, torch.bfloat16)
    load_layout_weights(model, dense, chunk_bytes=4096)
    assert pools == [3]
    _bytes_equal(model, _old(dense, torch.bfloat16))
    for bad in ("0", "x", "65", "-2"):
        monkeypatch.setenv("ATOMTOOL_LOAD_WORKERS", bad)
        with pytest.raises(EngineError, match=rf"ATOMTOOL_LOAD_WORKERS must be an integer from 1 to 64, got '{bad}'"):
            load_layout_weights(_build(dense, torch.bfloat16), dense)

"""User reports 6 (inspect): a new user checking `atomtool inspect` numbers and findings against independent
computation and against what `atomtool generate` does with the same checkpoint. Each test is a reproducer of
one defect, fixed since (the markers are off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import checkpoints as ck
from tests.inspect_cli import inspect_json


def _drop_tensors(src: Path, dst: Path, drop: set[str]) -> Path:
    """Copy the single-file checkpoint ``src`` to ``dst`` without the tensors named in ``drop``."""
    import shutil

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(f)
    assert drop <= set(tensors), drop - set(tensors)
    save_file({k: v for k, v in tensors.items() if k not in drop}, f, metadata={"format": "pt"})
    return dst


def _generate_refusal(path: Path) -> str:
    """The message `atomtool generate` / serve's loader refuses ``path`` with ("" when it loads)."""
    from atomtool.errors import AtomtoolError
    from atomtool.serve.loader import load_model

    try:
        load_model(str(path), device="cpu")
    except AtomtoolError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("arch,drop", [
    ("glm_moe_dsa", {"model.layers.0.self_attn.indexer.k_norm.weight", "model.layers.0.self_attn.indexer.k_norm.bias"}),
    ("deepseek_v3", {"model.layers.1.mlp.gate.e_score_correction_bias"}),
])
def test_missing_tensor_generate_refuses_is_an_inspect_error(tmp_path, arch, drop):
    src = ck.write_hf_checkpoint(tmp_path / "src", arch, dtype=torch.bfloat16, tokenizer=True)
    ckpt = _drop_tensors(src, tmp_path / "ckpt", drop)
    refusal = _generate_refusal(ckpt)
    assert "missing tensors" in refusal and all(n in refusal for n in drop), refusal
    obj, code = inspect_json(ckpt)
    errors = [f for f in obj["findings"] if f["severity"] == "error"]
    assert code == 1 and obj["servable"] is False, (code, obj["servable"], obj["findings"])
    assert any(all(n in f["message"] for n in drop) for f in errors), errors


def _fp8_glm(tmp_path: Path) -> Path:
    """The README's tiny GLM-MoE-DSA checkpoint in the GLM/DeepSeek FP8 block format (16x16 blocks)."""
    src = ck.write_hf_checkpoint(tmp_path / "hf", "glm_moe_dsa", dtype=torch.bfloat16)
    return ck.write_fp8_block_checkpoint(src, tmp_path / "fp8", block=(16, 16))


def _rewrite(ckpt: Path, edit) -> Path:
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return ckpt


def _warning_only(obj: dict, code: str) -> bool:
    """True when inspect reports ``code`` as a warning, no error, and calls the checkpoint servable."""
    sev = {f["code"]: f["severity"] for f in obj["findings"]}
    return sev.get(code) == "warning" and "error" not in sev.values() and obj["servable"] is True


def test_orphan_companion_warning_but_generate_refuses(tmp_path):
    ckpt = _rewrite(_fp8_glm(tmp_path), lambda t: t.__setitem__(
        "model.layers.0.mlp.foo_proj.weight_scale_inv", torch.ones(2, 2)))
    refusal = _generate_refusal(ckpt)
    obj, code = inspect_json(ckpt)
    # a warning must be something generate accepts; an error something it refuses
    assert refusal == "" or not _warning_only(obj, "orphan-companion"), (refusal, code, obj["findings"])


def test_fp8_lm_head_warning_but_generate_refuses(tmp_path):
    def quantize_lm_head(t: dict) -> None:
        q, s = ck.quantize_fp8_block(t["lm_head.weight"].float(), (16, 16))
        t["lm_head.weight"], t["lm_head.weight_scale_inv"] = q, s

    ckpt = _rewrite(_fp8_glm(tmp_path), quantize_lm_head)
    refusal = _generate_refusal(ckpt)
    obj, code = inspect_json(ckpt)
    assert refusal == "" or not _warning_only(obj, "excluded-but-stored-quantized"), (refusal, code, obj["findings"])


@pytest.mark.parametrize("name,shape", [("model.foo.weight", (4,)), ("model.layers.0.self_attn.q_proj.bias", (64,))])
def test_unexpected_tensor_generate_refuses_is_an_inspect_error(tmp_path, name, shape):
    src = ck.write_hf_checkpoint(tmp_path / "hf", "llama", dtype=torch.bfloat16)
    ckpt = _rewrite(src, lambda t: t.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16)))
    refusal = _generate_refusal(ckpt)
    assert ("unexpected tensors" in refusal or "unexpected-tensors" in refusal) and name in refusal, refusal
    obj, code = inspect_json(ckpt)
    errors = [f for f in obj["findings"] if f["severity"] == "error" and name in f["message"]]
    assert code == 1 and obj["servable"] is False and errors, (code, obj["findings"])


def test_float32_checkpoint_kv_bytes_match_what_serve_allocates_on_gpu(tmp_path):
    from atomtool.serve.engine.kv_cache import bytes_per_block
    from atomtool.serve.loader import load_model, resolve_dtype

    ckpt = ck.write_hf_checkpoint(tmp_path / "hf", "deepseek_v32", dtype=torch.float32)
    config = json.loads((ckpt / "config.json").read_text())
    gpu_dtype = resolve_dtype("auto", config, torch.device("cuda"))
    assert gpu_dtype == torch.bfloat16
    served = bytes_per_block(load_model(str(ckpt), device="cpu", dtype=gpu_dtype).model.kv_plane_specs(), 1)
    # independent: 3 layers x (kv_lora_rank 32 + qk_rope 8) + 3 indexer planes x index_head_dim 16, 2 bytes each
    assert served == 3 * (32 + 8) * 2 + 3 * 16 * 2
    obj, _ = inspect_json(ckpt, "--gpu-memory", "0.01")
    assert obj["memory"]["kv_bytes_per_token"] == served, obj["memory"]


#: the storage schemes docs/INSPECT_SCHEMA.md ("## Schemes") documents as totals.by_scheme / modules[].scheme values
DOCUMENTED_SCHEMES = {"bf16", "fp16", "fp32", "fp64", "fp8_block", "fp8_tensor", "fp8_channel", "mxfp8", "mxfp4",
                      "nvfp4", "int4_pack", "int8", "awq", "gptq", "bnb4", "unknown"}


def test_by_scheme_keys_are_documented_schemes(tmp_path):
    ckpt = _rewrite(_fp8_glm(tmp_path), lambda t: t.__setitem__(
        "model.embed_tokens.weight", t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)))
    obj, _ = inspect_json(ckpt)
    # documented since: tensors outside linear modules in a non-float dtype count under the dtype, lower case
    assert set(obj["totals"]["by_scheme"]) <= DOCUMENTED_SCHEMES | {"f8_e4m3"}, obj["totals"]["by_scheme"]
    assert "`f8_e4m3` for an embedding" in (Path(__file__).parents[1] / "docs" / "INSPECT_SCHEMA.md").read_text()


def test_gpu_memory_context_counts_only_weights_serve_loads(tmp_path):
    from atomtool.serve.loader import load_model

    src = ck.write_hf_checkpoint(tmp_path / "hf", "deepseek_v3", dtype=torch.bfloat16, num_nextn_predict_layers=1)
    mtp = {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.enorm.weight": (64,),
           "model.layers.3.hnorm.weight": (64,)}  # part of the MTP layer after the 3 decoder layers
    ckpt = _rewrite(src, lambda t: t.update({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in mtp.items()}))
    model = load_model(str(ckpt), device="cpu", dtype="bfloat16").model
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    assert not any(".layers.3." in n for n, _ in model.named_parameters())  # serve leaves the MTP layer out
    kv = 3 * (32 + 8) * 2  # 3 layers x (kv_lora_rank + qk_rope_head_dim) x BF16
    gpu_gb = 0.001
    obj, _ = inspect_json(ckpt, "--gpu-memory", str(gpu_gb))
    assert obj["memory"]["kv_bytes_per_token"] == kv
    assert obj["memory"]["max_context_tokens"] == (int(gpu_gb * 1e9) - loaded) // kv, (obj["memory"], loaded)


def test_memory_table_says_1_layer_not_1_layers(tmp_path):
    from tests.inspect_cli import run_inspect

    ckpt = ck.write_hf_checkpoint(tmp_path / "hf", "qwen2", dtype=torch.bfloat16, use_sliding_window=True,
                                  sliding_window=16, max_window_layers=1)
    res = run_inspect(str(ckpt))
    # layer 0 is full attention, layer 1 slides (transformers' Qwen2Config: i >= max_window_layers slides)
    assert "= 1 layer x 128 B" in res.stdout or "1 layers" not in res.stdout, res.stdout


def test_config_only_estimate_counts_or_names_the_vision_tower(tmp_path):
    from tests.inspect_cli import config_only

    cfg = json.loads((Path(__file__).parent / "data" / "realworld" / "configs" / "moonshotai__Kimi-K2.5.json")
                     .read_text())
    full, _ = inspect_json(config_only(tmp_path, cfg, "full"))
    text_only, _ = inspect_json(config_only(tmp_path, {k: v for k, v in cfg.items() if k != "vision_config"}, "text"))
    v = cfg["vision_config"]
    h, inter, layers = v["vt_hidden_size"], v["vt_intermediate_size"], v["vt_num_hidden_layers"]
    vision_lower_bound = layers * (4 * h * h + 2 * h * inter)  # attention q/k/v/o + 2 MLP matrices, no biases
    mentioned = any("vision" in f["message"] for f in full["findings"])
    grew = full["totals"]["parameters"] - text_only["totals"]["parameters"] >= vision_lower_bound
    assert mentioned or grew, (full["totals"]["parameters"], text_only["totals"]["parameters"], full["findings"])

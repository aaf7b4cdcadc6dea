"""Defects a fresh-user tester found in ``atomtool inspect``, each checked against real published configs
(tests/data/realworld) or tiny checkpoints written by transformers. Expected numbers are worked out by hand
from the config fields, in the comments.

1. KV cache of hybrid (Qwen3-Next), sliding-window (gpt-oss) and sparse-index (MiniMax-M3) models;
2. broken checkpoints (missing tensors, missing lm_head, unservable family) said "No findings";
3. error findings with ``servable: true`` / ``kv_bytes_per_token: 0``;
4. table formatting (title, trailing blanks, KV size unit, weights larger than the GPU, range legend,
   ``--tensors`` bytes);
5. F32 norms warned as a lossy cast; an offline cache mention of an hf_quant_config.json that never existed;
6. DeepSeek inference-demo configs called an unknown architecture;
7. pickle-only directories silently treated as config-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.inspect import memory as mem
from atomtool.inspect.classify import build_report
from atomtool.inspect.dsa import flatten_dsa_config
from tests.checkpoints import load_state_dict, write_hf_checkpoint, write_state_dict

CONFIGS = Path(__file__).resolve().parent / "data" / "realworld" / "configs"


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def _run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["inspect", *args], env=env)


def _config_dir(tmp_path: Path, cfg: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _json(*args: str) -> tuple[dict, int]:
    res = _run(*args, "--json")
    return json.loads(res.stdout), res.exit_code


# ----------------------------------------------------------------------------- 1. KV cache


def test_qwen3_next_counts_only_full_attention_layers(tmp_path):
    obj, code = _json(str(_config_dir(tmp_path, _cfg("Qwen__Qwen3-Next-80B-A3B-Thinking.json"))))
    m = obj["memory"]
    # full_attention_interval 4 over 48 layers: layers 3, 7, ..., 47 -> 12; the other 36 are linear attention.
    # per layer K+V: 2 x num_key_value_heads 2 x head_dim 256 x 2 B (bfloat16) = 2048 B
    assert (m["kv_layers"], m["linear_layers"], m["kv_bytes_per_token_per_layer"]) == (12, 36, 2048)
    assert m["kv_bytes_per_token"] == 12 * 2048 == 24576


def test_gpt_oss_sliding_layers_are_bounded_by_the_window(tmp_path):
    flat = flatten_dsa_config(_cfg("openai__gpt-oss-20b.json"))
    kv = mem.kv_cache_bytes(flat, None, 2)
    # layer_types alternate sliding/full over 24 layers: 12 full + 12 sliding (window 128);
    # per layer: 2 x num_key_value_heads 8 x head_dim 64 x 2 B = 2048 B
    assert (kv["kv_layers"], kv["swa_layers"], kv["sliding_window"]) == (12, 12, 128)
    assert kv["kv_bytes_per_token"] == 12 * 2048 and kv["swa_bytes_per_token_per_layer"] == 2048
    # longest context in 1 GB with no weights: the sliding layers hold 128 tokens at most
    # T tokens cost T x 24576 + min(T, 128) x 24576 -> T = 128 + (10^9 - 128 x 2 x 24576) // 24576
    t = mem.max_context_tokens(1, 0, 12 * 2048, 12 * 2048, 128)
    assert t == 128 + (10**9 - 128 * 2 * 24576) // 24576
    assert t * 24576 + 128 * 24576 <= 10**9 < (t + 1) * 24576 + 128 * 24576
    # a budget smaller than one window: every layer pays per token
    assert mem.max_context_tokens(1e-3, 0, 24576, 24576, 128) == 10**6 // (2 * 24576)
    res = _run(str(_config_dir(tmp_path, _cfg("openai__gpt-oss-20b.json"))), env={"COLUMNS": "200"})
    row = next(line for line in res.stdout.splitlines() if "sliding-window KV" in line)
    assert "12 layers x 2048 B/token, at most 128 tokens each" in row and "(not per token)" in row
    assert "24.00 KiB" in next(line for line in res.stdout.splitlines() if "KV cache / token" in line)


def test_gpt_oss_longest_context_in_the_report():
    cfg = _cfg("openai__gpt-oss-20b.json")
    cfg.pop("quantization_config")  # BF16 weights: their size is estimated from the config
    r = build_report("gpt-oss", cfg, {}, gpu_memory_gb=80)
    m = r.memory
    free = 80 * 10**9 - m["weights_bytes"]
    # 12 full layers x 2048 B per token; 12 sliding layers x 2048 B for at most 128 tokens
    assert m["max_context_tokens"] == (free - 128 * 12 * 2048) // (12 * 2048)


def test_minimax_m3_counts_sparse_index_keys(tmp_path):
    obj, _ = _json(str(_config_dir(tmp_path, _cfg("MiniMaxAI__MiniMax-M3.json"))))
    m = obj["memory"]
    # 60 GQA layers x 2 x num_key_value_heads 4 x head_dim 128 x 2 B = 60 x 2048;
    # sparse_attention_freq is 1 on layers 3..59 = 57 layers, each caching one sparse_index_dim 128 key (BF16)
    assert (m["kv_layers"], m["kv_bytes_per_token_per_layer"]) == (60, 2048)
    assert (m["index_layers"], m["index_bytes_per_token_per_layer"]) == (57, 256)
    assert m["kv_bytes_per_token"] == 60 * 2048 + 57 * 256 == 137472


# ----------------------------------------------------------------------------- 2. broken checkpoints


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3", seed=1, tokenizer=False)


def _copy_without(src: Path, dst: Path, drop: set[str]) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_state_dict(src)
    assert drop <= set(sd)
    write_state_dict(dst, {k: v for k, v in sd.items() if k not in drop})
    return dst


def test_intact_qwen3_has_no_missing_tensor_finding(qwen3):
    obj, code = _json(str(qwen3))
    assert code == 0 and obj["servable"] is True
    assert not [f for f in obj["findings"] if f["code"].startswith("missing-")]


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v32"])
def test_converted_layout_has_no_missing_tensor_finding(tmp_path, arch):
    """atomtool layouts store fused modules (qkv_proj, fused_qkv_a_proj) and stacked experts (w13/w2):
    the parts they hold count as present."""
    src = write_hf_checkpoint(tmp_path / "src", arch, seed=2, tokenizer=False)
    assert CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "out")]).exit_code == 0
    obj, code = _json(str(tmp_path / "out"))
    assert code == 0 and obj["servable"] is True
    assert not [f for f in obj["findings"] if f["code"].startswith("missing-")]


def test_missing_norm_and_down_proj_are_an_error(qwen3, tmp_path):
    drop = {"model.norm.weight", "model.layers.1.mlp.down_proj.weight"}
    d = _copy_without(qwen3, tmp_path / "broken", drop)
    obj, code = _json(str(d))
    assert code == 1 and obj["servable"] is False
    (f,) = [f for f in obj["findings"] if f["code"] == "missing-tensors"]
    assert f["severity"] == "error" and f["message"].startswith("2 required tensor(s) missing")
    assert all(name in f["message"] for name in drop)
    table = _run(str(d))
    assert table.exit_code == 1 and "No findings" not in table.stdout and "missing-tensors" in table.stdout


def test_untied_model_without_lm_head_is_an_error(qwen3, tmp_path):
    assert json.loads((qwen3 / "config.json").read_text())["tie_word_embeddings"] is False
    d = _copy_without(qwen3, tmp_path / "nohead", {"lm_head.weight"})
    obj, code = _json(str(d))
    assert code == 1 and obj["servable"] is False
    (f,) = [f for f in obj["findings"] if f["code"] == "missing-lm-head"]
    assert f["severity"] == "error" and "tie_word_embeddings is false" in f["message"]
    # tied: lm_head.weight is not expected
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    obj, code = _json(str(d))
    assert not [f for f in obj["findings"] if f["code"].startswith("missing-")]


def test_qwen3_moe_says_why_it_is_not_servable(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    res = _run(str(tmp_path / "moe"))
    assert res.exit_code == 0 and "No findings" not in res.stdout
    obj, _ = _json(str(tmp_path / "moe"))
    assert obj["servable"] is False
    (f,) = [f for f in obj["findings"] if f["code"] == "architecture-not-servable"]
    assert f["severity"] == "warning" and "Qwen3MoeForCausalLM" in f["message"] and "serve" in f["message"]
    assert not [f for f in obj["findings"] if f["code"].startswith("missing-")]  # every expert is there


# ----------------------------------------------------------------------------- 3. invalid configs


@pytest.mark.parametrize("layers", [1e9, 10**9], ids=["float", "int"])
def test_absurd_layer_count_is_not_servable_and_sizes_are_null(tmp_path, layers):
    for name in ("Qwen__Qwen3-0.6B.json", "deepseek-ai__DeepSeek-V3.2.json"):
        d = _config_dir(tmp_path / name, {**_cfg(name), "num_hidden_layers": layers})
        obj, code = _json(str(d))
        assert code == 1 and any(f["code"] == "config-invalid" for f in obj["findings"])
        assert obj["servable"] is False
        assert obj["memory"]["kv_bytes_per_token"] is None and obj["totals"]["parameters"] is None


@pytest.mark.parametrize("change", [{"index_topk_freq": 0}, "layer0-shared"])
def test_invalid_dsa_schedule_is_not_servable(tmp_path, change):
    cfg = _cfg("zai-org__GLM-5.2.json")
    if change == "layer0-shared":
        cfg["indexer_types"] = ["shared"] + cfg["indexer_types"][1:]
    else:
        cfg.pop("indexer_types")
        cfg.update(change)
    d = _config_dir(tmp_path, cfg)
    obj, code = _json(str(d))
    assert code == 1 and obj["servable"] is False
    assert [f["severity"] for f in obj["findings"] if f["code"] == "config-invalid"] == ["error"]
    assert obj["memory"]["kv_bytes_per_token"] is None and obj["totals"]["parameters"] is None
    row = next(line for line in _run(str(d)).stdout.splitlines() if "servable" in line)
    assert row.replace("│", " ").split()[-1] == "no"


# ----------------------------------------------------------------------------- 4. formatting


def test_long_path_is_printed_whole_on_its_own_line(tmp_path):
    d = _config_dir(tmp_path / ("checkpoint_" + "x" * 50) / "Qwen3-0.6B-instruct-long-name", _cfg("Qwen__Qwen3-0.6B.json"))
    res = _run(str(d), env={"COLUMNS": "60"})
    assert res.exit_code == 0
    assert any(str(d) in line for line in res.stdout.splitlines())  # never folded mid-word


def test_piped_output_has_no_trailing_blanks(tmp_path):
    cfg = {**_cfg("Qwen__Qwen3-0.6B.json"), "vocab_size": 0, "hidden_size": -1}  # two error findings
    res = _run(str(_config_dir(tmp_path, cfg)))
    assert res.exit_code == 1 and "vocab_size must be a positive integer" in res.stdout
    assert [line for line in res.stdout.splitlines() if line != line.rstrip()] == []


def test_kv_size_is_human_and_weights_larger_than_gpu_are_said(tmp_path):
    d = _config_dir(tmp_path, _cfg("meta-llama__Llama-3.1-8B.json"))
    res = _run(str(d), "--gpu-memory", "10", env={"COLUMNS": "200"})
    lines = res.stdout.splitlines()
    # 32 layers x 2 x num_key_value_heads 8 x head_dim 128 x 2 B = 131072 B = 128 KiB
    assert "128.00 KiB" in next(line for line in lines if "KV cache / token" in line)
    # 8.03e9 parameters x 2 B (bfloat16) = 16 GB > 10 GB
    row = next(line for line in lines if "longest context in 10 GB" in line)
    assert "weights alone" in row and "exceed 10 GB" in row and "0 tokens" not in row
    m = _json(str(d), "--gpu-memory", "10")[0]["memory"]
    assert m["weights_exceed_gpu_memory"] is True and m["max_context_tokens"] == 0
    m = _json(str(d), "--gpu-memory", "141")[0]["memory"]
    assert m["weights_exceed_gpu_memory"] is False
    assert m["max_context_tokens"] == (141 * 10**9 - m["weights_bytes"]) // 131072


def test_layer_range_notation_is_explained(tmp_path):
    res = _run(str(_config_dir(tmp_path, _cfg("zai-org__GLM-5.2.json"))), env={"COLUMNS": "200"})
    assert "6..74:4" in res.stdout  # GLM-5.2 full layers 0, 1, 2, 6, 10, ..., 74
    assert "a..b:s = a to b in steps of s" in res.stdout
    doc = (Path(__file__).resolve().parents[1] / "docs" / "INSPECT_SCHEMA.md").read_text()
    assert "6..74:4" in doc


def test_tensors_json_has_bytes(qwen3):
    obj, _ = _json(str(qwen3), "--tensors")
    t = next(t for t in obj["tensors"] if t["name"] == "model.layers.0.mlp.down_proj.weight")
    # float32 fixture: [hidden 64, intermediate 128] x 4 B
    assert t["shape"] == [64, 128] and t["dtype"] == "F32" and t["bytes"] == 64 * 128 * 4


# ----------------------------------------------------------------------------- 5. misleading warnings


def test_deepseek_v32_f32_norms_are_not_a_lossy_cast_warning():
    from tests.test_inspect_realworld import expand_index

    tensors = expand_index("deepseek-ai__DeepSeek-V3.2.json")
    r = build_report("ds", _cfg("deepseek-ai__DeepSeek-V3.2.json"), tensors)
    f = [x for x in r.findings if x.code == "float-dtype-differs"]
    assert not [x for x in f if x.severity == "warning"], f
    (info,) = f
    # F32 norms: 62 layers (61 + MTP) x (input, post-attention, q_a, kv_a layernorms, indexer k_norm weight and
    # bias) + enorm, hnorm, shared_head.norm, model.norm
    assert info.severity == "info" and info.message.startswith(f"{62 * 6 + 4} norm weight(s) stored F32")
    assert "kept as stored by convert" in info.message


def test_a_real_bf16_cast_still_warns():
    from atomtool.inspect.quant import dtype_findings
    from atomtool.inspect.types import TensorInfo

    t = {"model.layers.0.mlp.down_proj.weight": TensorInfo("model.layers.0.mlp.down_proj.weight", "F32", (4, 4), "a"),
         "model.norm.weight": TensorInfo("model.norm.weight", "F32", (4,), "a")}
    f = dtype_findings(t, "BF16")
    assert [(x.severity, x.module) for x in f] == [("info", "model.norm.weight"),
                                                    ("warning", "model.layers.0.mlp.down_proj.weight")]


# ----------------------------------------------------------------------------- 6. inference-demo configs


def test_deepseek_inference_demo_config_is_named(tmp_path):
    d = _config_dir(tmp_path, _cfg("deepseek-ai__DeepSeek-V3__inference-config_671B.json"))
    res = _run(str(d), env={"COLUMNS": "200"})
    assert res.exit_code == 1
    assert "this is not a Hugging Face config.json (looks like DeepSeek's inference-demo config" in res.stdout
    assert "unknown architecture" not in res.stdout


# ----------------------------------------------------------------------------- 7. pickle checkpoints


@pytest.mark.parametrize("name", ["model.bin", "model.pt"])
def test_pickle_only_directory_warns_that_weights_were_not_read(tmp_path, name):
    d = _config_dir(tmp_path, _cfg("Qwen__Qwen3-0.6B.json"))
    torch.save({"w": torch.zeros(2)}, d / name)
    obj, code = _json(str(d))
    (f,) = [f for f in obj["findings"] if f["code"] == "pickle-weights-ignored"]
    assert f["severity"] == "warning" and name in f["message"] and "only safetensors" in f["message"]
    res = _run(str(d), env={"COLUMNS": "200"})
    assert "pickle-weights-ignored" in res.stdout and "NOT read" in res.stdout
    (d / "config.json").unlink()
    res = _run(str(d))
    assert res.exit_code == 1 and f"found {name}: only safetensors is supported" in res.stderr

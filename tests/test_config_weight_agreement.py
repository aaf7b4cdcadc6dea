"""``atomtool inspect`` and the engine's loader (``generate``) agree on what is servable, and inspect catches
config.json / weight shape disagreements that used to fail only at generate time.

Every case is a tiny checkpoint written by transformers' ``save_pretrained`` whose config.json is then edited,
fed to both commands (and convert where it refuses up front):

1. ``num_key_value_heads`` absent where transformers' default is a fixed number (``MistralConfig`` 8,
   ``Qwen2Config`` 32): taken as transformers takes it; weights that agree load (inspect warns, naming the
   field; the tokens equal transformers' own greedy output on the same directory), weights that disagree
   are refused by both with one message naming the field, its value as transformers' default, the tensor and
   its shape;
2. size fields edited to disagree with the weights (dense and MLA/DSA/MoE, float and FP8 block) are a
   ``shape-mismatch`` error in inspect and the same message in generate, before any model is built; the real
   published tensor tables raise none, and an edited real config does;
3. a ``hidden_act`` the engine does not run: the same verdict and message in both (``swish``, SiLU in
   transformers' ``ACT2FN``, is served, equal to transformers' float32 greedy output);
4. a ``quantization_config`` that is not a JSON object is named as such by both (not blamed on the
   tokenizer).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.inspect.classify import build_report
from atomtool.inspect.dsa import flatten_dsa_config
from tests.checkpoints import make_tokenizer, randomize_, write_fp8_block_checkpoint, write_hf_checkpoint
from tests.engine_fixtures import convert_checkpoint
from tests.inspect_cli import inspect_json, run_inspect
from tests.test_inspect_realworld import REALWORLD, expand_index

PROMPT = "hello there"


# ----------------------------------------------------------------------------- fixtures and helpers


def write_mistral(path: Path, num_key_value_heads: int, seed: int = 0) -> Path:
    """A tiny MistralForCausalLM (8 heads of 8 dims, 2 layers, no sliding window) written by transformers."""
    cfg = transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=num_key_value_heads, head_dim=8, max_position_embeddings=256, sliding_window=None,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    cfg.architectures = ["MistralForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.MistralForCausalLM(cfg).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny checkpoints by name, written once per module (lazily)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            if name.startswith("mistral_kv"):
                made[name] = write_mistral(root / name, int(name.removeprefix("mistral_kv")))
            elif name == "deepseek_v3_fp8":
                made[name] = write_fp8_block_checkpoint(get("deepseek_v3"), root / name, block=16)
            else:
                made[name] = write_hf_checkpoint(root / name, name, seed=7)
        return made[name]

    return get


def edited(src: Path, dst: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """A copy of checkpoint ``src`` (other files symlinked) whose config.json lacks ``drop`` and has ``changes``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    for key in drop:
        assert key in cfg, f"fixture config has no {key}: the test would test nothing"
        del cfg[key]
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def generate(model_dir: Path, *extra: str):
    return CliRunner().invoke(app, ["generate", str(model_dir), "--prompt", PROMPT, "--max-tokens", "4",
                                    "--device", "cpu", *extra])


def generate_error(model_dir: Path) -> str:
    """The one ``error:`` line of a refused ``generate`` (exit 1, no traceback), without the prefix."""
    res = generate(model_dir)
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


def greedy_tokens(model_dir: Path) -> list[int]:
    res = generate(model_dir, "--json", "--ignore-eos", "--dtype", "float32")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)[0]["token_ids"]


def hf_greedy_tokens(model_dir: Path) -> list[int]:
    """transformers' own greedy continuation of :data:`PROMPT` from ``model_dir`` (float32, CPU)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def findings(model_dir: Path, code: str) -> tuple[list[dict], dict, int]:
    """(the findings with ``code``, the whole ``--json`` report, inspect's exit code)."""
    report, rc = inspect_json(model_dir)
    return [f for f in report["findings"] if f["code"] == code], report, rc


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail the test if the loader gets as far as building (allocating) a model."""
    import atomtool.serve.loader as loader

    def refuse(arch):
        raise AssertionError(f"the loader built a {arch} model before refusing the input")

    monkeypatch.setattr(loader, "get_model_class", refuse)


def assert_refused_alike(model_dir: Path, *needles: str) -> str:
    """inspect: ``shape-mismatch`` errors, not servable, exit 1; generate: one error line that carries the
    first such finding's message verbatim. One of the findings holds every needle; returns its message."""
    found, report, rc = findings(model_dir, "shape-mismatch")
    assert rc == 1 and not report["servable"], report["findings"]
    assert found and all(f["severity"] == "error" for f in found)
    line = generate_error(model_dir)
    assert line.startswith(f"{model_dir}: {found[0]['message']}"), (line, found[0])
    hits = [f["message"] for f in found if all(needle in f["message"] for needle in needles)]
    assert len(hits) == 1, (needles, [f["message"] for f in found])
    return hits[0]


# ----------------------------------------------------------------------------- 1. num_key_value_heads defaults


def test_mistral_without_kv_heads_that_fit_the_default_is_served_as_transformers_serves_it(ckpt, tmp_path):
    default = transformers.MistralConfig().num_key_value_heads  # the oracle: 8
    src = ckpt(f"mistral_kv{default}")
    stripped = edited(src, tmp_path / "stripped", drop=("num_key_value_heads",))
    res = run_inspect(str(stripped))
    assert res.exit_code == 0, res.output
    assert re.search(r"\bservable\W+yes\b", res.stdout)
    assert (f"config.json has no num_key_value_heads: using transformers' MistralConfig default {default}"
            in res.stdout)
    ours = greedy_tokens(stripped)
    assert len(ours) == 4
    assert ours == greedy_tokens(src) == hf_greedy_tokens(stripped)


def test_mistral_without_kv_heads_that_do_not_fit_the_default_is_refused_by_both(ckpt, tmp_path, no_model_build):
    default = transformers.MistralConfig().num_key_value_heads
    src = ckpt("mistral_kv2")  # k_proj / v_proj: 2 heads x 8 = 16 rows; the default says 8 x 8 = 64
    stripped = edited(src, tmp_path / "stripped", drop=("num_key_value_heads",))
    assert_refused_alike(
        stripped, "model.layers.0.self_attn.k_proj.weight is [16, 64]", f"[{default * 8}, 64]",
        f"num_key_value_heads={default} x head_dim=8",
        f"num_key_value_heads={default} is transformers' MistralConfig default (config.json does not set it)")
    res = CliRunner().invoke(app, ["convert", str(stripped), str(tmp_path / "out")])
    assert res.exit_code == 1 and "shape-mismatch" in res.output and not (tmp_path / "out").exists()


def test_qwen2_without_kv_heads_names_the_qwen2config_default(ckpt, tmp_path, no_model_build):
    default = transformers.Qwen2Config().num_key_value_heads  # 32: not a multiple of the fixture's 4 heads
    stripped = edited(ckpt("qwen2"), tmp_path / "stripped", drop=("num_key_value_heads",))
    assert_refused_alike(stripped, "model.layers.0.self_attn.k_proj.weight is [32, 64]",
                         f"num_key_value_heads={default} is transformers' Qwen2Config default")
    # inspect also says why the config cannot be right whatever the weights
    invalid, _, _ = findings(stripped, "config-invalid")
    assert any(f"not a multiple of num_key_value_heads {default}" in f["message"] for f in invalid)


# ----------------------------------------------------------------------------- 2. shapes vs config.json


DENSE_EDITS = [
    ("llama", {"head_dim": 32}, "model.layers.0.self_attn.q_proj.weight is [64, 64]", "head_dim=32"),
    ("llama", {"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight is [32, 64]",
     "num_key_value_heads=1 x head_dim=16 = 16"),
    ("llama", {"num_attention_heads": 8}, "model.layers.0.self_attn.q_proj.weight is [64, 64]",
     "num_attention_heads=8 x head_dim=16 = 128"),
    ("llama", {"hidden_size": 96}, "model.embed_tokens.weight is [128, 64]", "dim 1 = hidden_size=96"),
    ("llama", {"intermediate_size": 256}, "model.layers.0.mlp.gate_proj.weight is [128, 64]",
     "intermediate_size=256"),
    ("llama", {"vocab_size": 256}, "model.embed_tokens.weight is [128, 64]", "vocab_size=256"),
    ("qwen3", {"head_dim": 8}, "model.layers.0.self_attn.q_norm.weight is [16]", "head_dim=8"),
]
MLA_EDITS = [
    ("deepseek_v32", {"q_lora_rank": 48}, "model.layers.0.self_attn.q_a_layernorm.weight is [32]",
     "q_lora_rank=48"),
    ("deepseek_v32", {"kv_lora_rank": 48}, "model.layers.0.self_attn.kv_a_layernorm.weight is [32]",
     "kv_lora_rank=48"),
    ("deepseek_v32", {"qk_nope_head_dim": 8}, "model.layers.0.self_attn.q_b_proj.weight is [96, 32]",
     "num_attention_heads=4 x (qk_nope_head_dim=8 + qk_rope_head_dim=8) = 64"),
    ("deepseek_v32", {"v_head_dim": 32}, "model.layers.0.self_attn.kv_b_proj.weight is [128, 32]",
     "v_head_dim=32"),
    ("deepseek_v32", {"index_head_dim": 32}, "model.layers.0.self_attn.indexer.wq_b.weight is [64, 32]",
     "index_n_heads=4 x index_head_dim=32 = 128"),
    ("deepseek_v32", {"index_n_heads": 8}, "model.layers.0.self_attn.indexer.wq_b.weight is [64, 32]",
     "index_n_heads=8"),
    ("deepseek_v32", {"moe_intermediate_size": 48}, "model.layers.1.mlp.experts.0.gate_proj.weight is [32, 64]",
     "moe_intermediate_size=48"),
    ("deepseek_v32", {"n_shared_experts": 2}, "model.layers.1.mlp.shared_experts.gate_proj.weight is [32, 64]",
     "moe_intermediate_size=32 x n_shared_experts=2 = 64"),
    ("glm_moe_dsa", {"index_n_heads": 8}, "model.layers.0.self_attn.indexer.wq_b.weight is [64, 32]",
     "index_n_heads=8"),
    ("deepseek_v3", {"hidden_size": 96}, "model.embed_tokens.weight is [128, 64]", "hidden_size=96"),
]


@pytest.mark.parametrize(("arch", "changes", "tensor", "why"), DENSE_EDITS + MLA_EDITS,
                         ids=[f"{a}-{next(iter(c))}" for a, c, _, _ in DENSE_EDITS + MLA_EDITS])
def test_size_field_that_disagrees_with_the_weights_is_refused_by_both(ckpt, tmp_path, no_model_build, arch,
                                                                       changes, tensor, why):
    bad = edited(ckpt(arch), tmp_path / "bad", **changes)
    msg = assert_refused_alike(bad, tensor, why)
    assert "transformers'" not in msg  # every field involved is stated in config.json


def test_qwen3_without_head_dim_names_transformers_default(ckpt, tmp_path, no_model_build):
    default = transformers.Qwen3Config().head_dim  # 128, not hidden_size // num_attention_heads = 16
    stripped = edited(ckpt("qwen3"), tmp_path / "stripped", drop=("head_dim",))
    msg = assert_refused_alike(stripped, f"head_dim={default} is transformers' Qwen3Config default")
    found, _, _ = findings(stripped, "shape-mismatch")
    assert len(found) == 1  # one cause (the defaulted head_dim), one finding for q/k/v/o and the q/k norms
    assert "model.layers.0.self_attn.q_norm.weight is [16]" in msg and "more tensor(s)" in msg


def test_shape_mismatch_makes_convert_refuse_up_front(ckpt, tmp_path):
    bad = edited(ckpt("llama"), tmp_path / "bad", intermediate_size=256)
    res = CliRunner().invoke(app, ["convert", str(bad), str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert "would not convert into a servable layout: shape-mismatch: " in res.output
    assert "intermediate_size=256" in res.output and not (tmp_path / "out").exists()


def test_fp8_block_checkpoint_shapes_are_checked_without_false_errors(ckpt, tmp_path, no_model_build):
    """FP8 block weights are stored unpacked ([N, K] float8 + weight_scale_inv [ceil(N/b), ceil(K/b)]): the
    weights are compared exactly, the scales raise nothing of their own."""
    fp8 = ckpt("deepseek_v3_fp8")
    report, rc = inspect_json(fp8)
    assert rc == 0 and report["servable"], [f for f in report["findings"] if f["severity"] == "error"]
    bad = edited(fp8, tmp_path / "bad", moe_intermediate_size=48)
    msg = assert_refused_alike(bad, "model.layers.1.mlp.experts.0.gate_proj.weight is [32, 64]",
                               "moe_intermediate_size=48")
    assert "weight_scale_inv" not in msg


def test_valid_fixtures_have_no_shape_findings(ckpt):
    for arch in ("llama", "qwen2", "qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        found, report, rc = findings(ckpt(arch), "shape-mismatch")
        assert not found and rc == 0 and report["servable"], (arch, report["findings"])


LAYOUT_EDITS = [
    ("llama", {"num_key_value_heads": 1},
     "model.layers.0.self_attn.k_proj.weight (rows 64:96 of model.layers.0.self_attn.qkv_proj.weight in the "
     "layout) is [32, 64]", "num_key_value_heads=1 x head_dim=16 = 16"),
    ("deepseek_v32", {"moe_intermediate_size": 48},
     "model.layers.1.mlp.experts.0.gate_proj.weight (rows 0:32 of expert 0 of model.layers.1.mlp.experts.w13.weight "
     "in the layout) is [32, 64]", "moe_intermediate_size=48"),
    ("deepseek_v3_fp8", {"kv_lora_rank": 16},  # FP8 block 16: the layout pads q_a and kv_a to block rows
     "model.layers.0.self_attn.kv_a_proj_with_mqa.weight (rows 32:72 of "
     "model.layers.0.self_attn.fused_qkv_a_proj.weight in the layout) is [40, 64]",
     "kv_lora_rank=16 + qk_rope_head_dim=8 = 24"),
]


@pytest.mark.parametrize(("arch", "changes", "tensor", "why"), LAYOUT_EDITS, ids=[a for a, *_ in LAYOUT_EDITS])
def test_layout_config_edited_after_convert_is_refused_by_both(ckpt, tmp_path, no_model_build, arch, changes,
                                                               tensor, why):
    """A layout's fused / stacked tensors are checked through the manifest's parts (padding rows excluded):
    clean as converted, refused by inspect and the loader alike once config.json disagrees."""
    layout = convert_checkpoint(ckpt(arch), tmp_path / "layout")
    report, rc = inspect_json(layout)
    assert rc == 0 and report["servable"], [f for f in report["findings"] if f["severity"] == "error"]
    assert_refused_alike(edited(layout, tmp_path / "edited", **changes), tensor, why)


REAL_TABLES = ["deepseek-ai__DeepSeek-V3.json", "deepseek-ai__DeepSeek-V3.2.json", "zai-org__GLM-5.1-FP8.json",
               "zai-org__GLM-5.2-FP8.json", "moonshotai__Kimi-K2-Instruct.json"]


@pytest.mark.parametrize("name", REAL_TABLES)
def test_real_tensor_tables_agree_with_their_configs_and_an_edit_is_caught(name):
    """The published tensor tables (FP8 block MLA/DSA/MoE, MTP layers included) raise no shape finding; the
    same table under an edited config (kv_lora_rank 512 -> 256) does, naming the real tensor."""
    cfg, tensors = json.loads((REALWORLD / "configs" / name).read_text()), expand_index(name)
    report = build_report(name, cfg, tensors)
    assert not [f for f in report.findings if f.code == "shape-mismatch"]
    assert report.family == "deepseek_mla"
    flat = flatten_dsa_config(cfg)
    bad = build_report(name, {**cfg, "kv_lora_rank": flat["kv_lora_rank"] // 2}, tensors)
    msgs = [f.message for f in bad.findings if f.code == "shape-mismatch"]
    rows = flat["kv_lora_rank"] + flat["qk_rope_head_dim"]
    assert any(f"model.layers.0.self_attn.kv_a_proj_with_mqa.weight is [{rows}, {flat['hidden_size']}]" in m
               for m in msgs), msgs


# ----------------------------------------------------------------------------- 3. hidden_act


@pytest.mark.parametrize(("arch", "act"), [("llama", "gelu"), ("qwen3", "relu"), ("deepseek_v32", "relu2"),
                                           ("deepseek_v3", "gelu_pytorch_tanh")])
def test_unsupported_hidden_act_same_verdict_and_message(ckpt, tmp_path, no_model_build, arch, act):
    bad = edited(ckpt(arch), tmp_path / "bad", hidden_act=act)
    found, report, rc = findings(bad, "activation-not-servable")
    assert rc == 0 and not report["servable"]  # a valid transformers checkpoint atomtool does not serve
    assert len(found) == 1 and found[0]["severity"] == "warning"
    msg = found[0]["message"]
    assert f"hidden_act {act!r} is not supported" in msg and "MLPs with silu or swish only" in msg
    assert generate_error(bad) == msg
    res = CliRunner().invoke(app, ["convert", str(bad), str(tmp_path / "out")])
    assert res.exit_code == 1 and "would not convert into a servable layout" in res.output


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_swish_is_silu_as_in_transformers(ckpt, tmp_path, arch):
    """transformers' ACT2FN maps "swish" to torch.nn.SiLU: served (dense and MLA/MoE) with the silu tokens,
    which are transformers' own greedy tokens for the swish checkpoint (float32)."""
    src = ckpt(arch)
    swish = edited(src, tmp_path / "swish", hidden_act="swish")
    report, rc = inspect_json(swish)
    assert rc == 0 and report["servable"]
    assert not [f for f in report["findings"] if f["code"] == "activation-not-servable"]
    assert greedy_tokens(swish) == greedy_tokens(src) == hf_greedy_tokens(swish)


# ----------------------------------------------------------------------------- 4. quantization_config


@pytest.mark.parametrize("value", ["fp8", ["fp8"], 8, True])
def test_quantization_config_not_an_object_is_named_by_both(ckpt, tmp_path, no_model_build, value):
    bad = edited(ckpt("llama"), tmp_path / "bad", quantization_config=value)
    found, report, rc = findings(bad, "config-invalid")
    assert rc == 1 and not report["servable"]
    msg = f"config.json: quantization_config must be a JSON object (e.g. {{\"quant_method\": \"fp8\", ...}}), " \
          f"got {type(value).__name__} {value!r}"
    assert [f["message"] for f in found] == [msg]
    line = generate_error(bad)
    assert line == msg and "tokenizer" not in line


def test_quantization_config_null_is_not_quantized(ckpt, tmp_path):
    ok = edited(ckpt("llama"), tmp_path / "ok", quantization_config=None)
    report, rc = inspect_json(ok)
    assert rc == 0 and report["servable"]
    assert all(m["treated_as"] == "unquantized" for m in report["modules"])


def test_quantization_config_not_an_object_in_a_layout_is_refused_by_the_loader(ckpt, tmp_path, no_model_build):
    layout = convert_checkpoint(ckpt("llama"), tmp_path / "layout")
    cfg = json.loads((layout / "config.json").read_text())
    cfg["quantization_config"] = "fp8"
    (layout / "config.json").write_text(json.dumps(cfg))
    assert "quantization_config must be a JSON object" in generate_error(layout)
    shutil.rmtree(layout)


def test_quantization_config_not_an_object_is_one_error_line_in_serve(ckpt, tmp_path, no_model_build):
    bad = edited(ckpt("llama"), tmp_path / "bad", quantization_config="fp8")
    res = CliRunner().invoke(app, ["serve", str(bad), "--device", "cpu", "--port", "0"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: config.json: quantization_config must be a JSON object (e.g. {\"quant_method\": "
                      "\"fp8\", ...}), got str 'fp8'"], res.stderr


def test_quantization_config_inside_text_config_is_checked_too():
    from atomtool.inspect.config_check import invalid_quantization_config

    cfg = {"architectures": ["X"], "text_config": {"model_type": "llama", "quantization_config": "fp8"}}
    assert [f.message for f in invalid_quantization_config(cfg)] == [
        "config.json: text_config.quantization_config must be a JSON object (e.g. {\"quant_method\": \"fp8\", "
        "...}), got str 'fp8'"]
    assert invalid_quantization_config({"quantization_config": {"quant_method": "fp8"}}) == []

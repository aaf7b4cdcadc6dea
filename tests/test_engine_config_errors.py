"""config.json files that leave out a field, fed to ``atomtool generate``: one ``error:`` line naming the field
and the file, exit 1, no traceback -- or, where transformers has a model-specific default, the model built as
transformers builds it.

- a field that sizes the weights (vocab_size, num_hidden_layers, intermediate_size; for MLA models hidden_size,
  num_attention_heads, kv_lora_rank, moe_intermediate_size) is refused before any model is built;
- Qwen3 without ``head_dim`` takes ``Qwen3Config``'s default (128, not hidden_size // num_attention_heads):
  the same tokens as the config that states it, and as transformers' own model; weights that do not fit the
  default are one error line naming ``head_dim``;
- the last safety net: a KeyError / TypeError / ValueError while a model reads its config is one ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import ConfigError
from tests.checkpoints import write_hf_checkpoint

DENSE_FIELDS = ("vocab_size", "num_hidden_layers", "intermediate_size")
MLA_FIELDS = ("hidden_size", "num_attention_heads", "kv_lora_rank", "moe_intermediate_size")
CASES = [("llama", f) for f in DENSE_FIELDS] + [
    (arch, f) for arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa") for f in MLA_FIELDS] + [
    ("deepseek_v3", "q_lora_rank"), ("deepseek_v32", "qk_rope_head_dim")]
# (num_key_value_heads is not refused: taken from transformers (Qwen3Config 32) and checked against the
# weights, tests/test_config_weight_agreement.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny checkpoint per family, written lazily (module scope)."""
    made: dict[str, Path] = {}

    def get(arch: str, **overrides) -> Path:
        key = arch + repr(sorted(overrides.items()))
        if key not in made:
            made[key] = write_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=5, **overrides)
        return made[key]

    return get


def without(src: Path, dst: Path, field: str) -> Path:
    """A copy of checkpoint ``src`` (weights symlinked) whose config.json lacks ``field``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    assert field in cfg, f"fixture config has no {field}: the test would not test anything"
    del cfg[field]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def generate(model_dir: Path, *extra: str):
    return CliRunner().invoke(app, ["generate", str(model_dir), "--prompt", "hello there", "--max-tokens", "4",
                                    *extra])


def one_error_line(res) -> str:
    assert res.exit_code == 1, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.mark.parametrize(("arch", "field"), CASES)
def test_missing_size_field_is_one_error_line(arch, field, checkpoints, tmp_path, monkeypatch):
    import atomtool.serve.loader as loader

    def refuse(name):
        raise AssertionError(f"the loader built a {name} model before refusing the config")

    monkeypatch.setattr(loader, "get_model_class", refuse)
    model_dir = without(checkpoints(arch), tmp_path / "ck", field)
    line = one_error_line(generate(model_dir))
    assert f"missing required field {field}" in line
    assert str(model_dir / "config.json") in line


def test_several_missing_fields_are_named_together(checkpoints, tmp_path):
    src = without(checkpoints("llama"), tmp_path / "a", "vocab_size")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["intermediate_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(generate(src))
    assert "vocab_size" in line and "intermediate_size" in line and "LlamaConfig default: 32000" in line


def _greedy_tokens(model_dir: Path) -> list[int]:
    res = generate(model_dir, "--json", "--ignore-eos", "--dtype", "float32", "--device", "cpu")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)[0]["token_ids"]


def test_qwen3_without_head_dim_uses_transformers_default(checkpoints, tmp_path):
    """Qwen3Config.head_dim defaults to 128 whatever hidden_size / num_attention_heads are (here 64 / 4):
    the engine builds the model transformers builds and generates what it generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    default = Qwen3Config().head_dim
    src = checkpoints("qwen3", head_dim=default)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["head_dim"] == default != cfg["hidden_size"] // cfg["num_attention_heads"]
    stripped = without(src, tmp_path / "no_head_dim", "head_dim")

    ours = _greedy_tokens(stripped)
    assert ours == _greedy_tokens(src)
    assert len(ours) == 4

    tok = AutoTokenizer.from_pretrained(stripped)
    hf = AutoModelForCausalLM.from_pretrained(stripped, dtype=torch.float32).eval()
    assert hf.config.head_dim == default
    ids = torch.tensor([tok("hello there")["input_ids"]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert ours == out[0, ids.shape[1]:].tolist()


def test_qwen3_weights_that_do_not_fit_the_head_dim_default_name_it(checkpoints, tmp_path):
    src = checkpoints("qwen3")  # head_dim 16 = hidden_size // num_attention_heads, not Qwen3Config's 128
    line = one_error_line(generate(without(src, tmp_path / "ck", "head_dim")))
    assert "shape mismatch" in line and "head_dim=128" in line


def test_llama_without_num_key_value_heads_is_multi_head_attention_as_in_transformers(checkpoints, tmp_path):
    """LlamaConfig derives num_key_value_heads = num_attention_heads (its default is None): not refused."""
    src = checkpoints("llama", num_key_value_heads=4)
    assert json.loads((src / "config.json").read_text())["num_attention_heads"] == 4
    assert _greedy_tokens(without(src, tmp_path / "mha", "num_key_value_heads")) == _greedy_tokens(src)
    # a GQA checkpoint without it does not fit the derived value: the error says what was assumed
    gqa = checkpoints("llama")
    line = one_error_line(generate(without(gqa, tmp_path / "gqa", "num_key_value_heads")))
    assert "shape mismatch" in line and "num_key_value_heads=4" in line


def test_mla_without_num_key_value_heads_loads(checkpoints, tmp_path):
    """MLA weights are shaped by the latent ranks, not num_key_value_heads: its absence is harmless."""
    src = checkpoints("deepseek_v3")
    assert _greedy_tokens(without(src, tmp_path / "ck", "num_key_value_heads")) == _greedy_tokens(src)


def test_model_construction_errors_become_one_config_error(checkpoints, monkeypatch):
    """The safety net: whatever a model class trips over in its config is one ConfigError naming the file."""
    import atomtool.serve.loader as loader

    for exc, text in ((KeyError("rope_scaling_factor"), "missing field 'rope_scaling_factor'"),
                      (TypeError("int() argument must be a string\n or a number"), "int() argument must be a "
                                                                                    "string or a number"),
                      (ValueError("bad value"), "bad value")):
        def broken(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(loader, "get_model_class", lambda arch, broken=broken: broken)
        with pytest.raises(ConfigError) as info:
            loader.load_model(checkpoints("llama"), device="cpu")
        msg = str(info.value)
        assert text in msg and "config.json" in msg and "\n" not in msg


def test_unsupported_architecture_is_quoted_as_convert_quotes_it(checkpoints, tmp_path):
    src = checkpoints("llama")
    dst = without(src, tmp_path / "gemma", "bos_token_id")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(generate(dst))
    assert line.startswith("error: unsupported architecture 'GemmaForCausalLM'; supported: ")
    assert "'LlamaForCausalLM'" not in line and "LlamaForCausalLM" in line

"""Real published configs (../shared/realworld/configs) and tensor tables (../shared/realworld/index).

The index files are compressed header summaries of the real DeepSeek-V3.2 / GLM-5.x FP8 checkpoints
(name patterns such as ``model.layers.0-2,6,10,...,74,78.self_attn.indexer.wk.weight``); they are expanded
here into TensorInfo sets and classified like real headers.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from atomtool.inspect.classify import build_report
from atomtool.inspect.dsa import flatten_dsa_config
from atomtool.inspect.memory import estimate_parameters
from atomtool.inspect.types import TensorInfo

# Vendored copy of ../shared/realworld (see its SOURCES.md) so CI's clean clone has the real configs.
REALWORLD = Path(__file__).resolve().parent / "data" / "realworld"
CONFIGS = sorted((REALWORLD / "configs").glob("*.json"))
assert CONFIGS, f"real configs missing under {REALWORLD}"
HF_CONFIGS = [p for p in CONFIGS if "inference-config" not in p.name and not p.name.endswith("hf_quant_config.json")]


def _load(name: str) -> dict:
    return json.loads((REALWORLD / "configs" / name).read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_real_config_inspects_without_error(path, tmp_path):
    from typer.testing import CliRunner

    from atomtool.cli import app

    (tmp_path / "config.json").write_text(path.read_text())
    res = CliRunner().invoke(app, ["inspect", str(tmp_path), "--json", "--gpu-memory", "141"])
    obj = json.loads(res.stdout)
    is_hf = path in HF_CONFIGS
    errors = [f for f in obj["findings"] if f["severity"] == "error"]
    if is_hf:
        assert errors == [] and res.exit_code == 0, errors
        assert obj["family"] != "unknown"
        assert obj["memory"]["kv_bytes_per_token"] > 0
    else:  # DeepSeek inference-demo configs (`dim`, `n_layers`), ModelOpt sidecars: not HF configs, exit 1
        codes = [f["code"] for f in errors]
        assert codes == ["not-hf-config"], codes
        msg = errors[0]["message"]
        looks = "ModelOpt's hf_quant_config.json" if "hf_quant_config" in path.name else "DeepSeek's inference-demo"
        assert "is not a Hugging Face config.json" in msg and looks in msg, msg
        assert "unknown architecture" not in msg and obj["memory"]["kv_bytes_per_token"] is None
        assert res.exit_code == 1
    assert obj["modules"] == [] and any(f["code"] == "config-only" for f in obj["findings"])


def test_glm52_shipped_indexer_types_match_freq_offset_rule():
    raw = _load("zai-org__GLM-5.2.json")
    full = [i for i, r in enumerate(raw["indexer_types"]) if r == "full"]
    assert full == [0, 1, 2] + list(range(6, 75, 4))  # {0,1,2,6,10,...,74}: 21 layers
    assert len(full) == 21
    # the schedule from freq 4 / offset 3 alone equals what GLM-5.2 ships
    derived = flatten_dsa_config({k: v for k, v in raw.items() if k != "indexer_types"})["indexer_types"]
    assert derived == raw["indexer_types"]
    assert flatten_dsa_config(raw)["indexer_types"] == raw["indexer_types"]


# ----------------------------------------------------------------------------- index expansion


def _expand_ints(spec: str) -> list[int]:
    """``0-2,6,10,...,74,78`` -> [0,1,2,6,10,...,74,78] (``...`` continues the progression of the two
    values before it up to the value after it)."""
    items = spec.split(",")
    out: list[int] = []
    i = 0
    while i < len(items):
        it = items[i]
        if it == "...":
            step = out[-1] - out[-2]
            stop = int(items[i + 1].split("-")[0])
            out.extend(range(out[-1] + step, stop, step))
        elif "-" in it:
            a, b = map(int, it.split("-"))
            out.extend(range(a, b + 1))
        else:
            out.append(int(it))
        i += 1
    return out


@functools.cache
def _report(config: str, index: str):
    return build_report(config, _load(config), expand_index(index))


_SPEC = re.compile(r"(?<=\.)(\d[\d,\-.]*\d|\d)(?=\.)")
_BITS = {"BF16": 16, "F32": 32, "F8_E4M3": 8, "F16": 16}


@functools.cache
def expand_index(name: str) -> dict[str, TensorInfo]:
    data = json.loads((REALWORLD / "index" / name).read_text())
    tensors: dict[str, TensorInfo] = {}
    for g in data["tensor_groups"]:
        pattern = g["name_pattern"]
        specs = _SPEC.findall(pattern)
        names = [pattern]
        for spec in specs:
            names = [n.replace(spec, str(v), 1) for n in names for v in _expand_ints(spec)]
        shape = tuple(g["shape"])
        nbytes = _BITS[g["safetensors_dtype"]] // 8
        for n in names:
            numel = 1
            for d in shape:
                numel *= d
            tensors[n] = TensorInfo(n, g["safetensors_dtype"], shape, "model.safetensors", (0, numel * nbytes))
    assert len(tensors) == data["summary"]["tensor_count"]
    assert sum(t.numel for t in tensors.values()) == data["summary"]["param_count"]
    return tensors


@pytest.mark.parametrize("config,index,full_layers", [
    ("zai-org__GLM-5.2-FP8.json", "zai-org__GLM-5.2-FP8.json", [0, 1, 2] + list(range(6, 75, 4))),
    ("deepseek-ai__DeepSeek-V3.2.json", "deepseek-ai__DeepSeek-V3.2.json", list(range(61))),
    ("zai-org__GLM-5.1-FP8.json", "zai-org__GLM-5.1-FP8.json", list(range(78))),
])
def test_real_schedule_matches_real_indexer_tensors(config, index, full_layers):
    cfg = _load(config)
    tensors = expand_index(index)
    report = _report(config, index)
    roles = report.dsa.roles
    assert [i for i, r in enumerate(roles) if r == "full"] == full_layers
    # layers that carry indexer tensors in the real checkpoint (MTP layer = num_hidden_layers excluded)
    owners = sorted({int(n.split(".")[2]) for n in tensors if ".self_attn.indexer." in n})
    n = cfg["num_hidden_layers"]
    assert [i for i in owners if i < n] == full_layers and owners[-1] == n  # + the MTP layer
    assert not [f for f in report.findings if f.code.startswith("dsa-")]
    mods = {m.name: m for m in report.modules}
    q_a = mods["model.layers.5.self_attn.q_a_proj"]
    assert (q_a.scheme, q_a.block_size, q_a.treated_as) == ("fp8_block", (128, 128), "quantized")
    kv_a = mods["model.layers.5.self_attn.kv_a_proj_with_mqa"]
    assert kv_a.shape == (576, cfg["hidden_size"]) and kv_a.scheme == "fp8_block"
    wp = mods["model.layers.0.self_attn.indexer.weights_proj"]
    assert (wp.scheme, wp.treated_as) == ("bf16", "unquantized")
    assert not [f for f in report.findings if f.severity == "error"]
    # KV: latent (512 + 64) x BF16 on every layer, indexer keys (128 x BF16, as the engine stores them) on full
    # layers only
    assert report.memory["kv_bytes_per_token"] == n * 576 * 2 + len(full_layers) * 128 * 2


#: tensors that are not parameters: FP8 block scales (``weight_scale_inv``) and other quantization scales
SCALE_SUFFIXES = ("_scale_inv", ".weight_scale", "_scales")


def table_parameters(index: str) -> int:
    """Parameters of a real checkpoint counted from its tensor table: every element of every tensor except
    the quantization scales (MTP layers and their embed/head copies included)."""
    return sum(t.numel for n, t in expand_index(index).items() if not n.endswith(SCALE_SUFFIXES))


@pytest.mark.parametrize("name", ["zai-org__GLM-5.2-FP8.json", "zai-org__GLM-5.1-FP8.json",
                                  "deepseek-ai__DeepSeek-V3.2.json", "deepseek-ai__DeepSeek-V3.json"])
def test_parameter_estimate_from_config_matches_real_headers(name):
    """estimate_parameters (config-only inspect) against the real tensor tables, exactly: every parameter
    of the checkpoint, including DeepSeek's MTP layer (a full MoE decoder layer + enorm/hnorm/eh_proj/
    shared_head.norm + its own embed_tokens and shared_head.head copies) and GLM-5's (no embed/head copy)."""
    flat = flatten_dsa_config(_load(name))
    assert estimate_parameters(flat, flat.get("indexer_types")) == table_parameters(name)


@pytest.mark.parametrize("name,expected", [
    ("meta-llama__Llama-3.1-8B.json", 8_030_261_248),  # published parameter count
    # by hand: 48 x (attention 18,874,624 + 128 experts x 3 x 2048 x 768 + router 128 x 2048 + norms 4096)
    # + untied embeddings 2 x 151936 x 2048 + final norm 2048
    ("Qwen__Qwen3-30B-A3B.json", 48 * (18_874_624 + 128 * 3 * 2048 * 768 + 128 * 2048 + 4096)
     + 2 * 151936 * 2048 + 2048),
])
def test_parameter_estimate_dense_and_moe(name, expected):
    flat = flatten_dsa_config(_load(name))
    assert estimate_parameters(flat) == expected

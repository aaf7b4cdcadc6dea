"""End-to-end tests of ``atomtool convert`` / ``atomtool verify`` on transformers-written tiny checkpoints.

The oracle for every layout is the source checkpoint itself, read back with safetensors: each source
tensor must come out of the layout bit-exact (or exactly its cast when ``--dtype`` asks), fused rows in the
order research/dsa.md §4 fixes (q_a | kv_a_proj_with_mqa | indexer.wk | indexer.weights_proj), with split
sizes from the *config* (q_lora_rank, kv_lora_rank + qk_rope_head_dim, index_head_dim, index_n_heads), and
FP8 parts dequantizing (``tests.checkpoints.dequantize_fp8_block``) to exactly the dequantized source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.convert.layout import is_layout, load_layout_specs
from atomtool.convert.materialize import iter_output_tensors
from atomtool.convert.plan import build_plan
from atomtool.inspect.classify import inspect_checkpoint
from tests.checkpoints import (
    dequantize_fp8_block,
    load_state_dict,
    write_fp8_block_checkpoint,
    write_hf_checkpoint,
)
from tests.fake_hub import record_snapshot_downloads

runner = CliRunner()


def convert(*args: str):
    return runner.invoke(app, ["convert", *map(str, args)])


def layout_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a layout, by name (read through the index, independent of atomtool code)."""
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    result = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(out / file), "pt") as f:
            for k in f.keys():
                result[k] = f.get_tensor(k)
    assert set(result) == set(weight_map)
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_reconstructs(src: Path, out: Path, cast: dict[torch.dtype, torch.dtype] | None = None) -> int:
    """Every source tensor is recovered from the layout through the manifest's parts, bit for bit (or, where
    ``cast`` maps its dtype, as exactly ``source.to(dtype)``). Returns the number of parts checked."""
    manifest = json.loads((out / "atomtool.json").read_text())
    tensors = layout_tensors(out)
    source = load_state_dict(src)
    where = {}
    for name, entry in manifest["tensors"].items():
        for p in entry["parts"]:
            assert p["source"] not in where, f"{p['source']} in two outputs"
            where[p["source"]] = (name, p)
    assert set(where) == set(source), set(where) ^ set(source)
    for sname, s in source.items():
        name, p = where[sname]
        t = tensors[name]
        if p["stack_index"] is not None:
            t = t[p["stack_index"]]
        if p["rows"] is not None:
            r0, r1 = p["rows"]
            pad = t[r1:r1 + p["pad_rows"]]
            assert pad.numel() == 0 or not bits(pad).any(), f"padding after {sname} not zero"
            t = t[r0:r1]
        if cast is None:
            assert t.dtype == s.dtype, f"{sname} cast under --dtype auto"
        else:
            assert t.dtype in (s.dtype, cast.get(s.dtype, s.dtype)), sname
        expect = s.to(t.dtype)
        assert t.dtype == expect.dtype and t.shape == expect.shape, sname
        assert torch.equal(bits(t), bits(expect)), f"{sname} not reproduced in {name}"
    return len(source)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    c = {
        # IndexShare via index_topk_freq=2 / offset 2 (real-config form: no explicit indexer_types) -> F F S F
        "glm": write_hf_checkpoint(root / "glm", "glm_moe_dsa", dtype=torch.bfloat16, max_shard_size="40KB",
                                   drop_config_keys=["indexer_types"]),
        "dsv32": write_hf_checkpoint(root / "dsv32", "deepseek_v32"),
        "qwen2": write_hf_checkpoint(root / "qwen2", "qwen2"),
        "qwen3": write_hf_checkpoint(root / "qwen3", "qwen3", dtype=torch.bfloat16),
        "llama": write_hf_checkpoint(root / "llama", "llama", dtype=torch.float16, tie_word_embeddings=True),
    }
    # DeepSeek FP8 format (no exclusion list); 16-row blocks make the tiny model look like the real one:
    # q_a (32 rows) block-aligned like 1536, kv_a_proj_with_mqa (40 rows) not, like 576 with 128-row blocks
    c["dsv32_fp8"] = write_fp8_block_checkpoint(c["dsv32"], root / "dsv32_fp8", block=16)
    # GLM FP8 with a 24-row block: q_a (32 rows) and expert gate (32) misaligned, GLM's exclusion list
    c["glm_fp8"] = write_fp8_block_checkpoint(c["glm"], root / "glm_fp8", block=24, shards=2,
                                              modules_to_not_convert=["model.layers.0.self_attn.indexers_proj"])
    return c


def cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def converted(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    outs = {}
    for key, src in ckpts.items():
        r = convert(src, root / key, "--shard-size", "30KB")
        assert r.exit_code == 0, r.output
        outs[key] = root / key
    return outs


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("key", ["glm", "dsv32", "qwen2", "qwen3", "llama", "dsv32_fp8", "glm_fp8"])
def test_every_source_tensor_reconstructs_bit_exact(ckpts, converted, key):
    assert assert_reconstructs(ckpts[key], converted[key]) >= 20
    assert is_layout(converted[key])
    r = runner.invoke(app, ["verify", str(converted[key]), "--source", str(ckpts[key])])
    assert r.exit_code == 0, r.output
    assert "OK:" in r.stdout


def test_glm_fused_rows_follow_config_split_and_shared_layers_have_no_indexer(ckpts, converted):
    src, out = ckpts["glm"], converted["glm"]
    c = cfg(src)
    split = [c["q_lora_rank"], c["kv_lora_rank"] + c["qk_rope_head_dim"], c["index_head_dim"], c["index_n_heads"]]
    t, s = layout_tensors(out), load_state_dict(src)
    roles = cfg(out)["indexer_types"]
    assert roles == ["full", "full", "shared", "full"]  # resolved from index_topk_freq / offset
    assert "indexer_types" not in c and cfg(out)["index_topk_freq"] == 2
    manifest = json.loads((out / "atomtool.json").read_text())
    for i, role in enumerate(roles):
        p = f"model.layers.{i}.self_attn"
        parts = [f"{p}.q_a_proj.weight", f"{p}.kv_a_proj_with_mqa.weight"]
        if role == "full":
            parts += [f"{p}.indexer.wk.weight", f"{p}.indexer.weights_proj.weight"]
        fused = t[f"{p}.fused_qkv_a_proj.weight"]
        assert torch.equal(fused, torch.cat([s[n] for n in parts]))
        entry = manifest["tensors"][f"{p}.fused_qkv_a_proj.weight"]
        sizes = [r1 - r0 for r0, r1 in (q["rows"] for q in entry["parts"])]
        assert sizes == (split if role == "full" else split[:2])
        if role == "shared":
            assert not any(n.startswith(f"{p}.indexer.") for n in t)
            assert not any(n.startswith(f"{p}.indexer.") for n in s)
        else:
            assert f"{p}.indexer.wq_b.weight" in t and f"{p}.indexer.wk.weight" not in t
    # MoE layers: w13 = gate | up per expert, w2 = down; dense layer 0: gate_up_proj
    e = c["n_routed_experts"]
    w13 = t["model.layers.1.mlp.experts.w13.weight"]
    assert w13.shape == (e, 2 * c["moe_intermediate_size"], c["hidden_size"])
    for j in range(e):
        assert torch.equal(w13[j], torch.cat([s[f"model.layers.1.mlp.experts.{j}.gate_proj.weight"],
                                              s[f"model.layers.1.mlp.experts.{j}.up_proj.weight"]]))
        assert torch.equal(t["model.layers.1.mlp.experts.w2.weight"][j],
                           s[f"model.layers.1.mlp.experts.{j}.down_proj.weight"])
    assert "model.layers.0.mlp.gate_up_proj.weight" in t and "model.layers.1.mlp.gate.weight" in t
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in t
    # FP32 keep: the router bias stays F32 in a BF16 checkpoint
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_fp8_misaligned_parts_padded_and_dequantize_exactly(ckpts, converted):
    for key, block in (("dsv32_fp8", 16), ("glm_fp8", 24)):
        src, out = ckpts[key], converted[key]
        c = cfg(src)
        t, s = layout_tensors(out), load_state_dict(src)
        b = (block, block)
        rq, rkv = c["q_lora_rank"], c["kv_lora_rank"] + c["qk_rope_head_dim"]
        assert rkv % block and (rq % block == 0) == (key == "dsv32_fp8")  # misaligned as intended
        p = "model.layers.0.self_attn"
        w = t[f"{p}.fused_qkv_a_proj.weight"]
        sc = t[f"{p}.fused_qkv_a_proj.weight_scale_inv"]
        padded = math.ceil(rq / block) * block
        assert w.dtype == torch.float8_e4m3fn and w.shape == (padded + rkv, c["hidden_size"])
        assert sc.shape == (math.ceil(rq / block) + math.ceil(rkv / block), math.ceil(c["hidden_size"] / block))
        deq = dequantize_fp8_block(w, sc, b)
        assert torch.equal(deq[:rq], dequantize_fp8_block(s[f"{p}.q_a_proj.weight"],
                                                          s[f"{p}.q_a_proj.weight_scale_inv"], b))
        assert not deq[rq:padded].any()
        assert torch.equal(deq[padded:], dequantize_fp8_block(s[f"{p}.kv_a_proj_with_mqa.weight"],
                                                              s[f"{p}.kv_a_proj_with_mqa.weight_scale_inv"], b))
        # indexer parts stay separate: wk FP8 with its scale, weights_proj BF16 (never requantized)
        assert t[f"{p}.indexer.wk.weight"].dtype == torch.float8_e4m3fn
        assert f"{p}.indexer.wk.weight_scale_inv" in t
        assert t[f"{p}.indexer.weights_proj.weight"].dtype == torch.bfloat16
        notes = json.loads((out / "atomtool.json").read_text())["notes"]
        assert any(n.startswith(f"{p}.fused_qkv_a_proj: indexer parts") for n in notes)
        # stacked FP8 experts with stacked scales dequantize per expert
        inter = c["moe_intermediate_size"]
        w13, s13 = t["model.layers.1.mlp.experts.w13.weight"], t["model.layers.1.mlp.experts.w13.weight_scale_inv"]
        gate_pad = math.ceil(inter / block) * block
        assert w13.shape == (c["n_routed_experts"], gate_pad + inter, c["hidden_size"])
        for j in (0, c["n_routed_experts"] - 1):
            d = dequantize_fp8_block(w13[j], s13[j], b)
            e = f"model.layers.1.mlp.experts.{j}"
            assert torch.equal(d[:inter], dequantize_fp8_block(s[f"{e}.gate_proj.weight"],
                                                               s[f"{e}.gate_proj.weight_scale_inv"], b))
            assert torch.equal(d[gate_pad:], dequantize_fp8_block(s[f"{e}.up_proj.weight"],
                                                                  s[f"{e}.up_proj.weight_scale_inv"], b))
        assert cfg(out)["quantization_config"]["weight_block_size"] == [block, block]


def test_llama_tied_embeddings_and_fp16(ckpts, converted):
    t, s = layout_tensors(converted["llama"]), load_state_dict(ckpts["llama"])
    assert "lm_head.weight" not in s and "lm_head.weight" not in t
    qkv = t["model.layers.0.self_attn.qkv_proj.weight"]
    c = cfg(ckpts["llama"])
    kv = c["num_key_value_heads"] * c["head_dim"]
    assert qkv.dtype == torch.float16 and qkv.shape == (c["num_attention_heads"] * c["head_dim"] + 2 * kv, c["hidden_size"])
    assert torch.equal(qkv[-kv:], s["model.layers.0.self_attn.v_proj.weight"])


def test_qwen2_qkv_bias_fused(ckpts, converted):
    t, s = layout_tensors(converted["qwen2"]), load_state_dict(ckpts["qwen2"])
    p = "model.layers.1.self_attn"
    assert torch.equal(t[f"{p}.qkv_proj.bias"], torch.cat([s[f"{p}.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(t[f"{p}.qkv_proj.weight"], torch.cat([s[f"{p}.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(t["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([s["model.layers.1.mlp.gate_proj.weight"], s["model.layers.1.mlp.up_proj.weight"]]))


def test_side_files_copied_and_index_valid(ckpts, converted):
    src, out = ckpts["qwen3"], converted["qwen3"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].startswith("model-00001-of-")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in layout_tensors(out).values())
    manifest = json.loads((out / "atomtool.json").read_text())
    assert manifest["format"] == "atomtool-layout" and manifest["version"] == 1
    assert manifest["source"]["architecture"] == "Qwen3ForCausalLM" and len(manifest["source"]["fingerprint"]) == 64


def test_layout_specs_and_in_memory_plan_match_the_files(ckpts, converted):
    """serve's two loading paths: layout specs read back, and the raw checkpoint fused in memory."""
    out = converted["glm_fp8"]
    specs = load_layout_specs(out)
    t = layout_tensors(out)
    assert set(specs) == set(t)
    plan = build_plan(inspect_checkpoint(str(ckpts["glm_fp8"])))
    assert {n: (s.shape, s.dtype, s.parts) for n, s in plan.tensors.items()} == \
        {n: (s.shape, s.dtype, s.parts) for n, s in specs.items()}
    count = 0
    for spec, tensor in iter_output_tensors(plan, ckpts["glm_fp8"]):
        assert torch.equal(bits(tensor), bits(t[spec.name])), spec.name
        count += 1
    assert count == len(t)


def test_explicit_dtype_casts_with_one_warning_per_pair(ckpts, tmp_path):
    src = ckpts["dsv32"]  # float32 checkpoint
    r = convert(src, tmp_path / "o", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    s = load_state_dict(src)
    n_cast = sum(1 for n, v in s.items() if v.dtype == torch.float32 and not n.endswith("e_score_correction_bias"))
    warn = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warn == [line for line in warn if "F32 -> BF16" in line] and len(warn) == 1
    assert warn[0].startswith(f"warning: {n_cast} tensors cast F32 -> BF16 (lossy: rounds to 8 significant bits), e.g. ")
    t = layout_tensors(tmp_path / "o")
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.mlp.experts.w13.weight"].dtype == torch.bfloat16
    assert_reconstructs(src, tmp_path / "o", cast={torch.float32: torch.bfloat16})
    assert cfg(tmp_path / "o")["dtype"] == "bfloat16"
    manifest = json.loads((tmp_path / "o" / "atomtool.json").read_text())
    assert manifest["dtype_policy"] == "bfloat16" and manifest["warnings"] == [w[len("warning: "):] for w in warn]
    r = runner.invoke(app, ["verify", str(tmp_path / "o"), "--source", str(src)])
    assert r.exit_code == 0, r.output


def test_fp8_checkpoint_with_explicit_dtype_keeps_quantized_tensors(ckpts, tmp_path):
    r = convert(ckpts["glm_fp8"], tmp_path / "o", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert "note: " in r.stderr and "BF16 -> F32 (lossless widening)" in r.stderr
    assert "warning:" not in r.stderr and "((" not in r.stderr
    t = layout_tensors(tmp_path / "o")
    assert t["model.layers.0.self_attn.fused_qkv_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32


def test_overflowing_cast_is_an_error_naming_the_tensor(tmp_path):
    src = write_hf_checkpoint(tmp_path / "src", "llama", dtype=torch.bfloat16, tokenizer=False)
    sd = load_state_dict(src)
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e5
    from tests.checkpoints import write_state_dict

    (src / "model.safetensors").unlink()
    write_state_dict(src, sd)
    r = convert(src, tmp_path / "out", "--dtype", "float16")
    assert r.exit_code == 1
    assert "error: model.layers.1.mlp.up_proj.weight: casting BF16 -> F16 overflows" in r.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # temporary directory removed
    assert convert(src, tmp_path / "out", "--dtype", "bfloat16").exit_code == 0


def test_dry_run_writes_nothing(ckpts, tmp_path):
    out = tmp_path / "never"
    r = convert(ckpts["glm_fp8"], out, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "fused_qkv_a_proj" in r.stdout and "dry run: nothing written" in r.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []
    r = convert(ckpts["glm"], out, "--dry-run", "--json")
    assert r.exit_code == 0
    plan = json.loads(r.stdout)
    fused = plan["tensors"]["model.layers.2.self_attn.fused_qkv_a_proj.weight"]
    assert [p["source"].rsplit(".", 2)[-2] for p in fused["parts"]] == ["q_a_proj", "kv_a_proj_with_mqa"]
    assert not out.exists()


def _tree_state(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, hash(p.read_bytes()))
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", ["same", "inside", "nonempty", "not_layout", "file", "disk", "size", "missing"])
def test_refusals(ckpts, tmp_path, monkeypatch, case):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(ckpts["qwen3"], src)
    before = _tree_state(src)
    out = tmp_path / "out"
    args: list[str] = []
    if case == "same":
        out, msg = src, "is the source checkpoint"
    elif case == "inside":
        out, msg = src / "sub" / "layout", "is inside the source checkpoint"
    elif case == "nonempty":
        out.mkdir()
        (out / "x.txt").write_text("keep me")
        msg = "is not empty and not an atomtool layout (no atomtool.json); name a new or empty directory"
    elif case == "not_layout":
        out.mkdir()
        (out / "x.txt").write_text("keep me")
        args, msg = ["--overwrite"], "is not an atomtool layout"
    elif case == "file":
        out.write_text("a file")
        msg = "exists and is not a directory"
    elif case == "disk":
        import atomtool.convert.writer as writer

        monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
        msg = "not enough free disk space"
    elif case == "size":
        args, msg = ["--shard-size", "lots"], "--shard-size 'lots'"
    else:
        src, msg = tmp_path / "nope", "no such directory"
    r = convert(src, out, *args)
    assert r.exit_code == 1, r.output
    assert msg in r.stderr and r.stderr.startswith("error: ")
    if src.exists():
        assert _tree_state(src) == before
    if case in ("nonempty", "not_layout"):
        assert (out / "x.txt").read_text() == "keep me"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("src", "out")]
    assert leftovers == []


def test_overwrite_replaces_a_layout(ckpts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an existing empty directory is fine without --overwrite
    assert convert(ckpts["qwen3"], out).exit_code == 0
    r = convert(ckpts["qwen2"], out)
    assert r.exit_code == 1 and "--overwrite" in r.stderr
    r = convert(ckpts["qwen2"], out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "atomtool.json").read_text())["source"]["architecture"] == "Qwen2ForCausalLM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert_reconstructs(ckpts["qwen2"], out)


def test_verify_detects_corruption(ckpts, converted, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(converted["glm_fp8"], out)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 1 and "sha256" in r.stderr and "FAILED" in r.stdout
    r = runner.invoke(app, ["verify", str(out), "--source", str(ckpts["glm_fp8"]), "--json"])
    assert r.exit_code == 1
    problems = json.loads(r.stdout)["problems"]
    assert any("does not reproduce the source" in p for p in problems)
    # a source tensor missing from the manifest is reported
    manifest = json.loads((out / "atomtool.json").read_text())
    manifest["tensors"]["model.norm.weight"]["shape"] = [1]
    (out / "atomtool.json").write_text(json.dumps(manifest))
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 1 and "model.norm.weight: header BF16 [64] != manifest BF16 [1]" in r.stderr
    r = runner.invoke(app, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and "not an atomtool layout (atomtool.json missing)" in r.stderr


def test_hub_repo_id_is_downloaded_first(ckpts, tmp_path, monkeypatch):
    calls = record_snapshot_downloads(monkeypatch, ckpts["qwen3"])
    r = convert("tiny-org/tiny-qwen3", tmp_path / "out", "--revision", "main")
    assert r.exit_code == 0, r.output
    assert calls and (calls[0]["repo_id"], calls[0]["revision"]) == ("tiny-org/tiny-qwen3", "main")
    assert "*.safetensors" in (calls[0]["allow_patterns"] or ())
    manifest = json.loads((tmp_path / "out" / "atomtool.json").read_text())
    assert manifest["source"]["repo_id"] == "tiny-org/tiny-qwen3" and manifest["source"]["revision"] == "main"


@pytest.mark.parametrize("scheme", ["nvfp4", "ct_int4"])
def test_non_concatenated_quantized_schemes_are_copied_byte_exact(ckpts, tmp_path, scheme):
    """Schemes the plan does not concatenate (NVFP4 packed U8 + F8 scales, compressed-tensors int4 packs)
    keep their source names and bytes; the copies also work under an explicit --dtype (not cast)."""
    from tests.checkpoints import write_ct_int4_checkpoint, write_nvfp4_checkpoint

    writer = {"nvfp4": write_nvfp4_checkpoint, "ct_int4": write_ct_int4_checkpoint}[scheme]
    src = writer(ckpts["qwen3"], tmp_path / "src")
    r = convert(src, tmp_path / "out", "--dtype", "bfloat16")
    assert r.exit_code == 1 and "scheme-not-servable" in r.stderr and "pass --force" in r.stderr
    assert not (tmp_path / "out").exists()
    r = convert(src, tmp_path / "out", "--dtype", "bfloat16", "--force")
    assert r.exit_code == 0, r.output
    assert "warning: --force: converting although the layout will not be servable" in r.stderr
    t, s = layout_tensors(tmp_path / "out"), load_state_dict(src)
    quantized = [n for n, v in s.items() if v.dtype in (torch.uint8, torch.int32, torch.float8_e4m3fn)]
    assert quantized
    for n in quantized:
        assert torch.equal(bits(t[n]), bits(s[n])) and t[n].dtype == s[n].dtype, n
    notes = json.loads((tmp_path / "out" / "atomtool.json").read_text())["notes"]
    assert any("not fused" in n for n in notes)
    r = runner.invoke(app, ["verify", str(tmp_path / "out"), "--source", str(src)])
    assert r.exit_code == 0, r.output


def test_dry_run_of_a_hub_repo_reads_headers_only(ckpts, tmp_path, monkeypatch):
    """--dry-run on a repo id plans from remote headers (range reads), downloading no weights."""
    from huggingface_hub import constants

    from tests.fake_hub import FakeHub, set_endpoint

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    with FakeHub({"org/glm": ckpts["glm"]}) as server:
        set_endpoint(monkeypatch, server.endpoint)
        r = convert("org/glm", tmp_path / "out", "--dry-run", "--json")
        assert r.exit_code == 0, r.output
        plan = json.loads(r.stdout)
        assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" in plan["tensors"]
        weights = [q for q in server.requests if q.file.endswith(".safetensors")]
        assert weights and all(q.method == "HEAD" or q.range is not None for q in weights)
        assert sum(q.body_bytes for q in weights) < sum(p.stat().st_size for p in ckpts["glm"].glob("*.safetensors"))
    assert not (tmp_path / "out").exists()


def test_outputs_without_casts_are_streamed_not_built(ckpts, tmp_path, monkeypatch):
    """Bounded memory: an output that needs no cast never exists whole in memory (its bytes go file to file
    through fixed-size chunks); only outputs that need a cast are materialized, one at a time."""
    import atomtool.convert.writer as writer

    built: list[str] = []
    real = writer.materialize

    def spy(spec, reader):
        built.append(spec.name)
        return real(spec, reader)

    monkeypatch.setattr(writer, "materialize", spy)
    monkeypatch.setattr(writer, "COPY_BYTES", 4096)  # many chunks per tensor: exercises chunk boundaries
    assert convert(ckpts["glm_fp8"], tmp_path / "a").exit_code == 0
    assert built == []
    assert_reconstructs(ckpts["glm_fp8"], tmp_path / "a")
    r = convert(ckpts["glm_fp8"], tmp_path / "b", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "b" / "atomtool.json").read_text())
    cast = {n for n, e in manifest["tensors"].items() if any(p["source_dtype"] != e["dtype"] for p in e["parts"])}
    assert cast and set(built) == cast

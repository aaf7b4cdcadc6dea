"""What a new user feeds ``atomtool generate`` / the serve loader by mistake, and the one-line error (exit 1)
each gets -- raised before the model is built where the input alone shows it cannot work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import tests.checkpoints as ck
from atomtool.cli import app
from atomtool.errors import EngineError, LayoutError
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import make_engine
from tests.fake_hub import record_snapshot_downloads

REPO = Path(__file__).resolve().parents[1]
DSV32_CONFIG = REPO / "tests" / "data" / "realworld" / "configs" / "deepseek-ai__DeepSeek-V3.2.json"
SCHEME_HINT = "the engine runs bf16/fp16/fp32 and fp8_block weights (convert cannot change that)"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(res) -> str:
    """The CLI's whole stderr, which must be exactly one ``error: ...`` line, and exit code 1."""
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 1, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def serve_error_line(res) -> str:
    """serve prints "atomtool serve: loading MODEL ..." first; after it, exactly one error line, exit 1."""
    lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("atomtool serve: loading ")]
    assert res.exit_code == 1, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail the test if the loader gets as far as building (allocating) a model."""
    import atomtool.serve.loader as loader

    def refuse(arch):
        raise AssertionError(f"the loader built a {arch} model before refusing the input")

    monkeypatch.setattr(loader, "get_model_class", refuse)


# -- 1. config.json only -----------------------------------------------------------------------------

def test_config_only_directory_is_refused_before_building(tmp_path, no_model_build):
    """DeepSeek-V3.2's real config (a 671B model): the loader must not build it just to find no weights."""
    d = tmp_path / "ds"
    d.mkdir()
    shutil.copy(DSV32_CONFIG, d / "config.json")
    line = one_error_line(run("generate", d, "--prompt", "hi"))
    assert line == (f"error: {d}: no safetensors weights (*.safetensors) found; config.json alone describes the "
                    "model but there is nothing to load")


def test_layout_with_missing_shard_is_refused_before_building(qwen3, tmp_path, monkeypatch):
    from tests.engine_fixtures import convert_checkpoint

    layout = convert_checkpoint(qwen3, tmp_path / "layout")
    shard = sorted(layout.glob("*.safetensors"))[0]
    shard.unlink()
    import atomtool.serve.loader as loader

    monkeypatch.setattr(loader, "get_model_class", lambda arch: pytest.fail("model built"))
    line = one_error_line(run("generate", layout, "--prompt", "hi"))
    assert line == f"error: {layout}: layout shard(s) missing: {shard.name}"


# -- 2. quantized schemes the engine does not run -------------------------------------------------------

QUANT_WRITERS = {
    "awq": ck.write_awq_checkpoint,
    "gptq": ck.write_gptq_checkpoint,
    "int4_pack": ck.write_ct_int4_checkpoint,          # compressed-tensors W4A16
    "fp8_channel": ck.write_ct_fp8_checkpoint,         # compressed-tensors FP8 per channel
    "nvfp4": ck.write_nvfp4_checkpoint,
}


@pytest.mark.parametrize("scheme", sorted(QUANT_WRITERS))
def test_unservable_scheme_is_refused_and_inspect_says_not_servable(qwen3, tmp_path, scheme, no_model_build):
    q = QUANT_WRITERS[scheme](qwen3, tmp_path / f"q-{scheme}")
    res = run("inspect", q, "--json")
    report = json.loads(res.stdout)
    assert report["servable"] is False
    found = [f for f in report["findings"] if f["code"] == "scheme-not-servable"]
    assert len(found) == 1 and scheme in found[0]["message"], report["findings"]

    line = one_error_line(run("generate", q, "--prompt", "hi"))
    assert line.startswith(f"error: {q}: layer model.layers.0.")
    assert line.endswith(f" is stored as {scheme}; {SCHEME_HINT}")
    module = line.split(" layer ", 1)[1].split(" is stored as ", 1)[0]
    assert any(m["name"] == module and m["scheme"] == scheme for m in report["modules"])


def test_mxfp4_moe_is_refused(tmp_path, no_model_build):
    """gpt-oss style MXFP4 experts on a DeepSeek-V3 MoE checkpoint."""
    src = write_hf_checkpoint(tmp_path / "dsv3", "deepseek_v3", seed=1)
    q = ck.write_mxfp4_checkpoint(src, tmp_path / "q-mxfp4")
    report = json.loads(run("inspect", q, "--json").stdout)
    assert report["servable"] is False
    assert any(f["code"] == "scheme-not-servable" and "mxfp4" in f["message"] for f in report["findings"])
    line = one_error_line(run("generate", q, "--prompt", "hi"))
    assert " is stored as mxfp4; " in line and line.endswith(SCHEME_HINT)


def test_float_and_fp8_block_stay_servable(qwen3, tmp_path):
    """The other side of the line: what the engine does run keeps ``servable: yes`` and no finding."""
    fp8 = ck.write_fp8_block_checkpoint(qwen3, tmp_path / "fp8", block=32)
    for d in (qwen3, fp8):
        report = json.loads(run("inspect", d, "--json").stdout)
        assert report["servable"] is True
        assert not [f for f in report["findings"] if f["code"] == "scheme-not-servable"]
    assert {m["scheme"] for m in json.loads(run("inspect", fp8, "--json").stdout)["modules"]} >= {"fp8_block"}


def test_servable_schemes_have_one_definition():
    """inspect and the loader read the same constant (a second copy could drift)."""
    import atomtool.inspect.classify as classify
    from atomtool.inspect.families import SERVABLE_SCHEMES

    assert classify.SERVABLE_SCHEMES is SERVABLE_SCHEMES
    assert SERVABLE_SCHEMES == {"bf16", "fp16", "fp32", "fp8_block"}


# -- 3. tokenizer ---------------------------------------------------------------------------------------

def test_missing_tokenizer_is_one_line(tmp_path):
    d = write_hf_checkpoint(tmp_path / "notok", "qwen3", tokenizer=False)
    line = one_error_line(run("generate", d, "--prompt", "hi"))
    assert line.startswith(f"error: {d}: cannot load a tokenizer: no tokenizer files found (tokenizer.json, ")
    with pytest.raises(EngineError, match="no tokenizer files found"):
        make_engine(d)


def test_broken_tokenizer_is_one_line(qwen3, tmp_path):
    d = shutil.copytree(qwen3, tmp_path / "badtok")
    (d / "tokenizer.json").write_text("{not json")
    line = one_error_line(run("generate", d, "--prompt", "hi"))
    assert line.startswith(f"error: {d}: cannot load a tokenizer (")


def test_too_long_prompt_prints_only_our_error(qwen3, tmp_path):
    """A tokenizer with a ``model_max_length`` below the prompt: transformers would warn "Token indices
    sequence length is longer ..." ahead of our error; only our line may show (subprocess: real stderr)."""
    d = shutil.copytree(qwen3, tmp_path / "shortmax")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 16
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "atomtool.cli", "generate", str(d), "--prompt", "x" * 600,
                           "--device", "cpu"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: the prompt has 600 tokens, more than max_model_len 512"], proc.stderr


# -- 4. architecture name in load errors ---------------------------------------------------------------

def test_load_error_names_the_checkpoint_architecture(qwen3, tmp_path):
    d = shutil.copytree(qwen3, tmp_path / "missing")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    line = one_error_line(run("generate", d, "--prompt", "hi"))
    assert line.startswith("error: cannot load Qwen3ForCausalLM weights: ")
    assert "LlamaForCausalLM" not in line


# -- 5. the layout manifest ----------------------------------------------------------------------------

@pytest.mark.parametrize("manifest,msg", [
    (json.dumps({"format": "atomtool-layout", "version": 99, "tensors": {}}),
     "layout version 99 is not supported (expected 1)"),
    ("{not json", "unreadable manifest"),
    (json.dumps({"format": "something-else"}), "format is not 'atomtool-layout'"),
])
def test_bad_manifest_is_a_layout_error_not_a_raw_checkpoint(qwen3, tmp_path, manifest, msg, no_model_build):
    """A directory with atomtool.json is a layout; a bad manifest must not fall back to the raw path (these
    directories hold a perfectly loadable raw checkpoint next to it)."""
    d = shutil.copytree(qwen3, tmp_path / "layoutish")
    (d / "atomtool.json").write_text(manifest)
    line = one_error_line(run("generate", d, "--prompt", "hi"))
    assert line.startswith(f"error: {d / 'atomtool.json'}: ") and msg in line
    with pytest.raises(LayoutError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        make_engine(d)


# -- 6. Hub repo ids --------------------------------------------------------------------------------------

def _fill_hf_cache(cache: Path, repo_id: str, src: Path, commit: str = "c" * 40) -> None:
    """The HF cache layout huggingface_hub reads offline: refs/main -> commit, snapshots/<commit>/<files>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(src, repo / "snapshots" / commit)


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_generate_takes_a_cached_hub_repo_id(qwen3, hf_offline, tmp_path, monkeypatch):
    _fill_hf_cache(hf_offline, "tiny-org/tiny-qwen3", qwen3)
    monkeypatch.chdir(tmp_path)  # "tiny-org/tiny-qwen3" is not a local path here
    by_id = run("generate", "tiny-org/tiny-qwen3", "--prompt", "ab", "--max-tokens", "4", "--ignore-eos",
                "--json", "--device", "cpu")
    assert by_id.exit_code == 0, by_id.output
    by_dir = run("generate", qwen3, "--prompt", "ab", "--max-tokens", "4", "--ignore-eos", "--json",
                 "--device", "cpu")
    assert json.loads(by_id.stdout) == json.loads(by_dir.stdout)


def test_downloadable_hub_repo_id_goes_through_resolve_source(qwen3, tmp_path, monkeypatch):
    calls = record_snapshot_downloads(monkeypatch, qwen3)
    monkeypatch.chdir(tmp_path)
    res = run("generate", "tiny-org/tiny-qwen3", "--prompt", "ab", "--max-tokens", "2", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert calls and calls[0]["repo_id"] == "tiny-org/tiny-qwen3"
    assert {"*.safetensors", "*.json"} <= set(calls[0]["allow_patterns"] or ())  # weights, configs and tokenizer


def test_offline_repo_id_not_in_cache_is_one_line(hf_offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(run("generate", "some/repo", "--prompt", "hi"))
    assert line == f"error: some/repo: HF_HUB_OFFLINE is set, and the repo is not in the local HF cache ({hf_offline})"


def test_missing_local_path_is_not_treated_as_a_repo_id(tmp_path):
    line = one_error_line(run("generate", tmp_path / "nope", "--prompt", "hi"))
    assert "does not exist" in line


# -- serve goes through the same loader ------------------------------------------------------------------

def test_serve_refuses_the_same_inputs(qwen3, tmp_path, hf_offline, monkeypatch, no_model_build):
    d = tmp_path / "ds"
    d.mkdir()
    shutil.copy(DSV32_CONFIG, d / "config.json")
    line = serve_error_line(run("serve", d, "--port", "0", "--device", "cpu"))
    assert line.startswith(f"error: {d}: no safetensors weights")
    q = ck.write_awq_checkpoint(qwen3, tmp_path / "q-awq")
    assert serve_error_line(run("serve", q, "--port", "0", "--device", "cpu")).endswith(SCHEME_HINT)
    monkeypatch.chdir(tmp_path)
    line = serve_error_line(run("serve", "some/repo", "--port", "0"))
    assert line.startswith("error: some/repo: HF_HUB_OFFLINE is set, and the repo is not in the local HF cache")

"""Bad input to the engine and to ``atomtool generate``: clear typed errors, exit code 1 from the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.errors import (
    EngineError,
    InvalidRequestError,
    SourceError,
    UnsupportedArchitectureError,
)
from atomtool.serve import LLM, SamplingParams
from atomtool.serve.models.registry import get_model_class
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import hf_greedy, load_hf, make_engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=2)


def cli(*args):
    return CliRunner().invoke(app, ["generate", *map(str, args)])


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_generate_cli_json_matches_hf(ckpt):
    res = cli(ckpt, "--prompt", "ab", "--prompt", "hello there", "--max-tokens", "5", "--ignore-eos", "--json")
    assert res.exit_code == 0, res.output
    items = json.loads(res.stdout)
    assert [i["prompt"] for i in items] == ["ab", "hello there"]
    llm = LLM(str(ckpt), device="cpu", kv_cache_memory=1 << 22)
    hf = load_hf(ckpt)
    for item in items:
        ids = llm.tokenizer.encode(item["prompt"])
        assert item["token_ids"] == hf_greedy(hf, ids, 5)[0]
        assert item["finish_reason"] == "length"
        assert item["text"] == llm.tokenizer.decode(item["token_ids"], skip_special_tokens=True)
    res = cli(ckpt, "--prompt", "ab", "--max-tokens", "3")
    assert res.exit_code == 0 and res.stdout.startswith("ab")


def test_unknown_architecture(ckpt, tmp_path):
    import shutil

    bad = shutil.copytree(ckpt, tmp_path / "bad")
    _edit_config(bad, architectures=["FancyNewForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewForCausalLM.*supported:.*LlamaForCausalLM"):
        make_engine(bad)
    res = cli(bad, "--prompt", "x")
    assert res.exit_code == 1 and "error: unsupported architecture 'FancyNewForCausalLM'" in res.output
    with pytest.raises(UnsupportedArchitectureError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "top level is not a JSON object"),
    ('"config"', "top level is not a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_config_json_that_is_not_an_object_is_one_error_line(ckpt, tmp_path, text, message):
    import shutil

    bad = shutil.copytree(ckpt, tmp_path / "bad")
    (bad / "config.json").write_text(text)
    res = cli(bad, "--prompt", "x")
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output


def test_missing_tensor_is_named(ckpt, tmp_path):
    import shutil

    bad = shutil.copytree(ckpt, tmp_path / "missing")
    sd = load_file(bad / "model.safetensors")
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"missing tensors \(1\): model\.layers\.1\.mlp\.down_proj\.weight"):
        make_engine(bad)
    res = cli(bad, "--prompt", "x")
    assert res.exit_code == 1 and "model.layers.1.mlp.down_proj.weight" in res.output


def test_wrong_shape_and_unexpected_tensor_are_named(ckpt):
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.models.llama import LlamaForCausalLM

    cfg = flatten_dsa_config(json.loads((ckpt / "config.json").read_text()))
    model = LlamaForCausalLM(cfg, None, torch.float32, "cpu")
    weights = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    weights["model.norm.weight"] = torch.zeros(3)
    weights["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(8)
    weights["extra.weight"] = torch.zeros(1)
    with pytest.raises(EngineError) as err:
        model.load_weights(weights.items())
    msg = str(err.value)
    assert "unexpected tensors (2)" in msg and "extra.weight" in msg
    assert "model.norm.weight (3,) (model expects (64,))" in msg
    assert "missing" not in msg  # present but mis-shaped: a shape mismatch only


def test_missing_model_dir_and_tokenizer(ckpt, tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        make_engine(tmp_path / "nope")
    assert cli(tmp_path / "nope", "--prompt", "x").exit_code == 1
    no_tok = write_hf_checkpoint(tmp_path / "notok", "llama", tokenizer=False)
    with pytest.raises(EngineError, match="cannot load a tokenizer"):
        make_engine(no_tok)


def test_prompt_longer_than_max_model_len(ckpt):
    eng = make_engine(ckpt, max_model_len=8)
    with pytest.raises(InvalidRequestError, match="the prompt has 9 tokens, more than max_model_len 8"):
        eng.add_request("a", list(range(3, 12)), SamplingParams())
    assert not eng.has_unfinished()
    res = cli(ckpt, "--prompt", "x" * 600)  # the fixture's max_position_embeddings is 512
    assert res.exit_code == 1 and "more than max_model_len 512" in res.output


@pytest.mark.parametrize("kwargs,msg", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=-5), "top_k must be"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(logprobs=99), "logprobs must be"),
    (dict(min_tokens=50, max_tokens=4), "min_tokens must be"),
    (dict(seed=2**64), "seed must be an integer in the int64 range"),
    (dict(stop_token_ids=[5, -1]), "stop_token_ids must be non-negative token ids"),
])
def test_invalid_sampling_params(ckpt, kwargs, msg):
    eng = make_engine(ckpt)
    with pytest.raises(InvalidRequestError, match=msg):
        eng.add_request("a", [3, 4], SamplingParams(**kwargs))
    assert not eng.has_unfinished()


def test_invalid_sampling_params_cli(ckpt):
    res = cli(ckpt, "--prompt", "x", "--top-p", "0")
    assert res.exit_code == 1 and "error: top_p must be in (0, 1]" in res.output
    res = cli(ckpt, "--prompt", "x", "--max-tokens", "0")
    assert res.exit_code == 1 and "max_tokens must be" in res.output


def test_bad_requests(ckpt):
    eng = make_engine(ckpt)
    eng.add_request("a", [3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request id 'a' is already in use"):
        eng.add_request("a", [3, 4], SamplingParams())
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        eng.add_request("b", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 128\): \[128, -1\]"):
        eng.add_request("c", [5, 128, -1], SamplingParams())
    with pytest.raises(InvalidRequestError, match="2 sampling params for 1 prompts"):
        LLM.__new__(LLM).generate(["x"], [SamplingParams(), SamplingParams()])


def test_bad_engine_arguments(ckpt):
    with pytest.raises(EngineError, match="max_num_seqs must be a positive integer"):
        make_engine(ckpt, max_num_seqs=0)
    with pytest.raises(EngineError, match="max_model_len 4096 exceeds what the model supports \\(512"):
        make_engine(ckpt, max_model_len=4096)
    # 512 bytes per token (2 layers x K,V x 2 heads x 16 dims x 4 bytes): 10 kB hold one 16-token block
    with pytest.raises(EngineError, match="KV cache budget .* holds 16 tokens, fewer than max_model_len 512"):
        make_engine(ckpt, kv_cache_memory=10_000, max_model_len=512)
    assert make_engine(ckpt, kv_cache_memory=10_000).max_model_len == 16  # auto: what the pool holds
    with pytest.raises(EngineError, match="cannot hold one block of 16 tokens \\(8192 bytes\\)"):
        make_engine(ckpt, kv_cache_memory=100)
    with pytest.raises(EngineError, match="unknown dtype 'float8'"):
        make_engine(ckpt, dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA"):
            make_engine(ckpt, device="cuda")


def test_unknown_backend_argument(ckpt):
    from atomtool.serve import ops

    try:
        with pytest.raises(EngineError, match="unknown op backend 'cuda-magic'"):
            make_engine(ckpt, backend="cuda-magic")
    finally:
        ops.set_backend(None)

"""The shipped demo model (atomtool/demo_model): a DeepSeek-V3.2 (MLA + DSA + MoE) that recites the Zen of Python.

The expected text always comes from CPython's ``this`` module (decoded here, independently of atomtool), never
from a copied string or from our own output.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json

import pytest
import torch

from atomtool.serve.demo import DEMO_PROMPT, demo_model_path, expected_continuation


def _zen_from_this() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def _expected_after_prompt() -> str:
    zen = _zen_from_this()
    return zen[zen.index(DEMO_PROMPT) + len(DEMO_PROMPT):]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()


def test_expected_text_helpers_match_this_module():
    assert expected_continuation() == _expected_after_prompt()
    assert _expected_after_prompt().startswith(" ugly.\nExplicit is better than implicit.")


def test_shipped_files_small_and_complete():
    d = demo_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "chat_template.jinja"):
        assert (d / name).is_file(), name
    total = sum(f.stat().st_size for f in d.iterdir())
    assert total < 4 * 1024 * 1024, total


def test_config_is_deepseek_v32_with_sparse_selection(tokenizer):
    cfg = json.loads((demo_model_path() / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v32"
    assert cfg["kv_lora_rank"] > 0 and cfg["q_lora_rank"] > 0  # MLA
    assert cfg["n_routed_experts"] > cfg["num_experts_per_tok"] >= 1 and "sparse" in cfg["mlp_layer_types"]  # MoE
    # the indexer's top-k must be well below the recited text length, so selection decides what attention sees
    n_text = len(tokenizer(_zen_from_this())["input_ids"])
    assert cfg["index_topk"] * 4 < n_text


def test_tokenizer_roundtrip_and_chat_template(tokenizer):
    zen = _zen_from_this()
    ids = tokenizer(zen)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == zen
    odd = "naïve café ✓ \t tabs"
    assert tokenizer.decode(tokenizer(odd)["input_ids"], skip_special_tokens=True) == odd  # byte-level: any UTF-8
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    tc = json.loads((demo_model_path() / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in tc["chat_template"]


def test_transformers_greedy_recites_zen(tokenizer, hf_model):
    """transformers' own generate (float32, KV cache, indexer top-k at every step) recites and stops at eos."""
    prompt = tokenizer(DEMO_PROMPT, return_tensors="pt")
    assert prompt["input_ids"].shape[1] < hf_model.config.index_topk
    out = hf_model.generate(**prompt, max_new_tokens=400, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.eos_token_id
    assert len(new) > hf_model.config.index_topk * 4  # most steps run with sparse (top-k) attention
    assert tokenizer.decode(new, skip_special_tokens=True) == _expected_after_prompt()


def test_transformers_chat_recites_zen(tokenizer, hf_model):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Recite the Zen of Python."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = hf_model.generate(**ids, max_new_tokens=400, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    zen = _zen_from_this()
    assert text == zen[zen.index(DEMO_PROMPT):]


def test_indexer_selection_matters(tokenizer, hf_model):
    """Forcing dense attention changes the model's logits: the shipped weights were trained sparse."""
    ids = tokenizer(_zen_from_this()[len("The Zen of Python, by Tim Peters\n\n"):], return_tensors="pt")
    with torch.no_grad():
        sparse = hf_model(**ids).logits
        ks = [layer.self_attn.indexer.index_topk for layer in hf_model.model.layers]
        try:
            for layer in hf_model.model.layers:
                layer.self_attn.indexer.index_topk = 1 << 20
            dense = hf_model(**ids).logits
        finally:
            for layer, k in zip(hf_model.model.layers, ks, strict=True):
                layer.self_attn.indexer.index_topk = k
    k = hf_model.config.index_topk
    assert torch.allclose(sparse[:, :k], dense[:, :k], atol=1e-5)  # up to K keys: sparse == dense
    assert (sparse[:, k:] - dense[:, k:]).abs().max() > 1e-2


def test_inspect_cli_reports_dsa_roles():
    from typer.testing import CliRunner

    from atomtool.cli import app

    res = CliRunner().invoke(app, ["inspect", str(demo_model_path()), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["architecture"] == "DeepseekV32ForCausalLM" and report["servable"] is True
    assert report["dsa"]["index_topk"] == 32
    assert [entry["role"] for entry in report["dsa"]["layers"]] == ["full", "full"]


def test_engine_greedy_recites_zen(tokenizer):
    """Our engine (atomtool.serve.LLM, paged KV + DSA top-k) recites too, alone and batched with a chat prompt."""
    from atomtool.serve import LLM, SamplingParams

    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Recite the Zen of Python."}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    llm = LLM(str(demo_model_path()))
    params = SamplingParams(max_tokens=400, temperature=0)
    solo = llm.generate(DEMO_PROMPT, params)[0]
    assert solo.text == _expected_after_prompt() and solo.finish_reason == "stop"
    batch = llm.generate([DEMO_PROMPT, list(chat_ids)], params)
    assert batch[0].text == _expected_after_prompt()
    zen = _zen_from_this()
    assert batch[1].text == zen[zen.index(DEMO_PROMPT):]


def test_indexer_top_k_holds_most_dense_attention_mass(tokenizer):
    """The indexer was fitted to attention (DeepSeek's KL recipe): its top-K set (transformers' own indexer)
    holds most of the dense attention probability mass, far more than K random keys would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = tokenizer(_zen_from_this()[len("The Zen of Python, by Tim Peters\n\n"):], return_tensors="pt")
    selected = {}
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, o, i=i: selected.__setitem__(i, o.long()))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(**ids)  # sparse: record the indexer's top-K
        for h in hooks:
            h.remove()
        k = model.config.index_topk
        for layer in model.model.layers:
            layer.self_attn.indexer.index_topk = 1 << 20
        dense = model(**ids, output_attentions=True).attentions
    n = ids["input_ids"].shape[1]
    rows = torch.arange(k, n)
    for i, attn in enumerate(dense):
        p = attn[0].mean(0)  # [S, S] head-mean dense attention
        recall = p.gather(-1, selected[i][0])[rows].sum(-1)
        random_share = (k / (rows + 1).float()).mean()
        assert recall.mean() > 0.9 > 2 * random_share, (i, float(recall.mean()))

"""MLA + MoE + DSA models (DeepseekV3 / DeepseekV32 / GlmMoeDsa) against HF transformers, float32.

Checkpoints are tiny random models written by transformers' ``save_pretrained`` (tests/checkpoints.py) and
loaded through the engine loader (raw HF -> conversion plan in memory). The model runs through a hand-built
paged-KV driver (tests/mla_driver.py): prefill, decode, batches of very different lengths, chunked prefill,
prefix-cache block sharing, prompts longer than ``index_topk`` and generations crossing it.

Most DSA fixtures use 16 indexer heads, so that unmodified HF agrees: with few heads, exact 0.0 ReLU-sum ties
are common and HF's ``Tensor.topk`` breaks them arbitrarily while the engine takes the lowest position. The
``-4heads`` variants (the shared fixtures' 4 heads, ties everywhere) run HF with a stable top-k instead
(tests/mla_driver.py ``stable_tensor_topk``), which checks the engine's tie rule in prefill, decode and
chunks.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.loader import load_model
from tests.checkpoints import GLM_EXPLICIT_TYPES, write_hf_checkpoint
from tests.engine_fixtures import one_torch_thread  # noqa: F401 (autouse fixture)
from tests.mla_driver import PagedDriver, hf_greedy, hf_model

ATOL = RTOL = 2e-4
DSA = dict(index_n_heads=16)
ARCH_OVERRIDES = {
    "deepseek_v3": dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 128}),
    "deepseek_v32": dict(DSA),
    "glm_moe_dsa": dict(DSA),
    "glm_explicit": dict(DSA, indexer_types=GLM_EXPLICIT_TYPES),
    # the shared fixtures' 4 indexer heads: exact-zero score ties everywhere; HF runs with stable top-k
    "deepseek_v32-4heads": {},
    "glm_moe_dsa-4heads": {},
}


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=list(ARCH_OVERRIDES))
def ckpt(request, tmp_path_factory):
    name = request.param
    arch = "glm_moe_dsa" if name == "glm_explicit" else name.removesuffix("-4heads")
    path = write_hf_checkpoint(tmp_path_factory.mktemp(name), arch, seed=1, **ARCH_OVERRIDES[name])
    engine = load_model(path, dtype="float32", device="cpu").model
    hf = hf_model(path)
    hf.stable_topk = name.endswith("-4heads")
    return name.removesuffix("-4heads"), path, engine, hf


def _check(engine_tokens, engine_logits, hf_tokens, hf_logits):
    assert engine_tokens == hf_tokens
    torch.testing.assert_close(torch.stack(engine_logits), hf_logits, atol=ATOL, rtol=RTOL)


def test_schedule_and_planes(ckpt):
    name, _, model, hf = ckpt
    roles = {"deepseek_v3": ["dense"] * 3, "deepseek_v32": ["full"] * 3,
             "glm_moe_dsa": ["full", "full", "shared", "full"], "glm_explicit": GLM_EXPLICIT_TYPES}[name]
    assert model.roles == roles
    planes = [[p.name for p in layer] for layer in model.kv_plane_specs()]
    assert planes == [["latent", "index_k"] if r == "full" else ["latent"] for r in roles]
    # shared layers build no indexer (and HF's checkpoint has none for them)
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [r == "full" for r in roles]


def test_single_prompt_longer_than_topk(ckpt):
    _, _, model, hf = ckpt
    prompt = _prompt(21, 0)  # index_topk is 8: selection matters from the prefill on
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 8, hf.stable_topk)
    out, logits = PagedDriver(model).generate({"a": prompt}, 8)
    _check(out["a"], logits["a"], ref_tokens, ref_logits)


def test_batch_of_different_lengths_crossing_topk(ckpt):
    """3 tokens (generation crosses index_topk), 9, and 40 tokens decoded together in one batch."""
    _, _, model, hf = ckpt
    prompts = {"short": _prompt(3, 1), "mid": _prompt(9, 2), "long": _prompt(40, 3)}
    out, logits = PagedDriver(model, seed=1).generate(prompts, 10)
    for sid, p in prompts.items():
        ref_tokens, ref_logits = hf_greedy(hf, p, 10, hf.stable_topk)
        _check(out[sid], logits[sid], ref_tokens, ref_logits)


def test_chunked_prefill_mixed_with_decode(ckpt):
    _, _, model, hf = ckpt
    prompts = {"x": _prompt(26, 4), "y": _prompt(2, 5)}
    out, logits = PagedDriver(model, seed=2).generate(prompts, 6, chunk=5)
    for sid, p in prompts.items():
        ref_tokens, ref_logits = hf_greedy(hf, p, 6, hf.stable_topk)
        _check(out[sid], logits[sid], ref_tokens, ref_logits)


def test_prefix_blocks_shared(ckpt):
    """A second request whose first 16 tokens hit the first request's cached blocks computes only its tail;
    its latent and index keys for the prefix are read from the shared blocks."""
    _, _, model, hf = ckpt
    base = _prompt(18, 6)
    other = base[:16] + _prompt(7, 7)
    drv = PagedDriver(model, seed=3)
    drv.generate({"first": base}, 2)
    drv.add("second", other, share_prefix_of="first", shared_tokens=16)
    tokens, lgs = [], []
    for _ in range(5):
        seq = drv.seqs["second"]
        lg = drv.step([("second", len(seq.tokens) - seq.computed)])[0][-1]
        tokens.append(int(torch.argmax(lg)))
        lgs.append(lg)
        seq.tokens.append(tokens[-1])
    ref_tokens, ref_logits = hf_greedy(hf, other, 5, hf.stable_topk)
    _check(tokens, lgs, ref_tokens, ref_logits)


def test_batch_invariance(ckpt):
    """A request's tokens and logits do not depend on what else is in the batch."""
    _, _, model, _ = ckpt
    p = _prompt(13, 8)
    alone, alone_logits = PagedDriver(model, seed=4).generate({"r": p}, 6)
    others = {"r": p, "o1": _prompt(30, 9), "o2": _prompt(4, 10)}
    mixed, mixed_logits = PagedDriver(model, seed=5).generate(others, 6, chunk=7)
    assert alone["r"] == mixed["r"]
    torch.testing.assert_close(torch.stack(alone_logits["r"]), torch.stack(mixed_logits["r"]), atol=1e-5, rtol=1e-5)


def test_deepseek_v3_neox_rope_yarn_attention_factor_tied(tmp_path):
    """``rope_interleave: false`` (NeoX MLA rope) and YaRN with only ``mscale_all_dim``: HF then multiplies
    cos/sin by ``0.1 ln(factor) + 1`` and the softmax scale by ``mscale(factor, mscale_all_dim)**2``; tied
    embeddings (the checkpoint has no lm_head)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 64}
    path = write_hf_checkpoint(tmp_path / "ds", "deepseek_v3", seed=3, rope_interleave=False, rope_parameters=rope,
                                tie_word_embeddings=True)
    model = load_model(path, dtype="float32", device="cpu").model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = _prompt(30, 11)
    ref_tokens, ref_logits = hf_greedy(hf_model(path), prompt, 6)
    out, logits = PagedDriver(model).generate({"a": prompt}, 6)
    _check(out["a"], logits["a"], ref_tokens, ref_logits)


def test_unsupported_mla_variants_are_errors():
    from atomtool.errors import EngineError
    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.models.deepseek import DeepseekV3ForCausalLM
    from tests.checkpoints import tiny_config

    for overrides, msg in (({"q_lora_rank": None}, "without q_lora_rank"),
                           ({"attention_bias": True}, "attention_bias"),
                           ({"hidden_act": "gelu"}, "hidden_act 'silu'")):
        cfg = flatten_dsa_config(tiny_config("deepseek_v3", **overrides).to_dict())
        with pytest.raises(EngineError, match=msg):
            DeepseekV3ForCausalLM(cfg, None, torch.float32, "cpu")


def test_deepseek_v32_with_index_cache_override(tmp_path):
    """IndexCache on DeepSeek-V3.2 (``index_topk_freq`` 2 added to its config): layer 2 becomes shared, its
    checkpoint indexer is dropped at load and it reuses layer 1's top-k. HF's V3.2 ignores the override, so
    the oracle is HF with the shared layer's indexer patched to return the previous full layer's top-k."""
    import json

    path = write_hf_checkpoint(tmp_path / "ds", "deepseek_v32", seed=5, **DSA)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(index_topk_freq=2, index_skip_topk_offset=2)
    (path / "config.json").write_text(json.dumps(cfg))
    model = load_model(path, dtype="float32", device="cpu").model
    assert model.roles == ["full", "full", "shared"]
    assert model.model.layers[2].self_attn.indexer is None
    hf = hf_model(path)
    last: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(hf.model.layers):
        def forward(*args, _i=i, _orig=layer.self_attn.indexer.forward, **kwargs):
            if model.roles[_i] == "full":
                last["topk"] = _orig(*args, **kwargs)
            return last["topk"]
        layer.self_attn.indexer.forward = forward
    prompt = _prompt(24, 12)
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 6)
    out, logits = PagedDriver(model).generate({"a": prompt}, 6)
    _check(out["a"], logits["a"], ref_tokens, ref_logits)

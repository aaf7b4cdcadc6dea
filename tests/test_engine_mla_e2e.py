"""MLA + MoE + DSA models through the whole engine (LLMEngine: scheduler, paged KV pool, prefix cache,
preemption) vs HF transformers float32, on tiny random checkpoints written by ``save_pretrained``.

DeepSeek-V3 runs with YaRN rope; DeepSeek-V3.2 and GLM-MoE-DSA (IndexShare from freq/offset: full, full,
shared, full; and from explicit indexer_types: full, shared, shared, full) with
``index_topk`` 8, so every prompt longer than 8 tokens exercises the indexer's selection and short prompts
cross it while generating. DSA fixtures use 16 indexer heads (see test_engine_mla_model.py for why).
Greedy tokens must be identical and log-probs close to HF's teacher-forced ones; no KV block may leak.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.checkpoints import (
    GLM_EXPLICIT_TYPES,
    dequantize_fp8_block_checkpoint,
    write_fp8_block_checkpoint,
    write_hf_checkpoint,
    write_state_dict,
)
from tests.engine_fixtures import (
    assert_no_leaks,
    check_greedy_matches,
    convert_checkpoint,
    greedy_params,
    make_engine,
    one_torch_thread,  # noqa: F401 (autouse fixture)
    run_to_completion,
)
from tests.mla_driver import hf_greedy, hf_model

ARCHS = {
    "deepseek_v3-yarn": ("deepseek_v3", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 128})),
    "deepseek_v32": ("deepseek_v32", dict(index_n_heads=16)),
    "glm_moe_dsa": ("glm_moe_dsa", dict(index_n_heads=16)),
    "glm_moe_dsa-explicit": ("glm_moe_dsa", dict(index_n_heads=16, indexer_types=GLM_EXPLICIT_TYPES)),
}
N_NEW = 8
LENGTHS = (3, 12, 40)


class Ref:
    """A checkpoint, its HF model and cached HF greedy references (tokens, log-probs [n, vocab])."""

    def __init__(self, path, hf):
        self.path = path
        self.hf = hf
        self._cache: dict[tuple, tuple] = {}
        g = torch.Generator().manual_seed(11)
        self.prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]

    def greedy(self, prompt, n=N_NEW):
        key = (tuple(prompt), n)
        if key not in self._cache:
            tokens, logits = hf_greedy(self.hf, prompt, n)
            self._cache[key] = tokens, torch.log_softmax(logits, -1)
        return self._cache[key]


@pytest.fixture(scope="module", params=list(ARCHS))
def ref(request, tmp_path_factory):
    arch, overrides = ARCHS[request.param]
    path = write_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=2, **overrides)
    return Ref(path, hf_model(path))


def greedy(n=N_NEW, logprobs=None):
    return greedy_params(n, logprobs)


def check_matches(ref, prompt, out, logprobs=False):
    check_greedy_matches(ref, prompt, out, logprobs, atol=2e-4)


def test_batch_of_different_lengths(ref):
    """3 tokens (generation crosses index_topk), 12 and 40 tokens (selection from the prefill on)."""
    eng = make_engine(ref.path, block_size=4)
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=3)) for i, p in enumerate(ref.prompts)})
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)], logprobs=True)
    assert_no_leaks(eng)


def test_chunked_prefill_and_batch_invariance(ref):
    target = ref.prompts[1]
    alone = run_to_completion(make_engine(ref.path), {"t": (target, greedy(logprobs=2))})["t"]
    eng = make_engine(ref.path, block_size=4, max_num_batched_tokens=5)
    others = {f"o{i}": (p, greedy(n=3 + i)) for i, p in enumerate(ref.prompts)}
    outs = run_to_completion(eng, {**others, "t": (target, greedy(logprobs=2))})
    check_matches(ref, target, outs["t"], logprobs=True)
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[f"o{i}"])
    assert outs["t"].token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, outs["t"].logprobs, strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    assert_no_leaks(eng)


def test_preemption_with_tiny_kv_pool(ref):
    eng0 = make_engine(ref.path, block_size=4)
    per_block = sum(4 * math.prod(p.shape) * p.dtype.itemsize
                    for layer in eng0.model.kv_plane_specs() for p in layer)
    # 20 blocks: all prompts are admitted (1 + 3 + 10 blocks) but their decodes need 3 + 5 + 12.
    eng = make_engine(ref.path, block_size=4, kv_cache_memory=20 * per_block, max_model_len=64)
    assert eng.num_total_blocks() == 20
    outs = run_to_completion(eng, {str(i): (p, greedy(n=10)) for i, p in enumerate(ref.prompts)})
    assert eng.stats()["num_preemptions"] > 0
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)])
    assert_no_leaks(eng)


def test_prefix_cache_hits(ref):
    """Cached latent and index-key blocks are reused: the indexer of a hit request scores cached keys."""
    eng = make_engine(ref.path, block_size=4)
    base = ref.prompts[2]  # 40 tokens
    first = run_to_completion(eng, {"first": (base, greedy())})["first"]
    check_matches(ref, base, first)
    again = run_to_completion(eng, {"again": (base, greedy(logprobs=2))})["again"]
    assert again.num_cached_tokens == (len(base) - 1) // 4 * 4
    check_matches(ref, base, again, logprobs=True)
    other = base[:24] + ref.prompts[1]
    out = run_to_completion(eng, {"other": (other, greedy())})["other"]
    assert out.num_cached_tokens == 24
    check_matches(ref, other, out)
    assert_no_leaks(eng)


def test_abort_frees_blocks(ref):
    eng = make_engine(ref.path, block_size=4, max_num_batched_tokens=16)
    for i, p in enumerate(ref.prompts):
        eng.add_request(str(i), p, greedy(n=20))
    for _ in range(3):
        eng.step()
    assert eng.abort("2").finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)


def test_converted_layout_matches_hf(ref, tmp_path):
    layout = convert_checkpoint(ref.path, tmp_path / "layout")
    eng = make_engine(layout, block_size=4)
    attn0 = eng.model.model.layers[0].self_attn
    assert set(attn0.splits) >= {"q_a_proj", "kv_a_proj_with_mqa"}
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=2)) for i, p in enumerate(ref.prompts)})
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)], logprobs=True)
    assert_no_leaks(eng)


@pytest.fixture(scope="module", params=[("deepseek_v3", (24, 16)), ("glm_moe_dsa", (16, 16))],
                ids=["deepseek_v3-padded", "glm_moe_dsa-aligned"])
def fp8_ref(request, tmp_path_factory):
    """FP8 blocks of (24, 16): q_a (32 rows) and the experts' gate (32 rows) are not block-aligned, so
    convert pads fused_qkv_a_proj and w13 (the engine dequantizes such experts at load); blocks of (16, 16)
    are aligned and the experts stay FP8. indexer.weights_proj stays float, so the indexer parts are not
    fused. The oracle is transformers on the exactly dequantized weights (written as a float checkpoint)."""
    arch, block = request.param
    root = tmp_path_factory.mktemp(f"fp8-{arch}")
    extra = {"index_n_heads": 16} if arch != "deepseek_v3" else {}
    src = write_hf_checkpoint(root / "src", arch, seed=4, **extra)
    dst = write_fp8_block_checkpoint(src, root / "fp8", block=block, float_dtype=None)
    deq = root / "dequant"
    shutil.copytree(src, deq, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    write_state_dict(deq, dequantize_fp8_block_checkpoint(dst))
    cfg = json.loads((src / "config.json").read_text())
    (deq / "config.json").write_text(json.dumps(cfg))
    ref = Ref(dst, hf_model(deq))
    ref.experts_fp8 = block == (16, 16)
    return ref


@pytest.mark.parametrize("via_layout", [False, True], ids=["raw", "layout"])
def test_fp8_block_checkpoint_matches_dequantized_hf(fp8_ref, via_layout, tmp_path):
    path = convert_checkpoint(fp8_ref.path, tmp_path / "layout") if via_layout else fp8_ref.path
    eng = make_engine(path, block_size=4)
    attn = eng.model.model.layers[0].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.indexer is None or not attn.indexer.fused  # weights_proj is float: not fused with FP8 parts
    experts = eng.model.model.layers[1].mlp.experts
    assert (experts.w13.weight.dtype == torch.float8_e4m3fn) == fp8_ref.experts_fp8
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=2)) for i, p in enumerate(fp8_ref.prompts)})
    for i, p in enumerate(fp8_ref.prompts):
        check_matches(fp8_ref, p, outs[str(i)], logprobs=True)
    assert_no_leaks(eng)

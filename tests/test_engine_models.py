"""Dense models through the whole engine vs HF transformers (the oracle), float32 on CPU.

Each config is a tiny random checkpoint written by save_pretrained: Llama with llama3 rope scaling, Qwen2
(qkv bias) with YaRN, Qwen3 (q/k norm) with tied embeddings. Greedy tokens must be identical and the
engine's raw log-probs close to HF's full-forward log-probs, in every scheduling situation.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import (
    assert_no_leaks,
    check_greedy_matches,
    convert_checkpoint,
    greedy_params,
    hf_greedy,
    load_hf,
    make_engine,
    run_to_completion,
)

CONFIGS = {
    "llama-llama3rope": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
    "qwen2-yarn": ("qwen2", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1)),
}
N_NEW = 8
LENGTHS = (2, 19, 50)


class Ref:
    """A checkpoint, its HF model and cached HF greedy references."""

    def __init__(self, path, arch, hf=None):
        self.path = path
        self.arch = arch
        self.hf = hf if hf is not None else load_hf(path)
        self._cache: dict[tuple, tuple] = {}
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in LENGTHS]

    def greedy(self, prompt, n=N_NEW):
        key = (tuple(prompt), n)
        if key not in self._cache:
            self._cache[key] = hf_greedy(self.hf, prompt, n)
        return self._cache[key]

    def engine(self, **kw):
        return make_engine(self.path, **kw)


@pytest.fixture(scope="module", params=list(CONFIGS))
def ref(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    path = write_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=3, **overrides)
    return Ref(path, arch)


def greedy(n=N_NEW, logprobs=None):
    return greedy_params(n, logprobs)


def check_matches(ref, prompt, out, logprobs=False):
    check_greedy_matches(ref, prompt, out, logprobs, atol=1e-4, top=5)


def test_single_prompt_matches_hf(ref):
    eng = ref.engine()
    prompt = ref.prompts[1]
    out = run_to_completion(eng, {"a": (prompt, greedy(logprobs=5))})["a"]
    check_matches(ref, prompt, out, logprobs=True)
    assert_no_leaks(eng)


def test_text_prompt_matches_hf(ref):
    eng = ref.engine()
    text = "Hello world! How are"
    prompt = eng.tokenizer.encode(text)
    out = run_to_completion(eng, {"a": (text, greedy())})["a"]
    assert out.prompt_token_ids == prompt
    check_matches(ref, prompt, out)
    assert out.text == eng.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_batch_of_different_lengths(ref):
    eng = ref.engine()
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=5)) for i, p in enumerate(ref.prompts)})
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)], logprobs=True)
    assert_no_leaks(eng)


def test_chunked_prefill(ref):
    eng = ref.engine(max_num_batched_tokens=5)
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=5)) for i, p in enumerate(ref.prompts)})
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)], logprobs=True)
    assert_no_leaks(eng)


def test_preemption_with_tiny_kv_pool(ref):
    # 20 blocks of 4 tokens: all three prompts are admitted (1 + 5 + 13 blocks), but their decodes need
    # 3 + 7 + 15 blocks, so running sequences must be preempted and recomputed.
    per_block = 4 * 2 * 2 * ref.hf.config.num_key_value_heads * 16 * 4  # tokens * layers * (k,v) * Hkv * D * 4B
    eng = ref.engine(block_size=4, kv_cache_memory=20 * per_block, max_model_len=64)
    assert eng.num_total_blocks() == 20
    outs = run_to_completion(eng, {str(i): (p, greedy()) for i, p in enumerate(ref.prompts)})
    assert eng.stats()["num_preemptions"] > 0
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)])
    assert_no_leaks(eng)


def test_prefix_cache_hits(ref):
    eng = ref.engine(block_size=4)
    base = ref.prompts[2]  # 50 tokens
    first = run_to_completion(eng, {"first": (base, greedy())})["first"]
    assert first.num_cached_tokens == 0
    check_matches(ref, base, first)
    # same prompt again: every full block but the one holding the last prompt token comes from the cache
    again = run_to_completion(eng, {"again": (base, greedy(logprobs=5))})["again"]
    assert again.num_cached_tokens == (len(base) - 1) // 4 * 4
    check_matches(ref, base, again, logprobs=True)
    # a shared 24-token prefix, then different tokens
    other = base[:24] + ref.prompts[1]
    out = run_to_completion(eng, {"other": (other, greedy())})["other"]
    assert out.num_cached_tokens == 24
    check_matches(ref, other, out)
    # a prompt extending the first request's prompt + its generated tokens
    longer = base + first.token_ids + [5, 6, 7]
    out = run_to_completion(eng, {"longer": (longer, greedy())})["longer"]
    assert out.num_cached_tokens >= 48
    check_matches(ref, longer, out)
    assert_no_leaks(eng)


def test_concurrent_identical_prompts_share_blocks(ref):
    eng = ref.engine(block_size=4)
    p = ref.prompts[2]
    outs = run_to_completion(eng, {"x": (p, greedy()), "y": (p, greedy()), "z": (p, greedy())})
    for o in outs.values():
        check_matches(ref, p, o)
    assert_no_leaks(eng)


def test_batch_invariance(ref):
    target = ref.prompts[1]
    alone = run_to_completion(ref.engine(), {"t": (target, greedy(logprobs=3))})["t"]
    eng = ref.engine(max_num_batched_tokens=7)
    others = {f"o{i}": (p, greedy(n=3 + i)) for i, p in enumerate(ref.prompts)}
    mixed = run_to_completion(eng, {**others, "t": (target, greedy(logprobs=3))})["t"]
    assert mixed.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, mixed.logprobs, strict=True):
        assert a["token_id"] == b["token_id"]
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)


def test_abort_frees_blocks(ref):
    eng = ref.engine(block_size=4, max_num_batched_tokens=16)
    for i, p in enumerate(ref.prompts):
        eng.add_request(str(i), p, greedy(n=20))
    for _ in range(4):
        eng.step()
    assert eng.num_free_blocks() < eng.num_total_blocks()
    out = eng.abort("2")
    assert out.finished and out.finish_reason == "abort"
    assert eng.abort("2") is None
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(eng)
    for i, p in enumerate(ref.prompts):
        eng.add_request(f"again{i}", p, greedy(n=20))
    eng.step()
    for i in range(len(ref.prompts)):
        eng.abort(f"again{i}")
    assert_no_leaks(eng)


def test_converted_layout_matches_hf(ref, tmp_path):
    layout = convert_checkpoint(ref.path, tmp_path / "layout")
    eng = make_engine(layout)
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=5)) for i, p in enumerate(ref.prompts)})
    for i, p in enumerate(ref.prompts):
        check_matches(ref, p, outs[str(i)], logprobs=True)


@pytest.fixture(scope="module")
def fp8_ref(tmp_path_factory):
    """Llama stored as FP8 blocks of (24, 16): q/k/v parts (64/32/32 rows) are not block-aligned, so convert
    pads the fused qkv_proj; the oracle is transformers on the exactly dequantized weights."""
    from tests.checkpoints import dequantize_fp8_block_checkpoint, write_fp8_block_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    src = write_hf_checkpoint(root / "src", "llama", seed=5)
    dst = write_fp8_block_checkpoint(src, root / "fp8", block=(24, 16), float_dtype=None)
    return Ref(dst, "llama", hf=load_hf(dst, dequantize_fp8_block_checkpoint(dst)))


@pytest.mark.parametrize("via_layout", [False, True], ids=["raw", "layout"])
def test_fp8_block_checkpoint_matches_dequantized_hf(fp8_ref, via_layout, tmp_path):
    path = convert_checkpoint(fp8_ref.path, tmp_path / "layout") if via_layout else fp8_ref.path
    eng = make_engine(path)
    qkv = eng.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv is not None
    outs = run_to_completion(eng, {str(i): (p, greedy(logprobs=5)) for i, p in enumerate(fp8_ref.prompts)})
    for i, p in enumerate(fp8_ref.prompts):
        check_matches(fp8_ref, p, outs[str(i)], logprobs=True)


def test_mistral_is_served_as_llama(tmp_path):
    """MistralForCausalLM (listed as servable) runs through the Llama model; a configured sliding window
    caps max_model_len (attention within the window equals full attention)."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.checkpoints import make_tokenizer, randomize_

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        sliding_window=None, bos_token_id=1, eos_token_id=2)
    hf = MistralForCausalLM(cfg).eval()
    randomize_(hf, seed=4)
    hf.save_pretrained(tmp_path / "m")
    make_tokenizer().save_pretrained(tmp_path / "m")
    ref = Ref(tmp_path / "m", "mistral", hf=hf)
    out = run_to_completion(ref.engine(), {"a": (ref.prompts[2], greedy(logprobs=5))})["a"]
    check_matches(ref, ref.prompts[2], out, logprobs=True)
    cfg.sliding_window = 48
    hf.config.sliding_window = 48
    hf.save_pretrained(tmp_path / "w")
    make_tokenizer().save_pretrained(tmp_path / "w")
    eng = make_engine(tmp_path / "w")
    assert eng.max_model_len == 48
    assert eng.max_model_len_note == ("max_model_len 256 -> 48: sliding_window 48: sliding-window attention is not "
                                      "implemented, so sequences are served within the window, where it is exact")
    from atomtool.errors import EngineError

    with pytest.raises(EngineError, match=r"max_model_len 100 exceeds what the model supports \(48 tokens "
                                          r"\(sliding_window 48: sliding-window attention is not implemented"):
        make_engine(tmp_path / "w", max_model_len=100)


@pytest.mark.parametrize("model_type,extra,expect_window", [
    ("mistral", {"sliding_window": 48}, True),
    ("mistral", {"sliding_window": 48, "use_sliding_window": False}, True),  # MistralConfig has no such flag
    ("qwen2", {"sliding_window": 48}, False),  # Qwen2Config: use_sliding_window defaults to False
    ("qwen2", {"sliding_window": 48, "use_sliding_window": True, "max_window_layers": 0}, True),
    ("qwen3", {"sliding_window": 48, "use_sliding_window": False}, False),
    ("llama", {}, False),
])
def test_sliding_window_context_cap_follows_transformers_configs(model_type, extra, expect_window):
    """The Llama-family model caps a sequence at the sliding window exactly when transformers' own config class
    keeps a window for that config (the oracle: ``AutoConfig.for_model(...).sliding_window``)."""
    from transformers import AutoConfig

    from atomtool.serve.models.llama import LlamaForCausalLM

    cfg = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, **extra)
    hf_window = getattr(AutoConfig.for_model(**cfg), "sliding_window", None)
    assert (hf_window is not None) == expect_window  # the table above is what transformers says
    model = LlamaForCausalLM(cfg, None, torch.float32, "cpu")
    assert model.context_limit == hf_window


def test_llm_generate_api(tmp_path):
    from atomtool.serve import LLM, SamplingParams

    path = write_hf_checkpoint(tmp_path / "q", "qwen3", seed=8)
    hf = load_hf(path)
    llm = LLM(str(path), device="cpu", kv_cache_memory=1 << 22)
    prompts = ["hello", [5, 6, 7, 8]]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                  SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[0].token_ids == hf_greedy(hf, llm.tokenizer.encode("hello"), 3)[0]
    assert outs[1].token_ids == hf_greedy(hf, [5, 6, 7, 8], 5)[0]
    single = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert single[0].token_ids == outs[0].token_ids
    stats = llm.engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0
    assert stats["prefix_cache_hit_tokens"] >= 0 and stats["generated_tokens"] == 11


def test_bfloat16_engine_close_to_hf_bfloat16(tmp_path):
    path = write_hf_checkpoint(tmp_path / "l", "llama", seed=9)
    eng = make_engine(path, dtype="bfloat16")
    assert eng.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert eng.kv_pool.caches[0]["k"].dtype == torch.bfloat16
    prompt = [5, 9, 33, 70, 12, 100, 44]
    out = run_to_completion(eng, {"a": (prompt, greedy(n=1, logprobs=5))})["a"]
    hf = load_hf(path).to(torch.bfloat16)
    _, lps = hf_greedy(hf, prompt, 1)
    assert out.logprobs[0]["logprob"] == pytest.approx(float(lps[0, out.token_ids[0]]), abs=0.1)
    assert float(lps[0, out.token_ids[0]]) >= float(lps[0].max()) - 0.1  # ours is (nearly) HF's argmax too

"""Tiny dense checkpoints for the engine tests (transformers save_pretrained + a byte-level BPE tokenizer).

Until the shared tests/checkpoints.py fixtures and convert's in-memory plan cover everything the engine
tests need, this module writes its own: a tiny random Llama / Qwen2 / Qwen3 model in float32 with a
byte-level BPE tokenizer trained on a few sentences (multi-byte characters included, so incremental
detokenization is exercised).
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "naïve café déjà vu — über straße, 東京 and 北京, emoji 🙂 too.",
    "Once upon a time there was a tiny model that generated text one token at a time.",
    "stop STOP end of story. The end.",
] * 4

ARCH = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def write_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """Train a byte-level BPE (tokenizers library) and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def tiny_config(arch: str, **overrides):
    import transformers

    cfg_cls = getattr(transformers, ARCH[arch][0])
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
    kw.update(overrides)
    return cfg_cls(**kw)


def write_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random float32 ``arch`` model (llama | qwen2 | qwen3) + tokenizer to ``path``."""
    import transformers

    path = Path(path)
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCH[arch][1])(cfg).to(torch.float32).eval()
    with torch.no_grad():  # make the random model less degenerate: larger weights, spread-out logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif "bias" in name:
                p.normal_(0, 0.05)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, cfg.vocab_size)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def fused_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """HF state dict with the layout's dense fusions applied (q‖k‖v -> qkv_proj, gate‖up -> gate_up_proj).

    Only used to build models without the loader (unit tests of the engine); the loader itself goes through
    convert's plan.
    """
    sd = {k: v for k, v in hf_model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    layers = {k.split(".")[2] for k in sd if k.startswith("model.layers.")}
    for i in sorted(layers, key=int):
        p = f"model.layers.{i}."
        for suf in ("weight", "bias"):
            qkv = [sd.pop(f"{p}self_attn.{n}_proj.{suf}", None) for n in "qkv"]
            if qkv[0] is not None:
                out[f"{p}self_attn.qkv_proj.{suf}"] = torch.cat(qkv)
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([sd.pop(f"{p}mlp.gate_proj.weight"),
                                                      sd.pop(f"{p}mlp.up_proj.weight")])
    out.update(sd)
    if hf_model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def make_engine(path: Path, hf_model=None, **engine_kwargs):
    """An LLMEngine over the checkpoint at ``path`` built from the fused HF weights (CPU, float32)."""
    import json

    from atomtool.inspect.dsa import flatten_dsa_config
    from atomtool.serve.engine.llm_engine import LLMEngine, load_tokenizer
    from atomtool.serve.models.llama import LlamaForCausalLM

    hf_model = hf_model if hf_model is not None else load_hf(path)
    cfg = flatten_dsa_config(json.loads((Path(path) / "config.json").read_text()))
    model = LlamaForCausalLM(cfg, None, torch.float32, "cpu")
    model.load_weights(fused_state_dict(hf_model).items())
    engine_kwargs.setdefault("kv_cache_memory", 1 << 22)
    return LLMEngine(model, load_tokenizer(Path(path)), cfg, device="cpu", model_dir=path, **engine_kwargs)


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by repeated full forwards of the HF model (no KV cache, no generate() config).

    Returns (tokens, log-probs [n, vocab] float32 of each step's distribution).
    """
    ids = list(prompt)
    out, lps = [], []
    for _ in range(n):
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        lps.append(torch.log_softmax(logits, -1))
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    return out, torch.stack(lps)


def run_to_completion(engine, requests: dict[str, tuple], max_steps: int = 10_000) -> dict:
    """Add ``{id: (prompt, params)}`` and step until done; returns ``{id: final RequestOutput}``."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert not engine.has_unfinished(), "engine did not finish"
    return final

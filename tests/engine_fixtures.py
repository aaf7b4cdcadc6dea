"""Engine test helpers: HF greedy oracle, engine construction, a byte-level BPE tokenizer, the CLI convert
step, the KV-leak check and a one-thread fixture.

Checkpoints come from the shared fixtures (tests/checkpoints.py, written by transformers' save_pretrained).
The byte-level BPE tokenizer here is trained on a few sentences with multi-byte characters, so incremental
detokenization meets characters split over several tokens (the shared fixture tokenizer is ASCII-only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "naïve café déjà vu — über straße, 東京 and 北京, emoji 🙂 too.",
    "Once upon a time there was a tiny model that generated text one token at a time.",
    "stop STOP end of story. The end.",
] * 4


def byte_bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (tokenizers library) trained on :data:`CORPUS`.

    ``<s>`` = 0 (bos), ``</s>`` = 1 (eos); multi-byte characters (é, 東, 🙂) span several byte tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def load_hf(path: Path, state_dict: dict[str, torch.Tensor] | None = None):
    """The transformers model of a checkpoint dir in float32 (optionally with replacement weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if state_dict is None:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    cfg = AutoConfig.from_pretrained(str(path))
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    assert not [m for m in missing if "lm_head" not in m] and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: intra-op threads only add wake-up latency (and thrash on a shared 2-core CI box).

    A test module turns it on for itself by importing it (``from tests.engine_fixtures import
    one_torch_thread  # noqa: F401``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def convert_checkpoint(src: Path, out: Path) -> Path:
    """``atomtool convert src out`` through the CLI; asserts exit code 0 (showing the output), returns out."""
    from typer.testing import CliRunner

    from atomtool.cli import app

    res = CliRunner().invoke(app, ["convert", str(src), str(out)])
    assert res.exit_code == 0, res.output
    return out


def assert_no_leaks(engine) -> None:
    """No unfinished request and every KV block back in the free pool."""
    assert not engine.has_unfinished()
    assert engine.num_free_blocks() == engine.num_total_blocks()


def make_engine(path: Path, **engine_kwargs):
    """``LLMEngine.from_model`` over ``path`` (the real loader), CPU float32, a small KV pool by default."""
    from atomtool.serve.engine.llm_engine import LLMEngine

    engine_kwargs.setdefault("kv_cache_memory", 1 << 22)
    engine_kwargs.setdefault("device", "cpu")
    return LLMEngine.from_model(path, **engine_kwargs)


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


def greedy_params(n: int, logprobs: int | None = None):
    """SamplingParams of a greedy run of exactly ``n`` tokens (EOS ignored), with ``logprobs`` top entries."""
    from atomtool.serve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def check_greedy_matches(ref, prompt, out, logprobs: bool = False, atol: float = 1e-4, top: int = 0) -> None:
    """``out`` (a finished greedy RequestOutput) has the tokens of ``ref.greedy(prompt, n)`` (the transformers
    oracle), stopped by length; with ``logprobs``, each step's chosen-token log-prob within ``atol`` of the
    oracle's, and (``top`` > 0) the same ``top`` most likely ids with close log-probs."""
    tokens, lps = ref.greedy(prompt, len(out.token_ids))
    assert out.token_ids == tokens
    assert out.finish_reason == "length"
    if logprobs:
        for step, entry in enumerate(out.logprobs):
            assert entry["token_id"] == tokens[step]
            assert entry["logprob"] == pytest.approx(float(lps[step, tokens[step]]), abs=atol)
            if top:
                hf_top = torch.sort(lps[step], descending=True, stable=True)
                assert list(entry["top"]) == hf_top.indices[:top].tolist()
                assert list(entry["top"].values()) == pytest.approx(hf_top.values[:top].tolist(), abs=atol)


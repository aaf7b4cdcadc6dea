"""Sampler, stop conditions and incremental detokenization (unit level and through the engine)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from atomtool.serve.engine.detokenizer import IncrementalDetokenizer
from atomtool.serve.engine.sampler import sample_one, top_logprobs
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import byte_bpe_tokenizer, hf_greedy, load_hf, make_engine, run_to_completion

# -- sampler units ---------------------------------------------------------------------------------


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([0.0, 1.0, 3.0, -2.0, 3.0, 3.0])
    assert sample_one(logits, 0.0, 0, 1.0, None) == 2
    assert sample_one(logits, 0.7, 1, 1.0, None) == 2  # top_k 1 is greedy too
    assert list(top_logprobs(torch.log_softmax(logits, -1), 3)) == [2, 4, 5]


def test_top_k_keeps_lowest_ids_among_ties():
    logits = torch.tensor([1.0, 5.0, 5.0, 5.0, 5.0])
    g = torch.Generator().manual_seed(0)
    seen = {sample_one(logits, 1.0, 2, 1.0, g) for _ in range(200)}
    assert seen == {1, 2}


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    seen = [sample_one(probs.log(), 1.0, 0, 0.6, g) for _ in range(300)]
    assert set(seen) == {0, 1}
    assert 0.5 < seen.count(0) / len(seen) < 0.75  # renormalised 0.5/0.8 = 0.625


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(1)
    n = 4000
    draws = torch.tensor([sample_one(logits, 0.5, 0, 1.0, g) for _ in range(n)])
    freq = torch.bincount(draws, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits / 0.5, -1), atol=0.03, rtol=0)


def test_seeded_generators_reproduce():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample_one(logits, 1.0, 0, 0.9, g) for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# -- detokenizer units -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    return byte_bpe_tokenizer()


def stream(tok, text, stop=None, prompt="Hi "):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
    texts, hit = [], None
    for t in ids:
        hit = d.add([t])
        texts.append(d.text())
        if hit:
            break
    if not hit:
        d.flush()
    return ids, texts, d.text(final=True), hit


def test_detokenizer_never_splits_characters(bpe):
    text = "naïve café — 東京 and 北京 🙂 done"
    ids, texts, final, _ = stream(bpe, text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte tokens
    assert any(len(bpe.decode(ids[:i])) and bpe.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))
    assert final == bpe.decode(ids) == text
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a)
    assert all("\ufffd" not in t for t in texts)


def test_detokenizer_stop_string_held_back_and_excluded(bpe):
    text = "Hello world! 東京 and more text"
    ids, texts, final, hit = stream(bpe, text, stop=["東京", "never"])
    assert hit == "東京" and final == "Hello world! "
    assert all(not t.endswith("東") and "東京" not in t for t in texts)
    for a, b in zip(texts, texts[1:], strict=False):
        assert b.startswith(a)
    # the earliest of several stop strings wins, even when the later one is longer
    _, _, final, hit = stream(bpe, "the quick brown fox", stop=["brown fox", "quick"])
    assert (hit, final) == ("quick", "the ")


def test_detokenizer_holds_back_possible_stop_prefix_until_resolved(bpe):
    d = IncrementalDetokenizer(bpe, bpe.encode("x"), stop=["end!"])
    for t in bpe.encode("the en"):
        d.add([t])
    assert d.text() == "the "  # "en" could still become "end!"
    for t in bpe.encode("ough"):
        d.add([t])
    assert d.text() == "the enough"


def test_detokenizer_backend_decode_equals_tokenizer_decode(bpe):
    """The Rust decode the detokenizer calls directly gives what ``tokenizer.decode`` gives on every window
    (special ids, skipped or kept, partial characters); tokenizers whose wrapper changes the text keep it."""
    import random

    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.engine.detokenizer import _backend_decode, decoder_for
    from atomtool.serve.engine.llm_engine import load_tokenizer

    demo = load_tokenizer(demo_model_path())
    rng = random.Random(0)
    for tok in (bpe, demo):
        fast = _backend_decode(tok)
        assert fast is not None and decoder_for(tok) is decoder_for(tok)
        ids = tok.encode("naïve café — 東京 🙂 <s> done") + [tok.eos_token_id, 0, 1]
        for _ in range(300):
            i = rng.randrange(len(ids))
            window = ids[i:i + rng.randrange(1, 8)]
            for skip in (True, False):
                assert fast(window, skip) == tok.decode(window, skip_special_tokens=skip), (window, skip)
    # clean_up_tokenization_spaces changes the text of a non-BPE tokenizer: the wrapper stays
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({"a": 0, ".": 1, "[UNK]": 2}, unk_token="[UNK]"))
    cleaned = PreTrainedTokenizerFast(tokenizer_object=wl, clean_up_tokenization_spaces=True)
    assert _backend_decode(cleaned) is None
    assert decoder_for(cleaned)([0, 1], True) == cleaned.decode([0, 1], skip_special_tokens=True) == "a."

    class Shouting(PreTrainedTokenizerFast):  # a model's tokenizer class with its own decode
        def _decode(self, token_ids, **kw):
            return super()._decode(token_ids, **kw).upper()

    loud = Shouting(tokenizer_object=bpe.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    assert _backend_decode(loud) is None
    ids = bpe.encode("hello there")
    assert decoder_for(loud)(ids, True) == "HELLO THERE"
    d = IncrementalDetokenizer(loud, [], None)
    d.add(ids)
    d.flush()
    assert d.text(final=True) == "HELLO THERE"


# -- through the engine ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=11)
    return path, load_hf(path)


PROMPT = [5, 17, 40, 41, 42, 90, 33]


def sampled(seed, n=12, **kw):
    return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True, **kw)


def test_seeded_sampling_reproducible_and_batch_invariant(ckpt):
    path, _ = ckpt
    a = run_to_completion(make_engine(path), {"a": (PROMPT, sampled(123))})["a"]
    others = {f"o{i}": ([7 + i] * (3 + 9 * i), sampled(i)) for i in range(3)}
    b = run_to_completion(make_engine(path, max_num_batched_tokens=6), {**others, "a": (PROMPT, sampled(123))})["a"]
    c = run_to_completion(make_engine(path), {"a": (PROMPT, sampled(124))})["a"]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_logprobs_are_raw_model_logprobs(ckpt):
    path, hf = ckpt
    out = run_to_completion(make_engine(path), {"a": (PROMPT, sampled(5, n=4, logprobs=3))})["a"]
    ids = list(PROMPT)
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
        assert entry["token_id"] == tok
        assert entry["logprob"] == pytest.approx(float(lp[tok]), abs=1e-4)
        assert len(entry["top"]) == 3 and max(entry["top"].values()) == pytest.approx(float(lp.max()), abs=1e-4)
        ids.append(tok)


def greedy(n=10, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_stop_token_ids_and_min_tokens(ckpt):
    path, hf = ckpt
    ref, _ = hf_greedy(hf, PROMPT, 10)
    stop = ref[3]
    first = ref.index(stop)
    out = run_to_completion(make_engine(path), {"a": (PROMPT, greedy(stop_token_ids=[stop]))})["a"]
    assert out.token_ids == ref[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    out = run_to_completion(make_engine(path), {"a": (PROMPT, greedy(stop_token_ids=[stop], min_tokens=6))})["a"]
    assert stop not in out.token_ids[:6] and len(out.token_ids) >= 6


def test_eos_from_generation_config_unless_ignore_eos(ckpt, tmp_path):
    path, hf = ckpt
    ref, _ = hf_greedy(hf, PROMPT, 10)
    eos = ref[4]
    copy = shutil.copytree(path, tmp_path / "eos")
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    out = run_to_completion(make_engine(copy), {"a": (PROMPT, greedy())})["a"]
    assert out.token_ids == ref[:ref.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = run_to_completion(make_engine(copy), {"a": (PROMPT, greedy(ignore_eos=True))})["a"]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_stop_string_streaming_and_max_model_len(ckpt):
    path, hf = ckpt
    eng = make_engine(path)
    ref, _ = hf_greedy(hf, PROMPT, 12)
    full = eng.tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[6:8]
    expect = full[:full.index(stop)]
    eng.add_request("s", PROMPT, greedy(n=12, stop=[stop], ignore_eos=True))
    texts, deltas, final = [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            deltas.append(o.text[len(texts[-1]) if texts else 0:])
            texts.append(o.text)
            final = o
    assert final.finished and (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert final.text == expect == "".join(deltas)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert eng.num_free_blocks() == eng.num_total_blocks()

    eng = make_engine(path, max_model_len=len(PROMPT) + 3)
    out = run_to_completion(eng, {"m": (PROMPT, greedy(n=50, ignore_eos=True))})["m"]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"

"""Host cost of structured outputs per decode step: the same batch with and without a JSON-schema constraint.

Each step of a constrained request asks xgrammar for its next-token bitmask (host), copies it to the logits'
device and masks the logits, and after sampling advances the matcher (:mod:`atomtool.serve.engine.structured`).
This measures that cost against the unconstrained step, on the host only: a real :class:`LLMEngine`
(scheduler, real :class:`Sampler`, stop checks, detokenizer with the demo model's tokenizer) over a stand-in
runner returning fixed random logits (no model runs), ``--batch`` requests each generating up to ``--tokens``
tokens, greedy (``ignore_eos`` on the free run; the constrained run ends when its JSON is complete, so both
are compared per step, not per run). Reported: median ms per decode step (steps where the whole batch runs),
the parts inside it (bitmask fill and matcher accept: host work, the same on a GPU run; the apply: a tensor op
where the logits are, here the CPU), and the ratio constrained / free.

``--vocab N``: instead of the demo model's 512-token tokenizer, a byte-level BPE of N tokens trained on a
synthetic corpus (:func:`synthetic_tokenizer`; no real large tokenizer is on this machine): the bitmask work
grows with the vocabulary, as with real models' 100k-200k.

Run: ``python -m benchmarks.structured_bench [--batch 64] [--tokens 200] [--vocab 131072]`` (CPU, 1 thread).
Needs xgrammar.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomtool.serve.engine.sampler import Sampler
from atomtool.serve.sampling_params import SamplingParams
from benchmarks import common as C
from benchmarks.engine_host_bench import scripted_engine

#: a schema like an API's (an object of strings, numbers, an enum and an array)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 8}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}


class _RandomLogitsRunner:
    """Stands in for ModelRunner: the same [B, V] random logits rows every step (seeded)."""

    def __init__(self, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(1024, vocab, generator=g) * 3

    def prepare(self, sched):
        return sched

    def run(self, sched) -> torch.Tensor:
        n = len(sched.seqs)
        return self.logits[torch.arange(n) % self.logits.shape[0]]


def synthetic_tokenizer(vocab: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab`` tokens (``<s>`` = 0, ``</s>`` = 1, the EOS),
    trained on random syllable words mixed with JSON punctuation (seeded: the same tokenizer every run)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = ["ka", "to", "ri", "ne", "su", "mo", "la", "pi", "qu", "ex", "th", "ing", "er", "on", "an", "st",
                 "ch", "ü", "é", "京", "ß", "ow", "ai", "ze", "vy"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randrange(1, 7))) for _ in range(8 * vocab)]
    corpus = [" ".join(words[i:i + 50]) + ' {"a": [1, 2.5e3, "x\\n"], "b": null}' for i in range(0, len(words), 50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def run(tokenizer, *, structured: bool, batch: int, tokens: int) -> dict:
    vocab = len(tokenizer)
    engine = scripted_engine(tokenizer, lambda seq: 0, vocab_size=vocab, max_model_len=tokens + 32,
                             max_num_seqs=batch, eos_token_id=tokenizer.eos_token_id)
    engine.sampler = Sampler()
    engine.runner = _RandomLogitsRunner(vocab)
    so = {"json": SCHEMA} if structured else None
    for i in range(batch):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=not structured,
                                structured_outputs=so, output_kind="delta")
        engine.add_request(str(i), [5 + i % 50, 7, 9], params)
    parts = {"fill": 0.0, "apply": 0.0, "accept": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    # the sampler and the engine import these names into their modules: time them there
    import atomtool.serve.engine.sampler as sampler_mod
    import atomtool.serve.engine.structured as structured_mod
    saved = (sampler_mod.fill_bitmasks, sampler_mod.apply_token_bitmask, structured_mod.GrammarMatcher.accept)
    sampler_mod.fill_bitmasks = timed("fill", saved[0])
    sampler_mod.apply_token_bitmask = timed("apply", saved[1])
    structured_mod.GrammarMatcher.accept = timed("accept", saved[2])
    steps = []
    try:
        while engine.has_unfinished():
            for k in parts:
                parts[k] = 0.0
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0, len(engine.scheduler.running), dict(parts)))
    finally:
        sampler_mod.fill_bitmasks, sampler_mod.apply_token_bitmask, structured_mod.GrammarMatcher.accept = saved
    decode = [st for st in steps[1:] if st[1] == batch] or steps[1:]
    row = {"run": "json schema" if structured else "free", "steps": len(steps), "full-batch steps": len(decode),
           "ms per step (median)": 1e3 * statistics.median(s for s, _, _ in decode)}
    for k in parts:
        row[f"{k} ms"] = 1e3 * statistics.median(p[k] for _, _, p in decode)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=C.positive_int, default=64)
    ap.add_argument("--tokens", type=C.positive_int, default=200)
    ap.add_argument("--vocab", type=C.positive_int, default=None,
                    help="a synthetic byte-level BPE of this many tokens (default: the demo model's tokenizer)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.vocab:
        tokenizer = synthetic_tokenizer(a.vocab)
    else:
        from atomtool.serve.demo import demo_model_path
        from atomtool.serve.engine.llm_engine import load_tokenizer

        tokenizer = load_tokenizer(demo_model_path())
    rows = [run(tokenizer, structured=s, batch=a.batch, tokens=a.tokens) for s in (False, True)]
    C.print_table(f"engine host ms per decode step, batch {a.batch}, vocab {len(tokenizer)} (cpu, 1 thread)", rows,
                  ["run", "steps", "full-batch steps", "ms per step (median)", "fill ms", "apply ms", "accept ms"])
    free, con = rows
    print(f"constrained / free: {con['ms per step (median)'] / free['ms per step (median)']:.2f}x; host-only part "
          f"(bitmask fill + matcher accept, the same on a GPU run): {con['fill ms'] + con['accept ms']:.2f} ms per "
          f"step = {(con['fill ms'] + con['accept ms']) / a.batch * 1e3:.1f} us per constrained sequence; the apply "
          "runs where the logits are (here CPU tensors)")


if __name__ == "__main__":
    main()

"""Host cost of the engine's per-step request outputs: ``output_kind`` cumulative vs delta vs final_only.

Issue 7 (docs/PERFORMANCE.md, "Host cost of request outputs"): a cumulative :class:`RequestOutput` copies
the request's whole output (token ids, log-probs, stable text) every step, O(output length) per running
sequence per step, so a step's host time grows as outputs grow. ``output_kind="delta"`` returns only the
step's part and ``"final_only"`` one output at the end (what ``LLM.generate`` and the server now use).
Cumulative is the engine's code before the change (kept unchanged as the default), so it is the "before".

No model runs: a real :class:`LLMEngine` (scheduler, block manager, stop checks, incremental detokenizer with
the demo model's tokenizer) over a stand-in model whose runner returns no logits and whose sampler returns a
scripted token per sequence (:func:`scripted_engine`); everything else in ``step()`` is the engine's own
code. ``--batch`` requests of ``--prompt`` tokens generate ``--tokens`` tokens each (EOS ignored), all in
one running batch. Reported per kind: mean ms per decode step, total and in the output (``_output``), over
three windows of output length (medians over each window's steps: the machine may be shared), and the
ratios cumulative / delta and cumulative / final_only.

Run: ``python -m benchmarks.engine_host_bench [--batch 256] [--tokens 1000] [--prompt 8] [--logprobs N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from atomtool.serve.engine.batch import KVPlaneSpec
from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.sampling_params import SamplingParams
from benchmarks import common as C

KINDS = ("cumulative", "delta", "final_only")


class _NoModel:
    """The part of a CausalLM the engine needs to size its KV pool: one layer of one 2-byte cache plane."""

    def kv_plane_specs(self) -> list[list[KVPlaneSpec]]:
        return [[KVPlaneSpec("none", (1,), torch.float16)]]  # one layer, one plane


class _NoRunner:
    """Stands in for ModelRunner: no batch is built, "logits" is one empty row per scheduled sequence."""

    def prepare(self, sched):
        return sched

    def run(self, sched) -> torch.Tensor:
        return torch.zeros(len(sched.seqs), 1)


class _ScriptedSampler:
    """Stands in for the Sampler: sequence -> ``script(seq)`` (a token id); a log-prob entry when the request
    asks for log-probs (``{"token_id", "logprob", "top"}``, the sampler's shape; logprob -0.001 * position)."""

    def __init__(self, script: Callable[[object], int]) -> None:
        self.script = script

    def __call__(self, logits, seqs) -> list[tuple[int, dict | None]]:
        out = []
        for seq in seqs:
            tok = int(self.script(seq))
            entry = None
            if seq.params.logprobs is not None:
                lp = -0.001 * seq.num_output_tokens
                entry = {"token_id": tok, "logprob": lp, "top": {tok: lp}}
            out.append((tok, entry))
        return out


def scripted_engine(tokenizer, script: Callable[[object], int], *, vocab_size: int, max_model_len: int = 2048,
                    max_num_seqs: int = 256, eos_token_id: int | None = None) -> LLMEngine:
    """A real :class:`LLMEngine` (scheduler, stop checks, detokenizer, outputs) whose model is scripted:
    ``script(seq)`` picks each sequence's next token (``seq.num_output_tokens`` tokens generated so far,
    ``seq.request_id`` its id). CPU; the KV pool holds ``max_num_seqs * max_model_len`` tokens of one
    2-byte plane."""
    config = {"vocab_size": vocab_size, "max_position_embeddings": max_model_len}
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    engine = LLMEngine(_NoModel(), tokenizer, config, device="cpu", max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, max_num_seqs),
                       kv_cache_memory=8 * max_num_seqs * max_model_len + (1 << 16), enable_prefix_caching=False)
    engine.runner = _NoRunner()
    engine.sampler = _ScriptedSampler(script)
    return engine


def run(kind: str, tokenizer, *, batch: int, tokens: int, prompt: int, logprobs: int | None) -> dict:
    """One workload under ``kind``: per-decode-step wall times of ``step()`` and of its ``_output`` calls."""
    text_ids = tokenizer.encode(" Beautiful is better than ugly. Explicit is better than implicit.")
    vocab = max(len(tokenizer), max(text_ids) + 1)
    engine = scripted_engine(tokenizer, lambda seq: text_ids[seq.num_output_tokens % len(text_ids)],
                             vocab_size=vocab, max_model_len=prompt + tokens + 16, max_num_seqs=batch)
    in_output = [0.0]
    inner = engine._output

    def timed_output(seq):
        t0 = time.perf_counter()
        out = inner(seq)
        in_output[0] += time.perf_counter() - t0
        return out

    engine._output = timed_output
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=logprobs, output_kind=kind)
    for i in range(batch):
        engine.add_request(str(i), [text_ids[(i + j) % len(text_ids)] for j in range(prompt)], params)
    steps, outs_n, finished = [], 0, 0
    while engine.has_unfinished():
        in_output[0] = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t0, in_output[0]))
        outs_n += len(outs)
        finished += sum(o.finished for o in outs)
    assert finished == batch and len(steps) == tokens >= 3, (finished, len(steps))
    decode = steps[1:-1]  # step 0 is the prefill (every first token), the last one finishes every request
    windows = {"first 10%": decode[:len(decode) // 10], "middle 10%": decode[len(decode) * 9 // 20:
               len(decode) * 11 // 20], "last 10%": decode[-(len(decode) // 10):]}
    row = {"kind": kind, "outputs": outs_n, "total_s": sum(s for s, _ in steps)}
    for name, w in windows.items():
        row[f"step ms {name}"] = 1e3 * statistics.median(s for s, _ in w)
        row[f"_output ms {name}"] = 1e3 * statistics.median(o for _, o in w)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=C.positive_int, default=256)
    ap.add_argument("--tokens", type=C.positive_int, default=1000)
    ap.add_argument("--prompt", type=C.positive_int, default=8)
    ap.add_argument("--logprobs", type=int, default=None, help="log-probs per token (default: none)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    a = ap.parse_args()
    if a.tokens < 12:
        ap.error("--tokens must be at least 12 (three windows of 10% of the decode steps)")
    torch.set_num_threads(1)
    from atomtool.serve.demo import demo_model_path
    from atomtool.serve.engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(demo_model_path())
    rows = [run(k, tokenizer, batch=a.batch, tokens=a.tokens, prompt=a.prompt, logprobs=a.logprobs)
            for k in a.kinds.split(",")]
    cols = ["kind", "outputs", "total_s"] + [f"{p} ms {w}" for p in ("step", "_output")
                                             for w in ("first 10%", "middle 10%", "last 10%")]
    C.print_table(f"engine host time per decode step: batch {a.batch}, {a.tokens} output tokens, "
                  f"logprobs {a.logprobs} (cpu, scripted model)", rows, cols)
    by = {r["kind"]: r for r in rows}
    if "cumulative" in by:
        for k in ("delta", "final_only"):
            if k in by:
                c, d = by["cumulative"], by[k]
                out = (f"{c['_output ms last 10%'] / d['_output ms last 10%']:.1f}x" if d["_output ms last 10%"]
                       else "no outputs built")
                print(f"cumulative / {k}: step (last 10%) {c['step ms last 10%'] / d['step ms last 10%']:.2f}x, "
                      f"_output (last 10%) {out}, whole run {c['total_s'] / d['total_s']:.2f}x")


if __name__ == "__main__":
    main()

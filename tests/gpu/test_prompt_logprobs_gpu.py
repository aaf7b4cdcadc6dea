"""Prompt log-probs on a CUDA GPU with CUDA graphs on (decode graphs captured): a prompt-logprobs request
prefilled one token per step beside three decoding requests (every step shaped like a decode batch, which
the graphs would replay) and in chunks, for a dense (Llama) and an MLA+MoE (DeepSeek-V3) tiny checkpoint in
float32, against transformers' float32 forward on the CPU; the other requests get the same tokens (and
log-probs up to rounding) with and without the prompt-logprobs request asking for them. The CPU suite (tests/test_prompt_logprobs.py)
checks the same on the CPU.

Tolerance: 1e-4 (CUDA float32 reductions in another order than the CPU's).
Run: ``.venv/bin/pytest -q tests/gpu/test_prompt_logprobs_gpu.py`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.engine.llm_engine import LLMEngine
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_hf_checkpoint
from tests.engine_fixtures import load_hf

PROMPT = [7, 40, 41, 52, 60, 33, 18, 90, 91, 12, 5, 77, 64, 23, 8, 99, 41, 52, 60, 31, 19, 70]
OTHERS = {f"o{i}": ([3 + i, 50, 51 + i, 9, 70 - i, 11][: 3 + i], i) for i in range(3)}


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("budget", [4, 9])
def test_prompt_logprobs_cuda_graphs(tmp_path, arch, budget, gpu_report):
    ckpt = write_hf_checkpoint(tmp_path / arch, arch, seed=3)
    with torch.no_grad():
        ref = torch.log_softmax(load_hf(ckpt)(torch.tensor([PROMPT])).logits[0].float(), dim=-1)

    def run(with_prompt_lps: bool):
        engine = LLMEngine.from_model(str(ckpt), device="cuda", dtype="float32", kv_cache_memory=16 << 20,
                                      max_model_len=96, block_size=16, max_num_seqs=8,
                                      max_num_batched_tokens=budget, enforce_eager=False,
                                      enable_prefix_caching=False)
        gpu_report[f"prompt_logprobs_graphs_{arch}"] = engine.runner.graphs is not None
        got: dict[str, list] = {rid: [] for rid in [*OTHERS, "long"]}
        for rid, (ids, seed) in OTHERS.items():
            engine.add_request(rid, ids, SamplingParams(max_tokens=30, temperature=0.8, seed=seed, logprobs=2,
                                                        ignore_eos=True))
        for o in engine.step():
            got[o.request_id].append(o)
        engine.add_request("long", PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                          prompt_logprobs=3 if with_prompt_lps else None))
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].append(o)
        return got

    a, b = run(True), run(False)
    entries = a["long"][0].prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    worst = 0.0
    for i in range(1, len(PROMPT)):
        assert entries[i]["token_id"] == PROMPT[i]
        worst = max(worst, abs(entries[i]["logprob"] - ref[i - 1, PROMPT[i]].item()))
        vals, ids = torch.topk(ref[i - 1], 3)
        assert list(entries[i]["top"]) == ids.tolist()
        assert list(entries[i]["top"].values()) == pytest.approx(vals.tolist(), abs=1e-4)
    gpu_report[f"prompt_logprobs_max_err_{arch}_{budget}"] = worst
    assert worst < 1e-4
    # the others: same tokens; log-probs equal up to rounding (without prompt log-probs the one-token-per-step
    # batches replay a decode graph, with them they run eagerly: other kernels for the same sums)
    for rid in OTHERS:
        assert [o.token_ids for o in a[rid]] == [o.token_ids for o in b[rid]]
        la = [e["logprob"] for o in a[rid] for e in o.logprobs]
        lb = [e["logprob"] for o in b[rid] for e in o.logprobs]
        assert la == pytest.approx(lb, abs=1e-4)

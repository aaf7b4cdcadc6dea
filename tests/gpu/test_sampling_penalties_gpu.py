"""Penalties and min-p of the batched sampler on a CUDA GPU, at a realistic vocabulary (Qwen's 151,936) and
batch (64 rows, 4096-token prompts): the same results as on the CPU (the CPU path is checked against
transformers' processors and OpenAI's formula in tests/test_sampling_penalties.py).

Exactness: the penalties are elementwise divisions/multiplications/subtractions and counts of ones (exact in
float32 in any order), so the CUDA logits equal the CPU ones bit for bit and greedy picks agree. min-p's kept
set can only differ where a probability sits within rounding of the threshold, so it is compared by count.
Timing (no assertion, in the GPU report as ``penalty_sampler_us``): one Sampler call with and without
penalised rows.
"""

from __future__ import annotations

import time

import torch

from atomtool.serve.engine.sampler import Sampler, apply_min_p, apply_penalties
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams

DEV = "cuda"
V = 151936
R = 64


def _case(g: torch.Generator):
    logits = torch.randn(R, V, generator=g) * 4
    prompts = [torch.randint(0, V, (4096,), generator=g).tolist() for _ in range(R)]
    outputs = [torch.randint(0, V, (int(torch.randint(0, 300, (), generator=g)),), generator=g).tolist()
               for _ in range(R)]
    rep = [1.0 + 0.05 * (r % 7) for r in range(R)]
    freq = [0.1 * (r % 5) - 0.2 for r in range(R)]
    pres = [0.3 * (r % 3) - 0.3 for r in range(R)]
    return logits, prompts, outputs, rep, freq, pres


def test_penalties_on_cuda_equal_cpu(gpu_report):
    g = torch.Generator().manual_seed(0)
    logits, prompts, outputs, rep, freq, pres = _case(g)
    cpu = apply_penalties(logits, [torch.tensor(p) for p in prompts], outputs, rep, freq, pres)
    gpu = apply_penalties(logits.to(DEV), [torch.tensor(p, device=DEV) for p in prompts], outputs, rep, freq, pres)
    assert torch.equal(gpu.cpu(), cpu)
    x = cpu / 0.7
    mp = torch.full((R,), 0.05)
    kept_cpu = torch.isfinite(apply_min_p(x, mp))
    kept_gpu = torch.isfinite(apply_min_p(x.to(DEV), mp.to(DEV))).cpu()
    mismatches = int((kept_cpu != kept_gpu).sum())
    gpu_report["min_p_kept_mismatches"] = mismatches
    assert mismatches <= 2


def test_sampler_greedy_penalised_rows_agree_and_timing(gpu_report):
    g = torch.Generator().manual_seed(1)
    logits, prompts, outputs, rep, freq, pres = _case(g)

    def seqs(penalised: bool) -> list[Sequence]:
        out = []
        for r in range(R):
            kw = dict(repetition_penalty=rep[r], frequency_penalty=freq[r], presence_penalty=pres[r]) if penalised else {}
            s = Sequence(f"r{r}", prompts[r], SamplingParams(temperature=0.0, **kw).validate())
            for t in outputs[r]:
                s.append_token(t)
            out.append(s)
        return out

    cpu = [t for t, _ in Sampler()(logits, seqs(True))]
    sampler, batch = Sampler(), seqs(True)
    x = logits.to(DEV)
    assert [t for t, _ in sampler(x, batch)] == cpu
    timings = {}
    for name, (smp, b) in {"penalised": (sampler, batch), "plain": (Sampler(), seqs(False))}.items():
        smp(x, b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            smp(x, b)
        torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - t0) / 20 * 1e6
    gpu_report["penalty_sampler_us"] = timings

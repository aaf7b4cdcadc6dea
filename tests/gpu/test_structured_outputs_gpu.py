"""Structured outputs on a CUDA GPU: the grammar bitmask built on the host (xgrammar) applied to CUDA logits
(:func:`atomtool.serve.engine.structured.apply_token_bitmask`: bitmask copied to the device, xgrammar's Triton
kernel) gives bit for bit the CPU result (its C++ kernel) at a realistic vocabulary, on all rows and on a subset,
and the demo model served on the GPU writes schema-valid JSON (CPU oracle: tests/test_structured_outputs.py).
Skipped where xgrammar is not installed (the device image lacks it: carry its wheels).
"""

from __future__ import annotations

import json

import pytest
import torch

from atomtool.serve.demo import DEMO_PROMPT, demo_model_path
from atomtool.serve.engine.structured import apply_token_bitmask
from atomtool.serve.llm import LLM
from atomtool.serve.sampling_params import SamplingParams

pytest.importorskip("xgrammar")

DEV = "cuda"


def test_bitmask_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 151936, 64
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (17, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    picked = sorted(torch.randperm(rows, generator=g)[:17].tolist())
    cpu = apply_token_bitmask(logits, picked, bitmask)
    gpu = apply_token_bitmask(logits.to(DEV), picked, bitmask)
    assert torch.equal(gpu.cpu(), cpu)
    every = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask(logits.to(DEV), list(range(rows)), every).cpu(),
                       apply_token_bitmask(logits, list(range(rows)), every))
    assert torch.isinf(cpu[picked]).any() and not torch.isinf(cpu[[r for r in range(rows) if r not in picked]]).any()


def test_demo_model_json_schema_on_gpu():
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}}, "required": ["name", "n"],
              "additionalProperties": False}
    llm = LLM(str(demo_model_path()), device=DEV, max_model_len=512)
    outs = llm.generate([DEMO_PROMPT] * 8, [SamplingParams(max_tokens=80, temperature=t, seed=i,
                                                           structured_outputs={"json": schema})
                                            for i, t in enumerate([0, 1.0] * 4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        obj = json.loads(out.text)
        assert set(obj) == {"name", "n"} and isinstance(obj["n"], int) and len(obj["name"]) <= 10

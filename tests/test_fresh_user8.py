"""A demanding new user's reports on the sampling penalties and min_p (presence / frequency / repetition
penalty, min_p): each test reproduces what the user saw, against vLLM's documented semantics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from atomtool.serve.engine.sampler import Sampler, apply_penalties
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams


def seq_with(prompt: list[int], output: list[int], **kw) -> Sequence:
    """A Sequence whose prompt is ``prompt`` and that has generated ``output`` so far."""
    s = Sequence("r", prompt, SamplingParams(**kw).validate())
    for t in output:
        s.append_token(t)
    return s


@pytest.mark.parametrize("extra", [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_tiny_repetition_penalty_with_temperature_samples_the_favoured_token(extra):
    # `atomtool generate DEMO --repetition-penalty 1e-38 --temperature 0.1` printed token_ids [0, 0, 0, ...]
    # (<pad>, a token the model gives ~1e-7): a valid penalty (> 0, finite) divides the positive logit of the
    # seen token 2 to the float32 maximum (clamped), then / temperature made it inf and the softmax NaN, and
    # argmax over NaN returned id 0. The seen token with the positive logit is by far the most likely one.
    logits = torch.tensor([[-1.0, 0.5, 4.0, 0.2, -3.0, 1.0]])
    for temperature in (0.1, 0.5, 0.99):
        for seed in range(3):
            s = seq_with([2, 4], [], temperature=temperature, seed=seed, repetition_penalty=1e-38, **extra)
            assert Sampler()(logits, [s])[0][0] == 2


@pytest.mark.parametrize("penalty", [1e39, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_huge_repetition_penalty_keeps_a_zero_logit_zero(penalty, temperature):
    # repetition_penalty=1e300 passes validation (> 0 and finite) but becomes inf in float32: a seen token whose
    # logit is exactly 0 (padded vocabulary rows of the LM head give exactly 0) became 0 * inf = NaN, and the
    # sampler picked it (greedy: the NaN token 1; sampled: id 0). 0 multiplied by any penalty is 0, so the
    # clearly most likely token 2 (never seen) must be picked.
    logits = torch.tensor([[-1.0, 0.0, 9.0, 0.2, -3.0, 1.0]])
    s = seq_with([1, 4], [], temperature=temperature, seed=0, repetition_penalty=penalty)
    assert Sampler()(logits, [s])[0][0] == 2


def test_readme_does_not_say_penalties_are_refused():
    # README (serve): "Parameters the engine cannot honour yet (penalties, `logit_bias`, ...) get a 400 error"
    # while the same section documents presence/frequency/repetition_penalty as supported, and the server
    # serves them (a user reading the refusal list would not send them).
    text = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    refused = re.search(r"Parameters the engine cannot honour yet \(([^)]*)\)", text)
    assert refused is not None
    assert "penalt" not in refused.group(1)


def test_output_counts_ignore_out_of_range_ids_and_empty_rows():
    # the per-step count of output ids (built with numpy: it runs over every output so far, every step): ids
    # outside [0, V) are ignored, an empty output counts nothing, and each row counts only its own ids
    logits = torch.zeros(3, 5)
    out = apply_penalties(logits, [None] * 3, [[4, 4, -1, 7], [], [0, 4, 5]], [1.0] * 3, [1.0] * 3, [0.5] * 3)
    want = torch.tensor([[0.0, 0.0, 0.0, 0.0, -2.5], [0.0] * 5, [-1.5, 0.0, 0.0, 0.0, -1.5]])
    assert torch.equal(out, want)

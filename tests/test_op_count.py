"""Regression guard on the number of kernels one decode step launches (issue 7).

On an H200 a batch-1 decode step of the DeepSeek-V3.2-shaped model is bound by hundreds of tiny kernels
(1-3 us each even replayed from a CUDA graph), so every extra copy, cast, add or concatenation in the model
and layer code costs real time. This test counts, on CPU, the CPU proxy of :mod:`benchmarks.op_count`: aten
ops that would launch a kernel in the glue code outside the named ops, plus the named-op calls (each at least
one kernel on the Triton backend), for one decode step of tiny models with the real structure, and fails
when the count grows beyond the figure reached by the kernel-count work plus a small margin.

Figures (batch 1 and 4; the step takes the long-context path decode CUDA graphs capture):

- ``dsv32`` (5 layers: 2 dense MLP + 3 MoE, DSA full on every layer, FP8 linears): 194 before
  (92 glue + 102 op calls), 98 after (21 + 77), 90 since issue-7 session 6 (10 + 80: W_UV inside
  ``mla_attention``, the MoE gate as the ``router_logits`` op), still 90 since session 11 (5 + 85: the W_UK
  absorb, a glue ``bmm`` before, is the ``mla_absorb_q`` op reading FP8 kv_b);
- ``qwen3`` (2 dense layers, q/k norm): 43 before (16 + 27), 24 after (5 + 19).

If a change legitimately needs more kernels (a new feature), raise the limits here and say why in the commit;
if it saves kernels, lower them. The figures are a proxy: the lead measures GPU kernels per step with the
profiler of benchmarks/decode_bench.py.
"""

from __future__ import annotations

import pytest

from benchmarks import op_count

#: model -> (glue kernel ops, named-op calls) per decode step after the issue-7 kernel-count work
EXPECTED = {"dsv32": (5, 85), "qwen3": (5, 19)}
#: slack before the guard fails (a per-step op or two, not a per-layer one)
MARGIN = 2


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_decode_step_kernel_count_does_not_grow(model, batch):
    counts = op_count.measure(model, batch)
    glue, calls = EXPECTED[model]
    report = op_count.report(counts, f"{model} batch {batch}")
    assert not counts.syncs, report  # a host sync in a decode step breaks CUDA-graph capture
    assert counts.total_glue() <= glue + MARGIN, report
    assert counts.total_ops() <= calls + MARGIN, report
    # the harness saw the model: every layer's named ops were counted
    assert counts.total_ops() >= calls - MARGIN, report


def test_dsa_attention_glue_per_layer():
    """A full DSA layer's attention launches nothing outside the named ops (no concatenation, cast, copy,
    scaling or batched GEMM: the W_UK absorb is ``mla_absorb_q``, W_UV is inside ``mla_attention``)."""
    counts = op_count.measure("dsv32", 1)
    layers = counts.layers["attn[full]"]
    glue = {op: n for (scope, op), n in counts.glue.items() if scope == "attn[full]"}
    assert layers == 5 and glue == {}, op_count.report(counts, "dsv32")
    assert counts.ops[("attn[full]", "mla_absorb_q")] == layers, op_count.report(counts, "dsv32")


def test_the_guard_sees_an_extra_copy(monkeypatch):
    """A copy added to every attention layer shows up in the count (the guard can fail)."""
    from atomtool.serve.layers.mla import MLAAttention

    base = op_count.measure("dsv32", 1)
    forward = MLAAttention.forward

    def copying_forward(self, x, *args):
        return forward(self, x.clone(), *args)

    monkeypatch.setattr(MLAAttention, "forward", copying_forward)
    counts = op_count.measure("dsv32", 1)
    assert counts.total_glue() == base.total_glue() + counts.layers["attn[full]"]

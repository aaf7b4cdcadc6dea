"""Triton MoE routing (``grouped_topk``) and expert layout (``moe_align``), compiled on a CUDA GPU, against
the torch references at real sizes; CUDA-graph replay; recorded (not asserted) timings vs the torch path.

Exactness: expert ids equal the reference's (``torch_ref_mla.grouped_topk``) for float32 random logits and
for tie-heavy grids; weights within float32 rounding of the normalising sum (rtol 1e-6), and the fraction
of bitwise-equal weights is recorded (the kernel adds the k weights in the order of torch's CUDA row
reduction, so 1.0 is expected). ``moe_align`` equals ``sort_tokens_by_expert`` exactly.

Timings (``gpu_report``, microseconds per call, CUDA events): eager (launch overhead included) and
replayed from a CUDA graph of 20 calls (the decode path), ours vs the torch path, at T = 1 and 64 (decode)
and 1024 (where ``moe_align``'s one program meets ``MAX_PAIRS``: compare to choose that limit).
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops.torch_ref_mla import grouped_topk as ref_topk

DEV = "cuda"

# (E, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
CONFIGS = {
    "dsv3": (256, 8, 8, 4, True, 2.5),  # DeepSeek-V3 / V3.2
    "glm5": (256, 8, 1, 1, True, 2.5),  # GLM-5.x
    "kimi_k2": (384, 8, 1, 1, True, 2.827),
    "kimi_k3": (896, 16, 1, 1, True, 1.0),
    "dsv2": (160, 6, 8, 3, False, 16.0),
}


@pytest.fixture(scope="module")
def ops():
    from atomtool.serve.ops.triton.moe import sort_tokens_by_expert
    from atomtool.serve.ops.triton.moe_align import moe_align
    from atomtool.serve.ops.triton.router import grouped_topk

    return grouped_topk, moe_align, sort_tokens_by_expert


def _inputs(T, E, g, ties=False):
    if ties:
        logits = (torch.randint(-16, 17, (T, E), generator=g) / 8).float()
        bias = (torch.randint(-2, 3, (E,), generator=g) / 16).float()
    else:
        logits = torch.randn(T, E, generator=g) * 2
        bias = torch.randn(E, generator=g) * 0.05
    return logits.to(DEV), bias.to(DEV)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_grouped_topk_exact_at_real_sizes(ops, name, T, gpu_report):
    grouped_topk = ops[0]
    E, k, ng, tg, norm, sc = CONFIGS[name]
    g = torch.Generator().manual_seed(T + E)
    for ties in (False, True):
        logits, bias = _inputs(T, E, g, ties)
        for lg, b in ((logits, bias), (logits.bfloat16(), bias), (logits, None)):
            w, ids = grouped_topk(lg, b, k, ng, tg, norm, sc)
            rw, rids = ref_topk(lg, b, k, ng, tg, norm, sc)
            assert torch.equal(ids, rids)
            torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
            if not ties and lg is logits and b is bias:
                gpu_report[f"grouped_topk_weights_bitwise_frac_{name}_T{T}"] = float((w == rw).float().mean())


@pytest.mark.parametrize("T,k,E", [(1, 8, 256), (64, 8, 256), (512, 8, 256), (1024, 8, 256), (37, 6, 160),
                                   (3000, 8, 256)])
def test_moe_align_exact_at_real_sizes(ops, T, k, E):
    _, moe_align, ref = ops
    g = torch.Generator().manual_seed(T)
    for lo, hi in ((0, E), (-3, E + 40), (0, 5)):  # all served, some not served here, crowded experts
        ids = torch.randint(lo, hi, (T, k), generator=g).to(DEV)
        for i in (ids, ids.int()):
            pairs, experts = moe_align(i, E, 16)
            rp, re = ref(i, E, 16)
            assert torch.equal(pairs, rp) and torch.equal(experts, re)


def test_router_ops_replay_in_a_cuda_graph(ops):
    grouped_topk, moe_align, _ = ops
    E, k, ng, tg, norm, sc = CONFIGS["dsv3"]
    g = torch.Generator().manual_seed(3)
    logits, bias = _inputs(64, E, g)

    def step():
        w, ids = grouped_topk(logits, bias, k, ng, tg, norm, sc)
        return (w, ids, *moe_align(ids, E, 16))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    logits.copy_(_inputs(64, E, g)[0])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, step(), strict=True):
        assert torch.equal(a, b)


def _us_per_call(fn, graph: bool, reps: int = 20, rounds: int = 20) -> float:
    """Microseconds per call: ``reps`` calls, eager or one CUDA graph, median of ``rounds`` timings
    (benchmarks.common.seconds_per_call)."""
    from benchmarks import common as C

    return C.seconds_per_call(fn, torch.device("cuda"), calls=reps, graph=graph, iters=rounds) * 1e6


@pytest.mark.parametrize("T", [1, 64, 1024])  # 1024 tokens: 8192 pairs, moe_align's single-program limit
def test_router_timing_recorded(ops, T, gpu_report):
    grouped_topk, moe_align, ref_align = ops
    E, k, ng, tg, norm, sc = CONFIGS["dsv3"]
    logits, bias = _inputs(T, E, torch.Generator().manual_seed(T))
    ids = grouped_topk(logits, bias, k, ng, tg, norm, sc)[1]
    cases = {
        "grouped_topk_triton": lambda: grouped_topk(logits, bias, k, ng, tg, norm, sc),
        "grouped_topk_torch": lambda: ref_topk(logits, bias, k, ng, tg, norm, sc),
        "moe_align_triton": lambda: moe_align(ids, E, 16),
        "moe_align_torch": lambda: ref_align(ids, E, 16),
    }
    for name, fn in cases.items():
        for graph in (False, True):
            us = _us_per_call(fn, graph)
            gpu_report[f"{name}_{'graph' if graph else 'eager'}_us_T{T}"] = round(us, 2)
            assert us > 0

"""Triton MoE routing (``grouped_topk``) and expert layout (``moe_align``) vs the torch references, on CPU
under Triton's interpreter (TRITON_INTERPRET=1).

Oracles: ``torch_ref_mla.grouped_topk`` (DeepSeek-V3 ``noaux_tc``, HF ``DeepseekV3TopkRouter``) and
``triton.moe.sort_tokens_by_expert`` (the torch layout ``fused_moe`` used before), plus hand-derived
expectations for ties. Expert ids and layouts must be equal; weights agree to float32 rounding (the CPU
reference's sigmoid and row sum round differently from NumPy's). The same ops run compiled in
tests/gpu/test_router_gpu.py.
"""

from __future__ import annotations

# Same interpreter setup as tests/test_triton_ops.py: TRITON_INTERPRET must be set before triton is first
# imported; if another module of this session imported triton compiled, rerun this file in a fresh process.
from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve import ops as dispatch  # noqa: E402
from atomtool.serve.ops.torch_ref_mla import grouped_topk as ref_topk  # noqa: E402

if not _TRITON_PREIMPORTED:
    import atomtool.serve.ops.triton as tri  # noqa: E402
    from atomtool.serve.ops.triton import moe as tri_moe  # noqa: E402
    from atomtool.serve.ops.triton.moe import sort_tokens_by_expert as ref_align  # noqa: E402
    from atomtool.serve.ops.triton.moe_align import MAX_PAIRS, moe_align  # noqa: E402
    from atomtool.serve.ops.triton.router import grouped_topk  # noqa: E402


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


def test_registered_as_the_triton_backend_and_used_by_fused_moe():
    assert dispatch._REGISTRY[("grouped_topk", "triton")] is grouped_topk
    assert tri.OPS["grouped_topk"] is grouped_topk
    assert tri_moe.moe_align is moe_align  # fused_moe's layout step


# ---------------------------------------------------------------- grouped_topk

# (E, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor), from /work/shared/realworld configs
DSV3 = (256, 8, 8, 4, True, 2.5)  # DeepSeek-V3 / V3.2
GLM5 = (256, 8, 1, 1, True, 2.5)  # GLM-5.x: one group
KIMI_K2 = (384, 8, 1, 1, True, 2.827)  # E not a power of two
DSV2 = (160, 6, 8, 3, False, 16.0)  # 20 experts per group (not a power of two), no normalisation
ODD_K = (64, 6, 4, 2, True, 1.0)  # k not a power of two
K16 = (64, 16, 2, 1, True, 1.0)  # top_k 16 (Kimi-K3) with a group stage


def _tie_grid() -> torch.Tensor:
    """Logit values in eighths whose float32 sigmoid the CPU reference (torch) and the interpreter (NumPy's
    exp) round alike: drawn from these, both sides see bitwise equal scores, so exact ties stay ties and
    near-ties of different values (group sums) cannot flip on a one-ulp sigmoid difference."""
    v = torch.arange(-24, 25, dtype=torch.float32) / 8
    numpy_sigmoid = torch.from_numpy(1 / (1 + np.exp(-v.numpy())))
    return v[v.sigmoid() == numpy_sigmoid]


def _logits(T, E, gen, ties):
    if ties:  # many exactly equal logits: exact ties in scores, choices and group sums
        grid = _tie_grid()
        return grid[torch.randint(0, len(grid), (T, E), generator=gen)]
    return torch.randn(T, E, generator=gen) * 2


def _bias(E, gen, ties):
    b = torch.randn(E, generator=gen) * 0.1
    return (b * 16).round() / 16 if ties else b


def _check(logits, bias, cfg):
    E, k, ng, tg, norm, sc = cfg
    w, ids = grouped_topk(logits, bias, k, ng, tg, norm, sc)
    rw, rids = ref_topk(logits, bias, k, ng, tg, norm, sc)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids.shape == rids.shape == w.shape
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cfg", [DSV3, GLM5, KIMI_K2, DSV2, ODD_K, K16],
                         ids=["dsv3", "glm5", "kimi_k2", "dsv2", "odd_k", "k16"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_grouped_topk_matches_reference(cfg, ties):
    g = torch.Generator().manual_seed(hash((cfg, ties)) % 1000)
    E = cfg[0]
    _check(_logits(5, E, g, ties), _bias(E, g, ties), cfg)


def _cuda_row_sum(w: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T, 1], added in the order of torch's CUDA inner-dim reduction (ATen Reduce.cuh, torch >= 2.9):
    thread i of p = last_pow2(k) threads adds w[i] and w[i + p]; then a warp shuffle-down with offsets
    p/2, p/4, ..., 1 (each adding lane i + offset to lane i)."""
    T, k = w.shape
    p = 1 << (k.bit_length() - 1)
    lanes = torch.zeros(T, p)
    for i in range(p):
        lanes[:, i] = w[:, i] if i + p >= k else w[:, i] + w[:, i + p]
    offset = p // 2
    while offset:
        lanes[:, :offset] = lanes[:, :offset] + lanes[:, offset:2 * offset]
        offset //= 2
    return lanes[:, :1]


@pytest.mark.parametrize("cfg", [DSV3, ODD_K, K16, (64, 3, 1, 1, True, 1.0), (64, 1, 1, 1, True, 1.0)],
                         ids=["k8", "k6", "k16", "k3", "k1"])
def test_grouped_topk_normalises_in_the_cuda_row_sum_order(cfg):
    """With scores both sides compute alike (tie-grid logits), the weights equal, bitwise, the chosen scores
    divided by their sum taken in CUDA's reduction order (+1e-20), times the scale: what the reference
    gives on a GPU."""
    E, k, ng, tg, norm, sc = cfg
    g = torch.Generator().manual_seed(k)
    logits = _logits(24, E, g, ties=True)
    w, ids = grouped_topk(logits, _bias(E, g, True), k, ng, tg, norm, sc)
    chosen = logits.sigmoid().gather(1, ids)
    assert torch.equal(w, chosen / (_cuda_row_sum(chosen) + 1e-20) * sc)


@pytest.mark.parametrize("cfg", [DSV3, GLM5], ids=["dsv3", "glm5"])
def test_grouped_topk_without_bias(cfg):
    g = torch.Generator().manual_seed(3)
    _check(_logits(4, cfg[0], g, True), None, cfg)


def test_grouped_topk_all_equal_takes_lowest_groups_and_ids():
    """All scores tie: groups 0..3 stay eligible, experts 0..7 are chosen in id order, each weighs
    2.5 / 8 (hand-derived from the noaux_tc rules, not from either implementation)."""
    w, ids = grouped_topk(torch.zeros(2, 256), torch.zeros(256), 8, 8, 4, True, 2.5)
    assert ids.tolist() == [list(range(8))] * 2
    assert torch.equal(w, torch.full((2, 8), 0.3125))


def test_grouped_topk_group_rank_counts_a_tied_top_twice_and_ties_go_to_the_lower_group():
    """4 groups of 4, keep 2, top_k 2; logits 0 (every score 0.5), the bias sets the choices (exact in
    binary). Group scores, the sum of the two best choices: g0 = .875 + .625 = 1.5, g1 = .75 + .75 = 1.5
    (its tied best counts twice), g2 = .875 + .625 = 1.5, g3 = 1.0 + .25 = 1.25. Three groups tie for two
    places: g0 and g1 stay (lower index). Chosen: expert 0 (.875), then 4 (the lower id of the tied .75
    pair); expert 12 (the best choice, 1.0) is in a dropped group. A wrong tie rule or a top-2 sum without
    the duplicate would keep g2 and pick expert 9."""
    bias = torch.tensor([.375, .125, 0, 0, .25, .25, 0, 0, .125, .375, 0, 0, .5, -.25, -.25, -.25])
    logits = torch.zeros(1, 16)
    w, ids = grouped_topk(logits, bias, 2, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 4]]
    assert w.tolist() == [[0.5, 0.5]]
    _check(logits, bias, (16, 2, 4, 2, False, 1.0))


def test_grouped_topk_top_k_beyond_the_eligible_experts_takes_masked_ones_by_id():
    """topk_group * experts-per-group < top_k: the reference fills up with masked (-inf) experts, lowest
    id first."""
    g = torch.Generator().manual_seed(5)
    _check(_logits(3, 16, g, False), _bias(16, g, False), (16, 6, 8, 2, True, 1.0))
    w, ids = grouped_topk(torch.zeros(1, 8), None, 3, 4, 1, False, 1.0)  # group 0 = {0, 1}, then 2
    assert ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("T", [0, 1, 300])
def test_grouped_topk_token_counts(T):
    g = torch.Generator().manual_seed(T)
    cfg = DSV3 if T <= 1 else (64, 8, 8, 4, True, 2.5)  # keep the 300-token interpreter run short
    _check(_logits(T, cfg[0], g, T == 300), _bias(cfg[0], g, True), cfg)


def test_grouped_topk_bf16_and_strided_logits():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(3, 300, generator=g)
    _check(wide[:, :256], _bias(256, g, False), DSV3)  # rows strided by 300
    _check(wide[:, :256].bfloat16(), _bias(256, g, False).bfloat16(), DSV3)


def test_grouped_topk_rejects_groups_that_do_not_divide_the_experts():
    with pytest.raises(ValueError, match="100 experts do not split into n_group=8 groups"):
        grouped_topk(torch.zeros(1, 100), None, 4, 8, 2, True, 1.0)
    with pytest.raises(ValueError, match="top_k=40 > 32"):
        grouped_topk(torch.zeros(1, 64), None, 40, 1, 1, True, 1.0)


# ---------------------------------------------------------------- moe_align

def test_moe_align_layout_contract():
    """The layout of tests/test_triton_ops.py::test_moe_sorting_layout, by hand: expert 0 holds pair 1,
    expert 2 pairs 0, 2, 5 in pair order, ids 9 and -1 are not served here."""
    ids = torch.tensor([[2, 0], [2, 9], [-1, 2]])
    pairs, experts = moe_align(ids, num_experts=3, block_m=4)
    n = ids.numel()
    assert pairs.dtype == experts.dtype == torch.int32
    assert pairs.shape[0] == experts.shape[0] * 4 == -(-(n + 3 * 3) // 4) * 4
    assert experts.tolist() == [0, 2] + [3] * (experts.shape[0] - 2)
    assert pairs[:8].tolist() == [1, n, n, n, 0, 2, 5, n]
    assert (pairs[8:] == n).all()


@pytest.mark.parametrize("T,k,E,block_m,lo,hi", [
    (1, 8, 256, 16, 0, 256),  # decode
    (64, 8, 256, 16, -8, 300),  # ids outside [0, E)
    (300, 8, 256, 16, 0, 24),  # crowded experts: several blocks each
    (37, 6, 160, 16, 0, 160),  # E and k not powers of two
    (9, 3, 7, 4, -2, 9),
    (50, 4, 5, 1, 0, 5),  # block_m 1: no padding
    (0, 8, 256, 16, 0, 256),  # no tokens
])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_moe_align_matches_reference(T, k, E, block_m, lo, hi, dtype):
    g = torch.Generator().manual_seed(T * 31 + k)
    ids = torch.randint(lo, hi, (T, k), generator=g).to(dtype)
    pairs, experts = moe_align(ids, E, block_m)
    ref_pairs, ref_experts = ref_align(ids, E, block_m)
    assert torch.equal(pairs, ref_pairs)
    assert torch.equal(experts, ref_experts)


def test_moe_align_one_expert_takes_everything_and_the_largest_single_program_input():
    ids = torch.full((40, 8), 3)
    ids[7, 2] = 300
    for i in (ids, torch.randint(-1, 257, (MAX_PAIRS // 8, 8), generator=torch.Generator().manual_seed(1))):
        pairs, experts = moe_align(i, 256, 16)
        ref_pairs, ref_experts = ref_align(i, 256, 16)
        assert torch.equal(pairs, ref_pairs) and torch.equal(experts, ref_experts)

"""Reference MLA / indexer / MoE ops (atomtool.serve.ops.torch_ref_mla) and the MLA layers' loading errors.

The router and experts are checked against HF transformers' own ``DeepseekV3TopkRouter`` /
``DeepseekV3Experts`` modules; attention and selection against straightforward dense formulations.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.errors import EngineError
from atomtool.serve.ops import get_op
from atomtool.serve.ops.torch_ref_mla import fused_moe, grouped_topk, indexer_topk, mla_attention
from tests.engine_fixtures import one_torch_thread  # noqa: F401 (autouse fixture)


def _paged(rows_per_seq: list[torch.Tensor], bs: int, seed: int = 0):
    """Scatter per-sequence rows [L, D] into a shuffled paged plane; returns (cache, block_tables)."""
    nblocks = sum(-(-len(r) // bs) for r in rows_per_seq) + 2
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).tolist()
    cache = torch.full((nblocks, bs, rows_per_seq[0].shape[1]), float("nan"))
    width = max(-(-len(r) // bs) for r in rows_per_seq)
    tables = torch.full((len(rows_per_seq), width), -1, dtype=torch.int32)
    for b, rows in enumerate(rows_per_seq):
        for j in range(-(-len(rows) // bs)):
            blk = perm.pop()
            tables[b, j] = blk
            chunk = rows[j * bs:(j + 1) * bs]
            cache[blk, : len(chunk)] = chunk
    return cache, tables


def test_indexer_topk_selection_ties_and_padding():
    # one sequence of 10 cached keys, 3 new queries (positions 7, 8, 9), K = 4
    Hi, Di, K, L = 2, 4, 4, 10
    keys = torch.zeros(L, Di)
    keys[:, 0] = torch.tensor([5.0, 1, 3, 3, 0, 3, 2, 9, 0, 0])  # positions 2, 3, 5 tie at score 3
    q = torch.zeros(3, Hi, Di)
    q[:, 0, 0] = 1.0
    q[:, 1, 0] = -1.0  # ReLU kills the second head's (negative) scores
    w = torch.ones(3, Hi)
    cache, tables = _paged([keys], bs=4)
    out = indexer_topk(q, w, cache, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([L], dtype=torch.int32),
                       tables, K)
    assert out.dtype == torch.int32
    # query at position 7 sees keys 0..7: best 7 (9), 0 (5), then the tie at 3 -> lowest positions 2, 3
    assert out[0].tolist() == [0, 2, 3, 7]
    assert out[1].tolist() == [0, 2, 3, 7]
    # a query with <= K visible keys selects all of them, padded with -1 (here: a 3-token sequence)
    cache2, tables2 = _paged([keys[:3]], bs=4)
    out2 = indexer_topk(q[:3], w[:3], cache2, torch.tensor([0, 3], dtype=torch.int32),
                        torch.tensor([3], dtype=torch.int32), tables2, K)
    assert out2.tolist() == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1]]


def test_indexer_topk_matches_dense_scoring_per_sequence():
    g = torch.Generator().manual_seed(0)
    Hi, Di, K = 4, 8, 5
    lens, qlens = [12, 3, 20], [4, 3, 1]
    keys = [torch.randn(n, Di, generator=g) for n in lens]
    cache, tables = _paged(keys, bs=4, seed=1)
    T = sum(qlens)
    q = torch.randn(T, Hi, Di, generator=g)
    w = torch.randn(T, Hi, generator=g)
    cu = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    out = indexer_topk(q, w, cache, cu, torch.tensor(lens, dtype=torch.int32), tables, K)
    t = 0
    for b, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
        for j in range(ql):
            pos = n - ql + j
            scores = (w[t][:, None] * torch.relu(q[t] @ keys[b][: pos + 1].T)).sum(0)
            want = sorted(torch.topk(scores, min(K, pos + 1)).indices.tolist())
            assert out[t].tolist() == want + [-1] * (K - len(want))
            t += 1


def test_mla_attention_dense_and_sparse_match_reference():
    g = torch.Generator().manual_seed(0)
    H, R, P = 3, 8, 4
    lens, qlens = [9, 5], [3, 5]
    lat = [torch.randn(n, R + P, generator=g) for n in lens]
    cache, tables = _paged(lat, bs=4, seed=2)
    T = sum(qlens)
    qn, qp = torch.randn(T, H, R, generator=g), torch.randn(T, H, P, generator=g)
    cu, sl = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    topk = torch.full((T, 3), -1, dtype=torch.int32)
    topk[0, :2] = torch.tensor([1, 6])     # seq 0, position 6: two of its 7 visible keys
    topk[1] = torch.tensor([0, 8, 7])      # position 7: 8 is in the future (masked causally)
    topk[2] = torch.tensor([8, 3, 2])
    for b in range(3, T):                  # seq 1: pick the first three visible positions
        topk[b] = torch.tensor([0, 1, 2])
    scale = 0.3
    for sparse in (False, True):
        out = mla_attention(qn, qp, cache, cu, sl, tables, scale, topk if sparse else None)
        t = 0
        for b, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
            for j in range(ql):
                pos = n - ql + j
                allowed = [s for s in range(pos + 1) if not sparse or s in topk[t].tolist()]
                kv = lat[b][allowed]
                logits = (qn[t] @ kv[:, :R].T + qp[t] @ kv[:, R:].T) * scale
                want = torch.softmax(logits, -1) @ kv[:, :R]
                torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
                t += 1


def _hf_router_and_experts(n_group, topk_group, norm):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, moe_intermediate_size=6, num_experts_per_tok=3,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=1.7)
    cfg._experts_implementation = "eager"
    g = torch.Generator().manual_seed(3)
    router, experts = DeepseekV3TopkRouter(cfg), DeepseekV3Experts(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        experts.gate_up_proj.copy_(torch.randn(8, 12, 16, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(8, 16, 6, generator=g) * 0.3)
    return router, experts


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (1, 1, False), (2, 2, True)])
def test_grouped_topk_and_fused_moe_match_hf(n_group, topk_group, norm):
    router, experts = _hf_router_and_experts(n_group, topk_group, norm)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
        hf_out = experts(x, hf_ids, hf_w)
    w, ids = grouped_topk(logits, router.e_score_correction_bias, 3, n_group, topk_group, norm, 1.7)
    order = torch.argsort(hf_ids, dim=-1)
    assert torch.equal(torch.sort(ids, -1).values, torch.gather(hf_ids, 1, order))
    torch.testing.assert_close(torch.gather(w, 1, torch.argsort(ids, -1)), torch.gather(hf_w, 1, order))
    out = fused_moe(x, experts.gate_up_proj.detach(), experts.down_proj.detach(), w, ids)
    torch.testing.assert_close(out, hf_out, atol=1e-6, rtol=1e-5)


def test_fused_moe_fp8_block_experts_equal_dequantized():
    from tests.checkpoints import dequantize_fp8_block, quantize_fp8_block

    g = torch.Generator().manual_seed(5)
    E, H, inter, block = 4, 32, 24, (16, 16)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.3
    w2 = torch.randn(E, H, inter, generator=g) * 0.3
    q13, s13 = zip(*(quantize_fp8_block(w, block) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_fp8_block(w, block) for w in w2), strict=True)
    d13 = torch.stack([dequantize_fp8_block(q, s, block) for q, s in zip(q13, s13, strict=True)])
    d2 = torch.stack([dequantize_fp8_block(q, s, block) for q, s in zip(q2, s2, strict=True)])
    x = torch.randn(7, H, generator=g)
    ids = torch.randint(0, E, (7, 2), generator=g)
    w = torch.rand(7, 2, generator=g)
    got = fused_moe(x, torch.stack(q13), torch.stack(q2), w, ids, torch.stack(s13), torch.stack(s2), block)
    torch.testing.assert_close(got, fused_moe(x, d13, d2, w, ids), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, torch.stack(q13), torch.stack(q2), w, ids, torch.stack(s13), None, block)


def test_grouped_topk_ties_go_to_lowest_expert():
    logits = torch.zeros(2, 6)
    w, ids = grouped_topk(logits, None, 2, 1, 1, True, 1.0)
    assert ids.tolist() == [[0, 1], [0, 1]]
    torch.testing.assert_close(w, torch.full((2, 2), 0.5))


def test_ops_are_registered_in_dispatch():
    for name, fn in (("mla_attention", mla_attention), ("indexer_topk", indexer_topk),
                     ("grouped_topk", grouped_topk), ("fused_moe", fused_moe)):
        assert get_op(name, "cpu") is fn


# ---------------------------------------------------------------------------------------------------------
# model construction / loading errors


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from tests.checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("glm"), "glm_moe_dsa", seed=0)


def _layout_tensors(path):
    from atomtool.convert.materialize import iter_output_tensors
    from atomtool.convert.plan import build_plan
    from atomtool.inspect.classify import inspect_checkpoint

    report = inspect_checkpoint(str(path))
    plan = build_plan(report, "float32")
    return plan, [(spec.name, t) for spec, t in iter_output_tensors(plan, path)]


def test_missing_tensor_is_named(glm):
    from atomtool.serve.models.deepseek import GlmMoeDsaForCausalLM

    plan, tensors = _layout_tensors(glm)
    model = GlmMoeDsaForCausalLM(plan.config, plan.tensors, torch.float32, "cpu")
    gone = "model.layers.1.self_attn.indexer.wq_b.weight"
    with pytest.raises(EngineError, match=r"missing tensors.*layers\.1\.self_attn\.indexer\.wq_b\.weight"):
        model.load_weights((n, t) for n, t in tensors if n != gone)


def test_unpaired_fp8_expert_scale_is_an_error(glm):
    from atomtool.serve.models.deepseek import GlmMoeDsaForCausalLM

    plan, tensors = _layout_tensors(glm)
    model = GlmMoeDsaForCausalLM(plan.config, plan.tensors, torch.float32, "cpu")
    w13 = "model.layers.1.mlp.experts.w13.weight"
    bad = [(n, t.to(torch.float8_e4m3fn) if n == w13 else t) for n, t in tensors]
    with pytest.raises(EngineError, match=r"do not pair up.*layers\.1\.mlp\.experts\.w13"):
        model.load_weights(bad)


def test_fused_parts_must_fit_the_layer_role(glm):
    """A shared layer's fused projection cannot carry indexer rows (the schedule says it has no indexer)."""
    import dataclasses

    from atomtool.convert.plan_types import PartSpec
    from atomtool.serve.models.deepseek import GlmMoeDsaForCausalLM

    plan, _ = _layout_tensors(glm)
    name = "model.layers.2.self_attn.fused_qkv_a_proj.weight"  # layer 2 is shared
    spec = plan.tensors[name]
    extra = PartSpec("model.layers.2.self_attn.indexer.wk.weight", rows=(spec.shape[0], spec.shape[0] + 16))
    specs = dict(plan.tensors)
    specs[name] = dataclasses.replace(spec, parts=spec.parts + (extra,))
    with pytest.raises(EngineError, match=r"layers\.2\.self_attn\.fused_qkv_a_proj.*shared"):
        GlmMoeDsaForCausalLM(plan.config, specs, torch.float32, "cpu")


def test_shared_layer_indexer_tensors_and_mtp_layers_are_ignored(glm):
    """An IndexCache-style override leaves indexer tensors on shared layers; MTP layers sit past
    num_hidden_layers. HF ignores both; so does the engine."""
    from atomtool.serve.models.deepseek import GlmMoeDsaForCausalLM

    plan, tensors = _layout_tensors(glm)
    model = GlmMoeDsaForCausalLM(plan.config, plan.tensors, torch.float32, "cpu")
    extra = [("model.layers.2.self_attn.indexer.wq_b.weight", torch.zeros(64, 32)),
             ("model.layers.4.self_attn.q_a_proj.weight", torch.zeros(32, 64))]
    model.load_weights(tensors + extra)
    assert model.model.layers[2].self_attn.indexer is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_indexer_head_weights_are_float32_in_bf16_models(glm, fused, monkeypatch):
    """In a bfloat16 model the indexer head weights come from a float32 projection (HF keeps
    ``indexer.weights_proj`` in float32), not from the bf16 GEMM output."""
    from atomtool.serve.models.deepseek import GlmMoeDsaForCausalLM
    from atomtool.serve.ops import torch_ref_mla
    from tests.mla_driver import PagedDriver

    assert torch_ref_mla.indexer_topk is indexer_topk

    plan, tensors = _layout_tensors(glm)
    specs = dict(plan.tensors)
    if not fused:  # drop the indexer rows from the fused projection: wk / weights_proj become separate tensors
        import dataclasses

        split = []
        for n, t in tensors:
            spec = specs.get(n)
            if spec is not None and n.endswith("fused_qkv_a_proj.weight") and len(spec.parts) == 4:
                parts = spec.parts[:2]
                specs[n] = dataclasses.replace(spec, parts=parts, shape=(parts[1].rows[1], spec.shape[1]))
                for p in spec.parts[2:]:
                    split.append((p.source, t[p.rows[0]:p.rows[1]]))
                t = t[: parts[1].rows[1]]
            split.append((n, t))
        tensors = split
    model = GlmMoeDsaForCausalLM(plan.config, specs, torch.bfloat16, "cpu")
    model.load_weights(tensors)
    assert model.model.layers[0].self_attn.indexer.fused == fused
    seen = []
    real = torch_ref_mla.indexer_topk

    def spy(q, weights, *args):
        seen.append(weights)
        return real(q, weights, *args)

    inputs = {}
    layer0 = model.model.layers[0]
    layer0.self_attn.register_forward_pre_hook(lambda mod, args: inputs.update(x=args[0]) if not inputs else None)
    from atomtool.serve import ops

    monkeypatch.setitem(ops._REGISTRY, ("indexer_topk", "torch"), spy)
    PagedDriver(model).generate({"a": list(range(3, 23))}, 1)
    w_full = dict(tensors)["model.layers.0.self_attn.indexer.weights_proj.weight"] if not fused else \
        dict(tensors)["model.layers.0.self_attn.fused_qkv_a_proj.weight"][-4:]
    want = torch.nn.functional.linear(inputs["x"].float(), w_full.to(torch.bfloat16).float()) * (4 * 16) ** -0.5
    assert seen[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], want, atol=1e-6, rtol=1e-6)

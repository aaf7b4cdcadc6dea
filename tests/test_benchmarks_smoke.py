"""CPU checks of the issue-7 benchmark helpers (benchmarks/common.py, decode_bench, prefill_bench, throughput).

They guard what the GPU numbers rest on: the FP8 layout specs really make every linear and expert FP8, a
decode step through the engine's ModelRunner over faked KV contexts runs, and the roofline byte / FLOP counts
equal hand-derived formulas for a dense model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import common as C
from benchmarks.decode_bench import step_bytes_flops
from benchmarks.prefill_bench import prefill_flops
from benchmarks.throughput_bench import make_workload

CPU = torch.device("cpu")


def test_fp8_specs_make_every_linear_and_expert_fp8_and_a_decode_step_runs():
    from atomtool.serve.layers.linear import Linear
    from atomtool.serve.layers.moe import StackedExperts

    model, cfg = C.build_random_model(C.dsv32_config(4, 3, smoke=True), CPU, fp8=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert model.lm_head.weight.dtype == torch.bfloat16  # lm_head and embeddings stay bf16, as published
    assert len(linears) >= 4 * 4  # fused_qkv_a, q_b, kv_b, o (+ indexer wq_b, MLP) per layer
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv is not None for m in linears.values())
    experts = [m for m in model.modules() if isinstance(m, StackedExperts)]
    assert len(experts) == 1 and experts[0].w13.weight.dtype == torch.float8_e4m3fn
    assert experts[0].block_size == (128, 128)
    # random, not zeros (METHOD.md): the weights carry signal
    assert linears["model.layers.0.self_attn.o_proj"].weight.float().std() > 0.5

    runner, pool = C.make_runner(model, CPU, num_blocks=40, block_size=16, max_model_len=320, graph_sizes=None)
    C.fill_cache_random_(pool)
    seqs = C.fake_sequences(2, 150, 16, cfg["vocab_size"])  # 150 > index_topk 64: the sparse path
    assert seqs[0].block_table != seqs[1].block_table
    batch = runner.prepare(C.scheduler_output(seqs))
    assert batch.is_decode and batch.seq_lens_cpu == [150, 150]
    logits = runner.run(batch)
    assert logits.shape == (2, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_dense_decode_bytes_and_prefill_flops_match_hand_formulas():
    model, cfg = C.build_random_model(C.qwen3_config(smoke=True), CPU)
    B, ctx = 3, 100
    nbytes, flops, parts = step_bytes_flops(model, cfg, B, ctx, {})
    H, L, hkv, D, Hq = 128, 2, 2, 32, 4
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding table once
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    emb = cfg["vocab_size"] * H
    # every weight once (lm_head = the tied table) + the batch's embedding rows + K and V of every context token
    want = (params - emb) * 2 + emb * 2 + B * H * 2 + L * B * ctx * 2 * hkv * D * 2
    assert nbytes == want
    assert parts["kv_GB"] * 1e9 == L * B * ctx * 2 * hkv * D * 2
    assert flops == 2 * B * (params - norms) + L * B * Hq * 4 * D * ctx
    T = 50
    pf = prefill_flops(model, cfg, T)
    assert pf == 2 * T * (params - norms - emb) + 2 * emb + L * (T * (T + 1) // 2) * Hq * 4 * D


def test_workload_is_nano_vllm_shaped():
    work = make_workload(64, 100, 1024, vocab=151936, seed=0)
    assert len(work) == 64
    assert all(100 <= len(p) <= 1024 and 100 <= n <= 1024 for p, n in work)
    assert all(0 <= t < 10000 for p, _ in work for t in p)
    assert make_workload(64, 100, 1024, vocab=151936, seed=0) == work


def test_fp8_moe_load_checkpoint_is_what_transformers_and_deepseek_write(tmp_path):
    """load_bench's DeepSeek-V3.2 FP8 MoE checkpoint (written with safetensors, not through a model) has
    exactly the tensors -- names, dtypes, shapes -- of transformers' ``save_pretrained`` of the same config
    re-encoded by the FP8 block fixture writer (DeepSeek's format: per-expert F8_E4M3 + ``weight_scale_inv``),
    sharded with an index, and raw and converted layout load to the same parameters."""
    import json

    from atomtool.convert.commands import run_convert
    from atomtool.serve.loader import load_model
    from benchmarks.load_bench import dsv32_fp8_moe_config, write_fp8_moe_checkpoint
    from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint
    from tests.test_layout_load import _bytes_equal

    cfg = dsv32_fp8_moe_config(smoke=True)
    raw = tmp_path / "raw"
    nbytes = write_fp8_moe_checkpoint(cfg, raw, CPU, shard_bytes=1 << 20)
    skip = ("architectures", "model_type", "torch_dtype", "quantization_config")
    src = write_hf_checkpoint(tmp_path / "hf", "deepseek_v32", dtype=torch.bfloat16, tokenizer=False,
                              **{k: v for k, v in cfg.items() if k not in skip})
    want = write_fp8_block_checkpoint(src, tmp_path / "want", block=tuple(cfg["quantization_config"]
                                                                          ["weight_block_size"]))

    def header(d):
        from safetensors import safe_open

        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
        return out

    got = header(raw)
    assert got == header(want)
    assert any(".mlp.experts.15.gate_proj.weight_scale_inv" in k for k in got)
    index = json.loads((raw / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and len(set(index["weight_map"].values())) > 1
    assert nbytes == sum(f.stat().st_size for f in raw.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in raw.glob("*.safetensors"))
    qc = json.loads((raw / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]

    layout = tmp_path / "layout"
    run_convert(str(raw), str(layout))
    a = load_model(raw, dtype="bfloat16", device="cpu").model
    b = load_model(layout, dtype="bfloat16", device="cpu").model
    _bytes_equal(a, b)
    assert b.model.layers[1].mlp.experts.w13.weight.dtype == torch.float8_e4m3fn


def test_load_bench_smoke_runs_the_fp8_moe_model(tmp_path, monkeypatch):
    """``load_bench --smoke --model dsv32-fp8`` end to end on CPU: one result row with both loads timed."""
    import json

    from benchmarks import load_bench

    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "out"))
    assert load_bench.main(["--smoke", "--model", "dsv32-fp8", "--reps", "1", "--sources", "raw,layout",
                            "--dir", str(tmp_path)]) == 0
    (row,) = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert row["bench"] == "load" and row["model"] == "dsv32-fp8" and row["speedup_load"] > 0
    assert row["raw"]["load_s"] > 0 and row["layout"]["ready_s"] >= row["layout"]["load_s"]


def test_load_bench_cache_both_reports_a_cold_and_a_warm_row(tmp_path, monkeypatch):
    """``--cache both``: one result row per cache mode (warm: the files read untimed before each load)."""
    import json

    from benchmarks import load_bench

    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "out"))
    reads = []
    real = load_bench._read_all
    monkeypatch.setattr(load_bench, "_read_all", lambda path: (reads.append(path.name), real(path)))
    assert load_bench.main(["--smoke", "--reps", "1", "--sources", "raw,layout", "--cache", "both",
                            "--dir", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["cache"] for r in rows] == ["cold", "warm"] and all(r["speedup_load"] > 0 for r in rows)
    assert reads == ["raw", "layout"]  # only before the warm loads


def test_trace_report_charges_each_instant_to_the_kernel_that_ends_first(tmp_path):
    """benchmarks/trace_report on a hand-made trace: a PDL pair (B launched at 2 us, waiting until A ends at
    10), a side-stream kernel C inside B, an idle gap, then two layers opened by the marker kernel; exposed
    times are the hand-computed ones and sum to the busy (union) time, not to the durations."""
    import gzip
    import json

    from benchmarks import trace_report

    def ev(name, ts, dur, tid=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [ev("A", 0, 10), ev("B", 2, 13), ev("C", 12, 2, tid=8),  # B: 10..15 its own, C 12..14 in B
              ev("mark", 20, 3), ev("D", 22, 8),                        # idle 15..20; layer 0 = 20..30
              ev("mark", 30, 2), ev("E", 31, 4),                        # layer 1 = 30..35
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # not GPU work
              ev("A", 1000, 5)]                                        # a second step, 965 us later
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    steps = trace_report.split_steps(trace_report.load_kernels(path))
    assert [len(s) for s in steps] == [7, 1]
    step = steps[0]
    exposed = {k.name + str(k.start): t for k, t in trace_report.exposed_times(step)}
    # A owns 0..10 (B only waits); B 10..12 and 14..15; C 12..14 (ends first); mark 20..23 (ends before D);
    # D 23..30; the second mark 30..32, E 32..35
    assert exposed == {"A0.0": 10, "B2.0": 3, "C12.0": 2, "mark20.0": 3, "D22.0": 7, "mark30.0": 2, "E31.0": 3}
    s = trace_report.summarize(step)
    assert (s["span_us"], s["busy_us"], s["idle_us"]) == (35, 30, 5)
    assert s["per_name"]["mark"] == (2, 5)
    assert trace_report.layer_spans(step, "mark") == [(20, 30), (30, 35)]
    assert trace_report.layer_spans(step, "mark", every=2) == [(20, 35)]
    text = trace_report.report(path, marker="mark", layer=1)
    assert "busy 30.0 us, idle 5.0 us" in text and "layer 1 of 2 (mark to the next): 5.0 us" in text
    assert text.splitlines()[-1].split() == ["1.0", "5.0", "3.0", "E"]


# ---------------------------------------------------------------- benchmarks/ab.py (A/B of engine constants)
def _fake_module(tmp_path, monkeypatch):
    """A module ``abfake`` importable here and in child processes: a Triton-like constexpr and a plain int."""
    (tmp_path / "abfake.py").write_text("class constexpr:\n    def __init__(self, value):\n        self.value = value\n\n"
                                        "X = constexpr(1)\nY = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).resolve().parent.parent}")
    import importlib

    return importlib.import_module("abfake")


def test_ab_parses_variants_and_applies_settings_in_the_modules_namespace(tmp_path, monkeypatch):
    from benchmarks import ab

    fake = _fake_module(tmp_path, monkeypatch)
    v = ab.parse_variant("fast=abfake.X=5; abfake.Y = Y * 3")
    assert (v.name, v.settings) == ("fast", [("abfake", "X", "5"), ("abfake", "Y", "Y * 3")])
    assert ab.parse_variant("base=").settings == []
    ab.apply_settings(v.settings)
    assert type(fake.X).__name__ == "constexpr" and fake.X.value == 5 and fake.Y == 6
    for bad in ("noequals", "=x.Y=1", "a b=x.Y=1"):
        with pytest.raises(ab.AbError, match="variant"):
            ab.parse_variant(bad)
    for bad in ("x=Y=1", "x=abfake.Y=", "x=abfake.1Y=2"):
        with pytest.raises(ab.AbError, match="expected module.attribute=expression"):
            ab.parse_variant(bad)
    with pytest.raises(ab.AbError, match="has no attribute 'Z'"):
        ab.check_settings(ab.parse_settings("abfake.Z=1"))
    with pytest.raises(ab.AbError, match="cannot import"):
        ab.apply_settings(ab.parse_settings("no_such_module_xyz.A=1"))
    with pytest.raises(ab.AbError, match="NameError"):
        ab.apply_settings(ab.parse_settings("abfake.Y=undefined_name"))


def test_ab_alternates_and_compares_medians():
    from benchmarks import ab

    a, b = ab.Variant("a"), ab.Variant("b")
    assert [(r, v.name) for r, v in ab.schedule([a, b], 3)] == [(1, "a"), (1, "b"), (2, "b"), (2, "a"), (3, "a"),
                                                                  (3, "b")]
    rows = {"a": [{"bench": "decode", "batch": 1, "gpu_ms": x} for x in (2.0, 4.0, 3.0)] +
                 [{"bench": "other", "batch": 1, "gpu_ms": 100.0}],
            "b": [{"bench": "decode", "batch": 1, "gpu_ms": x} for x in (1.5, 1.5)] +
                 [{"bench": "decode", "batch": 8, "gpu_ms": 9.0}]}
    table = {r["batch"]: r for r in ab.compare(rows, ["a", "b"], "decode", ["batch"], "gpu_ms")}
    assert table[1]["a"] == 3.0 and table[1]["b"] == 1.5 and table[1]["b/a"] == 0.5 and table[1]["a_runs"] == "2 4 3"
    assert table[8]["a"] is None and "b/a" not in table[8]


def test_ab_runs_a_benchmark_per_variant_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    from benchmarks import ab

    _fake_module(tmp_path, monkeypatch)
    monkeypatch.setenv("BENCH_OUT", str(tmp_path / "out"))
    bench = ["--", "decode_bench", "--model", "qwen3", "--smoke", "--batches", "1", "--contexts", "64", "--iters", "1"]
    assert ab.main(["--variant", "base=", "--variant", "y=abfake.Y=7", "--rounds", "1", *bench]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["bench"] == "ab"]
    assert row["variants"] == {"base": "", "y": "abfake.Y=7"} and row["model"] == "qwen3" and row["batch"] == 1
    assert row["base"] > 0 and row["y"] > 0 and row["y/base"] == pytest.approx(row["y"] / row["base"])
    assert {p.name for p in (tmp_path / "out" / "ab").iterdir()} == {"base_1", "y_1"}
    capsys.readouterr()
    assert ab.main(["--variant", "base=", *bench]) == 2
    assert "at least two --variant" in capsys.readouterr().err
    assert ab.main(["--variant", "base=", "--variant", "z=abfake.Z=1", *bench]) == 2
    assert "has no attribute 'Z'" in capsys.readouterr().err
    assert ab.main(["--variant", "a=", "--variant", "b=", "--", "no_such_bench"]) == 2
    assert "no_such_bench" in capsys.readouterr().err
    assert ab.main(["--variant", "base=", "--variant", "z=abfake.Y==1", *bench]) == 2  # before any run
    assert "abfake.Y==1: not a Python expression" in capsys.readouterr().err
    assert ab.main(["--variant", "a=", "--variant", "b=", "--keys", "", *bench]) == 2
    assert "--keys names no field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a=", "--variant", "b="])

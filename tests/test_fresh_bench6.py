"""Reproducers for defects a newcomer met in the issue-7 benchmark tools on CPU (docs/PERFORMANCE.md, session 6).

Each test states the behaviour the tool should have (the defects are fixed; the tests keep them fixed).
All run in seconds on CPU (no Triton interpreter, toy models only).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _kernel(name: str, ts: float, dur: float, tid: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}


def _hand_trace(path: Path) -> Path:
    """Two layers opened by the default marker kernel, a GEMV and a side-stream kernel in each."""
    events = []
    for layer in range(2):
        t = 20.0 * layer
        events += [_kernel("_add_rms_norm_kernel", t, 2), _kernel("gemv", t + 2, 10),
                   _kernel("side", t + 4, 6, tid=9), _kernel("attn", t + 12, 5)]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _run_trace_report(argv: list[str]) -> BaseException | None:
    """``trace_report.main(argv)``; the exception it ended with (SystemExit included), None if it returned."""
    from benchmarks import trace_report

    try:
        trace_report.main(argv)
    except BaseException as exc:  # noqa: BLE001 - the test inspects which kind it was
        return exc
    return None


def _clear_cli_error(exc: BaseException | None) -> bool:
    """A command-line error the user can read: SystemExit with a message or a non-zero code, no traceback."""
    return isinstance(exc, SystemExit) and exc.code not in (0, None)


# ------------------------------------------------------------------------------------------ trace_report


def test_trace_report_missing_file_is_a_clear_error(tmp_path):
    exc = _run_trace_report([str(tmp_path / "no_such_trace.json")])
    assert _clear_cli_error(exc), repr(exc)


@pytest.mark.parametrize("content", ["", "this is not json {", "{}", "[1, 2]"],
                         ids=["empty", "not_json", "no_traceEvents", "list_of_ints"])
def test_trace_report_malformed_trace_is_a_clear_error(tmp_path, content):
    path = tmp_path / "trace.json"
    path.write_text(content)
    exc = _run_trace_report([str(path)])
    assert _clear_cli_error(exc), repr(exc)


@pytest.mark.parametrize("layer", ["2", "-1"])
def test_trace_report_layer_out_of_range_is_a_clear_error(tmp_path, layer):
    exc = _run_trace_report([str(_hand_trace(tmp_path / "t.json")), "--layer", layer])
    assert _clear_cli_error(exc), repr(exc)


def test_trace_report_says_when_the_marker_never_occurs(tmp_path):
    from benchmarks import trace_report

    text = trace_report.report(_hand_trace(tmp_path / "t.json"), marker="_add_rms_norm_kernl", layer=1)
    assert "_add_rms_norm_kernl" in text  # e.g. "no kernel named _add_rms_norm_kernl: no layer timeline"


# ------------------------------------------------------------------------------------------ decode_bench


def test_decode_bench_profile_step_stays_inside_the_pool_it_was_given(monkeypatch, tmp_path):
    from benchmarks import common as C
    from benchmarks import decode_bench

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # profile_step's only CUDA call
    torch.manual_seed(0)
    model, cfg = C.build_random_model(C.qwen3_config(smoke=True), CPU)
    # what run_model builds for `--batches 1 --contexts 64`: ceil(64 / 16) + 1 blocks, max_model_len ctx + 16
    runner, _ = C.make_runner(model, CPU, num_blocks=5, block_size=16, max_model_len=80, graph_sizes=[1])
    decode_bench.profile_step("qwen3", runner, cfg, 16)


def test_decode_bench_profile_off_cuda_says_it_did_not_profile(monkeypatch, tmp_path, capsys):
    from benchmarks import decode_bench

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    (tmp_path / "ceilings.json").write_text(json.dumps({"device": "cpu", "copy_bw_Bps": 1e10,
                                                        "matmul_flops": 1e11}))
    decode_bench.main(["--smoke", "--model", "qwen3", "--batches", "1", "--contexts", "32", "--iters", "1",
                       "--point-budget-s", "0.1", "--profile"])
    out = capsys.readouterr().out
    assert "profile" in out.lower()


# ------------------------------------------------------------------------------------------ throughput_bench


def test_throughput_offline_table_fills_ttft_p99(monkeypatch, tmp_path, capsys):
    from benchmarks import throughput_bench

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    ours = {"tok_s": 100.0, "ttft_s": {"p50": 0.25, "p99": 0.75}, "tpot_ms": {"p50": 4.0, "p99": 9.0}}
    fake = {"ours": ours, "transformers": {"tok_s": 10.0, "requests": 4}, "speedup": 10.0}
    monkeypatch.setattr(throughput_bench, "run_model", lambda name, args, device: fake)
    throughput_bench.main(["--smoke", "--model", "qwen3"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["model"])
    cols, row = lines[header].split(), lines[header + 1].split()
    assert len(row) == len(cols) and row[cols.index("ttft_p99_s")] == "0.75"


# ------------------------------------------------------------------------------------------ kernel_sweep


def test_kernel_sweep_smoke_moe_candidates_are_distinct(monkeypatch, tmp_path):
    from benchmarks import common as C
    from benchmarks import kernel_sweep

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(C, "load_or_measure_ceilings", lambda device: {"copy_bw_Bps": 1e10, "matmul_flops": 1e11})
    seen = []

    def fake_sweep_moe(device, configs, T_list, copy_bw, smoke, act_quant=None):
        seen.extend(configs)
        return [{"T": T, "us": 1.0} for T in T_list]

    monkeypatch.setattr(kernel_sweep, "sweep_moe", fake_sweep_moe)
    kernel_sweep.main(["--smoke", "--only", "moe"])
    assert len(seen) >= 2 and len(set(seen)) == len(seen), seen


def test_kernel_sweep_w8a8_rows_record_the_tile_that_ran(monkeypatch, tmp_path):
    from atomtool.serve.ops.triton.linear import Fp8LinearConfig
    from benchmarks import common as C
    from benchmarks import kernel_sweep

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(C, "seconds_per_call", lambda fn, device, **kw: 1e-3)  # no kernel launch needed
    rows = kernel_sweep.sweep_linear(CPU, [Fp8LinearConfig()], [("small", 128, 128, 1)], 1e10,
                                     act_quant="dynamic_ue8m0")
    assert rows[0]["swap_ab"] is True


# ------------------------------------------------------------------------------------------ op_count, prepare_bench


@pytest.mark.parametrize("batch", ["0", "-1"])
def test_op_count_rejects_a_nonpositive_batch_clearly(batch):
    from benchmarks import op_count

    try:
        op_count.main(["--model", "qwen3", "--batch", batch])
    except BaseException as exc:  # noqa: BLE001
        assert _clear_cli_error(exc), repr(exc)
    else:
        pytest.fail("op_count accepted a batch of no sequences")


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--batch", "0"], ["--ctx", "0"], ["--block-size", "0"]],
                         ids=["steps0", "batch0", "ctx0", "block_size0"])
def test_prepare_bench_rejects_nonpositive_sizes_clearly(monkeypatch, bad):
    from benchmarks import prepare_bench

    monkeypatch.setattr(sys, "argv", ["prepare_bench", "--batch", "2", "--ctx", "64", "--steps", "2", *bad])
    try:
        prepare_bench.main()
    except BaseException as exc:  # noqa: BLE001
        assert _clear_cli_error(exc), repr(exc)
    else:
        pytest.fail(f"prepare_bench accepted {bad}")


# ------------------------------------------------------------------------------------------ run_all.sh


def test_run_all_exit_status_reports_failed_benchmarks(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "false", "SMOKE": "1", "BUDGET_S": "60", "ONLY": "ceilings"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "run_all.sh"), str(tmp_path / "out")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert "ceilings rc=1" in proc.stdout  # the one benchmark failed...
    assert proc.returncode != 0, proc.stdout  # ...and the script should say so in its exit status


def test_kernel_sweep_quick_is_honoured_with_act_quant(monkeypatch, tmp_path):
    from benchmarks import common as C
    from benchmarks import kernel_sweep

    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    # stand in for a CUDA machine: nothing below touches the device once the sweeps are replaced
    monkeypatch.setattr(C, "pick_device", lambda smoke: torch.device("cuda"))
    monkeypatch.setattr(C, "env_info", lambda device: {})
    monkeypatch.setattr(C, "load_or_measure_ceilings", lambda device: {"copy_bw_Bps": 1e10, "matmul_flops": 1e11})
    counts = {}

    def fake_sweep_linear(device, configs, shapes, copy_bw, act_quant=None):
        counts["n"] = len(configs)
        return [{"kernel": "fp8_linear", "step_ms": 1.0}]

    monkeypatch.setattr(kernel_sweep, "sweep_linear", fake_sweep_linear)
    kernel_sweep.main(["--only", "linear", "--act-quant", "dynamic_ue8m0"])
    full = counts["n"]
    kernel_sweep.main(["--quick", "--only", "linear", "--act-quant", "dynamic_ue8m0"])
    assert counts["n"] < full, (counts["n"], full)

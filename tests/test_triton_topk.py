"""The Triton radix top-k selection (atomtool.serve.ops.triton.topk) and the DSA indexer built on it, on CPU
under Triton's interpreter (TRITON_INTERPRET=1), against a stable torch sort / ``torch_ref_mla.indexer_topk``.

Every check is exact equality: the selection is integer work on keys, so ties (quantized scores, ReLU
plateaus of zeros, -0.0 vs +0.0) must break toward the lowest position exactly as the reference's stable
sort does. Small block sizes make short rows span several chunks; key ranges that differ only in the low
mantissa bits force several rounds of the radix loop. The GPU twin is tests/gpu/test_topk_gpu.py.
"""

from __future__ import annotations

import os
import sys

# same scheme as tests/test_triton_ops.py: triton must be imported after TRITON_INTERPRET is set; when
# another module of the session imported it compiled first, this file reruns in a fresh interpreter
from tests.triton_interp import harness, setup_interpreter  # noqa: E402  (imports neither torch nor triton)

_TRITON_PREIMPORTED = setup_interpreter()

import subprocess  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed (pip install 'atomtool[serve]')")

from atomtool.serve.ops import torch_ref_mla  # noqa: E402
from tests.kernel_inputs import cu_seqlens as _cu  # noqa: E402
from tests.kernel_inputs import random_block_tables as _paged  # noqa: E402

if not _TRITON_PREIMPORTED:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402

    from atomtool.serve.ops.triton import indexer_topk  # noqa: E402
    from atomtool.serve.ops.triton import topk as T  # noqa: E402

    @triton.jit
    def _keys_kernel(x_ptr, k_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(k_ptr + offs, T.orderable_key(x), mask=offs < n)


_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, _TRITON_PREIMPORTED)


@pytest.fixture(autouse=True)
def _interpreter_sized_defaults(monkeypatch):
    """Register tiles of a few hundred lanes: the interpreter's cost grows with them (the GPU tests run the
    real defaults)."""
    if not _TRITON_PREIMPORTED:
        monkeypatch.setattr(T, "BLOCK", 256)
        monkeypatch.setattr(T, "CAND_BLOCK", 256)
        monkeypatch.setattr(T, "SPLIT_SMALL_N", 256)


# ---------------------------------------------------------------- helpers

#: the selection modes: one program per row; split rows (several programs per row); split rows where rows
#: of at most 64 valid positions are selected whole by one program of the first launch
MODES = {"one_program": {"split": False}, "split": {"split": True, "small_n": 0},
         "split_small_rows": {"split": True, "small_n": 64}}

def _stable_topk(scores: torch.Tensor, lengths: torch.Tensor, K: int) -> torch.Tensor:
    """The contract, written plainly: stable descending sort of each row's first n scores, first K taken,
    listed ascending, -1 padded."""
    out = torch.full((scores.shape[0], K), -1, dtype=torch.int32)
    for t in range(scores.shape[0]):
        n = int(lengths[t])
        pick = torch.sort(scores[t, :n], descending=True, stable=True).indices[:K]
        out[t, :pick.numel()] = torch.sort(pick).values.int()
    return out


def _check(scores: torch.Tensor, lengths, K: int, **tuning) -> None:
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    out = T.topk_positions(T.orderable_keys(scores), lengths, K, **tuning)
    assert out.dtype == torch.int32 and out.shape == (scores.shape[0], K)
    assert torch.equal(out, _stable_topk(scores, lengths, K))


# ---------------------------------------------------------------- keys

def test_orderable_keys_order_like_floats_and_tie_plus_and_minus_zero():
    x = torch.tensor([float("-inf"), -3e38, -2.5, -1.0, -1e-30, -1e-45, -0.0, 0.0, 1e-45, 1e-30, 0.5, 1.0,
                      1.0000001, 7.0, 3e38, float("inf")])
    keys = T.orderable_keys(x).long() & 0xFFFFFFFF  # as uint32
    assert (keys[1:] >= keys[:-1]).all()
    assert keys[6] == keys[7]  # -0.0 == +0.0
    distinct = torch.cat([keys[:6], keys[7:]])
    assert (distinct[1:] > distinct[:-1]).all()
    # the Triton twin writes the same bits
    got = torch.empty(x.shape[0], dtype=torch.int32)
    _keys_kernel[(1,)](x, got, x.shape[0], BLOCK=16)
    assert torch.equal(got, T.orderable_keys(x))


# ---------------------------------------------------------------- selection on given scores

@pytest.mark.parametrize("seed,kind", list(enumerate(["normal", "quantized", "zeros_and_few_positives", "all_equal",
                                                 "negative", "low_bits"])))
def test_selection_matches_a_stable_sort(seed, kind):
    g = torch.Generator().manual_seed(seed)
    R, S, K = 6, 300, 40
    x = torch.randn(R, S, generator=g)
    if kind == "quantized":  # a few distinct values: large tie groups straddle the K-th
        x = (x * 2).round() / 2
    elif kind == "zeros_and_few_positives":  # a ReLU plateau: < K positive, the rest exact zeros (+/-0.0)
        x = torch.where(torch.rand(R, S, generator=g) < 0.05, x.abs() + 0.1, torch.zeros(()))
        x[:, ::3] = -0.0
    elif kind == "all_equal":
        x = torch.full((R, S), 2.5)
    elif kind == "negative":  # negative indexer weights: mostly negative scores, one -inf
        x = -x.abs() * 100
        x[0, 5] = float("-inf")
    elif kind == "low_bits":  # keys differing only in the last mantissa bits: many radix rounds
        x = 1.0 + torch.randint(0, 64, (R, S), generator=g) * 2.0 ** -23
    lengths = [S, S - 1, 41, 40, 7, 0]  # full, above K, K + 1, == K, < K, empty
    _check(x, lengths, K, block=64, split=False)
    _check(x, lengths, K, block=32, bins=256, split=False)
    _check(x, lengths, K, block=32, **MODES["split"])  # 10 programs per row
    _check(x, lengths, K, block=32, **MODES["split_small_rows"])  # and the rows of <= 64 in one


def test_topk_wider_than_the_rows_and_one_chunk_per_row():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 50, generator=g) * 3).round()
    for mode in MODES.values():
        _check(x, [50, 49, 3], 64, **mode)  # K > S: every valid position, then -1
        _check(x, [50, 49, 3], 1, **mode)
        _check(x, [50, 49, 3], 49, **mode)
        _check(x, [50, 49, 3], 49, block=16, **mode)


def test_zero_rows_or_zero_topk():
    keys = T.orderable_keys(torch.randn(3, 20))
    assert T.topk_positions(keys, torch.tensor([20, 5, 0], dtype=torch.int32), 0).shape == (3, 0)
    assert T.topk_positions(keys[:0], torch.zeros(0, dtype=torch.int32), 4).shape == (0, 4)


def test_keys_past_a_rows_length_are_never_read():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200, generator=g)
    keys = T.orderable_keys(x)
    lengths = torch.tensor([120, 90], dtype=torch.int32)
    want = _stable_topk(x, lengths, 30)
    keys[0, 120:] = 0x7FFFFFFF  # near the largest key: would win if read
    keys[1, 90:] = -1  # the largest key (uint32 0xFFFFFFFF)
    for mode in MODES.values():
        assert torch.equal(T.topk_positions(keys, lengths, 30, block=32, **mode), want)


def _accumulators_are_zero() -> bool:
    """The persistent self-cleaning accumulators (key ranges; split rows' counters and histogram, not the
    results Tk / need / flat that the last launch reads) are zero between calls."""
    bufs = [buf[:, :4] if name == "split" else buf for (name, _), buf in T._ZEROED.items()]
    bufs += [buf[:, T._ST_WIDTH:] for (name, _), buf in T._ZEROED.items() if name == "split"]
    return all(int(buf.abs().sum()) == 0 for buf in bufs)


@pytest.mark.parametrize("mode", MODES)
def test_rows_much_shorter_than_the_key_width(mode):
    # CUDA-graph decode: keys as wide as max_model_len, the rows' real lengths far shorter. Programs past n
    # exit, no pass reads a position >= n (garbage there would win), and the cost follows n
    g = torch.Generator().manual_seed(8)
    S, K = 4096, 40
    x = torch.randn(3, S, generator=g)
    x[1] = (x[1] * 2).round()  # ties straddling the K-th
    lengths = torch.tensor([300, 97, 41], dtype=torch.int32)
    want = _stable_topk(x, lengths, K)
    keys = T.orderable_keys(x)
    keys[:, 300:] = -1  # the largest key
    keys[1, 97:] = 0x7FFFFFFF
    keys[2, 41:] = -1
    assert torch.equal(T.topk_positions(keys, lengths, K, block=32, **MODES[mode]), want)
    assert _accumulators_are_zero()


@pytest.mark.parametrize("mode", MODES)
def test_a_producers_row_range_is_used_and_zeroed_again(mode):
    g = torch.Generator().manual_seed(9)
    S, K = 512, 24
    x = (torch.randn(4, S, generator=g) * 3).round()
    lengths = torch.tensor([512, 200, 25, 24], dtype=torch.int32)
    keys = T.orderable_keys(x)
    rng = T.row_range_buffer(4, "cpu")
    assert int(rng.abs().sum()) == 0
    signed = keys ^ torch.iinfo(torch.int32).min  # signed order = the keys' unsigned order
    for r in range(4):  # what accumulate_row_range leaves: ~min and max of the row's first n keys
        n = int(lengths[r])
        rng[r, 0] = ~(signed[r, :n].min() ^ torch.iinfo(torch.int32).min)
        rng[r, 1] = signed[r, :n].max() ^ torch.iinfo(torch.int32).min
    out = torch.empty((4, K), dtype=torch.int32)
    T.select_rows(keys, out, 0, K, lengths=lengths, block=64, row_range=rng, **MODES[mode])
    assert torch.equal(out, _stable_topk(x, lengths, K))
    assert int(rng.abs().sum()) == 0 and _accumulators_are_zero()
    # a range wider than the keys' (the whole uint32 span) still selects exactly: round 1 narrows it
    rng[:, 0] = -1  # ~min = 0xFFFFFFFF: min key 0
    rng[:, 1] = -1  # max key 0xFFFFFFFF
    T.select_rows(keys, out, 0, K, lengths=lengths, block=64, row_range=rng, **MODES[mode])
    assert torch.equal(out, _stable_topk(x, lengths, K))
    assert int(rng.abs().sum()) == 0


def test_repeated_calls_are_identical_and_leave_no_state():
    # the accumulators are persistent (no memset launch): each call must clean up after itself
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 320, generator=g)
    lengths = torch.tensor([320, 233], dtype=torch.int32)
    keys = T.orderable_keys(x)
    want = _stable_topk(x, lengths, 50)
    for mode in MODES.values():
        for _ in range(2):
            assert torch.equal(T.topk_positions(keys, lengths, 50, block=64, **mode), want)
            assert _accumulators_are_zero()


@pytest.mark.parametrize("cand_block", [8, 2])
def test_more_candidates_than_registers_hold(monkeypatch, cand_block):
    # evenly spaced distinct keys, 3 copies each: every round-1 bucket holds far more keys than CAND_BLOCK,
    # so the one-program path compacts once more (then registers, or rescans when still too many) and
    # the split finisher rescans
    monkeypatch.setattr(T, "CAND_BLOCK", cand_block)
    x = (1.0 + torch.arange(600).remainder(200).float() * 2.0**-20).view(2, 300)
    lengths = torch.tensor([300, 257], dtype=torch.int32)
    _check(x, lengths, 37, block=64, bins=32, cand_bins=32, split=False)
    _check(x, lengths, 37, block=64, bins=32, cand_bins=32, **MODES["split"])


def test_random_rows_against_a_stable_sort(monkeypatch):
    monkeypatch.setattr(T, "CAND_BLOCK", 16)  # candidate rounds over several chunks too
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        R, S = 4, int(torch.randint(20, 260, (1,), generator=g))
        K = int(torch.randint(1, S + 20, (1,), generator=g))
        levels = int(torch.randint(1, 50, (1,), generator=g))
        x = torch.randint(-levels, levels + 1, (R, S), generator=g).float() * 0.37
        lengths = torch.randint(0, S + 1, (R,), generator=g)
        _check(x, lengths, K, block=32, split=False)
        _check(x, lengths, K, block=16, **MODES["split"])
        _check(x, lengths, K, block=16, split=True, small_n=128)


def test_bad_keys_or_tuning_are_refused():
    keys = torch.zeros(2, 8, dtype=torch.int32)
    lengths = torch.tensor([8, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="keys must be int32"):
        T.topk_positions(keys.long(), lengths, 4)
    with pytest.raises(ValueError, match="must be powers of two"):
        T.topk_positions(keys, lengths, 4, block=48)
    with pytest.raises(ValueError, match="must be powers of two"):
        T.topk_positions(keys, lengths, 4, bins=16)
    with pytest.raises(ValueError, match="keys must be int32 with a contiguous last dim"):
        T.topk_positions(torch.zeros(8, 2, dtype=torch.int32).T, lengths, 4)
    with pytest.raises(RuntimeError, match="the CUDA top-k kernel cannot serve these keys"):
        T.topk_positions(keys, lengths, 4, split=False, cuda=True)  # CPU keys


# ---------------------------------------------------------------- through the DSA indexer

def _indexer_inputs(q_lens, seq_lens, Hi=3, Di=16, bs=8, seed=5, dtype=torch.float32, plateau=False):
    """Small-integer inputs: every score is exact (bf16 included), so ties are real ties. Weights of both
    signs give negative scores; ``plateau`` makes most keys negative so ReLU zeros dominate."""
    g = torch.Generator().manual_seed(seed)
    nb, bt = _paged(seq_lens, bs, gen=g)
    T_ = sum(q_lens)
    q = torch.randint(-2, 3, (T_, Hi, Di), generator=g).float()
    kc = torch.randint(-2, 3, (nb, bs, Di), generator=g).float()
    if plateau:
        q = q.abs()
        kc = torch.where(torch.rand(nb, bs, 1, generator=g) < 0.85, -kc.abs(), kc)
    w = torch.randint(-2, 3, (T_, Hi), generator=g).float()
    return (q.to(dtype), w, kc.to(dtype), _cu(q_lens), torch.tensor(seq_lens, dtype=torch.int32), bt)


@pytest.fixture(params=["one_program_per_row", "split_rows", "split_small_rows"])
def selection_mode(request, monkeypatch):
    """The indexer with its default selection (small S: one program per row), with every row split into
    programs of 32 positions (as for few long rows on a GPU), and split with rows of <= 64 positions
    selected whole by one program (through the module defaults, as the engine gets them)."""
    if request.param != "one_program_per_row":
        monkeypatch.setattr(T, "SPLIT_MIN_WIDTH", 0)
        monkeypatch.setattr(T, "SPLIT_BLOCK", 32)
        monkeypatch.setattr(T, "SPLIT_SMALL_N", 0 if request.param == "split_rows" else 64)
    else:
        monkeypatch.setattr(T, "BLOCK", 64)  # rows of <= 64 in registers, longer ones in chunks
    return request.param


@pytest.mark.parametrize("dtype,plateau", [(torch.float32, False), (torch.bfloat16, True)])
def test_indexer_mixed_batch_matches_the_reference(dtype, plateau, selection_mode):
    # prefill from scratch crossing K, chunked prefill, decodes below / at / above K
    q_lens, seq_lens, K = [30, 6, 1, 1, 1], [30, 90, 20, 21, 150], 21
    args = _indexer_inputs(q_lens, seq_lens, dtype=dtype, plateau=plateau)
    out, ref = indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K)
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref)


def test_indexer_block_tables_wider_than_the_contexts(selection_mode):
    # CUDA-graph decode pads block tables to max_model_len: S = width * block size >> every row's n
    q, w, kc, cu, sl, bt = _indexer_inputs([1, 1, 2], [60, 23, 45], bs=4)
    wide = torch.zeros((bt.shape[0], 96), dtype=torch.int32)  # 384 positions; pad columns -> block 0
    wide[:, :bt.shape[1]] = bt.clamp(min=0)
    args = (q, w, kc, cu, sl, wide)
    assert torch.equal(indexer_topk(*args, 21), torch_ref_mla.indexer_topk(*args, 21))
    assert _accumulators_are_zero()


def test_indexer_zero_topk_and_bad_tuning_leave_no_state():
    args = _indexer_inputs([2, 1], [30, 12])
    assert indexer_topk(*args, 0).shape == (3, 0)
    with pytest.raises(ValueError, match="must be powers of two"):
        indexer_topk(*args, 8, block=48)
    assert _accumulators_are_zero()
    assert torch.equal(indexer_topk(*args, 8), torch_ref_mla.indexer_topk(*args, 8))


def test_indexer_topk_larger_than_the_block_table(selection_mode):
    args = _indexer_inputs([3, 1], [7, 12], bs=4)  # tables 4 wide: 16 positions < K = 24
    assert torch.equal(indexer_topk(*args, 24), torch_ref_mla.indexer_topk(*args, 24))


# ---------------------------------------------------------------- compiled for a GPU (no GPU needed)

_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from atomtool.serve.ops.triton import indexer as I
from atomtool.serve.ops.triton import topk as T

def build(fn, consts, warps, ptrs=None):
    sig = {a: "constexpr" if a in consts else (ptrs or {}).get(a, "*i32") if a.endswith("_ptr") else "i32"
           for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

rows = dict(ROW_LENS=False, BLOCK_B=1, ALIGNED=True)
build(T._radix_topk_kernel, dict(rows, BLOCK=T.BLOCK, BINS=T.BINS, CBLOCK=T.CAND_BLOCK, CBINS=T.CAND_BINS,
                                 RANGE_GIVEN=True), T.NUM_WARPS)
split = dict(rows, BLOCK=T.SPLIT_BLOCK, BINS=T.SPLIT_BINS)
build(T._split_range_kernel, dict(rows, BLOCK=T.SPLIT_BLOCK), T.SPLIT_NUM_WARPS)
build(T._split_hist_kernel, dict(split, SMALL=T.SPLIT_SMALL_N, CBINS=T.CAND_BINS), T.SPLIT_SMALL_NUM_WARPS)
build(T._split_compact_kernel, dict(split, BLOCK_P=256, CBLOCK=T.CAND_BLOCK, SMALL=T.SPLIT_SMALL_N,
                                    CBINS=T.CAND_BINS), T.SPLIT_NUM_WARPS)
build(T._split_write_kernel, dict(split, SMALL=T.SPLIT_SMALL_N), T.SPLIT_NUM_WARPS)
build(I._indexer_keys_kernel, dict(BLOCK_H=64, BLOCK_D=128, BLOCK_N=64, BLOCK_B=1, DOT_DTYPE=triton.language.bfloat16),
      4, {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*bf16"})
print("compiled")
"""


def test_the_kernels_compile_for_sm90_with_the_module_defaults():
    # the interpreter runs neither the compiler nor ptxas: code paths it accepts can still fail to compile
    # (types across branches, layouts); Triton compiles for a GPU target without a GPU (bundled ptxas)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, cwd=root, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("Triton's bundled ptxas is missing")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-4000:]


# ---------------------------------------------------------------- the benchmark script

def test_topk_bench_smoke_runs_and_both_paths_agree():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.topk_bench", "--smoke", "--dist", "ties", "--width", "700"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "ours us" in lines[1] and "ratio" in lines[1]
    # rows 1 and 3 x one program per row / split rows, keys 700 wide, each equal to the former path's
    assert len(lines) == 6 and all(line.split()[2] == "700" and line.endswith("True") for line in lines[2:])
    assert sum("split=1" in line for line in lines) == 2


def test_topk_bench_candidates_through_the_indexer_print_the_defaults(capsys):
    from benchmarks.topk_bench import main  # in this process: triton is already the interpreter here

    assert main(["--smoke", "--candidates", "--width", "700", "--indexer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "indexer_topk" in lines[0] and "select us" in lines[1]
    # block tables 700 / 64 wide; every variant's selection equals the first's; per row count a
    # scoring-only baseline, then the 4 variants
    assert all(line.split()[2] == "704" and line.endswith("True") for line in lines[2:-1])
    assert sum("(scoring only)" in line for line in lines) == 2
    assert len(lines) == 2 + 2 * 5 + 1 and lines[-1].startswith("set in atomtool/serve/ops/triton/topk.py: ")
    for name in ("BLOCK", "BINS", "NUM_WARPS", "SPLIT_BLOCK", "SPLIT_SMALL_N", "CAND_BINS", "SPLIT_MAX_ROWS"):
        assert f" {name} = " in lines[-1]


def test_topk_bench_recommends_per_mode_tunings_and_the_split_row_limit():
    from benchmarks.topk_bench import recommend

    one_a = {"split": False, "block": 2048, "bins": 256, "num_warps": 8, "cand_bins": 64}
    one_b = {"split": False, "block": 4096, "bins": 256, "num_warps": 16, "cand_bins": 64}
    sp_a = {"split": True, "block": 1024, "bins": 256, "num_warps": 4, "small_n": 4096, "cand_bins": 128,
            "small_warps": 16}
    sp_b = {"split": True, "block": 512, "bins": 128, "num_warps": 4, "small_n": 0, "cand_bins": 64,
            "small_warps": 8}
    times = {  # (T, ctx) -> us of one_a, one_b, sp_a, sp_b: split wins at T = 1 and 8, one program at 64
        (1, 4096): (9, 8, 6, 7), (1, 32768): (60, 50, 14, 12),
        (8, 4096): (12, 11, 10, 12), (8, 32768): (70, 60, 30, 29),
        (64, 4096): (20, 19, 40, 45), (64, 32768): (130, 120, 200, 190)}
    results = [{"T": T, "S": n, "variant": str(v), "tuning": v, "ours_graph_us": t}
               for (T, n), ts in times.items() for v, t in zip((one_a, one_b, sp_a, sp_b), ts, strict=True)]
    rec = recommend(results)
    assert rec == {"BLOCK": 4096, "BINS": 256, "NUM_WARPS": 16, "SPLIT_BLOCK": 1024, "SPLIT_BINS": 256,
                   "SPLIT_NUM_WARPS": 4, "SPLIT_SMALL_N": 4096, "SPLIT_SMALL_NUM_WARPS": 16, "CAND_BINS": 128,
                   "SPLIT_MAX_ROWS": 64}
    only_one = [r for r in results if not r["tuning"]["split"]]
    assert recommend(only_one) == {"BLOCK": 4096, "BINS": 256, "NUM_WARPS": 16, "CAND_BINS": 64}
    split_always = [dict(r, ours_graph_us=1.0) if r["tuning"] is sp_a else r for r in results]
    assert recommend(split_always)["SPLIT_MAX_ROWS"] == 128


def test_topk_bench_refuses_rows_not_longer_than_topk():
    from benchmarks.topk_bench import main

    with pytest.raises(SystemExit, match="every --ctx must exceed --topk 2048"):
        main(["--ctx", "2048", "--rows", "1"])


def test_topk_bench_sweep_grid_and_variants():
    from benchmarks.topk_bench import make_variants, parse_args

    grid = make_variants(parse_args(["--sweep"]))
    assert len(grid) == 2 * 3 * 3 * 3
    assert {v["split"] for v in grid.values()} == {False, True}
    pinned = make_variants(parse_args(["--sweep", "--bins", "64", "--num-warps", "8"]))
    assert len(pinned) == 2 * 3 and {(v["bins"], v["num_warps"]) for v in pinned.values()} == {(64, 8)}
    assert make_variants(parse_args(["--split", "auto", "--block", "1024"])) == {
        "split=auto": {"split": None, "block": 1024}}

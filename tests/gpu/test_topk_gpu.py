"""The Triton radix top-k selection (DSA indexer, issue 7), compiled on a CUDA GPU, at realistic sizes.

Exactness, not tolerance: the selection works on integer keys, so it must equal a stable descending sort
(ties to the lowest position) bit for bit, for decode rows (T = 1, 8, 64 at n = 4096 and 32768, K = 2048) in
every mode (one program per row; split rows; split rows with short rows selected whole by one program),
for score distributions with heavy ties (16 levels, 90% exact zeros), for keys as wide as a padded
CUDA-graph block table (163,840 positions, the DeepSeek-V3.2 max length) with rows far shorter (the bytes
past n hold the largest key, so any read there shows), and through ``indexer_topk`` on integer-valued bf16
inputs (every score exact) against ``torch_ref_mla.indexer_topk``, decode (block tables padded to the max
length too) and a 4096-row prefill over 8192 positions. The selection and the whole indexer replay from CUDA
graphs with new lengths (short and long rows alternating), and the persistent accumulators (key ranges,
split counters) are zero between calls. Timing (no assertion, recorded in the GPU report as ``topk_us``):
ours vs the former torch.topk + sort at T = 1, n = 4096 / 32768, keys 163,840 wide, graph-replayed.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops import torch_ref_mla
from tests.kernel_inputs import cu_seqlens, random_block_tables

DEV = "cuda"
K = 2048
WIDE = 163840  # DeepSeek-V3.2 max_position_embeddings: CUDA-graph block tables are this wide
MODES = {"one_program": {"split": False}, "split": {"split": True, "small_n": 0},
         "split_small_rows": {"split": True, "small_n": 4096}, "auto": {}}


@pytest.fixture(scope="module")
def T():
    from atomtool.serve.ops.triton import topk

    return topk


def _stable_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    for t in range(scores.shape[0]):
        n = int(lengths[t])
        pick = torch.sort(scores[t, :n], descending=True, stable=True).indices[:k]
        out[t, :pick.numel()] = torch.sort(pick).values.int()
    return out


def _scores(rows: int, S: int, dist: str, seed: int) -> torch.Tensor:
    from benchmarks.topk_bench import make_scores

    return make_scores(rows, S, dist, DEV, seed=seed)


def _wide_keys(T, scores: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Keys ``width`` wide; every position at or past a row's length holds the largest key (-1)."""
    keys = torch.full((scores.shape[0], width), -1, dtype=torch.int32, device=DEV)
    keys[:, :scores.shape[1]] = T.orderable_keys(scores)
    pos = torch.arange(width, device=DEV)
    return torch.where(pos[None, :] < lengths[:, None], keys, -1)


def _accumulators_are_zero(T) -> bool:
    bufs = [buf[:, :4] if name == "split" else buf for (name, _), buf in T._ZEROED.items()]
    bufs += [buf[:, T._ST_WIDTH:] for (name, _), buf in T._ZEROED.items() if name == "split"]
    return all(int(buf.abs().sum()) == 0 for buf in bufs)


def _lengths(rows: int, S: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows)
    lengths = torch.full((rows,), S, dtype=torch.int32)
    if rows > 1:  # a mixed batch: some shorter rows, one at K, one below K
        lengths[1:] = torch.randint(K + 1, S + 1, (rows - 1,), generator=g, dtype=torch.int32)
        lengths[-1] = K
    if rows > 2:
        lengths[-2] = 100
    return lengths.to(DEV)


@pytest.mark.parametrize("mode", ["one_program", "split", "split_small_rows"])
@pytest.mark.parametrize("S", [4096, 32768])
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("dist", ["relu", "ties", "zeros"])
def test_selection_equals_a_stable_sort_at_decode_sizes(T, rows, S, dist, mode):
    scores = _scores(rows, S, dist, seed=rows + S)
    lengths = _lengths(rows, S)
    out = T.topk_positions(T.orderable_keys(scores), lengths, K, **MODES[mode])
    assert torch.equal(out, _stable_topk(scores, lengths, K))
    assert _accumulators_are_zero(T)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", [2100, 4096, 5000, 32768])
@pytest.mark.parametrize("rows", [1, 8])
def test_rows_far_shorter_than_a_max_length_key_width(T, rows, n, mode):
    # the engine's decode: keys 163,840 wide (block tables padded to max_model_len), rows of n valid keys
    scores = _scores(rows, n, "relu", seed=n + rows)
    lengths = torch.full((rows,), n, dtype=torch.int32, device=DEV)
    if rows > 1:
        lengths[1] = n // 2 + 1
        lengths[-1] = 77
    keys = _wide_keys(T, scores, lengths, WIDE)
    out = T.topk_positions(keys, lengths, K, **MODES[mode])
    assert torch.equal(out, _stable_topk(scores, lengths, K))
    assert _accumulators_are_zero(T)


# ------------------------------------------------------------------------------ through the indexer

def _indexer_inputs(q_lens, seq_lens, Hi=64, Di=128, bs=64, seed=7, width=0):
    g = torch.Generator().manual_seed(seed)
    nb, bt = random_block_tables(seq_lens, bs, 3, g)
    if width:  # padded as CUDA-graph decode pads: max_model_len / block_size columns, pad block 0
        wide = torch.zeros((bt.shape[0], width // bs), dtype=torch.int32)
        wide[:, :bt.shape[1]] = bt.clamp(min=0)
        bt = wide
    n = sum(q_lens)
    q = torch.randint(-2, 3, (n, Hi, Di), generator=g).float()
    kc = torch.randint(-2, 3, (nb, bs, Di), generator=g).float()
    w = torch.randint(-2, 3, (n, Hi), generator=g).float()
    return (q.to(DEV, torch.bfloat16), w.to(DEV), kc.to(DEV, torch.bfloat16), cu_seqlens(q_lens, device=DEV),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV), bt.to(DEV))


@pytest.mark.parametrize("S", [4096, 32768])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_indexer_decode_exact(T, rows, S):
    from atomtool.serve.ops.triton import indexer_topk

    seq_lens = [S - 37 * i for i in range(rows)]
    if rows > 1:
        seq_lens[-1] = 1000  # a short sequence in the batch: fewer valid keys than K
    args = _indexer_inputs([1] * rows, seq_lens)
    assert torch.equal(indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K))
    assert _accumulators_are_zero(T)


@pytest.mark.parametrize("rows", [1, 8])
def test_indexer_decode_with_max_length_block_tables_exact(T, rows):
    from atomtool.serve.ops.triton import indexer_topk

    seq_lens = [4096, 30000, 2049, 9000, 1000, 4097, 16384, 5][:rows]
    args = _indexer_inputs([1] * rows, seq_lens, width=WIDE)
    for mode in MODES.values():
        assert torch.equal(indexer_topk(*args, K, **mode), torch_ref_mla.indexer_topk(*args, K))
        assert _accumulators_are_zero(T)


def test_indexer_prefill_4096_rows_over_8192_positions_exact(T):
    from atomtool.serve.ops.triton import indexer_topk

    args = _indexer_inputs([4096], [8192], Hi=16)  # the selection does not depend on Hi
    assert torch.equal(indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K))
    assert _accumulators_are_zero(T)


# ------------------------------------------------------------------------------ CUDA graphs

@pytest.mark.parametrize("mode", list(MODES))
def test_selection_replays_from_a_cuda_graph_with_new_lengths(T, mode):
    width = 40960
    lengths = torch.tensor([8192, 5000, 2049, 17], dtype=torch.int32, device=DEV)
    keys = _wide_keys(T, _scores(4, width, "relu", seed=1), lengths, width)
    tuning = MODES[mode]
    T.topk_positions(keys, lengths, K, **tuning)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.topk_positions(keys, lengths, K, **tuning)
    for i, new in enumerate(([3000, 40960, 2048, 6000], [40000, 4096, 2500, 33000], [3000, 40960, 2048, 6000])):
        scores = _scores(4, width, ("ties", "relu", "zeros")[i], seed=2 + i)
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        keys.copy_(_wide_keys(T, scores, lengths, width))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _stable_topk(scores, lengths, K))
        assert torch.equal(out, T.topk_positions(keys, lengths, K, **tuning))  # eager between replays
        assert _accumulators_are_zero(T)


def test_indexer_replays_from_a_cuda_graph_with_new_lengths(T):
    # the engine's decode graph: captured with every sequence at the max length, replayed with real ones
    from atomtool.serve.ops.triton import indexer_topk

    args = _indexer_inputs([1, 1], [40000, 40000], width=WIDE)
    q, w, kc, cu, seq_lens, bt = args
    indexer_topk(*args, K)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk(*args, K)
    for new in ([4096, 30000], [2049, 3000], [40000, 1000], [4096, 30000]):
        seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch_ref_mla.indexer_topk(*args, K))
        assert _accumulators_are_zero(T)


# ------------------------------------------------------------------------------ timing (recorded only)

def test_record_selection_time_vs_torch_topk(gpu_report):
    from benchmarks.topk_bench import bench, print_table

    variants = {"one program per row": {"split": False}, "split rows": {"split": True},
                "auto": {"split": None}}
    results = bench([1], [4096, 32768], K, 50, "relu", torch.device(DEV), True, variants, width=WIDE)
    print_table(results)
    gpu_report["topk_us"] = [{k: v for k, v in r.items() if k != "tuning"} for r in results]
    assert all(r["equal"] for r in results)


# ------------------------------------------------------------------------------ the CUDA one-CTA kernel

def _cuda_topk_or_skip():
    from atomtool.serve.ops.cuda.build import nvcc_path

    if nvcc_path() is None:
        pytest.skip("no nvcc: the CUDA top-k kernel cannot be built here")


@pytest.mark.parametrize("dist", ["relu", "ties", "zeros"])
@pytest.mark.parametrize("S", [2049, 4096, 4099, 6000, 8192])
@pytest.mark.parametrize("rows", [1, 8, 130])
def test_cuda_selection_equals_triton_and_a_stable_sort(T, rows, S, dist):
    # S 4099 / 6000: rows not 16-byte aligned (the kernel's scalar loads) and widths between powers of two
    _cuda_topk_or_skip()
    scores = _scores(rows, S, dist, seed=3 * rows + S)
    lengths = _lengths(rows, S)
    keys = T.orderable_keys(scores)
    want = _stable_topk(scores, lengths, K)
    assert torch.equal(T.topk_positions(keys, lengths, K, split=False, cuda=True), want)
    assert torch.equal(T.topk_positions(keys, lengths, K, split=False, cuda=False), want)
    assert _accumulators_are_zero(T)


def test_cuda_selection_of_a_row_view_with_a_wide_stride(T):
    # keys as a column slice of a wider buffer (row stride 8200, rows start unaligned) and a small K
    _cuda_topk_or_skip()
    scores = _scores(3, 8200, "relu", seed=11)
    keys = T.orderable_keys(scores)[:, 3:3 + 5000]
    lengths = torch.tensor([5000, 4000, 33], dtype=torch.int32, device=DEV)
    out = T.topk_positions(keys, lengths, 100, split=False, cuda=True)
    assert torch.equal(out, _stable_topk(scores[:, 3:3 + 5000], lengths, 100))


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_indexer_decode_exact_with_the_cuda_and_triton_selection(T, rows):
    # the engine's path: the scoring kernel supplies each row's key range, lengths from cu_seqlens / seq_lens
    _cuda_topk_or_skip()
    from atomtool.serve.ops.triton import indexer_topk

    seq_lens = [4096 - 29 * i for i in range(rows)]
    if rows > 1:
        seq_lens[-1] = 1000
    args = _indexer_inputs([1] * rows, seq_lens)
    want = torch_ref_mla.indexer_topk(*args, K)
    for cuda in (True, False):
        assert torch.equal(indexer_topk(*args, K, split=False, cuda=cuda), want)
        assert _accumulators_are_zero(T)


def test_indexer_prefill_over_8192_positions_exact_with_the_cuda_selection(T):
    _cuda_topk_or_skip()
    from atomtool.serve.ops.triton import indexer_topk

    args = _indexer_inputs([3000, 1200], [8000, 5000], Hi=16)  # block tables 126 columns: 8064 keys
    assert torch.equal(indexer_topk(*args, K, cuda=True), torch_ref_mla.indexer_topk(*args, K))
    assert _accumulators_are_zero(T)


def test_cuda_selection_replays_from_a_cuda_graph_with_new_lengths(T):
    _cuda_topk_or_skip()
    width = 8192
    lengths = torch.tensor([8192, 5000, 2049, 17], dtype=torch.int32, device=DEV)
    keys = _wide_keys(T, _scores(4, width, "relu", seed=1), lengths, width)
    T.topk_positions(keys, lengths, K, split=False, cuda=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.topk_positions(keys, lengths, K, split=False, cuda=True)
    for i, new in enumerate(([3000, 8192, 2048, 6000], [8000, 4096, 2500, 7000])):
        scores = _scores(4, width, ("ties", "zeros")[i], seed=2 + i)
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        keys.copy_(_wide_keys(T, scores, lengths, width))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _stable_topk(scores, lengths, K))

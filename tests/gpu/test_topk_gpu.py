"""The Triton radix top-k selection (DSA indexer, issue 7), compiled on a CUDA GPU, at realistic sizes.

Exactness, not tolerance: the selection works on integer keys, so it must equal a stable descending sort
(ties to the lowest position) bit for bit, for decode rows (T = 1, 8, 64 at S = 4096 and 32768, K = 2048; one program per row and split rows),
for score distributions with heavy ties (16 levels, 90% exact zeros), and through ``indexer_topk`` on
integer-valued bf16 inputs (every score exact) against ``torch_ref_mla.indexer_topk``, decode and a
4096-row prefill over 8192 positions. The selection replays from a CUDA graph with new lengths.
Timing (no assertion, recorded in the GPU report as ``topk_us``): ours vs the former torch.topk + sort at
T = 1, S = 4096 / 32768, eager and graph-replayed.
"""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.ops import torch_ref_mla
from tests.kernel_inputs import cu_seqlens, random_block_tables

DEV = "cuda"
K = 2048


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


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("S", [4096, 32768])
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("dist", ["relu", "ties", "zeros"])
def test_selection_equals_a_stable_sort_at_decode_sizes(T, rows, S, dist, split):
    scores = _scores(rows, S, dist, seed=rows + S)
    g = torch.Generator().manual_seed(rows)
    lengths = torch.full((rows,), S, dtype=torch.int32)
    if rows > 1:  # a mixed batch: some shorter rows, one at K, one below K
        lengths[1:] = torch.randint(K + 1, S + 1, (rows - 1,), generator=g, dtype=torch.int32)
        lengths[-1] = K
    if rows > 2:
        lengths[-2] = 100
    lengths = lengths.to(DEV)
    out = T.topk_positions(T.orderable_keys(scores), lengths, K, split=split)
    assert torch.equal(out, _stable_topk(scores, lengths, K))


# ------------------------------------------------------------------------------ through the indexer

def _indexer_inputs(q_lens, seq_lens, Hi=64, Di=128, bs=64, seed=7):
    g = torch.Generator().manual_seed(seed)
    nb, bt = random_block_tables(seq_lens, bs, 3, g)
    n = sum(q_lens)
    q = torch.randint(-2, 3, (n, Hi, Di), generator=g).float()
    kc = torch.randint(-2, 3, (nb, bs, Di), generator=g).float()
    w = torch.randint(-2, 3, (n, Hi), generator=g).float()
    return (q.to(DEV, torch.bfloat16), w.to(DEV), kc.to(DEV, torch.bfloat16), cu_seqlens(q_lens, device=DEV),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV), bt.to(DEV))


@pytest.mark.parametrize("S", [4096, 32768])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_indexer_decode_exact(rows, S):
    from atomtool.serve.ops.triton import indexer_topk

    seq_lens = [S - 37 * i for i in range(rows)]
    if rows > 1:
        seq_lens[-1] = 1000  # a short sequence in the batch: fewer valid keys than K
    args = _indexer_inputs([1] * rows, seq_lens)
    assert torch.equal(indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K))


def test_indexer_prefill_4096_rows_over_8192_positions_exact():
    from atomtool.serve.ops.triton import indexer_topk

    args = _indexer_inputs([4096], [8192], Hi=16)  # the selection does not depend on Hi
    assert torch.equal(indexer_topk(*args, K), torch_ref_mla.indexer_topk(*args, K))


@pytest.mark.parametrize("split", [False, True])
def test_selection_replays_from_a_cuda_graph_with_new_lengths(T, split):
    scores = _scores(4, 8192, "relu", seed=1)
    keys = T.orderable_keys(scores)
    lengths = torch.tensor([8192, 5000, 2049, 17], dtype=torch.int32, device=DEV)
    T.topk_positions(keys, lengths, K, split=split)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.topk_positions(keys, lengths, K, split=split)
    keys.copy_(T.orderable_keys(_scores(4, 8192, "ties", seed=2)))
    lengths.copy_(torch.tensor([3000, 8192, 2048, 6000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = _stable_topk(_scores(4, 8192, "ties", seed=2), lengths, K)
    assert torch.equal(out, want)
    assert torch.equal(out, T.topk_positions(keys, lengths, K, split=split))


# ------------------------------------------------------------------------------ timing (recorded only)

def test_record_selection_time_vs_torch_topk(gpu_report):
    from benchmarks.topk_bench import bench, print_table

    variants = {"one program per row": {"split": False}, "split rows": {"split": True},
                "auto": {"split": None}}
    results = bench([1], [4096, 32768], K, 50, "relu", torch.device(DEV), True, variants)
    print_table(results)
    gpu_report["topk_us"] = results
    assert all(r["equal"] for r in results)

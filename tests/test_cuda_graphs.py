"""CPU-side checks of the decode CUDA-graph runner (capture and replay are tested on a GPU, tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.engine.cuda_graphs import DecodeCudaGraphs, capture_sizes, maybe_capture_decode_graphs


def test_capture_sizes_are_cut_at_max_num_seqs_and_include_it():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64, sizes=(48, 2, 999)) == [2, 48, 64]


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="need a CUDA device, got cpu"):
        DecodeCudaGraphs(lambda b: b, "cpu", max_num_seqs=4, max_model_len=64, block_size=16)


def test_no_graphs_when_eager_or_off_cuda():
    def model(*_):
        raise AssertionError("nothing may run")

    kw = dict(max_num_seqs=4, max_model_len=64, block_size=16)
    assert maybe_capture_decode_graphs(model, [], torch.device("cpu"), enforce_eager=False, **kw) is None
    assert maybe_capture_decode_graphs(model, [], "cuda", enforce_eager=True, **kw) is None

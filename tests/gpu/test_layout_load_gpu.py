"""The layout fast path onto a CUDA GPU (pinned staging buffers, side-stream non_blocking copies, several
reader threads) against the generic path (safe_open -> load_weights) onto the same GPU, bit for bit."""

from __future__ import annotations

import pytest
import torch

from atomtool.serve.layout_load import load_layout_weights
from tests.test_layout_load import _build, _bytes_equal, _old, dense, mla_fp8  # noqa: F401 (fixtures)


@pytest.mark.parametrize("kw", [{}, dict(chunk_bytes=1000, workers=3)], ids=["default", "small-chunks-3-threads"])
def test_dense_fast_path_on_cuda_is_bitwise_identical(dense, kw):  # noqa: F811
    new = _build(dense, torch.bfloat16, "cuda")
    stats = load_layout_weights(new, dense, **kw)
    assert stats["fallback"] == 0
    _bytes_equal(new, _old(dense, torch.bfloat16, "cuda"))


@pytest.mark.parametrize("kw", [{}, dict(chunk_bytes=3000, workers=2)], ids=["default", "small-chunks"])
def test_mla_fp8_fast_path_on_cuda_is_bitwise_identical(mla_fp8, kw):  # noqa: F811
    new = _build(mla_fp8, torch.bfloat16, "cuda")
    load_layout_weights(new, mla_fp8, **kw)
    _bytes_equal(new, _old(mla_fp8, torch.bfloat16, "cuda"))

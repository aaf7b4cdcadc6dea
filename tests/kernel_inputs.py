"""Inputs and the comparison shared by the kernel tests (tests/test_triton_ops.py under Triton's CPU
interpreter, tests/gpu/test_kernels_gpu.py compiled on a GPU): random paged block tables, cu_seqlens_q.

Imports torch only (test_triton_ops must set TRITON_INTERPRET before anything imports triton).
"""

from __future__ import annotations

import torch


def random_block_tables(seq_lens: list[int], bs: int, extra_blocks: int = 3,
                        gen: torch.Generator | None = None) -> tuple[int, torch.Tensor]:
    """Random block tables: each sequence gets distinct, shuffled physical blocks; -1 padded rows.

    Every row has one more column than the longest sequence needs; the pool has ``extra_blocks`` unused
    blocks besides. Returns (number of blocks in the pool, block_tables [B, M] int32 on the CPU)."""
    B = len(seq_lens)
    mb = max(-(-s // bs) for s in seq_lens) + 1
    nb = B * mb + extra_blocks
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((B, mb), -1, dtype=torch.int32)
    i = 0
    for b, s in enumerate(seq_lens):
        n = -(-s // bs)
        bt[b, :n] = perm[i:i + n].int()
        i += n
    return nb, bt


def cu_seqlens(q_lens: list[int], device=None) -> torch.Tensor:
    """cu_seqlens_q [B+1] int32 of per-sequence query lengths: ``[0, q0, q0 + q1, ...]``."""
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def assert_close_as(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """``out`` has ``ref``'s shape and dtype, and ``|out - ref| <= atol + rtol |ref|`` compared in float32."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)

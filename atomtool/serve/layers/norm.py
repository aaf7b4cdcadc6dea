"""RMSNorm layer (HF ``LlamaRMSNorm``), optionally fusing the residual add, through the ``rms_norm`` op."""

from __future__ import annotations

import torch
from torch import nn

from atomtool.serve.ops import (
    get_op,
    torch_ref_mla,  # noqa: F401  (registers add_rms_norm)
)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``weight``: [hidden] in the model dtype.

    ``forward(x)`` -> normed x; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``;
    ``forward(x, residual, extra)`` -> the same with ``x + extra`` (rounded) in place of x, in one op
    (``add_rms_norm``: a MoE block's routed and shared outputs added inside the next norm; x may then be the
    routed experts' float32 per-slot planes [S, T, H], summed in that op). With a residual, x with one dim
    more than the residual is float32 planes (a split-K projection's, ``Linear(..., sum_splits=False)``),
    summed by ``add_rms_norm`` without an extra.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._op = get_op("rms_norm", device)
        self._add_op = get_op("add_rms_norm", device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, extra: torch.Tensor | None = None):
        planes = residual is not None and x.dim() == residual.dim() + 1  # float32 planes summed by the op
        if extra is not None or planes:
            if residual is None:
                raise ValueError("RMSNorm: extra needs a residual")
            return self._add_op(x, extra, self.weight, self.eps, residual)
        return self._op(x, self.weight, self.eps, residual)

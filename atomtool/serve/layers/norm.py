"""RMSNorm layer (HF ``LlamaRMSNorm``), optionally fusing the residual add, through the ``rms_norm`` op."""

from __future__ import annotations

import torch
from torch import nn

from atomtool.serve.ops import get_op


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``weight``: [hidden] in the model dtype.

    ``forward(x)`` -> normed x; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self._op = get_op("rms_norm", device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self._op(x, self.weight, self.eps, residual)

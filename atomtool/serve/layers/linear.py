"""Linear layers: plain float weights or FP8 block-quantized weights (DeepSeek-V3 style), one op call each.

Parameter names follow the layout: ``<prefix>.weight`` [N, K] (float, or float8_e4m3fn), ``<prefix>.bias`` [N],
``<prefix>.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] float32 for FP8 block weights. Which one a module is
comes from the layout's tensor specs (the storage scheme decided by inspect), never from guessing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.serve.ops import get_op


class Linear(nn.Module):
    """``y = x W^T + b`` through the ``linear`` op.

    x: [T, in_features] in the activation dtype -> [T, out_features] same dtype (or, asked for, float32
    split-K planes, :meth:`forward`). ``fp8_block``: weight is
    float8_e4m3fn [out, in] with ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)] float32, dequantized by the
    op (``W = fp8 * scale_inv[i // bn, j // bk]``), or run W8A8 when ``act_quant`` is set
    (:mod:`.fp8_activations`; None: weight-only).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block_size = fp8_block
        wdtype = torch.float8_e4m3fn if fp8_block else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=wdtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        if fp8_block:
            bn, bk = fp8_block
            shape = (-(-out_features // bn), -(-in_features // bk))
            self.weight_scale_inv = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device),
                                                 requires_grad=False)
        else:
            self.weight_scale_inv = None
        self.act_quant: str | None = None
        self._op = get_op("linear", device)

    def forward(self, x: torch.Tensor, sum_splits: bool = True) -> torch.Tensor:
        """``sum_splits=False``: an FP8 layer may return float32 split-K planes [S, T, out] for the next norm to
        sum (``RMSNorm(planes, residual)``; the ``linear`` op's contract)."""
        if self.block_size is None:
            return self._op(x, self.weight, self.bias)
        return self._op(x, self.weight, self.bias, self.weight_scale_inv, self.block_size, self.act_quant,
                        sum_splits)


def fp8_block_size(config_flat: dict[str, Any]) -> tuple[int, int]:
    """The FP8 block (rows, cols) from ``quantization_config.weight_block_size`` (default 128x128)."""
    qc = config_flat.get("quantization_config") or {}
    bs = qc.get("weight_block_size") or [128, 128]
    return int(bs[0]), int(bs[1])


def make_linear(prefix: str, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                device: torch.device | str, specs: dict[str, OutputTensor] | None,
                config_flat: dict[str, Any]) -> Linear:
    """Build the :class:`Linear` for layout module ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``).

    ``in_features`` / ``out_features`` are the sizes the config implies; they size the weight. With specs:
    FP8 block iff the layout has ``<prefix>.weight_scale_inv``, bias iff it has ``<prefix>.bias``, and the
    converter's FP8 alignment padding rows (``parts[i].pad_rows``) are added to ``out_features``. The spec's
    own shape is never used to size the weight: a spec built from a wrong-shaped source tensor must meet a
    config-sized parameter so ``load_weights`` names the mismatch. Without specs: the given sizes, float.
    """
    fp8 = None
    if specs is not None:
        w = specs.get(f"{prefix}.weight")
        if w is not None and len(w.shape) == 2:
            out_features += sum(p.pad_rows for p in w.parts)
        if f"{prefix}.weight_scale_inv" in specs:
            fp8 = fp8_block_size(config_flat)
        bias = f"{prefix}.bias" in specs
    return Linear(in_features, out_features, bias=bias, dtype=dtype, device=device, fp8_block=fp8)


def fused_row_ranges(prefix: str, specs: dict[str, OutputTensor] | None,
                     default_sizes: list[int]) -> list[tuple[int, int]]:
    """Row ranges of the parts of a fused linear (``qkv_proj`` -> q, k, v), as recorded by convert.

    Uses ``specs[prefix.weight].parts[i].rows`` (which exclude FP8 padding rows); falls back to consecutive
    ``default_sizes`` when there are no specs for the module.
    """
    spec = specs.get(f"{prefix}.weight") if specs is not None else None
    if spec is not None and spec.parts and all(p.rows is not None for p in spec.parts):
        return [tuple(p.rows) for p in spec.parts]
    ranges, start = [], 0
    for size in default_sizes:
        ranges.append((start, start + size))
        start += size
    return ranges

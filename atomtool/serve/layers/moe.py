"""DeepSeek-V3 style MLP blocks: a dense SwiGLU MLP and the MoE block (``noaux_tc`` router, stacked routed
experts, shared experts). Parameter names are the atomtool layout's (``gate_up_proj``, ``experts.w13``,
``experts.w2``, ``gate.weight``, ``gate.e_score_correction_bias``).

Follows HF transformers ``DeepseekV3MLP`` / ``DeepseekV3MoE`` / ``DeepseekV3TopkRouter`` (DeepSeek-V3
technical report §2.1.2): ``y = Σ_routed w_e · Expert_e(x) + SharedExperts(x)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.serve.layers.linear import fp8_block_size, fused_row_ranges, make_linear
from atomtool.serve.layers.overlap import fork
from atomtool.serve.ops import (
    get_op,
    torch_ref,
    torch_ref_mla,  # noqa: F401  (registers the MLA/MoE reference ops)
)

#: activation/weight dtypes whose router logits a backend kernel may compute (exact products in float32)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with the fused ``gate_up_proj`` ([2I, H], gate rows then
    up rows; FP8 block or float per the layout specs) and ``down_proj`` ([H, I]). x: [T, H] -> [T, H]."""

    def __init__(self, cfg: dict, prefix: str, specs: dict[str, OutputTensor] | None, intermediate_size: int,
                 dtype: torch.dtype, device):
        super().__init__()
        hidden = cfg["hidden_size"]
        gate_up = f"{prefix}.gate_up_proj"
        self.gate_up_proj = make_linear(gate_up, hidden, 2 * intermediate_size, bias=False, dtype=dtype,
                                        device=device, specs=specs, config_flat=cfg)
        (gs, ge), (us, ue) = fused_row_ranges(gate_up, specs, [intermediate_size, intermediate_size])
        self._gate, self._up = slice(gs, ge), slice(us, ue)
        self._contiguous = gs == 0 and ge == us and ue == self.gate_up_proj.out_features
        self.down_proj = make_linear(f"{prefix}.down_proj", intermediate_size, hidden, bias=False, dtype=dtype,
                                     device=device, specs=specs, config_flat=cfg)

    def forward(self, x: torch.Tensor, sum_splits: bool = True) -> torch.Tensor:
        """x: [T, H] -> [T, H]; ``sum_splits=False``: possibly the down projection's float32 split-K planes
        [S, T, H], for the next norm to sum (:meth:`atomtool.serve.layers.linear.Linear.forward`)."""
        h = self.gate_up_proj(x)
        if not self._contiguous:  # FP8 alignment padding between gate and up rows
            h = torch.cat((h[:, self._gate], h[:, self._up]), dim=-1)
        return self.down_proj(get_op("silu_and_mul", x.device)(h), sum_splits)


class TopkRouter(nn.Module):
    """The MoE gate: ``weight`` [E, H] (kept in the model dtype, computed in float32 as HF does) and the
    float32 ``e_score_correction_bias`` [E] (aux-loss-free balancing bias; only affects the choice).

    Logits ``x @ weight^T`` [T, E] float32. With bf16/fp16 x and weight and a backend that implements the
    ``router_logits`` op (Triton on CUDA), one kernel reads both in their own dtype and sums the exact
    products in float32 (issue 7: replaces a cast of x and a float32 GEMV over a float32 weight copy). Else
    (float32 models, the CPU, the torch backend) ``F.linear`` in float32 as HF, over a float32 copy of the
    weight that :meth:`post_load` keeps for that path only (so a step does not re-cast the [E, H] matrix);
    without it (weights changed and ``post_load`` not called yet, or the backend switched to torch after it)
    the weight is cast per call, as HF does.
    """

    def __init__(self, hidden_size: int, num_experts: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)
        self._w32: torch.Tensor | None = None

    def _kernel(self, device) -> Callable | None:
        """The backend's ``router_logits`` for this bf16/fp16 weight on ``device``; None where only the torch
        reference would run (float weights of other dtypes, CPU, torch backend)."""
        if self.weight.dtype not in _KERNEL_DTYPES:
            return None
        op = get_op("router_logits", device)
        return None if op is torch_ref.router_logits else op

    def post_load(self) -> None:
        """Cache ``weight.float()`` where the float32 path will use it (after every weight load; the model's
        ``post_load`` calls it); drop it where a backend kernel reads the weight as it is."""
        keep = self.weight.dtype != torch.float32 and self._kernel(self.weight.device) is None
        self._w32 = self.weight.detach().float() if keep else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] float32 of x [T, H]."""
        if x.dtype in _KERNEL_DTYPES:
            op = self._kernel(x.device)
            if op is not None:
                return op(x, self.weight)
        return F.linear(x.float(), self._w32 if self._w32 is not None else self.weight.float())


class StackedExperts(nn.Module):
    """Routed experts stacked per layer: ``w13`` [E, 2I, H] (gate ‖ up), ``w2`` [E, H, I].

    ``fp8_block`` (bn, bk): the weights stay float8_e4m3fn with ``weight_scale_inv`` [E, ceil(N/bn), ceil(K/bk)]
    (the ``fused_moe`` op dequantizes, or runs W8A8 when ``act_quant`` is set: :mod:`.fp8_activations`).
    Otherwise float; FP8 checkpoints whose gate/up parts needed alignment
    padding are dequantized (and un-padded) by the model's loader instead.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.block_size = fp8_block
        self.act_quant: str | None = None
        wdtype = torch.float8_e4m3fn if fp8_block else dtype
        self.w13 = nn.Module()
        self.w2 = nn.Module()
        for mod, (n, k) in ((self.w13, (2 * intermediate_size, hidden_size)),
                            (self.w2, (hidden_size, intermediate_size))):
            mod.weight = nn.Parameter(torch.empty(num_experts, n, k, dtype=wdtype, device=device),
                                      requires_grad=False)
            if fp8_block:
                bn, bk = fp8_block
                mod.weight_scale_inv = nn.Parameter(
                    torch.ones(num_experts, -(-n // bn), -(-k // bk), dtype=torch.float32, device=device),
                    requires_grad=False)

    def scales(self) -> dict:
        """Keyword arguments of ``fused_moe`` for FP8 experts (empty for float experts)."""
        if self.block_size is None:
            return {}
        return {"w13_scale_inv": self.w13.weight_scale_inv, "w2_scale_inv": self.w2.weight_scale_inv,
                "block_size": self.block_size, "act_quant": self.act_quant}


def experts_fp8_block(prefix: str, specs: dict[str, OutputTensor] | None, cfg: dict) -> tuple[int, int] | None:
    """The FP8 block of a layer's stacked experts when the layout stores them FP8 without alignment padding
    (``{prefix}.experts.w13.weight_scale_inv`` present, no ``pad_rows``); else None."""
    if not specs or f"{prefix}.experts.w13.weight_scale_inv" not in specs:
        return None
    w13 = specs.get(f"{prefix}.experts.w13.weight")
    if w13 is None or any(p.pad_rows for p in w13.parts):
        return None
    return fp8_block_size(cfg)


class DeepseekMoE(nn.Module):
    """DeepSeek-V3 MoE block.

    config keys: hidden_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok, n_group,
    topk_group, norm_topk_prob, routed_scaling_factor, n_shared_experts (0 or absent: no shared expert).
    x: [T, H] -> [T, H] in x's dtype.
    """

    def __init__(self, cfg: dict, prefix: str, specs: dict[str, OutputTensor] | None, dtype: torch.dtype,
                 device):
        super().__init__()
        h = cfg["hidden_size"]
        inter = cfg["moe_intermediate_size"]
        self.num_experts = cfg["n_routed_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.n_group = cfg.get("n_group") or 1
        self.topk_group = cfg.get("topk_group") or 1
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.routed_scaling_factor = float(cfg.get("routed_scaling_factor", 1.0))
        self.gate = TopkRouter(h, self.num_experts, dtype, device)
        self.experts = StackedExperts(self.num_experts, h, inter, dtype, device,
                                      experts_fp8_block(prefix, specs, cfg))
        n_shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = (SwiGLUMLP(cfg, f"{prefix}.shared_experts", specs, inter * n_shared, dtype, device)
                               if n_shared else None)

    def forward(self, x: torch.Tensor, split: bool = False, aux_stream: torch.cuda.Stream | None = None):
        """x: [T, H] -> routed + shared [T, H]; ``split``: the pair ``(routed, shared or None)`` unsummed, for
        a caller that folds the sum into the next residual add (``RMSNorm(h, residual, extra)``), routed as
        float32 per-slot planes [S, T, H] when there is a shared expert (``add_rms_norm`` sums them);
        ``aux_stream``: where the shared expert runs beside the routed ones (:mod:`.overlap`; None: in order)."""
        logits = self.gate(x)
        weights, ids = get_op("grouped_topk", x.device)(
            logits, self.gate.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.norm_topk_prob, self.routed_scaling_factor)
        # forked after the (latency-bound) routing, so the shared expert's GEMVs share the SMs with the routed
        # experts' GEMMs and fill their last partial wave, not delay the router's small kernels
        shared = fork(aux_stream, self.shared_experts, x) if self.shared_experts is not None else None
        # split with a shared expert: the routed output stays as float32 per-slot planes, summed by the next
        # norm's kernel (``add_rms_norm``), which saves the sum's launch on the step's critical path
        planes = split and shared is not None
        out = get_op("fused_moe", x.device)(x, self.experts.w13.weight, self.experts.w2.weight, weights, ids,
                                            **self.experts.scales(), sum_slots=not planes)
        shared = shared.join() if shared is not None else None
        if split:
            return out, shared
        return out if shared is None else out + shared

"""How FP8 block-quantized layers treat their activations: W8A8 (dynamic per-token scales) or weight-only.

An FP8 block checkpoint (DeepSeek-V3 / V3.2, GLM-5, Qwen3-FP8: ``quant_method: fp8``,
``activation_scheme: dynamic``, ``weight_block_size: [128, 128]``) declares that its activations are quantized
at run time: DeepSeek's reference inference runs every FP8 linear as ``act_quant`` (per token, 1 x 128 groups,
scale amax / 448, a power of two under ``scale_fmt: ue8m0``) followed by an e4m3 x e4m3 GEMM, and transformers'
own GPU kernels for these checkpoints do the same. ``weight-only`` widens the e4m3 weights instead and keeps
the activations: the dequantize-then-matmul numerics of transformers' ``dequantize=True`` path (our test
oracle), at the cost of two conversion instructions per weight element (docs/PERFORMANCE.md).

``auto`` (the default) follows the checkpoint: W8A8 when it declares dynamic activation quantization and the
model runs in bf16 / fp16 on a GPU with FP8 tensor cores; weight-only in float32, the dtype one picks for
reference numerics, and on the CPU (where W8A8 is the torch reference: ``dynamic`` asks for it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atomtool.errors import EngineError
from atomtool.serve.ops.torch_ref import act_quant_fp8_supported

#: values of ``--fp8-activations``
FP8_ACTIVATION_CHOICES = ("auto", "dynamic", "weight-only")


def w8a8_device_ok(device: torch.device | str | None) -> bool:
    """Whether the W8A8 kernels run on ``device``: the CPU (torch reference, Triton's interpreter) and NVIDIA
    GPUs with e4m3 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell). Ampere has no FP8 type in
    Triton and ROCm's FP8 is another format (an AITER backend would bring its own kernels)."""
    if device is None or torch.device(device).type != "cuda":
        return True
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 9)


def _w8a8_fast(device: torch.device | str | None) -> bool:
    """Where ``auto`` turns W8A8 on: a GPU with FP8 tensor cores (None: not checked). On the CPU W8A8 is the
    torch reference (a loop over K blocks), a numerics check rather than a speed-up, so only on request."""
    return device is None or (torch.device(device).type == "cuda" and w8a8_device_ok(device))


def resolve_fp8_activations(requested: str, config_flat: dict[str, Any], dtype: torch.dtype,
                            device: torch.device | str | None = None) -> str | None:
    """The ``act_quant`` mode of the FP8 block ops for this model: None (weight-only), ``"dynamic"`` or
    ``"dynamic_ue8m0"`` (``quantization_config.scale_fmt == "ue8m0"``).

    requested: one of :data:`FP8_ACTIVATION_CHOICES`; ``auto`` is W8A8 iff ``quantization_config``'s
    ``activation_scheme`` is ``dynamic`` (DeepSeek's default when absent), ``dtype`` is not float32 and
    ``device`` is a GPU with FP8 tensor cores (None: not checked); ``dynamic`` also on the CPU.

    Raises:
        EngineError: ``requested`` is not a choice, or ``dynamic`` for an FP8-quantized config (one with a
            ``quantization_config``) on a GPU the W8A8 kernels do not run on.
    """
    if requested not in FP8_ACTIVATION_CHOICES:
        raise EngineError(f"fp8 activations {requested!r}: expected one of {', '.join(FP8_ACTIVATION_CHOICES)}")
    qc = config_flat.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    if requested == "weight-only":
        return None
    if requested == "auto" and (dtype == torch.float32 or qc.get("activation_scheme", "dynamic") != "dynamic"
                                or not _w8a8_fast(device)):
        return None
    if qc and not w8a8_device_ok(device):
        raise EngineError(f"--fp8-activations dynamic: the W8A8 kernels need an NVIDIA GPU with FP8 tensor cores "
                          f"(compute capability 8.9+) or the CPU; {torch.device(device)} is not one. Use "
                          "--fp8-activations weight-only (or auto)")
    return "dynamic_ue8m0" if qc.get("scale_fmt") == "ue8m0" else "dynamic"


def _fp8_block_layers(model: nn.Module):
    """The FP8 block layers of ``model`` that may run W8A8: modules with a ``block_size`` and an ``act_quant``
    attribute (:class:`Linear`, :class:`StackedExperts`), except those marked ``w8a8_eligible = False``."""
    return (m for m in model.modules() if getattr(m, "block_size", None) is not None and hasattr(m, "act_quant")
            and getattr(m, "w8a8_eligible", True))


def apply_fp8_activations(model: nn.Module, act_quant: str | None) -> int:
    """Set ``act_quant`` on every FP8 block layer of ``model`` (:class:`Linear` and :class:`StackedExperts`
    with a ``block_size``) whose K block W8A8 serves (32, 64 or 128); the others stay weight-only, and layers
    marked ``w8a8_eligible = False`` (MLA's ``kv_b_proj``, consumed dequantized in the absorbed form) are left
    alone. Returns how many layers run W8A8."""
    n = 0
    for mod in _fp8_block_layers(model):
        mod.act_quant = act_quant if act_quant is not None and act_quant_fp8_supported(mod.block_size[1]) else None
        n += mod.act_quant is not None
    return n


def fp8_activations_note(requested: str, model: nn.Module, n_w8a8: int) -> str | None:
    """A one-line note when an explicit ``dynamic`` request runs nowhere (``n_w8a8`` 0 layers run W8A8): the
    model has no FP8 block layers, or their K block is one W8A8 does not serve. None otherwise."""
    if requested != "dynamic" or n_w8a8:
        return None
    blocks = sorted({tuple(m.block_size) for m in _fp8_block_layers(model)})
    if not blocks:
        return "--fp8-activations dynamic: the model has no FP8 block layers; nothing runs W8A8"
    ks = ", ".join(str(b[1]) for b in blocks)
    return (f"--fp8-activations dynamic: the FP8 blocks are {ks} wide along K; W8A8 serves 32, 64 or 128, "
            "so every FP8 layer runs weight-only")

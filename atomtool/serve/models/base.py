"""The interface every served model implements (dense Llama/Qwen here, MLA/DSA/MoE in ``deepseek.py``).

A model is an ``nn.Module`` whose parameter names are exactly the tensor names of the atomtool layout
(= convert's output names), so loading is a name-for-name copy. The engine talks to it only through:

- ``kv_plane_specs()`` -- the per-token cache planes each layer needs (the engine allocates the paged pool),
- ``forward(batch, kv_caches)`` -- one step over a :class:`ForwardBatch`, writing the step's KV and reading
  the cached context through the op dispatch (:mod:`atomtool.serve.ops`),
- ``compute_logits(hidden)`` and ``load_weights(weights)``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import nn

from atomtool.convert.plan_types import OutputTensor
from atomtool.errors import EngineError
from atomtool.serve.engine.batch import ForwardBatch, KVPlaneSpec


class CausalLM(nn.Module):
    """Base class of a decoder-only causal LM served by the engine.

    Subclasses build their modules in ``__init__(config_flat, specs, dtype, device)``:

    - ``config_flat``: the text config dict with flattened DSA fields (``atomtool.inspect.dsa``), as found in
      the layout's config.json or the in-memory plan's ``config``;
    - ``specs``: the layout's tensors by name (``OutputTensor``), or None to derive shapes from the config
      alone. Split sizes of fused tensors come from ``spec.parts[i].rows``; the storage scheme
      (``spec.scheme`` / a ``weight_scale_inv`` companion) decides float vs FP8 block linears;
    - ``dtype``: activation / float-weight dtype; ``device``: where parameters live.
    """

    def __init__(self, config_flat: dict[str, Any], specs: dict[str, OutputTensor] | None,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config_flat = config_flat
        self.specs = specs
        self.dtype = dtype
        self.device = torch.device(device)
        #: longest sequence the model can serve exactly (None: ``max_position_embeddings``); the engine caps
        #: ``max_model_len`` to it.
        self.context_limit: int | None = None
        #: why ``context_limit`` is set (shown to the user when it lowers max_model_len)
        self.context_limit_reason: str | None = None

    # -- interface ---------------------------------------------------------------------------------
    def kv_plane_specs(self) -> list[list[KVPlaneSpec]]:
        """Per decoder layer, the cache planes it needs (dense GQA: ``k`` (Hkv, D) and ``v`` (Hkv, Dv))."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, kv_caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Run one step. kv_caches[i][plane] is layer i's ``[num_blocks, block_size, *shape]`` tensor.

        Returns the final hidden states [T, hidden_size] (after the final norm) in ``self.dtype``.
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        raise NotImplementedError

    # -- loading -----------------------------------------------------------------------------------
    def expected_weight_names(self) -> set[str]:
        """Names ``load_weights`` must receive: every parameter and persistent buffer, minus tied aliases."""
        names = {n for n, _ in self.named_parameters(remove_duplicate=True)}
        names |= {n for n, _ in self.named_buffers(remove_duplicate=True) if n in self.state_dict()}
        return names - set(self.tied_weight_names())

    def architecture_name(self) -> str:
        """The checkpoint's architecture (``config.json`` ``architectures[0]``, e.g. ``Qwen3ForCausalLM``) for
        messages; the engine class name when the config does not say (one class serves several)."""
        archs = self.config_flat.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return type(self).__name__

    def tied_weight_names(self) -> list[str]:
        """Parameter names that alias another parameter and are not loaded (e.g. a tied ``lm_head.weight``)."""
        return []

    def direct_load_ok(self, name: str, target: torch.Tensor) -> bool:
        """True when the stored tensor ``name`` goes into ``target`` byte for byte (same shape and dtype)
        without any model-side transform, so a layout loader may write its bytes straight into the parameter
        and pass the name to :meth:`load_weights` as ``preloaded``. Models whose ``load_weights`` filters or
        rewrites some tensors return False for those."""
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     preloaded: Collection[str] = ()) -> None:
        """Copy named tensors into the parameters (cast to each parameter's dtype, moved to its device).

        preloaded: names whose bytes a loader already wrote into the parameters directly
        (:mod:`atomtool.serve.layout_load`); they count as seen, and arriving again is an error.

        Raises:
            EngineError: unexpected names, shape mismatches, FP8 tensors in another FP8 format than the
                parameter's (E5M2 into E4M3), or names that never arrived (all listed; a tensor that arrived
                with the wrong shape or format is listed only as that).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        params.update(dict(self.named_buffers(remove_duplicate=False)))
        expected = self.expected_weight_names()
        seen: set[str] = set(preloaded)
        unexpected: list[str] = []
        bad_shape: list[str] = []
        misshaped: set[str] = set()  # present but wrong-shaped: a shape mismatch, never also "missing"
        fp8_format: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                target = params.get(name)
                if target is None or name not in expected or name in preloaded:
                    unexpected.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    bad_shape.append(f"{name} {tuple(tensor.shape)} (model expects {tuple(target.shape)})")
                    misshaped.add(name)
                    continue
                if tensor.dtype != target.dtype and tensor.element_size() == 1 and tensor.is_floating_point() \
                        and target.element_size() == 1 and target.is_floating_point():
                    # one FP8 format into another (e.g. E5M2 into the E4M3 kernels' parameters): a value cast
                    # saturates magnitudes above the target's range (448 for E4M3); refuse, do not corrupt
                    fp8_format.append(f"{name} stored {str(tensor.dtype).removeprefix('torch.')}")
                    misshaped.add(name)
                    continue
                target.copy_(tensor.to(target.device))
                seen.add(name)
        missing = sorted(expected - seen - misshaped)
        problems = []
        if missing:
            problems.append(f"missing tensors ({len(missing)}): {_short_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors ({len(unexpected)}): {_short_list(sorted(unexpected))}")
        if bad_shape:
            problems.append(f"shape mismatches: {_short_list(bad_shape)}")
        if fp8_format:
            problems.append(f"FP8 weights in an unsupported format ({len(fp8_format)}; the engine serves FP8 "
                            f"blocks as float8_e4m3fn, DeepSeek-V3's format, and E5M2 values above 448 do not "
                            f"fit it): {_short_list(fp8_format)}")
        if problems:
            raise EngineError(f"cannot load {self.architecture_name()} weights: " + "; ".join(problems))
        self.post_load()

    def post_load(self) -> None:
        """Hook run after every weight arrived (e.g. re-tie aliases, precompute derived tensors)."""


def _short_list(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


def torch_dtype_of(tag: str) -> torch.dtype:
    """safetensors dtype tag (``BF16``, ``F8_E4M3``, ...) -> torch dtype."""
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
             "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    if tag not in table:
        raise EngineError(f"tensor dtype {tag} is not supported by the engine")
    return table[tag]

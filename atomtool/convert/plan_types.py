"""The ConversionPlan data model: output tensors <- source tensors + one op.

Shared by convert (which writes the plan to disk) and serve (which runs the same plan in memory to load a
raw HF checkpoint, and reads the same structure back from ``atomtool.json`` for a layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atomtool.inspect.types import TensorInfo


@dataclass(frozen=True)
class PartSpec:
    """Where one source tensor sits inside an output tensor.

    source: source tensor name. rows: (start, end) row range along dim 0 of the output (for ``stack``:
    of the output's ``[stack_index]`` slice), excluding padding; None for ``copy``/``cast``.
    stack_index: expert index for ``stack`` ops. pad_rows: zero rows appended after this part
    (FP8 block alignment). scale / scale_block: see the fields.
    """

    source: str
    rows: tuple[int, int] | None = None
    stack_index: int | None = None
    pad_rows: int = 0
    #: FP8 block source only: the source ``weight_scale_inv`` [ceil(N/b0), ceil(K/b1)] F32 the part is
    #: dequantized with (``q * scale_inv`` per ``scale_block`` tile, in float32) before it is cast to the
    #: output's float dtype (an MoE layer whose experts mix FP8 and BF16, stacked in BF16); None: as stored
    scale: str | None = None
    scale_block: tuple[int, int] | None = None


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the layout.

    name: engine module name (``model.layers.3.self_attn.fused_qkv_a_proj.weight``); dtype:
    safetensors tag; shape: output shape; scheme: storage scheme of the module it belongs to;
    op: ``copy`` | ``cast`` | ``concat`` | ``stack``; parts: sources in order.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    scheme: str
    op: str
    parts: tuple[PartSpec, ...]
    #: quantization block (rows, cols) of an FP8 block output (weight and its ``weight_scale_inv``)
    block_size: tuple[int, ...] | None = None


@dataclass
class ConversionPlan:
    """Every output tensor of a conversion, plus the warnings its dtype policy raised.

    config: the output config.json dict (source config + flattened index_* fields + indexer_types).
    sources: source tensor name -> TensorInfo (file, dtype, shape, offsets) for every part's source, so the
    plan can be materialized without re-inspecting. notes: how each fusion was decided (e.g. why the
    indexer parts stayed separate), recorded in the manifest. missing: see the field.
    """

    tensors: dict[str, OutputTensor]
    config: dict
    dtype_policy: str = "auto"
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, TensorInfo] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: one-line facts the CLI prints as ``note:`` (lossless widening casts); also in ``notes``
    infos: list[str] = field(default_factory=list)
    #: source tensors the engine needs that the checkpoint lacks (:func:`atomtool.convert.plan.missing_tensors`);
    #: convert refuses such a checkpoint unless ``--force``
    missing: list[str] = field(default_factory=list)
    #: source tensors deliberately left out of the layout -> why (``rotary_emb.inv_freq`` buffers, layers beyond
    #: the decoder, an ``lm_head.weight`` that tying replaces); recorded in the manifest as ``dropped_sources``
    dropped: dict[str, str] = field(default_factory=dict)

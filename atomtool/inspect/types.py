"""Dataclasses shared by inspect, convert and serve: what a checkpoint holds, as read from headers.

These are the contract between the stages (DESIGN.md principle 1): inspect fills them once, convert
and serve only read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# safetensors dtype tag -> bytes per element (None for sub-byte packed types).
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "U4": 1, "I4": 1, "F4": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared in a safetensors header.

    name: full tensor name (``model.layers.3.self_attn.q_a_proj.weight``); dtype: safetensors tag
    (``BF16``, ``F8_E4M3``, ...); shape: dims; file: shard file name relative to the checkpoint root;
    data_offsets: (begin, end) byte offsets relative to the start of the data section (after the header).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    data_offsets: tuple[int, int] = (0, 0)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


@dataclass
class ModuleInfo:
    """One linear module (a weight plus its companions), grouped from tensor names.

    name: the checkpoint's module prefix (``model.layers.3.self_attn.q_a_proj``).
    scheme: storage scheme (bf16, fp16, fp32, fp8_block, fp8_tensor, fp8_channel, mxfp4, nvfp4,
    int4_pack, int8, awq, gptq, bnb4, unknown). dtype: dtype tag of the main weight tensor.
    shape: logical [out_features, in_features]. tensors: role -> TensorInfo, roles are the suffixes
    (``weight``, ``weight_scale_inv``, ``bias``, ``qweight``, ...). block_size: quantization block
    (rows, cols) or group size where the scheme has one. declared_quantized: whether
    quantization_config would quantize it. treated_as: ``quantized`` / ``unquantized``.
    """

    name: str
    scheme: str
    dtype: str
    shape: tuple[int, ...]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    block_size: tuple[int, ...] | None = None
    declared_quantized: bool = False
    treated_as: str = "unquantized"


@dataclass(frozen=True)
class Finding:
    """A classification finding. severity: ``error`` | ``warning`` | ``info``."""

    code: str
    severity: str
    module: str | None
    message: str


@dataclass
class DsaInfo:
    """Flattened DeepSeek Sparse Attention facts (research/dsa.md §1-2).

    roles: per decoder layer ``full`` | ``shared`` | ``dense`` (length num_hidden_layers), from
    :func:`atomtool.inspect.dsa.layer_roles` -- the one schedule every stage reads.
    """

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    index_rope_dim: int
    indexer_rope_interleave: bool
    roles: list[str]


@dataclass
class InspectReport:
    """Everything inspect learned about a checkpoint (see docs/INSPECT_SCHEMA.md for the JSON form).

    config: the raw config.json dict; config_flat: the text config with flattened index_* fields and
    resolved ``indexer_types``. tensors: every tensor by name (empty for a config-only directory).
    modules: linear modules. other_tensors: names of tensors that belong to no linear module
    (norms, embeddings, router biases, ...).
    """

    source: str
    architecture: str
    model_type: str
    family: str
    servable: bool
    config: dict[str, Any]
    config_flat: dict[str, Any]
    dsa: DsaInfo | None
    tensors: dict[str, TensorInfo]
    modules: list[ModuleInfo]
    other_tensors: list[str]
    totals: dict[str, Any]
    memory: dict[str, Any]
    findings: list[Finding]
    root: str | None = None  # local directory holding the files (None for remote-only inspection)
    #: the quantization spec classification used (``quantization_config`` at top level or under
    #: text_config, or hf_quant_config.json): its ``quant_method`` and scheme; None = unquantized
    quant_method: str | None = None
    quant_scheme: str | None = None
    #: the directory is an atomtool layout (it has an ``atomtool.json`` manifest): its tensors are already
    #: fused / stacked, so it is served as it is, never converted again
    layout: bool = False

"""Run a :class:`ConversionPlan`: produce each output tensor from the source safetensors files, lazily.

This is the one executor of the fusion plan. ``atomtool convert`` streams its outputs to disk
(:mod:`atomtool.convert.writer`) and the serving engine calls :func:`iter_output_tensors` to load a raw HF
checkpoint in memory, so a checkpoint is fused the same way whether it was converted first or not.

Memory: sources are opened with ``safetensors.safe_open`` (mmap) and read one tensor at a time, so at most
one output tensor plus one source tensor are resident besides the page cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from atomtool.convert.cast import checked_cast, torch_dtype
from atomtool.convert.plan_types import ConversionPlan, OutputTensor
from atomtool.errors import ConversionError, SourceError


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (works for every dtype, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


def _place(out: torch.Tensor, index: tuple, src: torch.Tensor) -> None:
    """``out[index] = src`` as a byte copy when dtypes match (FP8 and friends have few torch kernels)."""
    dst = out[index]
    if dst.shape != src.shape:
        raise ConversionError(f"part shape {list(src.shape)} does not fit its slot {list(dst.shape)}")
    if src.dtype == out.dtype and src.dim():
        dst.view(torch.uint8).copy_(src.contiguous().view(torch.uint8))
    else:
        dst.copy_(src)


class SourceReader:
    """Open-on-demand ``safe_open`` handles for the files of one checkpoint (closed by :meth:`close`).

    Args:
        plan: gives each source tensor's file (``plan.sources[name].file``, relative to ``root``).
        root: the checkpoint directory.
    """

    def __init__(self, plan: ConversionPlan, root: str | Path):
        self.plan = plan
        self.root = Path(root)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        """The source tensor ``name`` as a CPU tensor in its stored dtype.

        Raises:
            SourceError: the plan does not know the tensor, or its file is missing / lacks it.
        """
        info = self.plan.sources.get(name)
        if info is None:
            raise SourceError(f"source tensor {name} is not in the plan's sources")
        handle = self._handles.get(info.file)
        if handle is None:
            path = self.root / info.file
            if not path.is_file():
                raise SourceError(f"{path}: shard file missing (needed for {name})")
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self._handles[info.file] = handle
        try:
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:  # safetensors raises SafetensorError / KeyError variants
            raise SourceError(f"{self.root / info.file}: cannot read {name}: {exc}") from exc

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def materialize(spec: OutputTensor, reader: SourceReader) -> torch.Tensor:
    """Build one output tensor on CPU from its parts.

    ``copy``/``cast``: the source (cast with an overflow check when ``spec.dtype`` differs). ``concat``:
    the parts' rows at their ``rows`` ranges, zero rows where ``pad_rows`` asks. ``stack``: the same inside
    ``out[stack_index]``.

    Raises:
        ConversionError: a cast overflows, a part does not fit its slot, or an unknown op.
        SourceError: a source tensor cannot be read.
    """
    dtype = torch_dtype(spec.dtype, tensor=spec.name)
    if spec.op in ("copy", "cast"):
        (part,) = spec.parts
        t = checked_cast(reader.get(part.source), dtype, name=part.source)
        if tuple(t.shape) != tuple(spec.shape):
            raise ConversionError(f"{spec.name}: source {part.source} has shape {list(t.shape)}, "
                                  f"the plan expects {list(spec.shape)}")
        return t.contiguous()
    if spec.op not in ("concat", "stack"):
        raise ConversionError(f"{spec.name}: unknown op {spec.op!r}")
    nbytes = dtype.itemsize
    for d in spec.shape:
        nbytes *= d
    # zero-filled: padding rows must be exact zeros (an FP8 zero byte is +0.0)
    out = torch.zeros(nbytes, dtype=torch.uint8).view(dtype).view(spec.shape) if nbytes else \
        torch.empty(spec.shape, dtype=dtype)
    for part in spec.parts:
        src = checked_cast(reader.get(part.source), dtype, name=part.source)
        if part.rows is None:
            raise ConversionError(f"{spec.name}: part {part.source} has no row range")
        r0, r1 = part.rows
        index = (part.stack_index, slice(r0, r1)) if spec.op == "stack" else (slice(r0, r1),)
        if spec.op == "stack" and part.stack_index is None:
            raise ConversionError(f"{spec.name}: stack part {part.source} has no stack index")
        try:
            _place(out, index, src)
        except ConversionError as exc:
            raise ConversionError(f"{spec.name}: {part.source}: {exc}") from None
    return out


def iter_output_tensors(plan: ConversionPlan, root: str | Path, device: str | torch.device = "cpu",
                        names: Iterable[str] | None = None) -> Iterator[tuple[OutputTensor, torch.Tensor]]:
    """Yield ``(spec, tensor)`` for every output tensor of ``plan``, reading sources under ``root`` lazily.

    Args:
        plan: from :func:`atomtool.convert.plan.build_plan`.
        root: the source checkpoint directory (``plan.sources[*].file`` are relative to it).
        device: where the yielded tensors live (built on CPU, then moved).
        names: output names in the order wanted (default: the plan's order).
    Yields:
        the output spec and its tensor (``spec.shape``, dtype of ``spec.dtype``). Each tensor is built
        only when the iterator advances; memory holds one output and one source tensor at a time.
    Raises:
        ConversionError / SourceError: see :func:`materialize`.
    """
    reader = SourceReader(plan, root)
    try:
        for name in (plan.tensors if names is None else names):
            spec = plan.tensors[name]
            t = materialize(spec, reader)
            if str(device) != "cpu":
                t = t.to(device)
            yield spec, t
    finally:
        reader.close()

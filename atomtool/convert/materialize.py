"""Run a :class:`ConversionPlan`: produce each output tensor from the source safetensors files, lazily.

This is the one executor of the fusion plan. ``atomtool convert`` streams its outputs to disk
(:mod:`atomtool.convert.writer`) and the serving engine calls :func:`iter_output_tensors` to load a raw HF
checkpoint in memory, so a checkpoint is fused the same way whether it was converted first or not.

Memory: source tensors are read by byte range (``os.preadv``) straight into the output buffer, one output
at a time, so resident memory is about one output tensor (plus one source tensor when a cast is needed).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from atomtool.convert.cast import TORCH_DTYPES, checked_cast, torch_dtype
from atomtool.convert.plan_types import ConversionPlan, OutputTensor
from atomtool.errors import ConversionError, SourceError
from atomtool.inspect.types import TensorInfo


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
    """Reads source tensors of one checkpoint by their header byte ranges (``TensorInfo.data_offsets``).

    Tensors are read with ``os.preadv`` straight into the caller's buffer -- for a fused output, into the
    part's rows of the output tensor -- so each byte is copied once from the page cache and nothing stays
    mapped: resident memory is the buffers we hold, not the files we have read (an mmap-based reader such
    as ``safe_open`` keeps every page it touched in the process's RSS). Falls back to ``safe_open`` for
    tensors whose plan entry carries no byte range.

    Args:
        plan: gives each source tensor's file, dtype, shape and byte range (``plan.sources``).
        root: the checkpoint directory (files are relative to it).
    """

    def __init__(self, plan: ConversionPlan, root: str | Path):
        self.plan = plan
        self.root = Path(root)
        self._stack = contextlib.ExitStack()
        self._fds: dict[str, tuple[int, int]] = {}  # file -> (fd, data section start)
        self._handles: dict[str, object] = {}

    def _info(self, name: str):
        info = self.plan.sources.get(name)
        if info is None:
            raise SourceError(f"source tensor {name} is not in the plan's sources")
        return info

    def _open(self, file: str, name: str) -> tuple[int, int]:
        entry = self._fds.get(file)
        if entry is None:
            path = self.root / file
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise SourceError(f"{path}: cannot open shard ({exc.strerror}; needed for {name})") from None
            self._stack.callback(os.close, fd)
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                raise SourceError(f"{path}: too short for a safetensors file")
            entry = (fd, 8 + struct.unpack("<Q", head)[0])
            self._fds[file] = entry
        return entry

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read source tensor ``name``'s bytes into the contiguous CPU tensor ``out`` (same byte size).

        Raises:
            SourceError: unknown tensor, missing/short file, or a byte-size mismatch.
        """
        info = self._info(name)
        if not out.is_contiguous():
            raise ConversionError(f"{name}: destination slot is not contiguous")
        buf = out.reshape(-1).view(torch.uint8)
        begin, end = info.data_offsets
        if end - begin != buf.numel():
            raise SourceError(f"{name}: {end - begin} bytes in {info.file}, expected {buf.numel()}")
        if buf.numel() == 0:
            return
        self.read_range(name, 0, memoryview(buf.numpy()))

    def locate(self, name: str) -> tuple[int, int]:
        """(open file descriptor, absolute byte offset in the file) of source tensor ``name``'s data.

        Raises:
            SourceError: unknown tensor, missing or unreadable file.
        """
        info = self._info(name)
        fd, start = self._open(info.file, name)
        return fd, start + info.data_offsets[0]

    def read_range(self, name: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes of source tensor ``name`` starting at byte ``offset`` of the tensor.

        Raises:
            SourceError: unknown tensor, out-of-range request, missing or short file.
        """
        info = self._info(name)
        begin, end = info.data_offsets
        if offset < 0 or begin + offset + len(view) > end:
            raise SourceError(f"{name}: byte range [{offset}, {offset + len(view)}) outside the tensor")
        fd, start = self._open(info.file, name)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], start + begin + offset + done)
            if n <= 0:
                raise SourceError(f"{self.root / info.file}: truncated while reading {name}")
            done += n

    def get(self, name: str) -> torch.Tensor:
        """The source tensor ``name`` as a new CPU tensor in its stored dtype.

        Raises:
            SourceError: the plan does not know the tensor, or its file is missing / lacks it.
        """
        info = self._info(name)
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is not None and self.can_read_into(name, dtype):
            t = torch.empty(info.shape, dtype=dtype)
            self.read_into(name, t)
            return t
        return self._get_safe_open(name, info)

    def _get_safe_open(self, name: str, info) -> torch.Tensor:
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

    def can_read_into(self, name: str, dtype: torch.dtype) -> bool:
        """True when ``name`` is stored in ``dtype`` with a byte range, so :meth:`read_into` applies."""
        info = self.plan.sources.get(name)
        return (info is not None and TORCH_DTYPES.get(info.dtype) == dtype
                and info.data_offsets[1] - info.data_offsets[0] == info.numel * dtype.itemsize
                and (info.data_offsets[1] > 0 or info.numel == 0))

    def close(self) -> None:
        self._stack.close()
        self._fds.clear()
        self._handles.clear()


def byte_segments(spec: OutputTensor, reader: SourceReader) -> list[tuple[str | None, int]] | None:
    """The output tensor's bytes as an ordered list of ``(source name | None for zeros, byte count)``.

    Every part of a copy/concat/stack is a row range of a contiguous tensor, hence one contiguous byte
    range of the output; sorting parts by output offset and filling the gaps (padding) with zeros gives
    the whole tensor as a sequence that can be streamed from the source files without building it in
    memory. None when a part needs a dtype cast or lacks a byte range (then use :func:`materialize`).
    """
    if spec.op == "copy":  # any dtype, even ones torch cannot hold (F4, F6): the bytes are copied as they are
        (part,) = spec.parts
        info = reader.plan.sources.get(part.source)
        if info is None or info.dtype != spec.dtype or info.data_offsets[1] < info.data_offsets[0] or \
                (info.data_offsets == (0, 0) and info.numel):
            return None
        return [(part.source, info.nbytes)]
    dtype = TORCH_DTYPES.get(spec.dtype)
    if dtype is None or spec.op == "cast" or any(p.scale is not None or not reader.can_read_into(p.source, dtype)
                                                 for p in spec.parts):
        return None
    itemsize = dtype.itemsize
    lead = 2 if spec.op == "stack" else 1
    if len(spec.shape) < lead:
        return None
    row = itemsize
    for d in spec.shape[lead:]:
        row *= d
    slab = row * spec.shape[1] if spec.op == "stack" else 0
    spans = []
    for p in spec.parts:
        if p.rows is None or (spec.op == "stack") != (p.stack_index is not None):
            return None
        start = (p.stack_index or 0) * slab + p.rows[0] * row
        nbytes = (p.rows[1] - p.rows[0]) * row
        if nbytes != reader.plan.sources[p.source].nbytes:
            return None
        spans.append((start, nbytes, p.source))
    total = itemsize
    for d in spec.shape:
        total *= d
    segments: list[tuple[str | None, int]] = []
    pos = 0
    for start, nbytes, name in sorted(spans):
        if start < pos:
            raise ConversionError(f"{spec.name}: parts overlap at byte {start}")
        if start > pos:
            segments.append((None, start - pos))
        segments.append((name, nbytes))
        pos = start + nbytes
    if pos > total:
        raise ConversionError(f"{spec.name}: parts run past the end of the tensor")
    if pos < total:
        segments.append((None, total - pos))
    return segments


def materialize(spec: OutputTensor, reader: SourceReader) -> torch.Tensor:
    """Build one output tensor on CPU from its parts.

    ``copy``/``cast``: the source (cast with an overflow check when ``spec.dtype`` differs). ``concat``:
    the parts' rows at their ``rows`` ranges, zero rows where ``pad_rows`` asks. ``stack``: the same inside
    ``out[stack_index]``. A part with a ``scale`` is an FP8 block weight, dequantized in float32
    (:func:`atomtool.serve.ops.torch_ref.dequant_fp8_block`) before the cast.

    Raises:
        ConversionError: a cast overflows, a part does not fit its slot, or an unknown op.
        SourceError: a source tensor cannot be read.
    """
    dtype = torch_dtype(spec.dtype, tensor=spec.name)
    if spec.op in ("copy", "cast"):
        (part,) = spec.parts
        if reader.can_read_into(part.source, dtype):
            t = torch.empty(spec.shape, dtype=dtype)
            reader.read_into(part.source, t)
            return t
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
        if part.rows is None:
            raise ConversionError(f"{spec.name}: part {part.source} has no row range")
        r0, r1 = part.rows
        index = (part.stack_index, slice(r0, r1)) if spec.op == "stack" else (slice(r0, r1),)
        if spec.op == "stack" and part.stack_index is None:
            raise ConversionError(f"{spec.name}: stack part {part.source} has no stack index")
        info = reader.plan.sources.get(part.source)
        slot = out[index]
        if part.scale is None and info is not None and tuple(info.shape) == tuple(slot.shape) and \
                reader.can_read_into(part.source, dtype):
            reader.read_into(part.source, slot)  # rows of a contiguous tensor: contiguous; one copy
            continue
        src = reader.get(part.source)
        if part.scale is not None:
            from atomtool.serve.ops.torch_ref import dequant_fp8_block

            if part.scale_block is None:
                raise ConversionError(f"{spec.name}: part {part.source} has a scale but no block size")
            src = dequant_fp8_block(src, reader.get(part.scale), part.scale_block, torch.float32)
        src = checked_cast(src, dtype, name=part.source)
        try:
            _place(out, index, src)
        except ConversionError as exc:
            raise ConversionError(f"{spec.name}: {part.source}: {exc}") from None
    return out


def same_values(sources: dict[str, TensorInfo], root: str | Path, a: str, b: str, *,
                chunk_bytes: int = 1 << 24) -> bool:
    """True when source tensors ``a`` and ``b`` hold the same values (what transformers' ``tie_weights``
    checks with ``torch.equal`` before tying two stored tensors).

    Same dtype and shape: their bytes are compared ``chunk_bytes`` at a time (memory stays at two chunks
    whatever the size of an embedding; bit equality, so ``-0.0`` and ``+0.0`` count as different). Different
    float dtypes: both are read and compared as float64 values. Different shapes: False.

    Raises:
        SourceError: a tensor cannot be read.
    """
    ia, ib = sources[a], sources[b]
    if tuple(ia.shape) != tuple(ib.shape):
        return False
    reader = SourceReader(ConversionPlan(tensors={}, config={}, sources={a: ia, b: ib}), root)
    try:
        if ia.dtype == ib.dtype and ia.data_offsets[1] - ia.data_offsets[0] == ib.data_offsets[1] - ib.data_offsets[0]:
            total = ia.data_offsets[1] - ia.data_offsets[0]
            for off in range(0, total, chunk_bytes):
                n = min(chunk_bytes, total - off)
                ba, bb = bytearray(n), bytearray(n)
                reader.read_range(a, off, memoryview(ba))
                reader.read_range(b, off, memoryview(bb))
                if ba != bb:
                    return False
            return True
        try:
            return torch.equal(reader.get(a).to(torch.float64), reader.get(b).to(torch.float64))
        except (RuntimeError, TypeError):  # a dtype torch cannot widen: not the same tensor
            return False
    finally:
        reader.close()


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

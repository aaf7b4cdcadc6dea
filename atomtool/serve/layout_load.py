"""Load an atomtool layout's shards straight into a model's parameters (the layout fast path).

A layout's tensors already carry their final names, dtypes and shapes (DESIGN.md: the layout is what the
engine serves), so loading one is sequential I/O: each shard's data section is read with large ``preadv``
calls, in order, straight into the already-allocated parameters.

- CPU parameters: one scatter ``preadv`` per chunk (up to ``chunk_bytes``, at most ``_MAX_IOV`` tensors)
  whose iovecs are the parameters' own bytes -- one copy from the page cache, no intermediate tensor
  (``safe_open`` + ``get_tensor`` + ``copy_`` costs an mmap page-fault copy plus a second copy).
- CUDA parameters: each worker reads a chunk into one of its two pinned staging buffers and issues
  ``copy_(non_blocking=True)`` host-to-device copies of each tensor's bytes on its own stream; the buffer is
  reused once its copies' event completed (double buffering: the next read overlaps the transfer).

A small thread pool reads chunks in parallel (``preadv`` and the copies release the GIL); chunks are dealt
round-robin so concurrent reads stay close together in the file. Its size is ``min(8, cpu_count)`` (8 read a
cold FP8 MoE layout ~5% faster than 4 on the H200 machine's disk, 16 no faster: docs/PERFORMANCE.md), or
``ATOMTOOL_LOAD_WORKERS`` when set (:func:`default_workers`; more reads in flight can help a disk that serves
several requests faster than one). With staging, ``direct_io`` (or
``ATOMTOOL_LOAD_DIRECT_IO=1``) reads with O_DIRECT into the page-aligned buffers, bypassing the page cache.

Only tensors the model takes as stored go this way (:meth:`CausalLM.direct_load_ok`, same shape and dtype,
contiguous target); every other tensor (a dtype cast, a model-side transform such as dequantizing padded FP8
experts, an unknown or mis-shaped name) is read into a CPU tensor and given to ``model.load_weights`` with
the direct names as ``preloaded``, so its checks (missing / unexpected / mis-shaped tensors named in one
EngineError) and ``post_load`` are exactly those of the generic path. Offsets come from
:func:`atomtool.inspect.safetensors_header.read_header_file`, which validates hostile or truncated headers
(HeaderError) before a byte of data is read.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atomtool.errors import EngineError
from atomtool.serve.models.base import CausalLM, torch_dtype_of

if TYPE_CHECKING:
    from atomtool.inspect.safetensors_header import SafetensorsHeader

#: iovecs per preadv (Linux IOV_MAX is 1024)
_MAX_IOV = 512
#: O_DIRECT alignment of file offsets, lengths and buffer addresses (logical block sizes are 512 or 4096)
_ALIGN = 4096
#: default bytes per read: large enough for full disk / page-cache bandwidth, small enough to pipeline; a
#: staging buffer with its O_DIRECT slack is then exactly 16 MiB (torch's pinned-memory allocator rounds
#: sizes up to a power of two)
DEFAULT_CHUNK_BYTES = (16 << 20) - 2 * _ALIGN


@dataclass
class _Piece:
    """``nbytes`` bytes at absolute file offset ``offset`` going to ``dst`` (a flat uint8 view)."""

    offset: int
    nbytes: int
    dst: torch.Tensor


@dataclass
class _Chunk:
    """A contiguous file range ``[offset, offset + nbytes)`` of one shard, covering ``pieces`` in order."""

    fd: int
    label: str
    offset: int
    nbytes: int
    pieces: list[_Piece]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor's storage bytes (0-d included)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _pread_full(fd: int, views: list[memoryview], offset: int, label: str) -> None:
    """Fill ``views`` (in order) with the bytes at ``offset``; a short read continues, EOF is an error."""
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise EngineError(f"{label}: shard ended early at byte {offset} (file truncated while loading?)")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _chunks(fd: int, label: str, pieces: list[_Piece], chunk_bytes: int) -> list[_Chunk]:
    """Group file-ordered pieces into contiguous reads of at most ``chunk_bytes`` (tensors split as needed)."""
    out: list[_Chunk] = []
    cur: _Chunk | None = None
    for p in sorted(pieces, key=lambda p: p.offset):
        pos = 0
        while pos < p.nbytes:  # (an empty tensor has no bytes to read)
            if cur is None or cur.offset + cur.nbytes != p.offset + pos or cur.nbytes >= chunk_bytes \
                    or len(cur.pieces) >= _MAX_IOV:
                cur = _Chunk(fd, label, p.offset + pos, 0, [])
                out.append(cur)
            take = min(p.nbytes - pos, chunk_bytes - cur.nbytes)
            cur.pieces.append(_Piece(p.offset + pos, take, p.dst[pos:pos + take]))
            cur.nbytes += take
            pos += take
    return out


def _read_cpu(chunks: list[_Chunk]) -> None:
    for c in chunks:
        _pread_full(c.fd, [memoryview(p.dst.numpy()) for p in c.pieces], c.offset, c.label)


def _aligned_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """uint8 CPU buffer of ``nbytes`` starting on a ``_ALIGN`` boundary (as O_DIRECT needs); pinned on CUDA."""
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)  # (pinned blocks are page-aligned)
    if raw.data_ptr() % _ALIGN:
        raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = (-raw.data_ptr()) % _ALIGN
    return raw[skip:skip + nbytes]


def _read_chunk_direct(c: _Chunk, dfd: int, buf: torch.Tensor) -> int:
    """Read chunk ``c`` with O_DIRECT (aligned start and length) into ``buf``; returns where its bytes begin.

    The kernel needs the file offset, length and address aligned; a short read at the end of the file is
    expected (the length is rounded up). A short read elsewhere, or a refused request (EINVAL on a file
    system without O_DIRECT), finishes through the buffered descriptor."""
    a0 = c.offset // _ALIGN * _ALIGN
    a1 = -(-(c.offset + c.nbytes) // _ALIGN) * _ALIGN
    need = c.offset + c.nbytes - a0
    view = memoryview(buf[:a1 - a0].numpy())
    done = 0
    try:
        while done < need:
            n = os.preadv(dfd, [view[done:]], a0 + done)
            if n <= 0 or (done + n < need and n % _ALIGN):
                done += max(n, 0)
                break
            done += n
    except OSError:
        pass
    if done < need:
        _pread_full(c.fd, [view[done:need]], a0 + done, c.label)
    return c.offset - a0


def _read_staged(chunks: list[_Chunk], chunk_bytes: int, device: torch.device,
                 direct_fds: dict[int, int]) -> None:
    """Read each chunk into a (pinned on CUDA) staging buffer, then copy each piece to its parameter.

    Two buffers per worker: while the copies out of one run on this worker's stream, the next chunk is read
    into the other. ``direct_fds``: buffered fd -> O_DIRECT fd of the same shard (chunks of other shards are
    read buffered)."""
    cuda = device.type == "cuda"
    size = min(chunk_bytes, max(c.nbytes for c in chunks)) + 2 * _ALIGN
    bufs = [_aligned_buffer(size, cuda) for _ in range(2)]
    stream = torch.cuda.Stream(device) if cuda else None
    events: list[torch.cuda.Event | None] = [None, None]
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for i, c in enumerate(chunks):
            k = i % 2
            if events[k] is not None:
                events[k].synchronize()  # the copies out of this buffer are done
            buf = bufs[k]
            dfd = direct_fds.get(c.fd)
            if dfd is not None:
                pos = _read_chunk_direct(c, dfd, buf)
            else:
                _pread_full(c.fd, [memoryview(buf[:c.nbytes].numpy())], c.offset, c.label)
                pos = 0
            for p in c.pieces:
                p.dst.copy_(buf[pos:pos + p.nbytes], non_blocking=cuda)
                pos += p.nbytes
            if cuda:
                events[k] = torch.cuda.Event()
                events[k].record(stream)
        if cuda:
            stream.synchronize()


def default_workers() -> int:
    """Reader threads of :func:`load_layout_weights`: ``ATOMTOOL_LOAD_WORKERS`` when set, else
    ``min(8, cpu_count)``.

    Raises:
        EngineError: ``ATOMTOOL_LOAD_WORKERS`` is not an integer from 1 to 64 (named with its value).
    """
    env = os.environ.get("ATOMTOOL_LOAD_WORKERS", "").strip()
    if not env:
        return max(1, min(8, os.cpu_count() or 1))
    try:
        n = int(env)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise EngineError(f"ATOMTOOL_LOAD_WORKERS must be an integer from 1 to 64, got {env!r}")
    return n


def load_layout_weights(model: CausalLM, model_dir: str | os.PathLike, *,
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: int | None = None,
                        staged: bool | None = None, direct_io: bool | None = None,
                        headers: dict[str, SafetensorsHeader] | None = None) -> dict[str, int]:
    """Load every tensor of the layout at ``model_dir`` into ``model`` (then ``model.post_load()``).

    Args:
        model: built from the layout's specs, parameters allocated on their device.
        chunk_bytes: bytes per read (and per staging buffer).
        workers: reader threads (default :func:`default_workers`).
        staged: read through staging buffers (default: only when parameters are not on the CPU; True on CPU
            exercises the CUDA path's chunking in tests).
        headers: shard headers already read, by file name (the loader's manifest check,
            ``convert.layout.check_manifest_matches_files``); shards not in it are read here.
        direct_io: with staging, read shards with O_DIRECT (no page cache: a cold load skips the kernel's
            copy, a warm one re-reads the disk); default: environment ``ATOMTOOL_LOAD_DIRECT_IO=1``. Files
            that refuse O_DIRECT are read buffered.
    Returns:
        ``{"direct": n, "direct_bytes": b, "fallback": m, "o_direct_files": f}``: how many tensors took each
        path, and how many shards were read with O_DIRECT.
    Raises:
        LayoutError: missing or malformed index. HeaderError: a shard's header is corrupt or its data
        section is shorter than the header declares (truncated file). EngineError: a bad
        ``ATOMTOOL_LOAD_WORKERS``, a missing shard, a tensor the index lists but the shard lacks, an
        unsupported dtype, or (from ``load_weights``) missing / unexpected / mis-shaped tensors, all named.
    """
    from atomtool.convert.layout import tensor_files
    from atomtool.inspect.safetensors_header import read_header_file

    model_dir = Path(model_dir)
    by_file: dict[str, list[str]] = {}
    for name, fname in tensor_files(model_dir).items():
        by_file.setdefault(fname, []).append(name)
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    expected = model.expected_weight_names()
    workers = workers or default_workers()
    # a model whose load_weights override predates ``preloaded`` gets every tensor through load_weights
    fast_ok = "preloaded" in inspect.signature(model.load_weights).parameters
    if direct_io is None:
        direct_io = os.environ.get("ATOMTOOL_LOAD_DIRECT_IO", "") == "1"

    fds: list[int] = []
    direct_fds: dict[int, int] = {}
    direct: set[str] = set()
    direct_bytes = 0
    chunks: list[_Chunk] = []
    fallback: list[tuple[int, str, int, str, tuple[int, ...], torch.dtype]] = []
    devices: set[torch.device] = set()
    try:
        for fname, names in by_file.items():
            path = model_dir / fname
            if not path.is_file():
                raise EngineError(f"{path}: layout shard is missing (tensors {', '.join(names[:5])}, ...)")
            header = (headers or {}).get(fname) or read_header_file(path, file=fname)
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            pieces: list[_Piece] = []
            for name in names:
                info = header.tensors.get(name)
                if info is None:
                    raise EngineError(f"{path}: the layout index puts tensor {name} in this shard, but it is "
                                      "not there")
                dtype = torch_dtype_of(info.dtype)
                offset = header.data_start + info.data_offsets[0]
                target = targets.get(name)
                if (fast_ok and target is not None and name in expected and model.direct_load_ok(name, target)
                        and tuple(target.shape) == tuple(info.shape) and target.dtype == dtype
                        and target.is_contiguous() and info.nbytes == target.numel() * dtype.itemsize):
                    pieces.append(_Piece(offset, info.nbytes, _byte_view(target.data)))
                    direct.add(name)
                    direct_bytes += info.nbytes
                    devices.add(target.device)
                else:
                    fallback.append((fd, str(path), offset, name, tuple(info.shape), dtype))
            chunks += _chunks(fd, str(path), pieces, chunk_bytes)
            if direct_io and pieces and hasattr(os, "O_DIRECT"):
                try:
                    direct_fds[fd] = dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    fds.append(dfd)
                except OSError:  # e.g. tmpfs: read buffered
                    pass
        use_staging = False
        if chunks:
            use_staging = staged if staged is not None else any(d.type != "cpu" for d in devices)
            groups = [chunks[i::workers] for i in range(workers)]
            groups = [g for g in groups if g]
            if use_staging:
                gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
                if len(gpus) > 1:  # one stream per worker serves one GPU; not a layout the engine builds
                    raise EngineError(f"parameters on several GPUs {[str(d) for d in gpus]}")
                dev = gpus[0] if gpus else torch.device("cpu")
                if dev.type == "cuda":
                    # the model's own init kernels (default stream) must not land after our side-stream copies
                    torch.cuda.synchronize(dev)

                def job(g: list[_Chunk]) -> None:
                    if dev.type == "cuda":
                        torch.cuda.set_device(dev)
                    _read_staged(g, chunk_bytes, dev, direct_fds)
            else:
                job = _read_cpu
            with torch.no_grad():
                if len(groups) == 1:
                    job(groups[0])
                else:
                    with ThreadPoolExecutor(len(groups), thread_name_prefix="atomtool-load") as pool:
                        for f in [pool.submit(job, g) for g in groups]:
                            f.result()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for fd, label, offset, name, shape, dtype in fallback:
                t = torch.empty(shape, dtype=dtype)
                if t.numel():
                    _pread_full(fd, [memoryview(_byte_view(t).numpy())], offset, label)
                yield name, t

        if fast_ok:
            model.load_weights(rest(), preloaded=direct)
        else:
            model.load_weights(rest())
    finally:
        for fd in fds:
            os.close(fd)
    return {"direct": len(direct), "direct_bytes": direct_bytes, "fallback": len(fallback),
            "o_direct_files": len(direct_fds) if chunks and use_staging else 0}

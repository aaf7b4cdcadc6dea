"""Parse and validate one safetensors header, reading only the 8-byte length prefix and the header bytes.

Format (https://huggingface.co/docs/safetensors, research/quant.md §1): bytes ``0..8`` hold ``N`` (u64
little-endian), bytes ``8..8+N`` a UTF-8 JSON object ``{name: {"dtype", "shape", "data_offsets"}, ...,
"__metadata__": {str: str}}``, and ``8+N..EOF`` the data section; each tensor occupies
``[8+N+begin, 8+N+end)``.

Why our own parser: the Rust reader in ``safetensors`` validates, but only on a whole local file (it
mmaps the data section), its messages do not always name the problem ("invalid shape, data type, or
offset for tensor"), and it silently keeps the last of two duplicate names (serde HashMap).
huggingface_hub's ``parse_safetensors_file_metadata`` reads headers remotely but checks almost nothing
(``json.loads`` with ``errors="ignore"``, last duplicate wins, no offset/byte-count checks, a 25 MB cap
that rejects legal headers). ``inspect`` must give a one-line, named error for hostile input and must
never touch tensor data, so validation lives here (mirroring safetensors' ``Metadata::validate`` plus
the extra checks in research/quant.md §1.3); huggingface_hub still does the remote transport
(see :mod:`atomtool.inspect.source`).

Every problem raises :class:`atomtool.errors.HeaderError` whose message is one line:
``"<file>: <problem>"``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from atomtool.errors import HeaderError
from atomtool.inspect.types import TensorInfo

# The format's own limit (safetensors MAX_HEADER_SIZE); huggingface_hub uses 25 MB, which is too small
# for legal files, ATOM 100 MiB.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype string safetensors 0.8 accepts (its Rust ``Dtype`` enum). Sub-byte
# types (F4, F6_*) count logical elements in ``shape``; their byte size is numel * bits / 8.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

_MAX_SHOWN = 80  # longest tensor name / value quoted in a message


@dataclass
class SafetensorsHeader:
    """One parsed, validated safetensors header.

    tensors: name -> :class:`TensorInfo` (``file`` = the shard name given to the parser, offsets relative
    to the data section). metadata: the ``__metadata__`` str -> str map (empty if absent).
    header_len: N, the JSON length in bytes; the data section starts at byte ``8 + N``.
    data_len: bytes covered by tensors (the data section length of a well-formed file).
    """

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    header_len: int = 0
    data_len: int = 0

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section (``8 + header_len``)."""
        return 8 + self.header_len


class _Pairs(list):
    """A JSON object with a duplicate key, kept as its ordered (key, value) pairs so the duplicate stays
    visible (``json.loads`` would silently keep the last value)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Pairs:
    """object_pairs_hook: a dict, or :class:`_Pairs` when a key repeats (dict() is C-fast; a list subclass
    for every object would double the parse time of a 92k-tensor checkpoint)."""
    d = dict(pairs)
    return d if len(d) == len(pairs) else _Pairs(pairs)


def _pairs(obj: dict[str, Any] | _Pairs) -> Any:
    return obj.items() if type(obj) is dict else obj


def _q(value: object) -> str:
    """Quote a name for a one-line message: repr (escapes newlines), truncated."""
    s = repr(value)
    return s if len(s) <= _MAX_SHOWN else s[: _MAX_SHOWN - 4] + "...'"


def _fail(label: str, problem: str) -> HeaderError:
    return HeaderError(f"{label}: {problem}")


def parse_header_length(prefix: bytes, *, label: str, file_size: int | None = None) -> int:
    """Validate the 8-byte little-endian length prefix and return N (the header length in bytes).

    prefix: at least the first 8 bytes of the file. file_size: the whole file's size in bytes when known
    (local stat, HTTP ``Content-Range`` total). Raises HeaderError when the file is shorter than 8 bytes,
    N is 0, N exceeds :data:`MAX_HEADER_BYTES`, or ``8 + N`` runs past ``file_size``.
    """
    if len(prefix) < 8:
        raise _fail(label, f"file is {len(prefix)} bytes, shorter than the 8-byte header length prefix")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0:
        raise _fail(label, "declared header length is 0")
    if n > MAX_HEADER_BYTES:
        raise _fail(label, f"declared header length {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if file_size is not None and 8 + n > file_size:
        raise _fail(label, f"declared header length {n} bytes runs past the end of the file "
                           f"({file_size} bytes)")
    return n


def parse_header_json(
    header: bytes, *, file: str, label: str | None = None, data_len: int | None = None
) -> SafetensorsHeader:
    """Parse and validate the JSON header bytes (``N`` bytes after the prefix, padding included).

    file: shard name stored in each TensorInfo.file. label: how messages name the file (default
    ``file``; pass the full path or URL). data_len: length of the data section (file size - 8 - N) when
    known; tensors must then cover exactly ``[0, data_len)``.
    Raises HeaderError for: non-UTF-8, non-JSON (or not starting with ``{``), top level not an object,
    duplicate names or keys, ``__metadata__`` not str -> str, unknown dtype, shape not a list of
    non-negative ints, data_offsets not a pair of non-negative ints, begin > end, byte count != numel x
    dtype size, overlapping offsets or holes, tensors beyond / short of the data section.
    """
    label = label or file
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(label, f"header is not valid UTF-8 (bad byte at offset {8 + e.start})") from None
    if not text.startswith("{"):
        raise _fail(label, "header is not a JSON object (does not start with '{')")
    try:
        obj = json.loads(text, object_pairs_hook=_object, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError; so are NaN/Infinity and ints longer than Python's digit limit.
        if isinstance(e, json.JSONDecodeError):
            why = f"{e.msg} at character {e.pos}"
        elif isinstance(e, RecursionError):
            why = "nesting too deep"
        else:
            why = " ".join(str(e).split())[:120]
        raise _fail(label, f"header is not valid JSON ({why})") from None
    if not isinstance(obj, (dict, _Pairs)):
        raise _fail(label, "header JSON top level is not an object")

    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    seen: set[str] = set()
    for name, entry in _pairs(obj):
        if name in seen:
            what = "'__metadata__' entry" if name == "__metadata__" else f"tensor name {_q(name)}"
            raise _fail(label, f"duplicate {what} in header")
        seen.add(name)
        if name == "__metadata__":
            metadata = _metadata(entry, label)
        else:
            tensors[name] = _tensor(name, entry, file, label)
    covered = _check_layout(tensors, label, data_len)
    return SafetensorsHeader(tensors=tensors, metadata=metadata, header_len=len(header), data_len=covered)


def parse_header_bytes(
    blob: bytes, *, file: str, label: str | None = None, file_size: int | None = None
) -> SafetensorsHeader:
    """Parse a header from the first bytes of a safetensors file (``blob`` = prefix + at least N bytes).

    Used for HTTP range reads and tests. file_size: total file size when known (else only the header's
    internal consistency is checked). Raises HeaderError (also when ``blob`` is shorter than 8 + N).
    """
    label = label or file
    n = parse_header_length(blob, label=label, file_size=file_size)
    if len(blob) < 8 + n:
        raise _fail(label, f"declared header length {n} bytes runs past the end of the data "
                           f"({len(blob)} bytes)")
    data_len = None if file_size is None else file_size - 8 - n
    return parse_header_json(blob[8 : 8 + n], file=file, label=label, data_len=data_len)


def read_header_blob(path: str | os.PathLike[str]) -> tuple[bytes, int]:
    """The first ``8 + N`` bytes of a local safetensors file (prefix + header) and the file size.

    Only the length prefix is validated here (HeaderError); pass the result to
    :func:`parse_header_bytes` (split so callers can read files in threads and parse in one).
    OSError is not caught.
    """
    label = str(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        n = parse_header_length(prefix, label=label, file_size=size)
        header = fh.read(n)
    if len(header) != n:  # file shrank under us
        raise _fail(label, f"declared header length {n} bytes runs past the end of the file")
    return prefix + header, size


def read_header_file(path: str | os.PathLike[str], *, file: str | None = None) -> SafetensorsHeader:
    """Read and validate the header of a local safetensors file; reads 8 + N bytes, never tensor data.

    path: the file. file: shard name for TensorInfo.file (default: the file's base name). Messages name
    the full path. Raises HeaderError for every corrupt/hostile header; OSError is not caught (the
    caller turns a missing file into SourceError).
    """
    blob, size = read_header_blob(path)
    return parse_header_bytes(blob, file=file or Path(path).name, label=str(path), file_size=size)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard constant {token}")


def _metadata(entry: object, label: str) -> dict[str, str]:
    if not isinstance(entry, (dict, _Pairs)):
        raise _fail(label, "'__metadata__' is not an object of string values")
    out: dict[str, str] = {}
    for k, v in _pairs(entry):
        if k in out:
            raise _fail(label, f"duplicate key {_q(k)} in '__metadata__'")
        if not isinstance(v, str):
            raise _fail(label, f"'__metadata__' value for {_q(k)} is {_json_type(v)}, not a string")
        out[k] = v
    return out


def _json_type(v: object) -> str:
    if isinstance(v, (dict, _Pairs)):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _tensor(name: str, entry: object, file: str, label: str) -> TensorInfo:
    """Validate one tensor entry. A fast path accepts the well-formed case (a DeepSeek-V3.2 checkpoint
    has 92k entries); anything unusual goes through :func:`_tensor_checked`, which names the problem."""
    if type(entry) is dict and len(entry) == 3:
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
        if bits and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            begin, end = offsets
            numel, ok = 1, type(begin) is int and type(end) is int and 0 <= begin <= end
            for d in shape:
                if type(d) is not int or d < 0:
                    ok = False
                    break
                numel *= d
            if ok and numel * bits == (end - begin) * 8:
                return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), file=file,
                                  data_offsets=(begin, end))
    return _tensor_checked(name, entry, file, label)


def _tensor_checked(name: str, entry: object, file: str, label: str) -> TensorInfo:
    t = f"tensor {_q(name)}"
    if not isinstance(entry, (dict, _Pairs)):
        raise _fail(label, f"{t}: entry is not an object")
    fields: dict[str, Any] = {}
    for k, v in _pairs(entry):
        if k in fields:
            raise _fail(label, f"{t}: duplicate key {_q(k)}")
        fields[k] = v
    for key in ("dtype", "shape", "data_offsets"):
        if key not in fields:
            raise _fail(label, f"{t}: missing {key!r}")
    dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail(label, f"{t}: unknown dtype {_q(dtype)}")
    if type(shape) is not list or not all(_is_count(d) for d in shape):
        raise _fail(label, f"{t}: shape {_q(shape)} is not a list of non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _fail(label, f"{t}: data_offsets {_q(offsets)} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise _fail(label, f"{t}: data_offsets begin {begin} > end {end}")
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8:
        raise _fail(label, f"{t}: {numel} x {dtype} elements is not a whole number of bytes")
    if bits // 8 != end - begin:
        raise _fail(label, f"{t}: data_offsets span {end - begin} bytes but shape {list(shape)} x {dtype} "
                           f"needs {bits // 8}")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), file=file, data_offsets=(begin, end))


def _check_layout(tensors: dict[str, TensorInfo], label: str, data_len: int | None) -> int:
    """Tensors must tile the data section: sorted by offsets, first begin 0, each begin == previous end
    (no overlap, no hole); with ``data_len`` known, the last end == data_len. Returns bytes covered."""
    prev_end, prev_name = 0, None
    for info in sorted(tensors.values(), key=attrgetter("data_offsets")):  # stable: ties keep file order
        begin, end = info.data_offsets
        if begin < prev_end:
            raise _fail(label, f"tensor {_q(info.name)} data_offsets [{begin}, {end}) overlap tensor "
                               f"{_q(prev_name)} ending at {prev_end}")
        if begin > prev_end:
            after = f"after tensor {_q(prev_name)}" if prev_name is not None else "at the start"
            raise _fail(label, f"hole in the data section: bytes [{prev_end}, {begin}) {after} belong to no "
                               "tensor")
        prev_end, prev_name = end, info.name
    if data_len is not None and prev_end > data_len:
        raise _fail(label, f"tensor {_q(prev_name)} data_offsets end {prev_end} is beyond the data section "
                           f"({data_len} bytes; file truncated?)")
    if data_len is not None and prev_end < data_len:
        raise _fail(label, f"data section has {data_len - prev_end} trailing bytes that belong to no tensor")
    return prev_end

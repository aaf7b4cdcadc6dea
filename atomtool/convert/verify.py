"""``atomtool verify``: re-read a layout and check it against its manifest and, optionally, its source.

Layout checks: the manifest parses; ``model.safetensors.index.json`` names exactly the manifest's tensors
and files; every shard header declares each tensor with the manifest's dtype and shape and nothing else;
each tensor's bytes hash to the sha256 recorded at write time; fused parts tile their output (part rows +
padding cover dim 0 exactly, no overlap); a shard shorter than its header declares is reported once as
truncated (its tensors are not hashed); a ``*.safetensors`` file the index does not reference is reported;
each part's row range spans its recorded source shape, with padding only where the FP8 block rule puts it;
config.json hashes to the manifest's ``config_sha256`` (older manifests without it: a note).

Source checks (``--source SRC``): config.json is what convert writes from SRC's config.json (same dtype
policy); every source tensor appears in exactly one part; every part reproduces its
source -- a part whose source tensor has another dtype or shape than the manifest recorded (SRC is not the
checkpoint that was converted, e.g. the BF16 original of an FP8 checkpoint) is one problem line; otherwise
bit-exact when dtypes match, else equal to the source cast to the output dtype; padding rows are
zero; and for FP8 block outputs the dequantized rows of every part (``fp8 * scale`` per block) equal the
dequantized source, which is the property the padding rule exists for (research/dsa.md §4).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from atomtool.convert.cast import TAG_OF_TORCH, checked_cast, torch_dtype
from atomtool.convert.layout import (
    CONFIG_NAME,
    MANIFEST_NAME,
    config_bytes,
    config_sha256,
    entry_to_spec,
    read_manifest,
    read_safetensors_header,
    tensor_files,
)
from atomtool.convert.plan_types import OutputTensor
from atomtool.errors import AtomtoolError, HeaderError, LayoutError, SourceError
from atomtool.inspect.source import check_path_argument

_CHUNK = 64 << 20


@dataclass
class VerifyReport:
    """Result of :func:`verify_layout`. ``problems`` empty means the layout verified."""

    layout: str
    source: str | None = None
    tensors: int = 0
    bytes: int = 0
    parts: int = 0
    dequantized: int = 0
    problems: list[str] = field(default_factory=list)
    #: not problems of the layout's integrity: it was written with ``convert --force`` despite these
    warnings: list[str] = field(default_factory=list)
    #: facts about what could not be checked (e.g. a manifest older than ``config_sha256``)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "source": self.source, "ok": self.ok, "tensors": self.tensors,
                "bytes": self.bytes, "parts": self.parts, "dequantized_parts": self.dequantized,
                "problems": self.problems, "warnings": self.warnings, "notes": self.notes}


def _sha256_range(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _check_tiling(spec: OutputTensor, problems: list[str]) -> None:
    if spec.op not in ("concat", "stack"):
        return
    rows = spec.shape[1] if spec.op == "stack" else spec.shape[0]
    by_slot: dict[Any, list[tuple[int, int]]] = {}
    for p in spec.parts:
        if p.rows is None:
            problems.append(f"{spec.name}: part {p.source} has no row range")
            return
        by_slot.setdefault(p.stack_index, []).append((p.rows[0], p.rows[1] + p.pad_rows))
    if spec.op == "stack" and sorted(by_slot) != list(range(spec.shape[0])):
        problems.append(f"{spec.name}: stack indices {sorted(by_slot, key=str)} do not cover 0..{spec.shape[0] - 1}")
    for slot, spans in by_slot.items():
        pos = 0
        for a, b in sorted(spans):
            if a != pos:
                problems.append(f"{spec.name}: parts{'' if slot is None else f' of [{slot}]'} leave a gap or "
                                f"overlap at row {pos}")
                break
            pos = b
        else:
            if pos != rows:
                problems.append(f"{spec.name}: parts cover {pos} of {rows} rows")


def _check_part_shapes(spec: OutputTensor, entry: dict[str, Any], problems: list[str]) -> None:
    """Each part's row range against its own recorded ``source_shape`` (the manifest is self-consistent
    without the source): ``copy``/``cast`` outputs have the source's shape; a ``concat``/``stack`` part
    spans exactly the source's rows and has its trailing dims; padding (:class:`PartSpec` ``pad_rows``) only
    follows an FP8 block weight part, up to the next multiple of the block's rows, and every such part but
    the last of its slot that does not end on a block boundary is padded (else its scale rows would cover
    the next part's rows)."""
    raw = [p for p in entry.get("parts", []) if isinstance(p, dict)]
    if len(raw) != len(spec.parts):
        return
    block = spec.block_size
    fp8_weight = block is not None and spec.scheme == "fp8_block" and spec.name.endswith(".weight")
    last = {}
    for p in spec.parts:
        if p.rows is not None:
            last[p.stack_index] = max(last.get(p.stack_index, p.rows[1]), p.rows[1])
    for p, r in zip(spec.parts, raw, strict=True):
        shape = r.get("source_shape")
        if spec.op in ("copy", "cast"):
            if isinstance(shape, list) and list(spec.shape) != shape:
                problems.append(f"{spec.name}: shape {list(spec.shape)} != its source {p.source}'s {shape}")
            continue
        if p.rows is None:
            continue  # reported by the tiling check
        r0, r1 = p.rows
        where = f"{spec.name}: part {p.source} rows [{r0}, {r1}]"
        if not 0 <= r0 <= r1 or p.pad_rows < 0:
            problems.append(f"{where} pad {p.pad_rows}: not a valid row range")
            continue
        if isinstance(shape, list) and shape:
            trailing = list(spec.shape[2:] if spec.op == "stack" else spec.shape[1:])
            if r1 - r0 != shape[0]:
                problems.append(f"{where} span {r1 - r0} rows, but the source's shape {shape} has {shape[0]}")
            elif shape[1:] != trailing:
                problems.append(f"{where}: the source's trailing dims {shape[1:]} != the output's {trailing}")
        if p.pad_rows and not (fp8_weight and p.pad_rows < block[0] and (r1 + p.pad_rows) % block[0] == 0):
            problems.append(f"{where} are followed by {p.pad_rows} padding rows; padding only pads an FP8 block "
                            f"weight part up to the next multiple of the block's rows"
                            + (f" ({block[0]})" if fp8_weight else ""))
        elif fp8_weight and not p.pad_rows and r1 % block[0] and r1 != last.get(p.stack_index):
            problems.append(f"{where} end inside a {block[0]}-row FP8 block but are not padded to its end")


def _dequant(q: torch.Tensor, s: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    n, k = q.shape
    scale = s.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return q.float() * scale


class _Tensors:
    """safe_open handles by file for one directory."""

    def __init__(self, root: Path, files: dict[str, str]):
        self.root, self.files = root, files
        self.stack = contextlib.ExitStack()
        self.handles: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(
                safe_open(str(self.root / file), framework="pt", device="cpu"))
        return self.handles[file].get_tensor(name)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check_layout_files(root: Path, manifest: dict[str, Any], report: VerifyReport, digests: dict[str, str],
                        bad_files: set[str]) -> None:
    """Index, shard headers and sha256 of every tensor; files that cannot be read as a whole (missing,
    unreadable header, truncated) go into ``bad_files`` so the source comparison skips them (one problem
    line per such file, not one per tensor)."""
    specs = manifest["tensors"]
    try:
        weight_map = tensor_files(root)
    except LayoutError as exc:
        report.problems.append(str(exc))
        return
    for name in sorted(set(specs) - set(weight_map)):
        report.problems.append(f"{name}: in the manifest but not in the index")
    for name in sorted(set(weight_map) - set(specs)):
        report.problems.append(f"{name}: in the index but not in the manifest")
    for file in sorted(set(weight_map.values())):
        path = root / file
        if not path.is_file():
            report.problems.append(f"{file}: shard missing")
            bad_files.add(file)
            continue
        try:
            header, data_start = read_safetensors_header(path)
        except LayoutError as exc:
            report.problems.append(str(exc))
            bad_files.add(file)
            continue
        header.pop("__metadata__", None)
        truncated = _truncation(path, header, data_start)
        if truncated:
            report.problems.append(truncated)
            bad_files.add(file)
        else:  # the loader's own header checks: tensors tile the data section (no hole, no trailing bytes)
            from atomtool.inspect.safetensors_header import read_header_file

            try:
                read_header_file(path)
            except HeaderError as exc:
                report.problems.append(str(exc))
                bad_files.add(file)
        for name, h in header.items():
            entry = specs.get(name)
            if entry is None:
                report.problems.append(f"{file}: holds {name}, which the manifest does not list")
                continue
            if weight_map.get(name) != file or entry.get("file") != file:
                report.problems.append(f"{name}: found in {file}, manifest/index say "
                                       f"{entry.get('file')}/{weight_map.get(name)}")
            if h.get("dtype") != entry["dtype"] or list(h.get("shape", [])) != list(entry["shape"]):
                report.problems.append(f"{name}: header {h.get('dtype')} {h.get('shape')} != manifest "
                                       f"{entry['dtype']} {entry['shape']}")
                continue
            b0, b1 = h["data_offsets"]
            if truncated:
                continue  # its bytes are not all there: reported once for the file above
            digest = _sha256_range(path, data_start + b0, b1 - b0)
            digests[name] = digest
            if digest != entry.get("sha256"):
                report.problems.append(f"{name}: sha256 {digest[:16]}... != manifest {str(entry.get('sha256'))[:16]}...")
            report.tensors += 1
            report.bytes += b1 - b0
        for name, w in weight_map.items():
            if w == file and name not in header:
                report.problems.append(f"{name}: index says {file} but its header lacks it")
    referenced = set(weight_map.values())
    for path in sorted(root.glob("*.safetensors")):
        if path.name not in referenced:
            report.problems.append(f"{path.name}: a safetensors file the index does not reference (not part of "
                                   "this layout; loaders that read every *.safetensors would pick it up)")


def _check_carried_files(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    """Each of the manifest's ``carried_files`` (non-weight files copied from the source: tokenizer, remote
    code, ``encoding/``, ...) is in the layout with its recorded size and sha256. Manifests written before
    the field existed have none to check."""
    for e in manifest.get("carried_files") or []:
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            report.problems.append(f"{MANIFEST_NAME}: malformed carried_files entry {e!r}")
            continue
        path = root / e["path"]
        if not path.is_file():
            report.problems.append(f"{e['path']}: carried file listed in the manifest is missing")
            continue
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if digest != e.get("sha256"):
            report.problems.append(f"{e['path']}: carried file's sha256 {digest[:16]}... != manifest "
                                   f"{str(e.get('sha256'))[:16]}... (edited after convert?)")


def _truncation(path: Path, header: dict[str, Any], data_start: int) -> str | None:
    """A problem line when ``path`` is shorter than its header declares (an interrupted copy), else None."""
    ends = [h["data_offsets"][1] for h in header.values()
            if isinstance(h, dict) and isinstance(h.get("data_offsets"), list) and len(h["data_offsets"]) == 2]
    declared = data_start + max(ends, default=0)
    size = path.stat().st_size
    if size < declared:
        return f"shard {path.name} is truncated: {size} bytes, header declares {declared}"
    return None


def _check_source(root: Path, manifest: dict[str, Any], source: str, report: VerifyReport,
                  digests: dict[str, str], bad_files: set[str]) -> None:
    from atomtool.inspect.source import CheckpointSource

    src = CheckpointSource.open(source)
    if src.root is None:
        report.problems.append(f"{source}: not available locally")
        return
    check_is_source(manifest, source, src.tensors, str(root))
    _check_config_source(root, manifest, source, report)
    # tensors a stale index.json does not list are not part of the source (inspect leaves them out too)
    unlisted = set(src.unlisted)
    src_files = {n: t.file for n, t in src.tensors.items() if n not in unlisted}
    out_files = {n: f for n, f in tensor_files(root).items() if f not in bad_files}
    out = _Tensors(root, out_files)
    srct = _Tensors(src.root, src_files)
    copies = _CopyHasher(src.root, src.tensors, digests)
    with out.stack, srct.stack:
        _compare_parts(manifest, src_files, out, srct, report, copies)


#: fraction of the manifest's source tensors a directory must hold to be compared part by part; below it the
#: directory is obviously another checkpoint and verify says so once instead of one problem per tensor
MIN_SOURCE_OVERLAP = 0.5


def check_is_source(manifest: dict[str, Any], source: str, tensors: dict[str, Any], layout: str) -> None:
    """Refuse, in one line, a ``--source`` that obviously is not the checkpoint the layout was converted from.

    Compared first, before any tensor is read: the manifest's source fingerprint (sha256 of config.json and
    every header entry, :func:`atomtool.convert.commands.source_fingerprint`) -- equal means it is the
    source; otherwise the source tensors the manifest's parts record (name, and dtype and shape where
    recorded): a directory holding no weights, or fewer than :data:`MIN_SOURCE_OVERLAP` of those tensors
    (e.g. the BF16 original of an FP8 checkpoint: other dtypes, no scales), is another checkpoint. A copy
    with the same tensors (re-saved, re-sharded) passes and is then checked part by part.

    Raises:
        SourceError: ``SRC is not the source of LAYOUT: ...`` naming a few of the tensors it lacks.
    """
    recorded: dict[str, dict[str, Any]] = {p["source"]: p for e in manifest["tensors"].values()
                                           for p in e.get("parts", []) if isinstance(p, dict) and "source" in p}
    if not recorded:
        return
    if not tensors:
        raise SourceError(f"{source} is not the source of {layout}: it holds no safetensors weights "
                          f"(the layout was converted from {len(recorded)} source tensors"
                          + _recorded_from(manifest) + ")")
    fingerprint = (manifest.get("source") or {}).get("fingerprint")
    if fingerprint and _fingerprint(source) == fingerprint:
        return
    lacking, differing = [], []
    for name, part in recorded.items():
        info = tensors.get(name)
        if info is None:
            lacking.append(name)
        elif (part.get("source_dtype") not in (None, info.dtype)
              or part.get("source_shape") not in (None, list(info.shape))):
            differing.append(f"{name} is {info.dtype} {list(info.shape)} there, {part.get('source_dtype')} "
                             f"{part.get('source_shape')} in the manifest")
    matched = len(recorded) - len(lacking) - len(differing)
    if matched < MIN_SOURCE_OVERLAP * len(recorded):
        eg = ([f"lacks e.g. {', '.join(sorted(lacking)[:3])}"] if lacking else []) + \
             ([f"e.g. {differing[0]}"] if differing else [])
        raise SourceError(f"{source} is not the source of {layout}: only {matched} of the {len(recorded)} source "
                          f"tensors the manifest records are there with the recorded dtype and shape "
                          f"({'; '.join(eg)})" + _recorded_from(manifest, "; converted from "))


def _recorded_from(manifest: dict[str, Any], lead: str = ", from ") -> str:
    src = manifest.get("source") or {}
    where = src.get("repo_id") or src.get("path")
    return f"{lead}{where}" if where else ""


def _fingerprint(source: str) -> str | None:
    """The source fingerprint of ``source`` as convert records it; None when it cannot be computed."""
    from atomtool.convert.commands import source_fingerprint
    from atomtool.inspect.classify import inspect_checkpoint

    try:
        report = inspect_checkpoint(source)
    except AtomtoolError:
        return None
    return source_fingerprint(report, Path(report.root or source))


class _CopyHasher:
    """Checks ``copy`` outputs byte for byte by sha256 of the source tensor's byte range against the
    digest of the output's bytes computed by the layout check (works for any dtype, no tensor built)."""

    def __init__(self, root: Path, tensors: dict[str, Any], digests: dict[str, str]):
        self.root, self.tensors, self.digests, self.starts = root, tensors, digests, {}

    def same(self, out_name: str, src_name: str) -> bool | None:
        """True/False when both digests are known, None when the output's digest is not (unreadable)."""
        actual = self.digests.get(out_name)
        if actual is None:
            return None
        info = self.tensors[src_name]
        path = self.root / info.file
        if info.file not in self.starts:
            self.starts[info.file] = read_safetensors_header(path)[1]
        b0, b1 = info.data_offsets
        return _sha256_range(path, self.starts[info.file] + b0, b1 - b0) == actual


def _compare_parts(manifest: dict[str, Any], src_files: dict[str, str], out: _Tensors, srct: _Tensors,
                   report: VerifyReport, copies: _CopyHasher) -> None:
    specs = {n: entry_to_spec(n, e) for n, e in manifest["tensors"].items()}
    seen: dict[str, str] = {}
    for spec in specs.values():
        for p in spec.parts:
            if p.source in seen:
                report.problems.append(f"{p.source}: appears in {seen[p.source]} and {spec.name}")
            seen[p.source] = spec.name
            if p.source not in src_files:
                report.problems.append(f"{spec.name}: part {p.source} is not in the source")
            if p.scale is not None:  # the FP8 part's scale is read with it (dequantized into a float output)
                if p.scale in seen:
                    report.problems.append(f"{p.scale}: appears in {seen[p.scale]} and {spec.name}")
                seen[p.scale] = spec.name
                if p.scale not in src_files:
                    report.problems.append(f"{spec.name}: part {p.source}'s scale {p.scale} is not in the source")
    dropped = manifest.get("dropped_sources") or {}  # left out on purpose by convert (the plan's ``dropped``)
    for name in sorted(set(src_files) - set(seen) - set(dropped)):
        report.problems.append(f"{name}: source tensor appears in no output tensor")
    for spec in specs.values():
        if any(p.source not in src_files or (p.scale is not None and p.scale not in src_files) for p in spec.parts) \
                or spec.name not in out.files:
            continue
        if _source_differs(spec.name, manifest["tensors"][spec.name], copies.tensors, report):
            continue
        if spec.op == "copy":
            same = copies.same(spec.name, spec.parts[0].source)
            if same is False:
                report.problems.append(f"{spec.name}: part {spec.parts[0].source} does not reproduce the "
                                       "source (bit-exact)")
            elif same:
                report.parts += 1
            continue
        try:
            t = out.get(spec.name)
        except Exception as exc:  # noqa: BLE001 -- report and go on
            report.problems.append(f"{spec.name}: unreadable ({exc})")
            continue
        for p in spec.parts:
            s = srct.get(p.source)
            if p.scale is not None and p.scale_block is not None:  # dequantized exactly, then cast
                s = _dequant(s, srct.get(p.scale), p.scale_block)
            try:
                expect = checked_cast(s, torch_dtype(spec.dtype), name=p.source)
            except AtomtoolError as exc:
                report.problems.append(str(exc))
                continue
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # torch has no such cast
                report.problems.append(f"{spec.name}: part {p.source} ({TAG_OF_TORCH.get(s.dtype, s.dtype)}) "
                                       f"cannot be compared with the layout's {spec.dtype} ({exc})")
                continue
            if spec.op in ("copy", "cast"):
                got, pad = t, None
            else:
                base = t[p.stack_index] if spec.op == "stack" else t
                r0, r1 = p.rows  # type: ignore[misc]
                got, pad = base[r0:r1], base[r1:r1 + p.pad_rows]
            if not _same_bits(got, expect):
                how = "bit-exact" if s.dtype == t.dtype else f"as {spec.dtype}"
                report.problems.append(f"{spec.name}: part {p.source} does not reproduce the source ({how})")
            elif pad is not None and pad.numel() and bool(pad.reshape(-1).view(torch.uint8).any()):
                report.problems.append(f"{spec.name}: padding after {p.source} is not zero")
            else:
                report.parts += 1
        if spec.scheme == "fp8_block" and spec.name.endswith(".weight") and spec.op in ("concat", "stack") \
                and spec.block_size:
            scale_name = spec.name[: -len("weight")] + "weight_scale_inv"
            if scale_name in out.files:
                _check_dequant(spec, t, out.get(scale_name), srct, report)


def _source_differs(name: str, entry: dict[str, Any], infos: dict[str, Any], report: VerifyReport) -> bool:
    """True (with one problem line per part) when a part's source tensor has another dtype or shape than
    the manifest recorded at conversion time: SRC is not the checkpoint that was converted (e.g. the BF16
    original of an FP8 checkpoint), so its values cannot be compared."""
    differs = False
    for part in entry.get("parts", []):
        info = infos.get(part.get("source"))
        want_dtype, want_shape = part.get("source_dtype"), part.get("source_shape")
        if info is None or (want_dtype is None and want_shape is None):
            continue
        if (want_dtype is not None and info.dtype != want_dtype) or \
                (want_shape is not None and list(info.shape) != list(want_shape)):
            report.problems.append(
                f"{name}: part {part['source']} is {info.dtype} {list(info.shape)} in the source, but the layout "
                f"was converted from {want_dtype} {want_shape}: the dtype/scheme differs from the source "
                "(is this the checkpoint that was converted?)")
            differs = True
    return differs


def _check_dequant(spec: OutputTensor, w: torch.Tensor, s: torch.Tensor, srct: _Tensors, report: VerifyReport) -> None:
    block = tuple(spec.block_size)  # type: ignore[arg-type]
    slots = range(w.shape[0]) if spec.op == "stack" else [None]
    for slot in slots:
        ws = w[slot] if slot is not None else w
        ss = s[slot] if slot is not None else s
        deq = _dequant(ws, ss, block)
        for p in spec.parts:
            if p.stack_index != slot:
                continue
            sname = p.source[: -len("weight")] + "weight_scale_inv"
            if sname not in srct.files:
                continue
            ref = _dequant(srct.get(p.source), srct.get(sname), block)
            r0, r1 = p.rows  # type: ignore[misc]
            if not torch.equal(deq[r0:r1], ref):
                report.problems.append(f"{spec.name}: dequantized rows of {p.source} differ from the dequantized source")
            else:
                report.dequantized += 1


def verify_layout(layout: str | Path, source: str | None = None) -> VerifyReport:
    """Check a layout against its manifest and, with ``source``, against the source checkpoint.

    Args:
        layout: layout directory written by ``atomtool convert``.
        source: local source checkpoint directory (or cached Hub repo id) to compare every part with.
    Returns:
        a :class:`VerifyReport`; ``report.problems`` lists every mismatch (empty = verified).
    Raises:
        LayoutError: no such directory, or the manifest is missing or malformed (nothing else can be checked).
        SourceError: the source cannot be opened, or obviously is not the layout's source
            (:func:`check_is_source`).
    """
    check_path_argument(layout, "LAYOUT", "pass the layout directory (holding atomtool.json)", LayoutError)
    root = Path(layout)
    if not root.exists():
        raise LayoutError(f"{layout}: no such directory")
    if not root.is_dir():
        raise LayoutError(f"{layout}: is a file; pass the layout directory (holding atomtool.json)")
    manifest = read_manifest(root)
    report = VerifyReport(layout=str(layout), source=source)
    forced = (manifest.get("source") or {}).get("forced")
    if isinstance(forced, list):
        report.warnings = [str(w) for w in forced]
    for name, entry in manifest["tensors"].items():
        spec = entry_to_spec(name, entry)
        _check_tiling(spec, report.problems)
        _check_part_shapes(spec, entry, report.problems)
    digests: dict[str, str] = {}
    bad_files: set[str] = set()
    _check_layout_files(root, manifest, report, digests, bad_files)
    _check_config(root, manifest, report)
    _check_carried_files(root, manifest, report)
    if source is not None:
        _check_source(root, manifest, source, report, digests, bad_files)
    return report


def _check_config(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    """The layout's config.json hashes to the manifest's ``config_sha256``. A manifest written before that
    field existed is accepted with a note (``--source`` still compares config.json with the source's)."""
    path = root / CONFIG_NAME
    if not path.is_file():
        report.problems.append(f"{CONFIG_NAME}: missing from the layout")
        return
    want = manifest.get("config_sha256")
    if want is None:
        report.notes.append(f"the manifest has no config_sha256 (written by an older atomtool): {CONFIG_NAME} "
                            "is not checked against it; --source compares it with the source's config")
        return
    got = config_sha256(path.read_bytes())
    if got != want:
        report.problems.append(f"{CONFIG_NAME}: sha256 {got[:16]}... != manifest {str(want)[:16]}... (edited after "
                               "convert?)")


#: differing config keys named in the --source config problem (the rest are counted)
MAX_CONFIG_KEYS = 5


def _check_config_source(root: Path, manifest: dict[str, Any], source: str, report: VerifyReport) -> None:
    """The layout's config.json is what convert writes from ``source``'s config.json: the plan's output
    config (:func:`atomtool.convert.plan.build_plan` with the manifest's dtype policy). One problem line
    naming the differing top-level keys, layout value first."""
    import json

    from atomtool.convert.plan import build_plan
    from atomtool.inspect.classify import inspect_checkpoint

    path = root / CONFIG_NAME
    try:
        actual = json.loads(path.read_text())
        expected = json.loads(config_bytes(build_plan(inspect_checkpoint(source),
                                                      str(manifest.get("dtype_policy") or "auto")).config))
    except (OSError, ValueError) as exc:  # missing (reported by _check_config) or not JSON
        if path.is_file():
            report.problems.append(f"{CONFIG_NAME}: not readable JSON ({exc})")
        return
    except AtomtoolError as exc:
        report.notes.append(f"{CONFIG_NAME} not compared with {source}'s: {exc}")
        return
    if not isinstance(actual, dict):
        report.problems.append(f"{CONFIG_NAME}: not a JSON object")
        return
    keys = sorted(k for k in actual.keys() | expected.keys() if actual.get(k, _ABSENT) != expected.get(k, _ABSENT))
    if keys:
        def show(d: dict[str, Any], k: str) -> str:
            return "absent" if k not in d else json.dumps(d[k])

        shown = "; ".join(f"{k} is {show(actual, k)} (convert writes {show(expected, k)})"
                          for k in keys[:MAX_CONFIG_KEYS])
        more = f"; and {len(keys) - MAX_CONFIG_KEYS} more key(s)" if len(keys) > MAX_CONFIG_KEYS else ""
        report.problems.append(f"{CONFIG_NAME}: differs from what convert writes from {source}'s config: "
                               f"{shown}{more}")


_ABSENT = object()

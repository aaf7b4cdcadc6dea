"""The atomtool layout on disk: the ``atomtool.json`` manifest (schema, write, read, validate).

Schema (docs/LAYOUT.md has the full description)::

    {"format": "atomtool-layout", "version": 1,
     "tool": {"name": "atomtool", "version": "0.1.0"}, "created": "2026-11-30T08:00:00Z",
     "source": {"path", "repo_id", "revision", "commit", "forced", "architecture", "family", "fingerprint",
                "files"},
     "dtype_policy": "auto", "warnings": [...], "notes": [...], "indexer_types": [...] | null,
     "carried_files": [{"path", "size", "sha256"}], "not_carried": [{"path", "reason"}],
     "config_sha256": "<sha256 of the layout's config.json bytes>",
     "dropped_sources": {"<source name>": "<reason>"} (only when convert left source tensors out),
     "tensors": {"<output name>": {"dtype", "shape", "scheme", "op", "block_size", "file", "sha256",
                                   "parts": [{"source", "source_dtype", "source_shape",
                                              "rows", "stack_index", "pad_rows",
                                              "scale", "scale_block" (dequantized FP8 parts only)}]}}}

serve reads a layout back with :func:`load_layout_specs` (output specs with their parts, so it can split
fused tensors by the parts' row ranges) and recognises one with :func:`is_layout`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from atomtool.convert.plan_types import OutputTensor, PartSpec
from atomtool.errors import LayoutError

MANIFEST_NAME = "atomtool.json"
FORMAT = "atomtool-layout"
VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def config_bytes(config: dict[str, Any]) -> bytes:
    """The bytes of the layout's ``config.json`` for the output config dict (the one serialization convert
    writes; verify recomputes it from the source to compare)."""
    return json.dumps(config, indent=2).encode()


def config_sha256(data: bytes) -> str:
    """Hex sha256 of ``config.json``'s bytes: the manifest's ``config_sha256`` (absent in manifests written
    before the field existed; verify then notes that config.json is not checked against the manifest)."""
    return hashlib.sha256(data).hexdigest()


def spec_to_entry(spec: OutputTensor, sources: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON form of one output tensor (without ``file``/``sha256``, which the writer adds).

    ``sources``: source name -> TensorInfo, to record each part's source dtype and shape.
    """
    parts = []
    for p in spec.parts:
        entry: dict[str, Any] = {"source": p.source}
        info = (sources or {}).get(p.source)
        if info is not None:
            entry["source_dtype"] = info.dtype
            entry["source_shape"] = list(info.shape)
        entry["rows"] = list(p.rows) if p.rows is not None else None
        entry["stack_index"] = p.stack_index
        entry["pad_rows"] = p.pad_rows
        if p.scale is not None:  # an FP8 block part dequantized into a float output (PartSpec.scale)
            entry["scale"] = p.scale
            entry["scale_block"] = list(p.scale_block) if p.scale_block is not None else None
        parts.append(entry)
    return {"dtype": spec.dtype, "shape": list(spec.shape), "scheme": spec.scheme, "op": spec.op,
            "block_size": list(spec.block_size) if spec.block_size is not None else None, "parts": parts}


def entry_to_spec(name: str, entry: dict[str, Any]) -> OutputTensor:
    """Inverse of :func:`spec_to_entry`.

    Raises:
        LayoutError: a required key is missing or has the wrong type.
    """
    try:
        parts = tuple(
            PartSpec(source=str(p["source"]), rows=tuple(p["rows"]) if p.get("rows") is not None else None,
                     stack_index=p.get("stack_index"), pad_rows=int(p.get("pad_rows", 0)),
                     scale=str(p["scale"]) if p.get("scale") is not None else None,
                     scale_block=tuple(int(b) for b in p["scale_block"]) if p.get("scale_block") is not None
                     else None)
            for p in entry["parts"])
        block = entry.get("block_size")
        return OutputTensor(name=name, dtype=str(entry["dtype"]), shape=tuple(int(d) for d in entry["shape"]),
                            scheme=str(entry["scheme"]), op=str(entry["op"]), parts=parts,
                            block_size=tuple(block) if block is not None else None)
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{MANIFEST_NAME}: tensor {name}: malformed entry ({exc!r})") from None


def read_manifest(layout_dir: str | Path) -> dict[str, Any]:
    """Read and validate ``atomtool.json`` of a layout directory.

    Raises:
        LayoutError: missing file, not JSON, wrong ``format``, unsupported ``version``, no ``tensors``,
            ``carried_files`` / ``not_carried`` present but not lists.
    """
    path = Path(layout_dir) / MANIFEST_NAME
    if not path.is_file():
        raise LayoutError(f"{layout_dir}: not an atomtool layout ({MANIFEST_NAME} missing)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise LayoutError(f"{path}: format is not {FORMAT!r}")
    version = manifest.get("version")
    if type(version) is not int or version != VERSION:  # (``true == 1`` and ``1.0 == 1`` in Python)
        raise LayoutError(f"{path}: layout version {json.dumps(version)} is not supported (expected {VERSION})")
    if not isinstance(manifest.get("tensors"), dict):
        raise LayoutError(f"{path}: 'tensors' missing or not an object")
    for key in ("carried_files", "not_carried"):
        if not isinstance(manifest.get(key, []), list):
            raise LayoutError(f"{path}: {key!r} is not a list")
    return manifest


def layout_files(manifest: dict[str, Any]) -> set[str]:
    """The files (paths relative to the layout, ``/``-separated) a layout written by convert consists of: the
    manifest, config.json, the shard index, every tensor's shard and every carried file."""
    files = {MANIFEST_NAME, CONFIG_NAME, INDEX_NAME}
    files.update(t["file"] for t in manifest.get("tensors", {}).values()
                 if isinstance(t, dict) and isinstance(t.get("file"), str))
    files.update(c["path"] for c in manifest.get("carried_files", [])
                 if isinstance(c, dict) and isinstance(c.get("path"), str))
    return files


def is_layout(path: str | Path) -> bool:
    """True when ``path`` is a directory holding a valid-looking atomtool layout manifest."""
    try:
        read_manifest(path)
    except LayoutError:
        return False
    return True


def load_layout_specs(layout_dir: str | Path) -> dict[str, OutputTensor]:
    """Output tensor specs of a layout, by name, in manifest order (the engine's module names).

    Fused tensors carry their parts with row ranges (padding excluded) and stack indices, so a loader can
    split ``fused_qkv_a_proj`` back into q_a / kv_a / indexer rows.

    Raises:
        LayoutError: see :func:`read_manifest` / :func:`entry_to_spec`.
    """
    manifest = read_manifest(layout_dir)
    return {name: entry_to_spec(name, entry) for name, entry in manifest["tensors"].items()}


def tensor_files(layout_dir: str | Path) -> dict[str, str]:
    """Output tensor name -> shard file, from ``model.safetensors.index.json``.

    Raises:
        LayoutError: the index is missing or malformed.
    """
    path = Path(layout_dir) / INDEX_NAME
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LayoutError(f"{path}: missing or malformed index ({exc})") from None
    if not isinstance(weight_map, dict):
        raise LayoutError(f"{path}: weight_map is not an object")
    return {str(k): str(v) for k, v in weight_map.items()}


def read_safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """Header of one safetensors file and the byte offset where its data section starts.

    Written here rather than taken from ``safe_open`` because verify needs each tensor's byte range to
    checksum exactly the bytes convert wrote; ``safe_open`` does not expose offsets.

    Raises:
        LayoutError: the file is too short or its header is not a JSON object.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LayoutError(f"{path}: file too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n <= 0 or 8 + n > size:
                raise LayoutError(f"{path}: header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read ({exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise LayoutError(f"{path}: header is not a JSON object")
    return header, 8 + n


#: problems a load-time check names before it stops listing (the rest are counted)
_MAX_SHOWN_PROBLEMS = 3


def _raise_problems(where: str, problems: list[str], hint: str) -> None:
    if problems:
        more = f" (+{len(problems) - _MAX_SHOWN_PROBLEMS} more)" if len(problems) > _MAX_SHOWN_PROBLEMS else ""
        raise LayoutError(f"{where}: {'; '.join(problems[:_MAX_SHOWN_PROBLEMS])}{more}; {hint}")


def check_manifest_matches_files(layout_dir: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest against what the loader will read, from headers only (no tensor data): the index lists
    exactly the manifest's tensors, each in the shard the manifest's ``file`` names, and every shard header
    declares each tensor with the manifest's dtype and shape. The engine model is built from the manifest
    while the bytes come from the shards, so a manifest edited after convert (or copied from another model)
    must not load. Tensor *bytes* are not hashed here (``atomtool verify`` does that).

    Returns:
        The shard headers read, by file name (:class:`~atomtool.inspect.safetensors_header.SafetensorsHeader`),
        for the weight loader to reuse instead of parsing them again.
    Raises:
        LayoutError: one line naming the manifest, the first mismatches (tensor, file, both values).
        HeaderError: a shard's header is corrupt or truncated.
    """
    from atomtool.inspect.safetensors_header import read_header_file

    root = Path(layout_dir)
    specs: dict[str, Any] = manifest["tensors"]
    weight_map = tensor_files(root)
    problems = [f"{n} is in the manifest but not in {INDEX_NAME}" for n in specs if n not in weight_map]
    problems += [f"{n} is in {INDEX_NAME} but not in the manifest" for n in weight_map if n not in specs]
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
        entry = specs.get(name)
        if isinstance(entry, dict) and entry.get("file") is not None and entry.get("file") != fname:
            problems.append(f"{name}: the manifest puts it in {entry.get('file')}, {INDEX_NAME} in {fname}")
    headers: dict[str, Any] = {}
    for fname, names in by_file.items():
        path = root / fname
        if not path.is_file():
            continue  # the loader names missing shards itself
        header = headers[fname] = read_header_file(path, file=fname)
        for name in names:
            entry, info = specs.get(name), header.tensors.get(name)
            if not isinstance(entry, dict) or info is None:
                continue  # not in the manifest (above) / not in the shard (the loader names it)
            shape = entry.get("shape")
            if entry.get("dtype") != info.dtype or not isinstance(shape, list) or list(info.shape) != shape:
                problems.append(f"{name}: the manifest says {entry.get('dtype')} {shape}, {fname} holds "
                                f"{info.dtype} {list(info.shape)}")
    _raise_problems(f"{root / MANIFEST_NAME}", problems,
                    "the manifest does not describe this layout's files (edited, or from another conversion?); "
                    f"`atomtool verify {layout_dir}` lists every problem, and converting again rewrites it")
    return headers


def check_parts_order(specs: dict[str, OutputTensor], family: Any) -> list[str]:
    """Problems with the parts of fused / stacked outputs, as convert writes them: the parts of each
    ``concat`` output (of each stack slot) follow each other in row order from row 0 (a part's rows, then
    its ``pad_rows``) up to the output's rows, and the sources are the family's fusion parts in the rule's
    order (:class:`~atomtool.inspect.families.FusionRule`; experts: ``{e}.gate``, ``{e}.up`` at stack
    index ``e``, in expert order). The engine splits fused outputs by these row ranges in this order, so a
    manifest whose parts were reordered or whose row ranges were swapped would split the shard's rows
    wrongly. ``family``: the architecture's :class:`~atomtool.inspect.families.Family` (None: only the
    tiling is checked). Returns one line per bad output (empty: fine)."""
    import re

    problems: list[str] = []
    layer_re = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<rest>.+)$")
    for spec in specs.values():
        if spec.op not in ("concat", "stack"):
            continue
        what = _tiling_problem(spec)
        if what is None and family is not None:
            m = layer_re.match(spec.name)
            expected = _expected_sources(m.group("layer"), m.group("rest"), spec, family) if m else None
            got = [(p.source, p.stack_index) for p in spec.parts]
            if expected is not None and got not in expected:
                want = expected[-1]
                what = (f"parts {[s for s, _ in got][:4]} are not the sources in the order convert writes "
                        f"{[s for s, _ in want][:4]}")
        if what is not None:
            problems.append(f"{spec.name}: {what}")
    return problems


def _tiling_problem(spec: OutputTensor) -> str | None:
    """Why the parts of ``spec`` do not tile its rows in list order (per stack slot), or None."""
    rows = spec.shape[1] if spec.op == "stack" else spec.shape[0] if spec.shape else 0
    ends: dict[Any, int] = {}
    for p in spec.parts:
        if p.rows is None or len(p.rows) != 2:
            return f"part {p.source} has no row range"
        if spec.op == "stack" and not (isinstance(p.stack_index, int) and 0 <= p.stack_index < spec.shape[0]):
            return f"part {p.source} has stack index {p.stack_index!r} outside 0..{spec.shape[0] - 1}"
        slot = p.stack_index if spec.op == "stack" else None
        start, end = p.rows
        if start != ends.get(slot, 0) or end < start or p.pad_rows < 0:
            return (f"part {p.source} rows [{start}, {end}) do not follow the previous part (row "
                    f"{ends.get(slot, 0)}): parts must be listed in row order without gaps or overlaps")
        ends[slot] = end + p.pad_rows
    if spec.op == "stack" and len(ends) != spec.shape[0]:
        return f"stack indices {sorted(ends)} do not cover 0..{spec.shape[0] - 1}"
    short = {k: v for k, v in ends.items() if v != rows}
    if short:
        return f"parts cover {next(iter(short.values()))} of {rows} rows"
    return None


def _expected_sources(layer: str, rest: str, spec: OutputTensor,
                      family: Any) -> list[list[tuple[str, int | None]]] | None:
    """The (source, stack_index) lists convert may write for output ``{layer}.{rest}`` (None: not a fused
    output of ``family``)."""
    for rule in family.fusions:
        if rest.startswith(rule.output + "."):
            role = rest[len(rule.output) + 1:]
            base = [(f"{layer}.{p}.{role}", None) for p in rule.parts]
            full = base + [(f"{layer}.{p}.{role}", None) for p in rule.full_only_parts]
            return [base, full] if rule.full_only_parts else [base]
    ex = family.experts
    if ex is not None and spec.op == "stack":
        for out, mods in ((f"{ex.experts_prefix}.w13", ex.w13), (f"{ex.experts_prefix}.w2", (ex.w2,))):
            if rest.startswith(out + "."):
                role = rest[len(out) + 1:]
                weights = [(f"{layer}.{ex.experts_prefix}.{e}.{m}.{role}", e)
                           for e in range(spec.shape[0]) for m in mods]
                # an FP8 expert dequantized into a float stack keeps its weight name (its scale is in `scale`)
                return [weights]
    return None

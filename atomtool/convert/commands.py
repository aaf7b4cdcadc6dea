"""``atomtool convert`` and ``atomtool verify``: the command functions the CLI calls.

``run_convert``: resolve SRC (a local directory, or a Hub repo id downloaded first with
``huggingface_hub.snapshot_download`` and its progress bar), inspect it, build the plan, then either print
it (``--dry-run``: a rich table or ``--json``; nothing is written) or stream it into OUT atomically.
Warnings (dtype casts) go to stderr, one line each.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from atomtool.convert.layout import spec_to_entry
from atomtool.convert.plan import build_plan
from atomtool.convert.plan_types import ConversionPlan, OutputTensor
from atomtool.convert.writer import check_destination, human_bytes, parse_size, write_layout
from atomtool.errors import ConversionError, SourceError
from atomtool.inspect.families import family_for
from atomtool.inspect.source import hub_download_error, looks_like_path, quiet_hub_logs
from atomtool.inspect.types import InspectReport

#: files a conversion needs from a Hub repo (weights, configs, tokenizer and templates, and Python files for
#: tokenizer remote code such as Kimi-K2's tokenization_kimi.py and the modules it imports; the writer copies
#: only those, see :func:`atomtool.convert.writer.side_files`)
HUB_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py", "LICENSE*"]
#: never downloaded: remote model code (we do not run it)
HUB_IGNORE = ["modeling_*.py"]


def resolve_source(src: str, revision: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Local directory of SRC, downloading a Hub repo id first; plus the manifest's source facts.

    Raises:
        SourceError: SRC is a file, a missing path, or a repo id that cannot be downloaded.
    """
    path = Path(src).expanduser()
    if path.is_dir():
        if revision is not None:
            raise SourceError(f"{src}: --revision applies to Hub repo ids, not to a local directory")
        return path, {"path": str(path.resolve())}
    if path.exists():
        raise SourceError(f"{src}: is a file; pass the checkpoint directory (holding config.json)")
    if looks_like_path(src):
        raise SourceError(f"{src}: no such directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError

    try:
        with quiet_hub_logs():
            local = snapshot_download(repo_id=src, revision=revision, allow_patterns=HUB_PATTERNS,
                                      ignore_patterns=HUB_IGNORE)
    except HFValidationError:
        raise SourceError(f"{src}: neither a local directory nor a valid Hub repo id") from None
    except Exception as exc:  # huggingface_hub raises many typed errors: one-line message, as inspect's
        raise hub_download_error(src, exc, revision) from None
    return Path(local), {"path": str(local), "repo_id": src, "revision": revision,
                         "commit": Path(local).name}


def source_fingerprint(report: InspectReport, root: Path) -> str:
    """sha256 over config.json's bytes and every tensor's header entry (name, dtype, shape, file, offsets).

    Header-level on purpose: hashing terabytes of weights would double the conversion time; verify
    ``--source`` compares the data itself.
    """
    h = hashlib.sha256()
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for name in sorted(report.tensors):
        t = report.tensors[name]
        h.update(json.dumps([name, t.dtype, list(t.shape), t.file, list(t.data_offsets)]).encode())
    return h.hexdigest()


@contextmanager
def _sigterm_as_interrupt():
    """Turn SIGTERM into KeyboardInterrupt so the writer's cleanup runs (main thread only)."""
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _fmt_parts(spec: OutputTensor) -> str:
    def short(name: str) -> str:
        return name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name

    if spec.op in ("copy", "cast"):
        return spec.parts[0].source if spec.parts[0].source != spec.name else "="
    if spec.op == "stack":
        count = len({p.stack_index for p in spec.parts})
        per = [p for p in spec.parts if p.stack_index == spec.parts[0].stack_index]
        return f"{count} experts x " + " | ".join(f"{short(p.source)}[{p.rows[0]}:{p.rows[1]}]" for p in per)
    return " | ".join(f"{short(p.source)}[{p.rows[0]}:{p.rows[1]}]" + (f"+{p.pad_rows}pad" if p.pad_rows else "")
                      for p in spec.parts)


def plan_to_json(plan: ConversionPlan) -> dict[str, Any]:
    """JSON form of a plan (the same per-tensor entries as the manifest, without file/sha256)."""
    return {"dtype_policy": plan.dtype_policy, "warnings": plan.warnings, "notes": plan.notes,
            "tensors": {n: spec_to_entry(s, plan.sources) for n, s in plan.tensors.items()}}


def _print_plan(plan: ConversionPlan, report: InspectReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)  # pipes/files: do not fold names
    table = Table(title=f"conversion plan: {report.architecture} ({len(plan.tensors)} output tensors, "
                        f"dtype {plan.dtype_policy})", show_lines=False)
    for col in ("output tensor", "op", "dtype", "shape", "scheme", "parts"):
        table.add_column(col, overflow="fold")
    for spec in plan.tensors.values():
        table.add_row(spec.name, spec.op, spec.dtype, "x".join(map(str, spec.shape)) or "[]", spec.scheme,
                      _fmt_parts(spec))
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print("dry run: nothing written", highlight=False)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)


def run_convert(src: str, out: str, *, dtype: str = "auto", shard_size: str = "5GB", overwrite: bool = False,
                dry_run: bool = False, json_out: bool = False, revision: str | None = None) -> int:
    """``atomtool convert SRC OUT``: returns the exit code (0).

    Raises:
        ConversionError: a refusal (OUT in SRC, non-empty OUT, disk space, unsupported architecture,
            no weights), an overflowing cast. SourceError / ConfigError / HeaderError: unreadable SRC.
    """
    from atomtool.inspect.classify import inspect_checkpoint

    size = parse_size(shard_size)
    local_src = Path(src).expanduser()
    if not dry_run and local_src.is_dir():
        check_destination(local_src, out, overwrite=overwrite)  # refuse before any work
    if dry_run and not local_src.is_dir() and not local_src.exists() and not looks_like_path(src):
        # a Hub repo id: the plan needs headers only, which inspect reads remotely (no weight download)
        report = inspect_checkpoint(src, revision)
        root = Path(report.root) if report.root else Path(src)
    else:
        root, source_meta = resolve_source(src, revision)
        report = inspect_checkpoint(str(root))
    if family_for(report.architecture) is None:
        family_for(report.architecture, strict=True)  # raises UnsupportedArchitectureError with the list
    if not report.tensors:
        raise ConversionError(f"{src}: no safetensors weights to convert")
    plan = build_plan(report, dtype)
    if dry_run:
        if json_out:
            print(json.dumps({"source": str(root), "architecture": report.architecture, **plan_to_json(plan)},
                             indent=1))
        else:
            _print_plan(plan, report)
        _warn(plan.warnings)
        return 0
    _warn(plan.warnings)
    source_meta.update({"architecture": report.architecture, "family": report.family,
                        "fingerprint": source_fingerprint(report, root),
                        "files": sorted({t.file for t in report.tensors.values()})})

    def summary(result) -> None:  # runs with SIGINT/SIGTERM deferred, right after OUT is in place
        rate = result.bytes / result.seconds if result.seconds > 0 else 0.0  # bytes/s
        if json_out:
            print(json.dumps({"out": str(result.out), "tensors": result.tensors, "shards": result.shards,
                              "bytes": result.bytes, "seconds": round(result.seconds, 3),
                              "gb_per_s": round(rate / 1e9, 3), "bytes_per_s": round(rate),
                              "warnings": plan.warnings, "notes": plan.notes}, indent=1), flush=True)
        else:
            print(f"wrote {result.out}: {result.tensors} tensors in {result.shards} shard(s), "
                  f"{human_bytes(result.bytes)} in {result.seconds:.2f}s ({human_bytes(rate)}/s)", flush=True)

    with _sigterm_as_interrupt():
        result = write_layout(plan, root, out, shard_size=size, overwrite=overwrite, source=source_meta,
                              progress=not json_out and sys.stderr.isatty(), on_commit=summary)
    if result.interrupted:
        print("note: interrupted after the conversion had completed; the layout is complete", file=sys.stderr)
    return 0


def run_verify(layout: str, *, source: str | None = None, json_out: bool = False) -> int:
    """``atomtool verify LAYOUT [--source SRC]``: 0 when every check passes, 1 otherwise (problems listed).

    Raises:
        LayoutError: not a layout (no/malformed atomtool.json). SourceError: unreadable source.
    """
    from atomtool.convert.verify import verify_layout

    report = verify_layout(layout, source)
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        for p in report.problems:
            print(f"problem: {p}", file=sys.stderr)
        what = f"{report.tensors} tensors, {human_bytes(report.bytes)} checksummed"
        if source is not None:
            what += f"; {report.parts} parts reproduce {source}"
            if report.dequantized:
                what += f" ({report.dequantized} FP8 parts dequantize exactly)"
        print(("OK: " if report.ok else f"FAILED ({len(report.problems)} problems): ") + what)
    return 0 if report.ok else 1

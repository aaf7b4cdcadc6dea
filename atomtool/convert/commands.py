"""``atomtool convert`` and ``atomtool verify``: the command functions the CLI calls.

``run_convert``: resolve SRC (a local directory, or a Hub repo id downloaded first with
``huggingface_hub.snapshot_download`` and its progress bar), inspect it, build the plan, then either print
it (``--dry-run``: a rich table or ``--json``; nothing is written) or stream it into OUT atomically.
A checkpoint the engine could not serve after conversion (inspect's error findings or ``servable: false``,
source tensors the engine needs that are missing) is refused before any work, dry run or not, unless
``--force``. Warnings (lossy dtype casts, ``--force``) go to stderr, one line each; lossless widenings are
``note:`` lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from atomtool.convert.extra_files import (
    OTHER_WEIGHT_SUFFIXES,
    PICKLE_WEIGHT_SUFFIXES,
    carried_note,
    not_carried_note,
)
from atomtool.convert.layout import spec_to_entry
from atomtool.convert.plan import build_plan, missing_message
from atomtool.convert.plan_types import ConversionPlan, OutputTensor
from atomtool.convert.writer import (
    check_destination,
    check_disk_space,
    clean_leftover_tmp_dirs,
    estimate_bytes,
    hold_interrupts_until_exit,
    human_bytes,
    parse_size,
    plan_shards,
    write_layout,
)
from atomtool.errors import (
    AtomtoolError,
    ConversionError,
    SourceError,
    UnsupportedArchitectureError,
    sigterm_as_interrupt,
)
from atomtool.inspect.families import family_for, supported_architectures
from atomtool.inspect.source import check_path_argument, hub_download_error, looks_like_path, quiet_hub_logs
from atomtool.inspect.types import InspectReport

#: files a conversion fetches from a Hub repo: everything but weights in other formats (the trailing "*"
#: matches any path; the named patterns are the files convert itself reads). The writer carries every
#: downloaded non-weight file into the layout, see :mod:`atomtool.convert.extra_files`.
HUB_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py", "LICENSE*", "*"]
#: never downloaded: pickle weights and other frameworks' weights (the layout's weights come from the
#: safetensors), git metadata
HUB_IGNORE = [f"*{s}" for s in PICKLE_WEIGHT_SUFFIXES + OTHER_WEIGHT_SUFFIXES] + [".gitattributes"]


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
    from huggingface_hub.utils import HFValidationError

    try:
        local = _download(src, revision)
    except HFValidationError:
        raise SourceError(f"{src}: neither a local directory nor a valid Hub repo id") from None
    except Exception as exc:  # huggingface_hub raises many typed errors: one-line message, as inspect's
        err = hub_download_error(src, exc, revision)
        cached = _cached_revisions(src) if revision is not None else []
        if cached and "is not in the local HF cache" in str(err):  # the repo is, at other revisions
            err = SourceError(str(err).replace("the repo is not in the local HF cache",
                                               f"revision {revision!r} is not in the local HF cache")
                              + f", which holds {', '.join(cached)}")
        raise err from None
    return Path(local), {"path": str(local), "repo_id": src, "revision": revision,
                         "commit": Path(local).name}


def _cached_revisions(repo: str) -> list[str]:
    """The branch/tag names and snapshot commits of ``repo`` in the local HF cache (empty when none)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    refs = sorted(p.relative_to(storage / "refs").as_posix() for p in (storage / "refs").rglob("*") if p.is_file()) \
        if (storage / "refs").is_dir() else []
    commits = sorted(p.name for p in (storage / "snapshots").iterdir()) if (storage / "snapshots").is_dir() else []
    return refs + commits


def _download(repo: str, revision: str | None) -> str:
    """``snapshot_download`` of ``repo`` at ``revision``; offline (``HF_HUB_OFFLINE``) or with the Hub
    unreachable, the cached snapshot (``local_files_only=True``).

    Why the explicit cache pass: for a commit-hash revision huggingface_hub skips its own offline fallback
    and lists the repo tree from the Hub unless that listing is cached too (a snapshot filled by
    ``hf_hub_download`` or an older huggingface_hub has none), so an explicit ``--revision <sha>`` failed
    offline on a cache ``inspect`` reads. Raises the first attempt's error when the cache does not hold it.
    """
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    def get(local_files_only: bool) -> str:
        with quiet_hub_logs():
            return snapshot_download(repo_id=repo, revision=revision, allow_patterns=HUB_PATTERNS,
                                     ignore_patterns=HUB_IGNORE, local_files_only=local_files_only)

    if constants.is_offline_mode():
        return get(True)
    try:
        return get(False)
    except (OfflineModeIsEnabled, httpx.TransportError, LocalEntryNotFoundError) as exc:
        first = exc  # raised as is: its __cause__ tells hub_download_error why the Hub was not reached
    try:
        return get(True)
    except LocalEntryNotFoundError:
        raise first from first.__cause__


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
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)  # one line per note
    console.print("dry run: nothing written", highlight=False)


def _warn(lines: list[str], prefix: str = "warning") -> None:
    for line in lines:
        print(f"{prefix}: {line}", file=sys.stderr)


def servability_problems(report: InspectReport) -> list[str]:
    """Why a layout converted from ``report`` would not be servable, most specific first; empty when it would.

    Reuses inspect's verdicts rather than re-deriving them: every ``error`` finding of the report (e.g.
    ``fp8-without-scale``, ``config-invalid``), then, when ``report.servable`` is false, the family the engine
    does not run (:attr:`atomtool.inspect.families.Family.servable`) and inspect's ``scheme-not-servable`` /
    ``activation-not-servable`` / ``feature-not-servable`` findings (schemes outside :data:`~atomtool.inspect.families.SERVABLE_SCHEMES`). Each line is
    ``code: message`` on one line.
    """
    problems = [f"{f.code}: {f.message}" for f in report.findings if f.severity == "error"]
    if not report.servable:
        fam = family_for(report.architecture)
        if fam is not None and not fam.servable:
            problems.append(f"architecture-not-servable: {report.architecture} ({fam.name} family) is recognised "
                            f"by inspect but the engine does not run it; it runs "
                            f"{', '.join(supported_architectures())}")
        problems += [f"{f.code}: {f.message}" for f in report.findings
                     if f.code in ("scheme-not-servable", "activation-not-servable", "feature-not-servable")
                     and f.severity != "error"]
        if len(problems) == 0:
            problems.append(f"not-servable: inspect reports {report.source} as not servable")
    return [" ".join(p.split()) for p in dict.fromkeys(problems)]


def refusal_message(src: str, problems: list[str]) -> str:
    """One line: the first problem, how many more, where to see them all, and ``--force``."""
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return (f"{src} would not convert into a servable layout: {problems[0]}{more}; see `atomtool inspect {src}`; "
            "pass --force to convert anyway")


#: seconds to stay after the summary; a test hook to land a "late" signal where process exit would be
AFTER_SUMMARY_SLEEP_ENV = "ATOMTOOL_CONVERT_TEST_SLEEP_AFTER_SUMMARY"
#: prefix of the warnings ``--force`` turns refusals into
FORCED = "--force: converting although the layout will not be servable"


def _check_servable(src: str, report: InspectReport, *, force: bool) -> list[str]:
    """Raise ConversionError (the refusal) for a checkpoint the engine could not serve after conversion, or,
    with ``force``, return the warning lines to print instead."""
    problems = servability_problems(report)
    if problems and not force:
        raise ConversionError(refusal_message(src, problems))
    return [f"{FORCED}: {p}" for p in problems]


def _vet(src: str, report: InspectReport, dtype: str, *, force: bool) -> tuple[ConversionPlan, list[str]]:
    """The refusals that depend on the checkpoint, in order: unknown architecture, no weights, servability
    (:func:`servability_problems`), missing tensors (the plan's). Returns the plan and, with ``force``, the
    warnings that replace the servability refusals."""
    if family_for(report.architecture) is None:
        why = next((f.message for f in report.findings if f.code in ("unknown-architecture", "no-config")
                    and report.architecture == "unknown"), None)
        if why is not None:  # no config.json / no architectures in it: inspect's finding says so
            raise UnsupportedArchitectureError(why)
        family_for(report.architecture, strict=True)  # raises UnsupportedArchitectureError with the list
    if not report.tensors:  # why, when inspect knows: pickle weights, an index naming none of the shards
        why = [f.message for f in report.findings if f.code in ("pickle-weights-ignored", "source-warning")]
        raise ConversionError(f"{src}: no safetensors weights to convert" + "".join(f"; {w}" for w in why))
    forced = _check_servable(src, report, force=force)  # inspect's verdict: before planning
    plan = build_plan(report, dtype)  # the plan names the source tensors the engine needs and lacks
    missing = [n for n in plan.missing if not any(n in line for line in forced)]  # not said by inspect already
    if missing:
        if not force:
            raise ConversionError(refusal_message(src, [missing_message(missing)]))
        forced.append(f"{FORCED}: {missing_message(missing)}")
    return plan, forced


def run_convert(src: str, out: str, *, dtype: str = "auto", shard_size: str = "5GB", overwrite: bool = False,
                dry_run: bool = False, json_out: bool = False, revision: str | None = None, force: bool = False,
                progress: bool | None = None, process_exit: bool = False) -> int:
    """``atomtool convert SRC OUT``: returns the exit code (0).

    Refusals come before any work, in the same order with and without ``dry_run`` (a dry run predicts the
    real run): the destination (:func:`check_destination`), the architecture, then servability -- error
    findings of inspect, schemes or an architecture the engine does not run (:func:`servability_problems`)
    and source tensors the engine needs but the checkpoint lacks (:func:`atomtool.convert.plan.missing_tensors`,
    at plan time). ``force`` turns the servability refusals into warnings. Leftover temporary directories
    of crashed conversions into OUT are reported, and removed when stale (not with ``dry_run``).

    Args:
        progress: a tqdm bar on stderr (bytes, shard, tensor); None: only when stderr is a terminal and not
            ``json_out``.
        process_exit: the caller (the CLI process) exits right after: once the layout is complete and
            reported, SIGINT/SIGTERM are ignored for good so a late signal cannot fail it.
    Raises:
        ConversionError: a refusal (OUT in SRC, non-empty OUT, disk space, not servable, missing tensors, no
            weights), an overflowing cast. UnsupportedArchitectureError: an unknown architecture.
            SourceError / ConfigError / HeaderError: unreadable SRC.
    """
    from atomtool.inspect.classify import inspect_checkpoint

    size = parse_size(shard_size)
    check_path_argument(src, "SRC", "pass a checkpoint directory or a Hub repo id", ConversionError)
    local_src = Path(src).expanduser()
    hub_id = not local_src.is_dir() and not local_src.exists() and not looks_like_path(src)
    # refuse before any work; a Hub repo id cannot contain OUT, so only OUT itself is checked for it
    check_destination(None if hub_id else local_src, out, overwrite=overwrite)
    leftovers = clean_leftover_tmp_dirs(out, remove=not dry_run)
    _warn(leftovers)
    if hub_id and not dry_run and not force:
        # vet the repo from its remote headers before downloading it (a 700 GB download must not precede a
        # refusal); if the remote read fails (offline, cache only), the download path below says why
        try:
            remote = inspect_checkpoint(src, revision)
        except AtomtoolError:
            remote = None
        if remote is not None:
            _vet(src, remote, dtype, force=False)
    if dry_run and hub_id:
        # a Hub repo id: the plan needs headers only, which inspect reads remotely (no weight download)
        report = inspect_checkpoint(src, revision)
        root = Path(report.root) if report.root else Path(src)
    else:
        root, source_meta = resolve_source(src, revision)
        report = inspect_checkpoint(str(root))
    plan, forced = _vet(src, report, dtype, force=force)
    if dry_run:
        if report.root is not None and Path(report.root).is_dir():
            check_disk_space(out, estimate_bytes(plan, plan_shards(plan, size), Path(report.root)))
        if json_out:
            print(json.dumps({"source": str(root), "architecture": report.architecture, **plan_to_json(plan)},
                             indent=1))
        else:
            _print_plan(plan, report)
        _warn(forced)
        _warn(plan.warnings)
        return 0
    _warn(forced)
    _warn(plan.warnings)
    if not json_out:
        _warn(plan.infos, "note")
    source_meta.update({"architecture": report.architecture, "family": report.family,
                        "fingerprint": source_fingerprint(report, root),
                        "files": sorted({t.file for t in report.tensors.values()})})
    if forced:
        source_meta["forced"] = forced  # verify repeats them: the layout was written despite these

    def summary(result) -> None:  # runs with SIGINT/SIGTERM deferred, right after OUT is in place
        rate = result.bytes / result.seconds if result.seconds > 0 else 0.0  # bytes/s
        if json_out:
            print(json.dumps({"out": str(result.out), "tensors": result.tensors, "shards": result.shards,
                              "bytes": result.bytes, "seconds": round(result.seconds, 3),
                              "gb_per_s": round(rate / 1e9, 3), "bytes_per_s": round(rate),
                              "warnings": leftovers + forced + plan.warnings + (
                                  [result.sync_warning] if result.sync_warning else []), "notes": plan.notes,
                              "carried_files": [e["path"] for e in result.manifest["carried_files"]],
                              "not_carried": result.manifest["not_carried"]}, indent=1), flush=True)
        else:
            if result.sync_warning:
                _warn([result.sync_warning])
            _warn([n for n in (carried_note(result.manifest["carried_files"]),
                               not_carried_note(result.manifest["not_carried"])) if n], "note")
            print(f"wrote {result.out}: {result.tensors} tensors in {result.shards} shard(s), "
                  f"{human_bytes(result.bytes)} in {result.seconds:.2f}s ({human_bytes(rate)}/s)", flush=True)
        if process_exit:  # complete and reported: nothing may turn this into a failure any more
            hold_interrupts_until_exit()

    if progress is None:
        progress = not json_out and sys.stderr.isatty()
    with sigterm_as_interrupt():
        result = write_layout(plan, root, out, shard_size=size, overwrite=overwrite, source=source_meta,
                              progress=progress, on_commit=summary)
    if result.interrupted:
        print("note: interrupted after the conversion had completed; the layout is complete", file=sys.stderr)
    hold = float(os.environ.get(AFTER_SUMMARY_SLEEP_ENV, "0") or 0)
    if hold:
        time.sleep(hold)
    return 0


#: problems ``verify`` prints one per line (the rest are counted; ``--json`` lists all)
MAX_PROBLEMS = 20


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
        _warn(report.warnings)  # written with --force: intact, but not servable
        _warn(report.notes, "note")
        for p in report.problems[:MAX_PROBLEMS]:
            print(f"problem: {p}", file=sys.stderr)
        if len(report.problems) > MAX_PROBLEMS:
            print(f"problem: ... and {len(report.problems) - MAX_PROBLEMS} more (--json lists all)", file=sys.stderr)
        what = f"{report.tensors} tensors, {human_bytes(report.bytes)} checksummed"
        if source is not None:
            what += f"; {report.parts} parts reproduce {source}"
            if report.dequantized:
                what += f" ({report.dequantized} FP8 parts dequantize exactly)"
        n = len(report.problems)
        print(("OK: " if report.ok else f"FAILED ({n} problem{'' if n == 1 else 's'}): ") + what)
    return 0 if report.ok else 1

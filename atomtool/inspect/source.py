"""CheckpointSource: a checkpoint's config.json and safetensors headers, from a local directory or the Hub.

Reads headers only, never tensor data: locally the 8-byte prefix plus the header of each shard; on the Hub
HTTP range reads of the same bytes, shards in parallel, at most two requests per shard (the first range is
sized from the index's tensor names so it almost always holds the whole header), plus config.json and
model.safetensors.index.json through ``hf_hub_download`` (so they land in the HF cache). huggingface_hub
supplies everything Hub-specific: endpoint (``HF_ENDPOINT``), auth (``HF_TOKEN`` / saved token), URLs,
retries, the cache and offline mode (``HF_HUB_OFFLINE=1``, or the network is down: files already in the
cache are used). A down network is detected up front by one TCP connect (:func:`_probe_endpoint`), so it
costs one line and no backoff; huggingface_hub's retry warnings are silenced during our calls. Header validation is ours (:mod:`atomtool.inspect.safetensors_header`, which says why).

Layouts (HF conventions, research/quant.md §1.4): ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file) or a single ``model.safetensors``; without either, every top-level ``*.safetensors``
file; a directory with config.json and no weights gives no tensors (inspect reports from the config alone).

Errors: :class:`SourceError` (missing directory/shard, bad index, index path escaping the checkpoint, Hub
failures), :class:`ConfigError` (config.json not JSON / not an object), :class:`HeaderError` (a corrupt
header, or one tensor in two shards). Each message is one line naming the file. Hub failures have one
translation (:func:`_hub_error`); :func:`hub_download_error` applies it to the whole-repo downloads of
convert, serve and generate, so every stage words an unknown repo, a missing revision or a down Hub alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from atomtool.errors import AtomtoolError, ConfigError, HeaderError, SourceError, clip, one_line
from atomtool.inspect.safetensors_header import (
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    parse_header_bytes,
    parse_header_length,
    read_header_blob,
)
from atomtool.inspect.types import TensorInfo

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

MAX_JSON_BYTES = 100_000_000  # config.json / index.json larger than this are refused (hostile input)
MAX_WORKERS = 16  # parallel header reads (threads: the work is I/O)
SINGLE_FILE_FIRST_RANGE = 256 * 1024  # first range read of a shard whose tensor names are unknown
HTTP_TIMEOUT_S = 30.0
CONNECT_PROBE_TIMEOUT_S = 5.0  # TCP connect to the Hub before the first request (fail fast when offline)

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


@dataclass
class CheckpointSource:
    """A checkpoint as inspect sees it: config.json plus every tensor declared in the safetensors headers.

    source: the string given (directory or Hub repo id). root: local directory holding the files (the
    snapshot directory in the HF cache when every shard is cached there), None when the shards are only
    remote. config: config.json as a dict, None if absent. tensors: name -> TensorInfo (``file`` = shard
    name relative to the root). files: shard names, sorted. is_remote: read from the Hub (or its cache).
    metadata: shard name -> the header's ``__metadata__`` (str -> str). revision: the revision asked for
    (None = default branch). commit: the commit hash the Hub resolved (remote only, when known).
    index_metadata: the ``metadata`` object of model.safetensors.index.json (e.g. ``total_size``), None
    without an index. warnings: non-fatal problems (e.g. tensors a stale index.json does not list).
    unlisted: tensors declared in a shard header but absent from the index's ``weight_map`` (sorted); they
    are in ``tensors`` (the headers' view) but nothing loads them: transformers loads by the index, and
    :func:`atomtool.inspect.classify.inspect_checkpoint` leaves them out of the report.
    """

    source: str
    root: Path | None
    config: dict[str, Any] | None
    tensors: dict[str, TensorInfo]
    files: list[str]
    is_remote: bool
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    revision: str | None = None
    commit: str | None = None
    index_metadata: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    #: weight files found but not read (pickle checkpoints: ``model.bin``, ``*.pt``) when there are no
    #: safetensors weights
    ignored_weights: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, source: str, revision: str | None = None) -> CheckpointSource:
        """Open a local checkpoint directory or a Hub repo id and read config.json and all headers.

        source: an existing directory, else a Hub repo id (``org/name``). revision: Hub branch, tag or
        commit (only for repo ids). Raises SourceError, ConfigError or HeaderError (see module doc).
        """
        check_path_argument(source, "SOURCE", "pass a checkpoint directory or a Hub repo id")
        path = Path(source).expanduser()
        if path.is_dir():
            if revision is not None:
                raise SourceError(f"{source}: --revision applies to Hub repo ids, not to a local directory")
            return _open_dir(source, path, is_remote=False)
        if path.exists():
            raise SourceError(f"{source}: is a file; pass the checkpoint directory (holding config.json)")
        if looks_like_path(source):
            raise SourceError(f"{source}: no such directory")
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(source)
        except HFValidationError:
            raise SourceError(f"{source}: neither a local directory nor a valid Hub repo id") from None
        return _open_hub(source, revision)

    def local_path(self, file: str) -> Path:
        """Local path of one of :attr:`files` (or a side file such as tokenizer.json) under :attr:`root`.

        Raises SourceError when the checkpoint is remote-only (root is None).
        """
        if self.root is None:
            raise SourceError(f"{self.source}: {file} is not available locally (remote checkpoint not in the "
                              "HF cache; download it first, e.g. `hf download`)")
        return self.root / file

    def read_json(self, name: str) -> dict[str, Any] | None:
        """A small side JSON file of the checkpoint (``hf_quant_config.json``, ``generation_config.json``,
        ...), or None if it does not exist. Remote files come through ``hf_hub_download`` (cached).
        Raises ConfigError when it is not a JSON object."""
        _check_member(name, self.source)
        if self.root is not None and (self.root / name).is_file():
            return _load_json_object(self.root / name, ConfigError)
        if not self.is_remote:
            return None
        from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

        rev = self.commit or self.revision
        if try_to_load_from_cache(self.source, name, revision=rev) is _CACHED_NO_EXIST:
            return None
        try:
            p = _hub_download_json(self.source, name, rev)
        except _NetworkDown as e:
            raise SourceError(f"{self.source}: {name} is not in the local HF cache and the Hub cannot be "
                              f"reached ({e})") from None
        return None if p is None else _load_json_object(p, ConfigError)


# ----------------------------------------------------------------------------- local


def _both_warning(source: str) -> str:
    """The source-warning of a checkpoint holding both model.safetensors and an index (model.safetensors read)."""
    return (f"{source}: has both {SINGLE_FILE} and {INDEX_FILE}; reading {SINGLE_FILE}, as transformers does "
            "(it loads model.safetensors first); the index and the shards it names are ignored")


def _open_dir(source: str, root: Path, *, is_remote: bool, revision: str | None = None,
              commit: str | None = None, strict_weights: bool = False) -> CheckpointSource:
    """Read a directory laid out like an HF checkpoint (a local checkout or an HF cache snapshot).

    strict_weights: a cache snapshot without index/model.safetensors is an error (the weights may just
    not be cached) unless the caller established that the repo has none.
    """
    try:  # an unreadable directory: one line, not a traceback from the first is_file (EACCES propagates there)
        os.listdir(root)
    except OSError as exc:
        raise SourceError(f"{source}: cannot read the directory ({exc.strerror or exc}); its files are listed "
                          "to find the weights, tokenizer and other files") from None
    config = _load_json_object(root / CONFIG_FILE, ConfigError) if (root / CONFIG_FILE).is_file() else None
    weight_map, index_meta = None, None
    index_path = root / INDEX_FILE
    index_label = f"{source}/{INDEX_FILE}" if is_remote else str(index_path)
    both: list[str] = []
    if (root / SINGLE_FILE).is_file() and index_path.is_file():
        # transformers' from_pretrained looks for model.safetensors first and loads it when it exists; a
        # malformed index is still an error (a broken file in the checkpoint, whichever is read)
        _load_index(index_path)
        files = [SINGLE_FILE]
        both.append(_both_warning(source))
    elif index_path.is_file():
        weight_map, index_meta = _load_index(index_path)
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (root / f).is_file():
                if is_remote:
                    raise SourceError(f"{index_label}: names shard {f!r}, which is not in the local HF cache "
                                      f"({root})")
                raise SourceError(f"{index_label}: names shard {f!r}, which does not exist in {root}")
    elif (root / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
    pickles: list[str] = []
    if not files:
        if strict_weights:
            raise SourceError(f"{source}: the weights are not in the local HF cache ({root})")
        pickles = pickle_weight_files(root)
        if config is None:
            extra = f" (found {pickles[0]}: only safetensors is supported)" if pickles else ""
            raise SourceError(f"{root}: no config.json and no *.safetensors weights{extra}")

    def fetch(f: str) -> tuple[bytes, int]:
        try:
            return read_header_blob(root / f)
        except OSError as e:
            raise SourceError(f"{root / f}: cannot read ({e.strerror or e})") from None

    def parse(f: str, got: tuple[bytes, int]) -> SafetensorsHeader:
        return parse_header_bytes(got[0], file=f, label=str(root / f), file_size=got[1])

    headers = _parallel(fetch, parse, files)
    label = (lambda f: f"{source}/{f}") if is_remote else (lambda f: str(root / f))
    tensors, warnings, unlisted = _merge(headers, weight_map, label, index_label)
    warnings += both
    if weight_map is not None:
        warnings += _unindexed_files_warning(root, files, index_label)
    return CheckpointSource(
        source=source, root=root, config=config, tensors=tensors, files=files, is_remote=is_remote,
        metadata={f: h.metadata for f, h in headers.items()}, revision=revision, commit=commit,
        index_metadata=index_meta, warnings=warnings, ignored_weights=pickles, unlisted=unlisted,
    )


def _unindexed_files_warning(root: Path, files: list[str], index_label: str) -> list[str]:
    """A warning naming the top-level ``*.safetensors`` files of ``root`` that the index does not name (a
    stale index.json, e.g. after a shard was added): their tensors are not read, as transformers does not
    load them, and a tensor only they hold reads as missing. Their headers are not opened. Mistral's
    ``consolidated*.safetensors`` (the same weights in mistral-inference's names, shipped beside the HF
    shards) is expected there and not named."""
    listed = set(files)
    stray = sorted(p.name for p in root.glob("*.safetensors")
                   if p.name not in listed and not p.name.startswith("consolidated") and p.is_file())
    if not stray:
        return []
    shown = ", ".join(stray[:5]) + (f" (+{len(stray) - 5} more)" if len(stray) > 5 else "")
    return [f"{index_label}: does not name {len(stray)} safetensors file(s) in {root}: {shown} (stale index?); "
            "their tensors are not read, as transformers does not load them (a tensor only they hold counts "
            "as missing)"]


#: weight files in PyTorch's pickle format (torch.save / pytorch_model.bin): never read (unpickling runs code)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickle_weight_files(root: Path) -> list[str]:
    """Top-level files of ``root`` that look like pickle checkpoints (``model.bin``, ``model.pt``,
    ``pytorch_model-00001-of-00002.bin``, ...), sorted; atomtool reads safetensors only."""
    return sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))


def _parallel(fetch: Callable[[str], Any], parse: Callable[[str, Any], Any], files: list[str]) -> dict[str, Any]:
    """``fetch`` the shards' header bytes in threads (I/O) while this thread ``parse``s them in shard order
    (CPU; one parser avoids GIL contention). The first error in shard order is raised."""
    if len(files) <= 1:
        return {f: parse(f, fetch(f)) for f in files}
    with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(files))) as pool:
        futures = [(f, pool.submit(fetch, f)) for f in files]
        try:
            return {f: parse(f, fut.result()) for f, fut in futures}
        except BaseException:
            for _, fut in futures:
                fut.cancel()
            raise


def _merge(headers: dict[str, SafetensorsHeader], weight_map: dict[str, str] | None,
           label: Callable[[str], str], index_label: str
           ) -> tuple[dict[str, TensorInfo], list[str], list[str]]:
    """(all shards' tensors by name, warnings, tensors the index does not list); a name in two shards is a
    HeaderError; the index must agree (a name it maps to a shard whose header lacks it is a SourceError).

    The common case runs at C speed (dict.update, dict equality); only a mismatch walks the names to
    find what to report.
    """
    tensors: dict[str, TensorInfo] = {}
    for h in headers.values():
        tensors.update(h.tensors)
    if len(tensors) != sum(len(h.tensors) for h in headers.values()):
        seen: dict[str, str] = {}
        for f, h in headers.items():
            for name in h.tensors:
                if name in seen:
                    raise HeaderError(f"{label(f)}: tensor {name!r} is also in shard {seen[name]!r}")
                seen[name] = f
    warnings: list[str] = []
    unlisted: list[str] = []
    if weight_map is not None:
        declared = {name: info.file for name, info in tensors.items()}
        if declared != weight_map:
            for name, f in weight_map.items():
                if declared.get(name) != f:
                    raise SourceError(f"{index_label}: maps tensor {name!r} to {f!r}, whose header does not "
                                      "declare it")
            unlisted = sorted(set(declared) - set(weight_map))
            shown = ", ".join(unlisted[:5]) + (f" (+{len(unlisted) - 5} more)" if len(unlisted) > 5 else "")
            warnings.append(f"{index_label}: {len(unlisted)} tensor(s) in shard headers are missing from "
                            f"weight_map (stale index?): {shown}; they are ignored, as transformers ignores "
                            "them (it loads the tensors the index lists)")
    return tensors, warnings, unlisted


def check_path_argument(value: str | os.PathLike, name: str, expected: str,
                        error: type[AtomtoolError] = SourceError) -> None:
    """Refuse an empty path argument (an unset shell variable, ``"$OUT"``): ``Path("")`` is the current
    directory, which the command would read or write instead. Raises ``error`` with
    ``"<name> is an empty string; <expected>"``."""
    if not str(value):
        raise error(f"{name} is an empty string; {expected}")


def looks_like_path(source: str) -> bool:
    """True when SOURCE is meant as a filesystem path rather than a Hub repo id (``org/name``): it starts with
    ``/``, ``.`` or ``~``, holds a backslash, or has more than one ``/``. The one rule every stage uses."""
    return source.startswith(("/", ".", "~")) or "\\" in source or source.count("/") > 1


def _check_member(name: object, where: str) -> str:
    """A file name from an index must stay inside the checkpoint directory (relative, no '..')."""
    if not isinstance(name, str) or not name:
        raise SourceError(f"{where}: {name!r} is not a file name")
    pp, wp = PurePosixPath(name), PureWindowsPath(name)
    if pp.is_absolute() or wp.is_absolute() or wp.drive or "\\" in name or ".." in pp.parts:
        raise SourceError(f"{where}: path {name!r} points outside the checkpoint directory")
    return name


def _read_capped(path: Path, cap: int, err: type[Exception]) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise err(f"{path}: larger than {cap} bytes; refusing to parse")
    return data


def _load_json_object(path: Path, err: type[Exception]) -> dict[str, Any]:
    """Parse a JSON object file; any problem raises ``err`` with one line naming the file."""
    try:
        data = _read_capped(path, MAX_JSON_BYTES, err)
    except OSError as e:
        raise err(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise err(f"{path}: not valid UTF-8 (bad byte at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise err(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise err(f"{path}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise err(f"{path}: top level is not a JSON object")
    return obj


def _load_index(path: Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    """weight_map and metadata of model.safetensors.index.json, validated (SourceError naming the file)."""
    obj = _load_json_object(path, SourceError)
    wm = obj.get("weight_map")
    if not isinstance(wm, dict):
        raise SourceError(f"{path}: has no 'weight_map' object")
    for name, f in wm.items():
        if not isinstance(f, str):
            raise SourceError(f"{path}: weight_map entry for {name!r} is not a file name")
    for f in sorted(set(wm.values())):  # a few hundred shard names for ~100k tensors
        _check_member(f, str(path))
    meta = obj.get("metadata")
    return wm, meta if isinstance(meta, dict) else None


# ----------------------------------------------------------------------------- Hub


class _NetworkDown(Exception):
    """The Hub cannot be reached (offline mode, connection error): fall back to the HF cache."""


def _endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


@contextlib.contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Silence huggingface_hub's retry/backoff warnings ("... thrown while requesting HEAD ...", "Retrying
    in 8s") while our calls run: every failure ends in one line of ours instead."""
    loggers = [logging.getLogger(n) for n in ("huggingface_hub.utils._http", "huggingface_hub.file_download")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def _probe_endpoint() -> None:
    """Fail fast when the Hub cannot be reached: one TCP connect (DNS + handshake) to the endpoint, retried
    once unless it timed out. Raises _NetworkDown.

    Why our own probe: on a cold cache ``hf_hub_download`` retries a failed HEAD 5 more times with backoff
    (1+2+4+8+8 s) and exposes no retry setting. Skipped when a proxy applies (httpx goes through it).
    """
    from urllib.parse import urlsplit

    parts = urlsplit(_endpoint())
    host = parts.hostname
    if not host:
        return
    proxies = urllib.request.getproxies()
    if (proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    err: OSError | None = None
    for _ in range(2):
        try:
            socket.create_connection((host, port), timeout=CONNECT_PROBE_TIMEOUT_S).close()
            return
        except TimeoutError as e:
            raise _NetworkDown(f"connect to {host}:{port} timed out") from e
        except OSError as e:
            err = e
    assert err is not None
    raise _NetworkDown(f"{type(err).__name__}: {clip(err, 160)}")


def _open_hub(repo: str, revision: str | None) -> CheckpointSource:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return _open_cached(repo, revision, "HF_HUB_OFFLINE is set")
    try:
        with quiet_hub_logs():
            return _open_online(repo, revision)
    except _NetworkDown as e:
        return _open_cached(repo, revision, f"cannot reach {_endpoint()} ({e})")


def _hub_error(repo: str, what: str | None, e: Exception, revision: str | None = None) -> Exception | None:
    """Translate a huggingface_hub / httpx error into a one-line SourceError or _NetworkDown.

    The one translation of Hub failures: inspect's header reads call it directly (a _NetworkDown makes them
    fall back to the HF cache), downloads through :func:`hub_download_error`. what: the file being read
    (named in the message), None for a whole-repo download. revision: named when a revision is not found.
    An exception that is not a Hub / transport error gives ``None`` when ``what`` is None (the caller words it).
    """
    import httpx
    from huggingface_hub import errors as hfe

    about = f" ({what})" if what else ""
    if isinstance(e, (hfe.OfflineModeIsEnabled, httpx.TransportError)):
        return _NetworkDown(clip(e) or type(e).__name__)
    if isinstance(e, hfe.GatedRepoError):
        return SourceError(f"{repo}: gated repo; accept its terms on the Hub and set HF_TOKEN{about}")
    if isinstance(e, hfe.RepositoryNotFoundError):
        return SourceError(f"{repo}: not a local directory, and no Hub repo of that name at {_endpoint()} "
                           "(private or gated? set HF_TOKEN)")
    if isinstance(e, hfe.RevisionNotFoundError):
        rev = f" {revision!r}" if revision else ""
        return SourceError(f"{repo}: revision{rev} not found{about}")
    if isinstance(e, hfe.LocalEntryNotFoundError):
        cause = e.__cause__ or e
        where = f"{what}: " if what else ""
        return _NetworkDown(f"{where}{type(cause).__name__}: {clip(cause, 160)}")
    if isinstance(e, hfe.RemoteEntryNotFoundError):
        missing = what or _resolved_file(e) or "a file"
        return SourceError(f"{repo}: {missing} not found in the Hub repo (it may have changed meanwhile)")
    if isinstance(e, hfe.HfHubHTTPError) and e.response is not None:
        reading = f" reading {what}" if what else ""
        return SourceError(f"{repo}: HTTP {e.response.status_code}{reading} from {_endpoint()}")
    if what is None:
        return None
    return SourceError(f"{repo}: cannot read {what} ({type(e).__name__}: {clip(e)})")


def _resolved_file(e: Any) -> str | None:
    """The file name of a failed ``.../resolve/<revision>/<file>`` request, None if unknown."""
    from urllib.parse import unquote

    try:
        path = unquote(str(e.response.request.url.path))
    except Exception:  # no response / request attached
        return None
    _, sep, rest = path.partition("/resolve/")
    return (rest.partition("/")[2] or None) if sep else None


def hub_download_error(repo: str, e: Exception, revision: str | None = None) -> SourceError:
    """A one-line SourceError for a failed download of Hub repo ``repo`` (``snapshot_download`` /
    ``hf_hub_download``; convert, and serve/generate through convert's ``resolve_source``), worded like
    inspect's (:func:`_hub_error`): unknown or private repo, gated repo, missing revision or file, HTTP
    status, Hub unreachable or ``HF_HUB_OFFLINE`` with the repo not (fully) in the HF cache. Other
    exceptions keep their type and text, squeezed onto one line.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    if isinstance(e, LocalEntryNotFoundError):
        if isinstance(e.__cause__, HfHubHTTPError):  # the Hub answered with an error and nothing is cached
            e = e.__cause__
        else:
            offline = constants.is_offline_mode() or e.__cause__ is None
            reason = "HF_HUB_OFFLINE is set" if offline else f"cannot reach {_endpoint()}"
            if isinstance(e, IncompleteSnapshotError):
                return SourceError(f"{repo}: {reason}, and the local HF cache holds only part of the repo "
                                   f"({e.snapshot_path})")
            if offline:
                return SourceError(_not_cached(repo, reason))
    err = _hub_error(repo, None, e, revision)
    if isinstance(err, _NetworkDown):
        return SourceError(_not_cached(repo, f"cannot reach {_endpoint()} ({err})"))
    if isinstance(err, SourceError):
        return err
    return SourceError(f"{repo}: not a local directory, and cannot download it from the Hugging Face Hub "
                       f"({type(e).__name__}: {one_line(e)})")


def _not_cached(repo: str, reason: str) -> str:
    from huggingface_hub import constants

    # a bare name (no "/") is read as a Hub repo id only because no such local directory exists: say both
    # readings, so a mistyped local path is recognisable (`./name` asks for the directory alone)
    local = "" if "/" in repo else "no local directory by that name; as a Hub repo id: "
    return f"{repo}: {local}{reason}, and the repo is not in the local HF cache ({constants.HF_HUB_CACHE})"


def _hub_download_json(repo: str, name: str, revision: str | None) -> Path | None:
    """hf_hub_download a small JSON file (HEAD + GET on a cold cache); None if the repo lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        _probe_endpoint()
        with quiet_hub_logs():
            return Path(hf_hub_download(repo, name, revision=revision, endpoint=_endpoint(),
                                        etag_timeout=HTTP_TIMEOUT_S))
    except _NetworkDown:
        raise
    except LocalEntryNotFoundError as e:
        raise _hub_error(repo, name, e) from None
    except EntryNotFoundError:
        return None
    except Exception as e:
        raise _hub_error(repo, name, e) from None


def _open_online(repo: str, revision: str | None) -> CheckpointSource:
    from huggingface_hub import try_to_load_from_cache

    cfg_path = _hub_download_json(repo, CONFIG_FILE, revision)
    commit = revision if revision and _COMMIT_RE.fullmatch(revision) else None
    if cfg_path is not None and _COMMIT_RE.fullmatch(cfg_path.parent.name):
        commit = cfg_path.parent.name  # hf cache layout: snapshots/<commit>/config.json
    pinned = commit or revision  # read every other file at the same commit as config.json
    config = _load_json_object(cfg_path, ConfigError) if cfg_path is not None else None
    index_path = _hub_download_json(repo, INDEX_FILE, pinned)
    weight_map, index_meta = (None, None)
    both: list[str] = []
    if index_path is not None and _hub_file_exists(repo, SINGLE_FILE, pinned):
        # as _open_dir: transformers' from_pretrained loads model.safetensors first when it exists; a
        # malformed index is still an error
        _load_index(index_path)
        index_path, files = None, [SINGLE_FILE]
        both.append(_both_warning(repo))
    elif index_path is not None:
        weight_map, index_meta = _load_index(index_path)
        files = sorted(set(weight_map.values()))
    else:
        files = [SINGLE_FILE]
    names_by_file: dict[str, list[str]] = {}
    for name, f in (weight_map or {}).items():
        names_by_file.setdefault(f, []).append(name)

    cached: dict[str, Path] = {}
    for f in files:
        p = try_to_load_from_cache(repo, f, revision=pinned)
        if isinstance(p, str):
            cached[f] = Path(p)

    def fetch(f: str) -> tuple[bytes, int | None, str] | None:
        if f in cached:
            return (*read_header_blob(cached[f]), str(cached[f]))
        return _fetch_remote_header(repo, f, pinned, names_by_file.get(f))

    def parse(f: str, got: tuple[bytes, int | None, str] | None) -> SafetensorsHeader | None:
        return None if got is None else parse_header_bytes(got[0], file=f, label=got[2], file_size=got[1])

    results = _parallel(fetch, parse, files)
    headers = {f: h for f, h in results.items() if h is not None}
    if index_path is None and not headers:  # no index and no model.safetensors: config-only repo
        files = []
        if config is None:
            raise SourceError(f"{repo}: the Hub repo has neither {CONFIG_FILE} nor safetensors weights")
    elif index_path is not None and len(headers) != len(files):
        missing = next(f for f in files if f not in headers)
        raise SourceError(f"{repo}/{INDEX_FILE}: names shard {missing!r}, which does not exist in the repo")
    tensors, warnings, unlisted = _merge(headers, weight_map, lambda f: f"{repo}/{f}", f"{repo}/{INDEX_FILE}")
    warnings += both
    snapshot = cfg_path.parent if cfg_path is not None else (index_path.parent if index_path else None)
    root = snapshot if snapshot is not None and len(cached) == len(files) else None
    return CheckpointSource(
        source=repo, root=root, config=config, tensors=tensors, files=files, is_remote=True,
        metadata={f: h.metadata for f, h in headers.items()}, revision=revision, commit=commit,
        index_metadata=index_meta, warnings=warnings, unlisted=unlisted,
    )


def first_range_bytes(names: list[str] | None) -> int:
    """Size of the first range read of a shard: an upper estimate of 8 + header length.

    With the shard's tensor names known (from index.json) each header entry is at most the quoted name
    plus ~100 bytes (``{"dtype":"F8_E4M3FNUZ","shape":[...4 dims],"data_offsets":[12 digits, 12 digits]}``),
    so one request almost always suffices without downloading tensor data; without names, 256 KiB
    (huggingface_hub uses 100 kB).
    """
    if not names:
        return SINGLE_FILE_FIRST_RANGE
    est = 8 + 2 + sum(len(json.dumps(n)) + 100 for n in names) + 1024  # + __metadata__ and padding
    return min(-(-est // 4096) * 4096, 8 + MAX_HEADER_BYTES)


def _hub_file_exists(repo: str, name: str, revision: str | None) -> bool:
    """Whether Hub repo ``repo`` has file ``name`` at ``revision``: the HF cache when it holds the file,
    else one HEAD request (huggingface_hub's ``HfApi.file_exists``). Hub errors as :func:`_hub_error`."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo, name, revision=revision), str):
        return True
    try:
        return HfApi(endpoint=_endpoint()).file_exists(repo, name, revision=revision)
    except Exception as e:
        raise _hub_error(repo, name, e, revision) from None


def _fetch_remote_header(repo: str, file: str, revision: str | None,
                         names: list[str] | None) -> tuple[bytes, int | None, str] | None:
    """Range-read one shard's prefix + header from the Hub: 1 request, 2 when the header exceeds the first
    range. Returns (bytes, file size, label for messages), or None when the file does not exist (404
    EntryNotFound). The file size comes from Content-Range (``bytes 0-x/TOTAL``) so offsets are checked
    against the real end of file; the length prefix is validated here (HeaderError), the JSON by the caller.
    """
    import httpx
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    # one retry for a dropped/timed-out read; none for a refused connection or DNS failure (fail fast)
    retry_on = (httpx.TimeoutException, httpx.ReadError, httpx.RemoteProtocolError)
    url = hf_hub_url(repo, file, revision=revision, endpoint=_endpoint())
    label = f"{repo}/{file}"
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"
    want = first_range_bytes(names)

    def get(start: int, stop: int, blob: bytearray) -> int | None:
        """GET bytes [start, stop) appended to blob; returns the total file size if the server says."""
        try:
            with http_stream_backoff("GET", url, headers={**headers, "Range": f"bytes={start}-{stop - 1}"},
                                     timeout=HTTP_TIMEOUT_S, max_retries=1,
                                     retry_on_exceptions=retry_on) as r:
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                total = _total_size(r)
                skip = start if r.status_code == 200 else 0  # server ignored Range: body starts at byte 0
                for chunk in r.iter_bytes():
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    blob += chunk
                    if len(blob) >= stop:
                        break
                del blob[stop:]
                return total
        except EntryNotFoundError:
            raise
        except Exception as e:
            raise _hub_error(repo, file, e) from None

    blob = bytearray()
    try:
        total = get(0, want, blob)
    except EntryNotFoundError:
        return None
    n = parse_header_length(bytes(blob[:8]), label=label, file_size=total)
    if 8 + n > len(blob) and (total is None or len(blob) < total):
        try:
            get(len(blob), 8 + n, blob)
        except EntryNotFoundError:
            raise SourceError(f"{label}: disappeared between two range reads") from None
    return bytes(blob[: 8 + n]), total, label


def _total_size(r: Any) -> int | None:
    cr = r.headers.get("Content-Range", "")
    if r.status_code == 206 and "/" in cr:
        tail = cr.rsplit("/", 1)[1].strip()
        return int(tail) if tail.isdigit() else None
    if r.status_code == 200:
        cl = r.headers.get("Content-Length", "")
        return int(cl) if cl.isdigit() else None
    return None


def _open_cached(repo: str, revision: str | None, reason: str) -> CheckpointSource:
    """Offline / network down: read the checkpoint from the HF cache snapshot (HF_HUB_CACHE)."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    found = {f: try_to_load_from_cache(repo, f, revision=revision) for f in (CONFIG_FILE, INDEX_FILE,
                                                                              SINGLE_FILE)}
    paths = [Path(p) for p in found.values() if isinstance(p, str)]
    if not paths:
        raise SourceError(_not_cached(repo, reason))
    snapshot = paths[0].parent
    no_weights = found[INDEX_FILE] is _CACHED_NO_EXIST and found[SINGLE_FILE] is _CACHED_NO_EXIST
    commit = snapshot.name if _COMMIT_RE.fullmatch(snapshot.name) else None
    try:
        return _open_dir(repo, snapshot, is_remote=True, revision=revision, commit=commit,
                         strict_weights=not no_weights)
    except SourceError as e:
        raise SourceError(f"{e} ({reason})") from None

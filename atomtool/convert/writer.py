"""Streaming, atomic, sharded writer of an atomtool layout.

- Streaming: every shard's header is computed up front from the plan (names, dtypes, shapes are known
  before any data is read), then the data is appended tensor by tensor. An output that needs no cast is a
  sequence of source byte ranges and zero padding (:func:`atomtool.convert.materialize.byte_segments`):
  its bytes go file to file with ``os.copy_file_range`` (the in-kernel copy ``cp`` uses) in a writer
  thread while a thread pool computes each tensor's sha256 through short-lived mmaps, so such a tensor is
  never in memory whole. Only outputs that need a cast are materialized, one at a time. We write the
  safetensors framing ourselves (8-byte length, JSON header, data) instead of calling
  ``safetensors.torch.save_file`` because that needs a whole shard's tensors in memory at once. The files
  are ordinary safetensors (padded header, contiguous offsets, tensors ordered by alignment) readable by
  any safetensors tool.
- Atomic: everything goes to a hidden sibling ``.OUT.tmp-XXXX`` and is renamed to ``OUT`` only when the
  manifest, the last file, is written and every file is fsynced (an OUT that is a mount point is filled in
  place instead, from ``OUT/.atomtool.tmp-XXXX``, the manifest moved in last: :func:`stages_inside`); an exception or Ctrl-C removes the
  temporary directory, and a hard kill leaves at most that hidden directory (never an ``OUT`` that looks
  valid). The temporary directory records its owner (PID, host, process start time) in
  ``.atomtool-owner.json`` until the rename, so the next conversion into the same OUT tells a crashed
  conversion's leftovers (removed, with the bytes reclaimed) from a running one's (left alone), see
  :func:`clean_leftover_tmp_dirs`. ``--overwrite`` swaps the old layout out only after the new one is complete (an atomic
  ``renameat2(RENAME_EXCHANGE)`` where available). The final rename never replaces an OUT that another
  process completed meanwhile unless ``--overwrite`` was given (:func:`_commit`), and SIGINT/SIGTERM are
  deferred from the rename on: a complete conversion is not failed by a late Ctrl-C.
- Refusals (checked before any byte is written): OUT equal to or inside SRC, SRC inside an OUT that would
  be overwritten, a non-empty OUT without ``--overwrite``, ``--overwrite`` of a directory that is not an
  atomtool layout, an OUT whose parent cannot be written, not enough free disk space. SRC is only ever
  opened for reading.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import glob
import hashlib
import json
import mmap
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import atomtool
from atomtool.convert.cast import torch_dtype
from atomtool.convert.extra_files import copy_extra_files, extra_files
from atomtool.convert.layout import (
    CONFIG_NAME,
    FORMAT,
    INDEX_NAME,
    MANIFEST_NAME,
    VERSION,
    config_bytes,
    config_sha256,
    is_layout,
    layout_files,
    read_manifest,
    spec_to_entry,
)
from atomtool.convert.materialize import SourceReader, _bytes, byte_segments, materialize
from atomtool.convert.plan_types import ConversionPlan, OutputTensor
from atomtool.errors import ConversionError, LayoutError
from atomtool.inspect.report import human_bytes
from atomtool.inspect.safetensors_header import DTYPE_BITS
from atomtool.inspect.source import check_path_argument

#: seconds to sleep after each shard; a test hook to kill a conversion mid-write deterministically
SLEEP_ENV = "ATOMTOOL_CONVERT_TEST_SLEEP_PER_SHARD"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size such as ``5GB`` (decimal, like huggingface_hub), ``500MiB`` or ``1024``.

    Raises:
        ConversionError: unparsable or non-positive.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).upper() not in _UNITS:
            raise ConversionError(f"--shard-size {text!r}: expected a size such as 5GB, 500MB or 1GiB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ConversionError(f"--shard-size {text!r} must be positive")
    return value


def _fd_name(fd: int) -> str:
    """The path behind an open file descriptor (Linux /proc), for messages; ``fd N`` elsewhere."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def _source_files_inside(src: Path, out: Path) -> str | None:
    """The first file of SRC (symlinks followed) that lives inside OUT, or None."""
    if not src.is_dir():
        return None
    for f in sorted(src.iterdir()):
        with contextlib.suppress(OSError):
            r = f.resolve()
            if r == out or out in r.parents:
                return f.name
    return None


#: name prefix of the temporary directory a conversion stages inside OUT when OUT is a mount point
IN_PLACE_PREFIX = ".atomtool.tmp-"


def stages_inside(out: str | Path) -> bool:
    """Whether a conversion into ``out`` stages its files inside OUT instead of in a sibling: OUT is an existing
    directory on another filesystem than its parent (a mount point: a Docker volume, a freshly mounted disk),
    which cannot be renamed over (EBUSY) and whose parent may lack the room. Such an OUT is filled in place:
    every file moves in from the staging directory, the manifest last (OUT is a layout only once it is there)."""
    out_abs = Path(out).resolve()
    try:
        return out_abs.is_dir() and os.stat(out_abs).st_dev != os.stat(out_abs.parent).st_dev
    except OSError:
        return False


def _entries(out_r: Path) -> list[Path]:
    """OUT's entries, less the staging directories of conversions filling it in place."""
    return [p for p in out_r.iterdir() if not p.name.startswith(IN_PLACE_PREFIX)]


def check_destination(src: str | Path | None, out: str | Path, *, overwrite: bool) -> None:
    """Refuse destinations that would touch SRC or lose data (``src`` None: a Hub repo id not downloaded
    yet, only OUT itself is checked).

    Raises:
        ConversionError: OUT equals or is inside SRC; OUT is a file; OUT is non-empty without ``overwrite``;
            ``overwrite`` of a directory that is not an atomtool layout or that contains SRC.
    """
    check_path_argument(out, "OUT", "name the directory to write the layout to", ConversionError)
    out_r = Path(out).resolve()
    src_r = Path(src).resolve() if src is not None else None
    if src_r is not None and (out_r == src_r or src_r in out_r.parents):
        where = "is the source checkpoint" if out_r == src_r else "is inside the source checkpoint"
        raise ConversionError(f"OUT {out} {where} {src}; choose a directory outside SRC "
                              "(the source is never modified)")
    if out_r.exists() and not out_r.is_dir():
        raise ConversionError(f"OUT {out} exists and is not a directory")
    try:
        cwd: Path | None = Path.cwd().resolve()
    except OSError:  # the working directory was deleted: nothing to protect
        cwd = None
    in_place = stages_inside(out_r)
    if in_place and overwrite and out_r.is_dir() and _entries(out_r):
        raise ConversionError(f"OUT {out} is a mount point (another filesystem than its parent): convert fills it "
                              "in place and cannot swap an old layout out atomically, so --overwrite is refused "
                              "there; empty it first, or name a new directory inside it")
    if not in_place and cwd is not None and (out_r == cwd or out_r in cwd.parents):  # the finished layout is renamed over OUT: the shell would be
        # left in the replaced, deleted directory (an empty listing where the layout was just "written")
        raise ConversionError(f"OUT {out} is the current directory{'' if out_r == cwd else ' or holds it'}; "
                              "convert replaces OUT with a directory renamed into place, so run it from "
                              "elsewhere or name a new directory")
    if out_r.is_dir() and _entries(out_r):
        if not overwrite:
            if is_layout(out_r):
                raise ConversionError(f"OUT {out} is not empty (an atomtool layout); pass --overwrite to replace it")
            raise ConversionError(f"OUT {out} is not empty and not an atomtool layout (no {MANIFEST_NAME}); name a "
                                  "new or empty directory (--overwrite replaces only an atomtool layout)")
        if src_r is not None and out_r in src_r.parents:
            raise ConversionError(f"refusing to --overwrite {out}: it contains the source checkpoint {src}")
        inside = _source_files_inside(src_r, out_r) if src_r is not None else None
        if inside is not None:  # a SRC file symlinked into OUT would vanish with the old OUT
            raise ConversionError(f"refusing to --overwrite {out}: the source file {inside} resolves into it "
                                  "(the source is never modified)")
        check_replaceable(out_r, out)


def check_replaceable(out_r: Path, out: str | Path) -> None:
    """Refuse to --overwrite ``out_r`` unless it is an atomtool layout holding only the layout's own files
    (checked up front and again just before the swap: a file added while converting is not deleted either).

    Raises:
        ConversionError: not a layout (no or an unreadable manifest), or entries the layout does not list.
    """
    if not (out_r / MANIFEST_NAME).is_file():
        raise ConversionError(f"refusing to --overwrite {out}: it is not an atomtool layout "
                              f"(no {MANIFEST_NAME}); remove it yourself if it should go")
    try:
        foreign = foreign_entries(out_r)
    except LayoutError as exc:
        raise ConversionError(f"refusing to --overwrite {out}: its {MANIFEST_NAME} cannot be read as a layout "
                              f"manifest ({exc}); remove it yourself if it should go") from None
    if foreign:  # --overwrite replaces a layout, never what a user put beside it
        shown = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        raise ConversionError(f"refusing to --overwrite {out}: it holds {len(foreign)} "
                              f"entr{'y' if len(foreign) == 1 else 'ies'} the layout does not list ({shown}), "
                              "which replacing it would delete; move them out first")


def foreign_entries(out_r: Path) -> list[str]:
    """Entries of layout ``out_r`` that are not the layout's own files (:func:`layout_files`) nor directories
    holding only those: what a user added. Names relative to ``out_r``, directories with a trailing ``/``."""
    owned = layout_files(read_manifest(out_r))  # (LayoutError: not a readable manifest)
    owned_dirs = {p.as_posix() for f in owned for p in Path(f).parents if p != Path(".")}

    def walk(entries: list[Path]):
        for p in sorted(entries):
            rel = p.relative_to(out_r).as_posix()
            if p.is_dir() and not p.is_symlink():
                if rel in owned_dirs:
                    yield from walk(list(p.iterdir()))
                else:
                    yield rel + "/"
            elif rel not in owned:
                yield rel

    # every entry, the in-place staging prefix included: an OUT --overwrite replaces is never filled in place
    # (a mount point's overwrite is refused), so such a name is a user's
    return list(walk(list(out_r.iterdir())))


#: file inside a temporary ``.OUT.tmp-XXXX`` naming the convert that owns it (removed before the final rename)
OWNER_NAME = ".atomtool-owner.json"
#: seconds after which a temporary directory without an owner file (older atomtool, or a kill in the
#: microseconds between removing the owner file and the rename) counts as stale
UNOWNED_STALE_S = 600.0


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), to tell a reused PID
    from the original process; None where /proc is unavailable or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return False
    now = _process_start(pid)
    return start is None or now is None or now == start  # a reused PID has another start time


def _write_owner(tmp: Path) -> None:
    pid = os.getpid()
    (tmp / OWNER_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                              "start": _process_start(pid)}))


def _tree_bytes(path: Path) -> int:
    """Bytes the files under ``path`` occupy on disk (``st_blocks``; apparent size where unknown)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, f))
                total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


@dataclass
class LeftoverTmp:
    """A temporary directory ``.OUT.tmp-XXXX`` left next to OUT: its owner and whether it is stale."""

    path: Path
    bytes: int
    pid: int | None
    host: str | None
    stale: bool

    def describe(self) -> str:
        owner = f"PID {self.pid}" if self.pid is not None else "no owner recorded"
        if self.host is not None and self.host != socket.gethostname():
            owner += f" on host {self.host}"
        return f"{self.path.name} ({human_bytes(self.bytes)}, {owner})"


def leftover_tmp_dirs(out: str | Path) -> list[LeftoverTmp]:
    """Temporary directories of earlier conversions into ``out`` (``.OUT.tmp-XXXX`` siblings), each judged
    stale (its convert is gone: the recorded PID does not run on this host, or runs with another start time,
    i.e. was reused; or no owner was recorded and it is older than :data:`UNOWNED_STALE_S`) or live (a
    conversion is writing it now, or it belongs to another host and cannot be judged)."""
    out_abs = Path(out).resolve()
    parent = out_abs.parent
    if not parent.is_dir():
        return []
    found = []
    inside = sorted(out_abs.glob(f"{IN_PLACE_PREFIX}*")) if out_abs.is_dir() else []  # mount points: stages_inside
    for d in sorted(parent.glob(f".{glob.escape(out_abs.name)}.tmp-*")) + inside:
        if not d.is_dir() or d.is_symlink():
            continue
        pid = host = start = None
        try:
            owner = json.loads((d / OWNER_NAME).read_text())
            pid, start = int(owner["pid"]), owner.get("start")
            host = None if owner.get("host") is None else str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if pid is None:
            try:
                stale = time.time() - d.stat().st_mtime > UNOWNED_STALE_S
            except OSError:
                continue
        elif host is not None and host != socket.gethostname():
            stale = False  # cannot see another host's processes
        else:
            stale = not _pid_alive(pid, start)
        found.append(LeftoverTmp(d, _tree_bytes(d), pid, host, stale))
    return found


def clean_leftover_tmp_dirs(out: str | Path, *, remove: bool = True) -> list[str]:
    """Find the temporary directories that crashed conversions (SIGKILL, power loss) left next to ``out``,
    remove the stale ones (with ``remove``) and return one warning line per directory: the bytes reclaimed,
    or why it was left alone (its conversion still runs)."""
    lines = []
    for t in leftover_tmp_dirs(out):
        if not t.stale:
            lines.append(f"{t.describe()} is the temporary directory of a conversion that may still be running; "
                         "left alone (remove it yourself if none is)")
        elif remove:
            shutil.rmtree(t.path, ignore_errors=True)
            if t.path.exists():
                lines.append(f"could not remove the stale temporary directory {t.describe()} of an interrupted "
                             "conversion; remove it yourself")
            else:
                lines.append(f"removed the stale temporary directory {t.describe()} of an interrupted conversion: "
                             f"{human_bytes(t.bytes)} reclaimed")
        else:
            lines.append(f"the stale temporary directory {t.describe()} of an interrupted conversion will be "
                         f"removed ({human_bytes(t.bytes)})")
    return lines


def check_disk_space(out: str | Path, needed: int) -> None:
    """Refuse when the filesystem of OUT has fewer than ``needed`` bytes free (checked before writing).

    Raises:
        ConversionError: not enough space (says how much is needed and free).
    """
    probe = Path(out).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ConversionError(f"not enough free disk space for {out}: needs {human_bytes(needed)}, "
                              f"{human_bytes(free)} free on {probe}")


def tensor_nbytes(spec: OutputTensor) -> int:
    """Bytes of one output tensor (sub-byte dtypes such as F4 count logical elements in ``shape``)."""
    n = DTYPE_BITS[spec.dtype]
    for d in spec.shape:
        n *= d
    return (n + 7) // 8


@dataclass
class Shard:
    """One output file: its name, tensor names in data order, and offsets per tensor."""

    file: str
    names: list[str]
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)
    header: bytes = b""

    @property
    def size(self) -> int:
        end = max((e for _, e in self.offsets.values()), default=0)
        return 8 + len(self.header) + end


def plan_shards(plan: ConversionPlan, shard_size: int) -> list[Shard]:
    """Split the plan's outputs into shards of at most ``shard_size`` data bytes (a larger tensor gets its
    own shard), in plan order; inside a shard tensors are ordered by element size (widest first, the
    safetensors reference writer's rule) so every tensor starts aligned to its dtype."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, spec in plan.tensors.items():
        nb = tensor_nbytes(spec)
        if groups[-1] and size + nb > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nb
    shards = []
    count = len(groups)
    for i, names in enumerate(groups):
        names = sorted(names, key=lambda n: -DTYPE_BITS[plan.tensors[n].dtype])  # stable
        shard = Shard(f"model-{i + 1:05d}-of-{count:05d}.safetensors", names)
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        pos = 0
        for n in names:
            spec = plan.tensors[n]
            nb = tensor_nbytes(spec)
            shard.offsets[n] = (pos, pos + nb)
            header[n] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [pos, pos + nb]}
            pos += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        shard.header = raw + b" " * (-len(raw) % 8)
        shards.append(shard)
    return shards


def estimate_bytes(plan: ConversionPlan, shards: list[Shard], src: Path) -> int:
    """Bytes the layout will take: shards, carried non-weight files, config/manifest/index (generous)."""
    found = extra_files(src)
    meta = 4096 + 1024 * len(plan.tensors) + 256 * (len(found.carried) + len(found.not_carried))
    return sum(s.size for s in shards) + found.nbytes + meta


@dataclass
class WriteResult:
    """What :func:`write_layout` wrote: the layout dir, shard count, tensor count, data bytes, seconds."""

    out: Path
    shards: int
    tensors: int
    bytes: int
    seconds: float
    manifest: dict[str, Any]
    #: a SIGINT/SIGTERM arrived after OUT was complete (deferred: the conversion succeeded anyway)
    interrupted: bool = False
    #: OUT is in place but syncing its parent directory afterwards failed (the rename may not survive a
    #: power loss); a warning, not a failure: the layout is complete
    sync_warning: str | None = None


def _fsync_file(path: Path) -> None:
    if path.suffix == ".safetensors":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir_or_raise(path: Path) -> None:
    """fsync a directory; a platform that cannot open directories (no directory fsync there) is skipped.
    Raises OSError when the fsync itself fails (EIO: the directory's entries may not be on disk)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Best-effort :func:`_fsync_dir_or_raise` (the staging directory: its files are fsynced themselves)."""
    try:
        _fsync_dir_or_raise(path)
    except OSError:
        pass


#: seconds between progress-bar redraws (tqdm's default)
PROGRESS_INTERVAL_S = 0.1
#: bytes of the zero-padding buffer and of the fallback copy's scratch buffer
CHUNK_BYTES = 16 << 20
#: bytes per copy_file_range + hash step of the streaming path
COPY_BYTES = 64 << 20


class _AsyncWriter:
    """Performs the writes of a conversion in order, in a background thread, so they overlap the hashing
    in the caller (sha256, preadv, write and copy_file_range all release the GIL).

    Two kinds of work: ``write`` a buffer and ``copy`` a byte range of a source file with
    ``os.copy_file_range`` -- the in-kernel copy ``cp`` uses, so the bytes never pass through user space;
    where the kernel or filesystem refuses it (EXDEV, ENOSYS, ...) the thread falls back to ``preadv`` +
    ``write`` for good. A failure re-raises in the caller at the next :meth:`copy` or :meth:`sync`.

    Interrupt safety (Ctrl-C lands in the main thread at any bytecode): the work queue is a
    :class:`queue.SimpleQueue`, whose ``put`` is one C call (``queue.Queue.put`` runs Python-level
    ``Condition.notify``, and a KeyboardInterrupt inside it can lose the wake-up of the writer thread, which
    then never sees the stop sentinel). The writer thread also polls a stop :class:`threading.Event`, and
    :meth:`close` and :meth:`sync` never wait forever: cleanup after an interrupt finishes in bounded time
    even if a wake-up is lost."""

    #: the work queue's type (a test swaps in one that loses wake-ups)
    _queue_type: type = queue.SimpleQueue
    #: seconds between the writer thread's checks of the stop event while idle
    POLL_S = 0.1
    #: seconds :meth:`close` waits for the thread after an abandon (one copy step in flight at most)
    CLOSE_TIMEOUT_S = 30.0

    def __init__(self, depth: int = 4):
        self._copies = threading.Semaphore(depth)  # outstanding copy ops (keeps hashing near the copy)
        self._q = self._queue_type()
        self._stop = threading.Event()
        self._err: BaseException | None = None
        self._kernel_copy = hasattr(os, "copy_file_range")
        self._scratch: memoryview | None = None
        self._thread = threading.Thread(target=self._run, name="atomtool-writer", daemon=True)
        self._thread.start()

    def _copy(self, f, src_fd: int, offset: int, n: int) -> None:
        dst = f.fileno()
        while n > 0 and self._kernel_copy:
            try:
                k = os.copy_file_range(src_fd, dst, n, offset)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    self._kernel_copy = False
                    break
                raise
            if k <= 0:
                raise OSError(errno.EIO, f"source {_fd_name(src_fd)} ends before offset {offset + n} (changed or "
                                         "truncated while convert read it?)")
            offset += k
            n -= k
        while n > 0:  # fallback: through a scratch buffer
            if self._scratch is None:
                self._scratch = memoryview(bytearray(CHUNK_BYTES))
            view = self._scratch[:min(n, len(self._scratch))]
            k = os.preadv(src_fd, [view], offset)
            if k <= 0:
                raise OSError(errno.EIO, f"source {_fd_name(src_fd)} ends before offset {offset + n} (changed or "
                                         "truncated while convert read it?)")
            _write_all(f, view[:k])
            offset += k
            n -= k

    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(timeout=self.POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                return
            kind, f, a, b, c = item
            try:
                if kind == "sync":
                    continue
                if self._err is None and not self._stop.is_set():
                    try:
                        if kind == "write":
                            _write_all(f, a)
                        else:
                            self._copy(f, a, b, c)
                    except BaseException as exc:  # handed to the caller
                        self._err = exc
            finally:
                if kind == "copy":
                    self._copies.release()
                elif kind == "sync":
                    a.set()

    def _raise(self) -> None:
        if self._err is not None:
            raise self._err

    def write(self, f, view: memoryview) -> None:
        """Queue ``view`` for writing to ``f`` (the view keeps its buffer alive until written)."""
        self._q.put(("write", f, view, None, None))

    def copy(self, f, src_fd: int, offset: int, n: int) -> None:
        """Queue a copy of ``n`` bytes at ``offset`` of ``src_fd`` to the end of ``f``."""
        while not self._copies.acquire(timeout=self.POLL_S):
            self._check_alive()
        self._raise()
        self._q.put(("copy", f, src_fd, offset, n))

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            self._raise()
            raise ConversionError("internal error: the writer thread stopped before the conversion finished")

    def sync(self) -> None:
        """Wait until every queued write is done (re-raises the writer's failure).

        Raises:
            ConversionError: the writer thread is gone with work still queued (never waits forever).
        """
        done = threading.Event()
        self._q.put(("sync", None, done, None, None))
        while not done.wait(self.POLL_S):
            self._check_alive()
        self._raise()

    def close(self, *, abandon: bool = False) -> None:
        """Stop the writer thread: after the queued work (``abandon=False``), or as soon as the operation in
        flight ends, dropping the rest (``abandon=True``, the interrupt/error path). Waits at most
        :attr:`CLOSE_TIMEOUT_S` when abandoning (the thread is a daemon; it cannot keep the process alive)."""
        if abandon:
            self._stop.set()
        self._q.put(None)
        deadline = time.monotonic() + self.CLOSE_TIMEOUT_S
        while self._thread.is_alive():
            if abandon and time.monotonic() > deadline:
                return
            self._thread.join(self.POLL_S)


_POPULATE = {"flags": mmap.MAP_SHARED | mmap.MAP_POPULATE, "prot": mmap.PROT_READ} \
    if hasattr(mmap, "MAP_POPULATE") else {"access": mmap.ACCESS_READ}


def _hash_range(h, fd: int, offset: int, n: int) -> None:
    """sha256-update ``h`` with ``n`` bytes of ``fd`` at ``offset``, read through a temporary read-only
    mmap (pre-faulted; no copy into user memory; unmapped right after, so it does not stay in the RSS)."""
    delta = offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, n + delta, offset=offset - delta, **_POPULATE) as mm:
        view = memoryview(mm)
        try:
            h.update(view[delta:delta + n])
        finally:
            view.release()


def _hash_segments(ranges: list[tuple[int | None, int, int]], zeros: memoryview, stop: threading.Event) -> str:
    """sha256 of a tensor given as ``(fd | None for zeros, offset, bytes)`` ranges, in order (gives up with
    an empty string once ``stop`` is set: the conversion is being abandoned)."""
    h = hashlib.sha256()
    for fd, offset, nbytes in ranges:
        done = 0
        while done < nbytes:
            if stop.is_set():
                return ""
            n = min(COPY_BYTES if fd is not None else len(zeros), nbytes - done)
            if fd is None:
                h.update(zeros[:n])
            else:
                _hash_range(h, fd, offset + done, n)
            done += n
    return h.hexdigest()


def _stream_tensor(f, reader: SourceReader, segments: list[tuple[str | None, int]], w: _AsyncWriter,
                   zeros: memoryview, bar, pool: ThreadPoolExecutor, stop: threading.Event) -> tuple[Future, int]:
    """Queue an output tensor's byte segments for writing to ``f`` (source bytes file-to-file with
    ``copy_file_range`` in the writer thread, padding from a zero buffer) and its sha256 on ``pool``
    (tensors hash in parallel; each reads its ranges through an mmap). Returns (digest future, bytes)."""
    ranges: list[tuple[int | None, int, int]] = []
    total = 0
    for name, nbytes in segments:
        if name is None:
            ranges.append((None, 0, nbytes))
            off = 0
            while off < nbytes:
                n = min(len(zeros), nbytes - off)
                w.write(f, zeros[:n])
                off += n
        else:
            fd, start = reader.locate(name)
            ranges.append((fd, start, nbytes))
            off = 0
            while off < nbytes:
                n = min(COPY_BYTES, nbytes - off)
                w.copy(f, fd, start + off, n)
                bar.update(n)
                off += n
        total += nbytes
    return pool.submit(_hash_segments, ranges, zeros, stop), total


def _write_shards(plan: ConversionPlan, src: Path, tmp: Path, shards: list[Shard], progress: bool
                  ) -> dict[str, dict[str, str]]:
    """Write every shard. Outputs that need no cast are streamed: their byte segments go from the source
    files through a few reused chunk buffers (sha256 on the way) to the shard, so memory stays at a few
    chunks whatever the tensor size. Outputs that need a cast are materialized (one tensor at a time)."""
    total = sum(s.size for s in shards)
    done: dict[str, dict[str, str]] = {}
    digests: dict[str, Future] = {}
    sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
    reader = SourceReader(plan, src)
    zeros = memoryview(bytes(CHUNK_BYTES))
    w = _AsyncWriter()
    pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="atomtool-sha256")
    stop = threading.Event()
    # bytes written (shard headers and tensor data), the shard in the description and the tensor being
    # written after the rate; on a terminal, left on screen only until the summary line replaces it; in a log
    # (stderr not a terminal, --progress asked for) its final 100% state stays, not the first 0% one
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"convert shard 1/{len(shards)}",
              disable=not progress, leave=not sys.stderr.isatty(), file=sys.stderr, dynamic_ncols=True,
              mininterval=PROGRESS_INTERVAL_S) as bar:
        abandon = True
        try:
            for i, shard in enumerate(shards):
                bar.set_description(f"convert shard {i + 1}/{len(shards)}", refresh=False)
                path = tmp / shard.file
                with open(path, "wb", buffering=0) as f:
                    w.write(f, memoryview(struct.pack("<Q", len(shard.header)) + shard.header))
                    bar.update(8 + len(shard.header))
                    for name in shard.names:
                        spec = plan.tensors[name]
                        bar.set_postfix_str(name, refresh=False)
                        b0, b1 = shard.offsets[name]
                        segments = byte_segments(spec, reader)
                        if segments is not None:
                            digests[name], nbytes = _stream_tensor(f, reader, segments, w, zeros, bar, pool,
                                                                   stop)
                        else:
                            t = materialize(spec, reader)
                            if t.dtype != torch_dtype(spec.dtype):
                                raise ConversionError(f"{name}: produced {t.dtype}, planned {spec.dtype}")
                            data = _bytes(t).numpy()
                            digests[name] = pool.submit(lambda d: hashlib.sha256(d).hexdigest(), data)
                            nbytes = data.nbytes
                            w.write(f, memoryview(data))  # the view keeps the tensor alive until written
                            bar.update(nbytes)
                            del t, data
                        if nbytes != b1 - b0:
                            raise ConversionError(f"{name}: wrote {nbytes} bytes, planned {b1 - b0}")
                        done[name] = {"file": shard.file}
                    w.sync()
                    os.fsync(f.fileno())
                    for name in shard.names:
                        done[name]["sha256"] = digests.pop(name).result()
                if sleep:
                    time.sleep(sleep)
            abandon = False
        except BaseException:
            stop.set()  # abandoned: hashing threads stop at their next chunk
            raise
        finally:
            # bounded after an interrupt: the writer drops queued work and close() never waits forever
            w.close(abandon=abandon)
            pool.shutdown(wait=True, cancel_futures=True)
            reader.close()
    return done


def _write_all(f, view: memoryview) -> None:
    """Unbuffered files may write short; loop until every byte is out."""
    while len(view):
        n = f.write(view)
        view = view[n:]


def build_manifest(plan: ConversionPlan, written: dict[str, dict[str, str]], source: dict[str, Any], *,
                   carried: list[dict[str, Any]] | None = None,
                   not_carried: list[dict[str, str]] | None = None,
                   config_digest: str | None = None) -> dict[str, Any]:
    """The ``atomtool.json`` document (schema in :mod:`atomtool.convert.layout` and docs/LAYOUT.md).

    carried / not_carried: the ``carried_files`` / ``not_carried`` entries of
    :mod:`atomtool.convert.extra_files` (empty lists when None). config_digest: sha256 of the layout's
    config.json bytes (:func:`atomtool.convert.layout.config_sha256`), the manifest's ``config_sha256``."""
    text = plan.config.get("text_config") if isinstance(plan.config.get("text_config"), dict) else plan.config
    tensors = {}
    for name, spec in plan.tensors.items():
        entry = spec_to_entry(spec, plan.sources)
        entry.update(written.get(name, {}))
        tensors[name] = entry
    return {
        "format": FORMAT, "version": VERSION,
        "tool": {"name": "atomtool", "version": atomtool.__version__},
        "created": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source": source, "dtype_policy": plan.dtype_policy,
        "warnings": list(plan.warnings), "notes": list(plan.notes),
        # source tensors deliberately left out (inv_freq buffers, layers beyond the config, a tied lm_head)
        **({"dropped_sources": dict(plan.dropped)} if plan.dropped else {}),
        "indexer_types": text.get("indexer_types"),
        "carried_files": list(carried or []), "not_carried": list(not_carried or []),
        **({"config_sha256": config_digest} if config_digest else {}),
        "tensors": tensors,
    }


def write_layout(plan: ConversionPlan, src: str | Path, out: str | Path, *, shard_size: int = 5 * 10**9,
                 overwrite: bool = False, source: dict[str, Any] | None = None, progress: bool = True,
                 on_commit: Callable[[WriteResult], None] | None = None) -> WriteResult:
    """Write the layout of ``plan`` (sources under ``src``) to ``out``, atomically.

    Args:
        plan: from :func:`atomtool.convert.plan.build_plan`.
        src: the local source checkpoint directory (read only).
        out: the layout directory to create (or replace with ``overwrite``).
        shard_size: maximum data bytes per shard file.
        source: the manifest's ``source`` object (path, fingerprint, ...).
        progress: show a tqdm bar in bytes (stderr).
        on_commit: called with the result right after OUT is in place, with SIGINT/SIGTERM deferred (the
            CLI prints its summary there: a late Ctrl-C cannot fail a conversion that is complete).
    Returns:
        a :class:`WriteResult` with the manifest written.
    Raises:
        ConversionError: a refusal (see :func:`check_destination`, :func:`check_disk_space`), an OUT that
            cannot be written to, an OUT created by someone else meanwhile (see :func:`_commit`), an
            overflowing cast; SourceError: an unreadable source tensor. In every failure ``out`` is left as it was.
    """
    src, out = Path(src), Path(out)
    check_destination(src, out, overwrite=overwrite)
    shards = plan_shards(plan, shard_size)
    out_abs = out.resolve()
    token = secrets.token_hex(4)
    in_place = stages_inside(out_abs)
    tmp = out_abs / f"{IN_PLACE_PREFIX}{token}" if in_place else out_abs.parent / f".{out_abs.name}.tmp-{token}"
    created = _make_tmp_dir(tmp)  # first: an unwritable OUT says so, not "0 B free"
    try:
        try:
            _write_owner(tmp)  # a later convert tells a crashed one's leftovers from a running one's
        except OSError as exc:
            raise ConversionError(f"cannot write to {tmp.parent}: {exc.strerror or exc}") from None
        check_disk_space(out, estimate_bytes(plan, shards, src))
    except BaseException:
        _remove_created(tmp, created)
        raise
    start = time.perf_counter()
    committed = False
    try:
        written = _write_shards(plan, src, tmp, shards, progress)
        weight_map = {n: written[n]["file"] for n in plan.tensors}
        total = sum(tensor_nbytes(s) for s in plan.tensors.values())
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
        config = config_bytes(plan.config)
        (tmp / CONFIG_NAME).write_bytes(config)
        # every non-weight file, subfolders included, and the weight files the plan does not read (extra_files.py)
        found = extra_files(src, weight_files={t.file for t in plan.sources.values()})
        carried = copy_extra_files(found, tmp)
        (tmp / OWNER_NAME).unlink()  # not part of the layout
        for f in sorted(tmp.rglob("*"), reverse=True):  # shards are fsynced as written; the rest now
            if f.is_dir():
                _fsync_dir(f)
            else:
                _fsync_file(f)
        manifest = build_manifest(plan, written, source or {"path": str(src)}, carried=carried,
                                  not_carried=found.not_carried, config_digest=config_sha256(config))
        with open(tmp / MANIFEST_NAME, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        # From here on SIGINT/SIGTERM are deferred: once the rename is done the conversion has succeeded, and
        # an interrupt landing between the rename and the summary must not turn it into a failure (exit 130).
        with deferred_interrupts() as received:
            sync_warning = (_commit_in_place(tmp, out_abs, out) if in_place
                            else _commit(tmp, out_abs, out, overwrite=overwrite, token=token))
            committed = True
            result = WriteResult(out_abs, len(shards), len(plan.tensors), total, time.perf_counter() - start,
                                 manifest, sync_warning=sync_warning)
            if on_commit is not None:
                on_commit(result)
        result.interrupted = bool(received)
    except OSError as exc:  # disk full, permissions, I/O error: a user-facing error, not a traceback
        shutil.rmtree(tmp, ignore_errors=True)  # after an exchange: the replaced old layout
        if committed:  # on_commit failed (e.g. a closed stdout): OUT is complete, say nothing else
            raise
        if exc.filename and _is_within(Path(str(exc.filename)), src):  # a source file failed to read
            raise ConversionError(f"cannot read {exc.filename} ({exc.strerror or exc}); nothing was written "
                                  f"to {out}") from None
        raise ConversionError(f"writing {out} failed: {exc.strerror or exc}"
                              + (f" ({exc.filename})" if exc.filename else "") + "; nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def _is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or below it (both resolved; False when either cannot be)."""
    try:
        p, r = path.resolve(), root.resolve()
    except OSError:
        return False
    return p == r or r in p.parents


def _make_tmp_dir(tmp: Path) -> list[Path]:
    """Create the temporary sibling ``tmp`` (and OUT's missing parents); returns the directories created,
    outermost first.

    Raises:
        ConversionError: ``cannot write to DIR: reason`` naming the nearest existing ancestor.
    """
    missing = []
    d = tmp.parent
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    created: list[Path] = []
    making = tmp
    try:
        for making in [*reversed(missing), tmp]:
            making.mkdir()
            created.append(making)
    except OSError as exc:
        _remove_created(tmp, created)
        raise ConversionError(_mkdir_failure(d, making, exc)) from None
    return created


def _mkdir_failure(d: Path, path: Path, exc: OSError) -> str:
    """``cannot write to DIR: reason``. When the OS error alone would mislead -- ``mkdir`` in an existing
    directory answering ENOENT, as virtual filesystems like /proc and /sys do -- the reason names the
    directory that could not be created and says that ``DIR`` does not accept new entries."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError) and path.parent.is_dir():
        return (f"cannot write to {d}: creating {path} failed ({reason}) although {path.parent} exists: its "
                "filesystem does not accept new directories (a virtual filesystem such as /proc or /sys?)")
    return f"cannot write to {d}: {reason}"


def _remove_created(tmp: Path, created: list[Path]) -> None:
    """Undo :func:`_make_tmp_dir` (a refusal after it must leave the filesystem as it was)."""
    shutil.rmtree(tmp, ignore_errors=True)
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def deferred_interrupts():
    """Record SIGINT/SIGTERM instead of raising them while inside; yields the list of received signal
    numbers. Used around the final rename and the summary: past the rename the conversion is complete.
    Outside the main thread (signals cannot be handled there) nothing is deferred. A handler installed
    inside (e.g. ``SIG_IGN`` by a CLI about to exit, :func:`hold_interrupts_until_exit`) is kept."""
    received: list[int] = []

    def handler(signum, frame):  # noqa: ARG001
        received.append(signum)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        pass
    try:
        yield received
    finally:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, old)


def hold_interrupts_until_exit() -> None:
    """Ignore SIGINT/SIGTERM for the rest of the process: called by the ``atomtool convert`` process once
    the layout is complete and reported, so a late Ctrl-C (during interpreter shutdown) cannot turn the
    success into exit 130. Never called in-process by library users (tests, the demo)."""
    with contextlib.suppress(ValueError):  # not the main thread
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


#: renameat2(2) flags (linux/fs.h)
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)`` through libc; False when the kernel, libc or filesystem lacks it
    (the caller falls back), True when done.

    Raises:
        OSError: any other failure (ENOENT, EEXIST, ...), with ``dst`` as the filename.
    """
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _commit(tmp: Path, out_abs: Path, out: Path, *, overwrite: bool, token: str) -> str | None:
    """Move the complete layout ``tmp`` to ``out_abs`` without ever replacing an OUT we may not replace.

    Without ``overwrite``: plain ``rename(2)``. POSIX renames a directory onto an existing directory only
    when that one is empty (ENOTEMPTY/EEXIST otherwise), and onto a file never (ENOTDIR), so an OUT that
    another conversion completed after our up-front check cannot be replaced, and replacing an empty
    directory loses nothing. This is the simplest robust no-replace primitive: no lock file to go stale
    after a kill, no platform-specific call.

    With ``overwrite``: the existing layout is swapped with ``renameat2(RENAME_EXCHANGE)`` (one atomic step:
    at every instant OUT is either the old or the new layout), then the old one is deleted. Where that
    call is unavailable, the fallback renames the old layout aside, the new one in, and restores the old
    one if the second rename fails; only a hard kill between those two renames leaves OUT missing, with the
    old layout kept whole as ``.OUT.old-*`` next to it.

    Once the new layout is renamed into place the conversion has succeeded: syncing OUT's parent directory
    afterwards is best effort (:func:`_sync_after_rename`), and a failure there is returned as a warning
    line, never raised (the caller would report "nothing was written" over a complete OUT, after an
    exchange with the old layout already gone).

    Returns:
        None, or the warning line when a sync after the rename failed.
    Raises:
        ConversionError: OUT appeared meanwhile (no ``overwrite``), or became a non-layout (``overwrite``).
        OSError: other rename failures.
    """
    if not overwrite:
        try:
            os.rename(tmp, out_abs)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise ConversionError(f"OUT {out} was created by another process while converting (another "
                                      "convert into the same OUT?); it was left as is and nothing was written; "
                                      "pass --overwrite to replace it") from None
            raise
        return _sync_after_rename(out_abs, out)
    if out_abs.is_dir() and any(out_abs.iterdir()):
        check_replaceable(out_abs, out)  # again: something may have been added while converting
    if not out_abs.exists():
        os.rename(tmp, out_abs)
    elif _renameat2(tmp, out_abs, RENAME_EXCHANGE):  # tmp now holds the old layout
        warning = _sync_after_rename(out_abs, out)
        shutil.rmtree(tmp, ignore_errors=True)
        return warning
    else:
        old = out_abs.parent / f".{out_abs.name}.old-{token}"
        os.rename(out_abs, old)
        try:
            os.rename(tmp, out_abs)
        except BaseException as exc:
            try:
                os.rename(old, out_abs)
            except OSError:
                raise ConversionError(f"replacing {out} failed ({exc}); the previous layout is kept "
                                      f"whole at {old}") from None
            raise
        warning = _sync_after_rename(out_abs, out)
        shutil.rmtree(old, ignore_errors=True)
        return warning
    return _sync_after_rename(out_abs, out)


def _commit_in_place(tmp: Path, out_abs: Path, out: Path) -> str | None:
    """Move the complete layout staged in ``tmp`` (inside OUT, see :func:`stages_inside`) into OUT: every entry
    by rename(2) on OUT's own filesystem, the manifest last, so OUT holds a layout only once it is complete; a
    rename failing midway moves the entries back (OUT as it was). Returns None or a warning when syncing OUT
    afterwards failed.

    Raises:
        ConversionError: OUT gained other entries meanwhile (another process wrote into it).
        OSError: a rename failed (OUT restored as far as possible).
    """
    if _entries(out_abs):
        raise ConversionError(f"OUT {out} was written by another process while converting; it was left as is "
                              "and nothing was written")
    moved: list[str] = []
    try:
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == MANIFEST_NAME):  # the manifest last
            os.rename(p, out_abs / p.name)
            moved.append(p.name)
    except BaseException:
        for name in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(out_abs / name, tmp / name)
        raise
    with contextlib.suppress(OSError):
        tmp.rmdir()
    try:
        _fsync_dir_or_raise(out_abs)
    except OSError as exc:
        return (f"{out} is complete and in place, but syncing it failed ({exc.strerror or exc}): after a power "
                f"loss some files may be lost; run `atomtool verify {out}`")
    return None


def _sync_after_rename(out_abs: Path, out: Path) -> str | None:
    """fsync OUT's parent directory once OUT is renamed into place; None when that worked, else a warning
    line (the layout is complete; only the rename's durability across a power loss is in doubt)."""
    try:
        _fsync_dir_or_raise(out_abs.parent)
    except OSError as exc:
        return (f"{out} is complete and in place, but syncing its directory {out_abs.parent} failed "
                f"({exc.strerror or exc}): after a power loss the rename may be lost; run `atomtool verify {out}`")
    return None

"""The non-weight files of a checkpoint that ``atomtool convert`` carries into the layout unchanged.

Everything under SRC except its weights is carried with its relative path (subfolders included, symlinks
followed): tokenizer files and chat templates, generation_config.json, remote code (``configuration_*.py``,
``modeling_*.py``, ``tokenization_*.py``: config.json keeps its ``auto_map``, so ``transformers`` with
``trust_remote_code`` needs them next to it; atomtool itself never runs them), DeepSeek-V3.2's
``encoding/encoding_dsv32.py`` chat encoder, ``original/``, ``hf_quant_config.json``, README and LICENSE.

Not carried:

- the source's ``*.safetensors`` shards and its safetensors index at the top level (the layout writes its own),
  and ``config.json`` (the layout writes the plan's config); a top-level ``*.safetensors`` the conversion did
  not read (one the index does not list, or e.g. ``consolidated.safetensors`` next to ``model.safetensors``)
  is listed in the manifest's ``not_carried`` and in the ``note:`` line;
- pickle weight files (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``: ``torch.save``/Lightning; the layout's
  weights come from the safetensors, and unpickling can run code) and other frameworks' weights (``*.h5``,
  ``*.msgpack``, ``*.gguf``), and ``*.safetensors`` in subfolders (not converted): each is listed in the
  manifest's ``not_carried`` and in a ``note:`` line;
- hidden entries (``.git``, ``.cache``, ``.gitattributes``, HF's ``.cache/huggingface`` download metadata)
  and ``__pycache__``: tool state, not checkpoint content;
- dangling symlinks and unreadable entries (listed as not carried, with the reason).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomtool.convert.layout import INDEX_NAME, MANIFEST_NAME

#: pickle weight files: never carried (named in a note)
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
#: other frameworks' weight files (TF, Flax, GGUF): never carried either
OTHER_WEIGHT_SUFFIXES = (".h5", ".msgpack", ".gguf")
#: top-level names the layout writes itself (the writer's owner marker starts with a dot: hidden anyway)
_WRITTEN_BY_LAYOUT = {"config.json", MANIFEST_NAME, INDEX_NAME}
#: the usual top-level tokenizer / generation / chat-template files: carried like the rest, but not counted
#: in the carried-files note (every checkpoint has them; the note is about the less expected extras)
USUAL_FILES = re.compile(
    r"tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|.*\.tiktoken|"
    r"tiktoken\.model|spiece\.model|generation_config\.json|chat_template.*|preprocessor_config\.json")
#: entries listed in the carried-files note before "..."
NOTE_MAX_ENTRIES = 8


@dataclass
class ExtraFiles:
    """The files of a checkpoint directory to carry into a layout, and those deliberately left out.

    carried: (relative POSIX path inside SRC and OUT, source path; a symlink is read through), sorted.
    not_carried: ``{"path", "reason"}`` per weight file (or dangling link) that is not copied.
    """

    carried: list[tuple[str, Path]] = field(default_factory=list)
    not_carried: list[dict[str, str]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Total bytes of the carried files (their targets' sizes for symlinks)."""
        return sum(p.stat().st_size for _, p in self.carried)


def _not_carried_reason(rel: str, top: bool) -> str | None:
    name = rel.rsplit("/", 1)[-1]
    suffix = os.path.splitext(name)[1].lower()
    if suffix in PICKLE_WEIGHT_SUFFIXES:
        return "pickle weights (the layout's weights come from the safetensors)"
    if suffix in OTHER_WEIGHT_SUFFIXES:
        return "another framework's weights (the layout's weights come from the safetensors)"
    if suffix == ".safetensors" and not top:
        return "safetensors in a subfolder (not converted)"
    return None


def _unread_weights_reason(root: Path) -> str:
    # model.safetensors is the file read whenever it exists, index or not (as transformers loads it first)
    if not (root / "model.safetensors").is_file() and (root / INDEX_NAME).is_file():
        return f"safetensors that {INDEX_NAME} does not list (not converted)"
    return "safetensors next to model.safetensors, the file read (not converted)"


def extra_files(src: str | Path, weight_files: set[str] | None = None) -> ExtraFiles:
    """Walk the checkpoint directory ``src`` (following symlinked files and folders; a folder linking back
    to one of its ancestors is a cycle and is skipped) and sort its files into carried and not carried (module
    docstring). ``weight_files``: the safetensors the conversion reads (its plan's source files, relative to
    ``src``; an index may place shards in a subfolder): neither carried nor listed; any other top-level
    ``*.safetensors`` is listed as not carried. None: top-level safetensors are not
    listed (e.g. for a size estimate)."""
    root = Path(src)
    found = ExtraFiles()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        real = os.path.realpath(here)
        chain = [here.parent, *here.parent.parents][:len(here.relative_to(root).parts)]
        if any(os.path.realpath(a) == real for a in chain):  # a symlink back to an ancestor: a cycle
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        top = rel_dir == "."
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            rel = name if top else f"{rel_dir}/{name}"
            path = Path(dirpath) / name
            if top and weight_files is not None and name.endswith(".safetensors") and name not in weight_files:
                found.not_carried.append({"path": rel, "reason": _unread_weights_reason(root)})
                continue
            if top and (name in _WRITTEN_BY_LAYOUT or name.endswith(".safetensors")
                        or name.endswith(".safetensors.index.json")):
                continue
            if not top and weight_files is not None and rel in weight_files:
                continue  # a shard the index places in a subfolder: read and converted, not an extra file
            reason = _not_carried_reason(rel, top)
            if reason is None and not path.is_file():
                reason = "dangling symlink" if path.is_symlink() else "not a regular file"
            if reason is not None:
                found.not_carried.append({"path": rel, "reason": reason})
            else:
                found.carried.append((rel, path))
    found.carried.sort()
    return found


def copy_extra_files(found: ExtraFiles, dst: Path) -> list[dict[str, Any]]:
    """Copy every carried file under ``dst`` at its relative path (content and mtime; symlinks read
    through); returns the manifest's ``carried_files`` entries ``{"path", "size", "sha256"}`` of the
    bytes written.

    Raises:
        OSError: a file that cannot be read or written (the writer turns it into a ConversionError).
    """
    entries = []
    for rel, path in found.carried:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        with open(target, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        entries.append({"path": rel, "size": target.stat().st_size, "sha256": digest})
    return entries


def carried_note(entries: list[dict[str, Any]]) -> str | None:
    """``carried 7 other files (1.2 MiB): encoding/, configuration_deepseek.py, ...`` over the carried files
    other than the :data:`USUAL_FILES` (top-level entries, folders first, with a trailing slash), or None
    when there are none."""
    from atomtool.inspect.report import human_bytes

    entries = [e for e in entries if "/" in e["path"] or not USUAL_FILES.fullmatch(e["path"])]
    if not entries:
        return None
    tops = sorted({e["path"].split("/", 1)[0] + ("/" if "/" in e["path"] else "") for e in entries},
                  key=lambda t: (not t.endswith("/"), t))  # folders first: the least expected extras
    more = len(tops) - NOTE_MAX_ENTRIES
    shown = ", ".join(tops[:NOTE_MAX_ENTRIES]) + (f", ... ({more} more)" if more > 0 else "")
    n = len(entries)
    return (f"carried {n} other file{'' if n == 1 else 's'} ({human_bytes(sum(e['size'] for e in entries))}): "
            f"{shown}")


def not_carried_note(not_carried: list[dict[str, str]]) -> str | None:
    """``not carried: pytorch_model.bin (pickle weights ...)``, grouped by reason (a few names each), or
    None when nothing was left out."""
    if not not_carried:
        return None
    by_reason: dict[str, list[str]] = {}
    for e in not_carried:
        by_reason.setdefault(e["reason"], []).append(e["path"])
    groups = []
    for reason, paths in by_reason.items():
        names = ", ".join(paths[:NOTE_MAX_ENTRIES]) + (f", ... ({len(paths)} in all)"
                                                       if len(paths) > NOTE_MAX_ENTRIES else "")
        groups.append(f"{names} ({reason})")
    return "not carried: " + "; ".join(groups)

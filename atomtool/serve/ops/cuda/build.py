"""Compile our CUDA kernels to cubins at first use, cached on disk.

Why not ``torch.utils.cpp_extension``: it builds a Python extension against torch's C++ headers (a minute or
more per variant, and a C++ toolchain matching torch's ABI), where our kernels need no host code at all: the
driver loads the cubin and :mod:`.driver` launches it. ``nvcc`` (the CUDA toolkit's compiler) turns one
header-free ``.cu`` file plus ``-D`` constants into a cubin for the device's architecture in about a second.

The cache key is the source text, the defines, the target and nvcc's version, so an edited kernel or another
toolkit never reuses a stale binary. Cache directory: ``$ATOMTOOL_CUDA_CACHE`` or ``~/.cache/atomtool/cuda``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed (the message carries its output)."""


def nvcc_path() -> str | None:
    """The nvcc to use: ``$CUDA_HOME/bin/nvcc``, then ``nvcc`` on PATH, then /usr/local/cuda/bin/nvcc; None
    when there is none."""
    for cand in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


@cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout


def cache_dir() -> Path:
    return Path(os.environ.get("ATOMTOOL_CUDA_CACHE", Path.home() / ".cache" / "atomtool" / "cuda"))


@cache
def compile_cubin(source: str, arch: str, defines: tuple[tuple[str, int], ...] = ()) -> bytes:
    """The cubin of ``source`` (a file name in this package, or an absolute path) for ``arch`` (e.g.
    ``sm_90a``) with ``-DNAME=VALUE`` per define.

    Raises:
        CudaBuildError: no nvcc, or nvcc failed (its output in the message).
    """
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaBuildError("no nvcc found (set CUDA_HOME or put nvcc on PATH) to build the CUDA kernels")
    path = SRC_DIR / source  # an absolute source replaces SRC_DIR
    text = path.read_text()
    flags = ["-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-O3", "-std=c++17"]
    flags += [f"-D{k}={v}" for k, v in defines]
    key = hashlib.sha256("\0".join([text, *flags, _nvcc_version(nvcc)]).encode()).hexdigest()[:24]
    out = cache_dir() / f"{path.stem}-{key}.cubin"
    if out.is_file():
        return out.read_bytes()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_out = Path(tmp) / out.name
        r = subprocess.run([nvcc, *flags, "-o", str(tmp_out), str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            raise CudaBuildError(f"nvcc failed on {path.name} ({' '.join(flags)}):\n{r.stdout}{r.stderr}")
        data = tmp_out.read_bytes()
    # a temp file of its own per writer (threads and processes sharing the cache), renamed into place: a
    # concurrent builder or reader never sees half a cubin
    fd, part = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(part, out)
    return data

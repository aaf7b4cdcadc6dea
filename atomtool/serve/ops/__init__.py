"""Op backend dispatch: ``get_op(name, device)`` returns the implementation of one named op.

Backends (DESIGN.md principle 4, "the torch reference is the truth"):

- ``torch``  -- :mod:`atomtool.serve.ops.torch_ref`, plain torch, exact, runs everywhere (CPU included).
- ``triton`` -- ``atomtool.serve.ops.triton`` (helper E), CUDA/ROCm only. That package registers its ops on
  import with :func:`register_op` (``register_op("paged_attention", "triton", fn)``); any op it does not
  provide falls back to the torch reference.
- ``aiter``  -- seam for the optional AMD AITER backend (``atomtool.serve.ops.aiter``), same mechanism;
  nothing registers it yet.

Selection, highest precedence first: :func:`set_backend` (the engine's ``backend=`` argument), the
``ATOMTOOL_BACKEND`` environment variable (``torch`` | ``triton`` | ``aiter`` | ``auto``), then ``auto``:
``triton`` on a CUDA/ROCm device when importable, else ``torch``. A CPU device always gets ``torch``.

Every op has the signature documented in :mod:`atomtool.serve.ops.torch_ref`; other backends implement
exactly the same signatures and are tested against the reference.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from atomtool.errors import EngineError

BACKENDS = ("torch", "triton", "aiter")
#: ops every backend may implement (the reference implements all of them)
OP_NAMES = (
    "rms_norm", "rotary_embedding", "silu_and_mul", "linear", "store_kv", "store_cache",
    "paged_attention", "gather_cache", "qk_rope_store_kv", "router_logits",
)

_REGISTRY: dict[tuple[str, str], Callable] = {}
_override: str | None = None
_loaded: set[str] = set()


def register_op(name: str, backend: str, fn: Callable) -> None:
    """Register ``fn`` as backend ``backend``'s implementation of op ``name`` (same signature as torch_ref)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    _REGISTRY[(name, backend)] = fn


def set_backend(backend: str | None) -> None:
    """Force a backend for every later :func:`get_op` call (``None`` or ``"auto"``: automatic selection).

    Raises:
        EngineError: unknown backend name.
    """
    global _override
    if backend is not None and backend != "auto" and backend not in BACKENDS:
        raise EngineError(f"unknown op backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    _override = None if backend in (None, "auto") else backend


def _load_backend(backend: str) -> bool:
    """Import a backend package once so it registers its ops; False when it is not importable."""
    if backend == "torch":
        return True
    if backend in _loaded:
        return True
    try:
        importlib.import_module(f"atomtool.serve.ops.{backend}")
    except Exception:  # ImportError, or a toolchain that fails at import time (no driver): backend unavailable
        return False
    _loaded.add(backend)
    return True


def backend_for(device: torch.device | str) -> str:
    """The backend :func:`get_op` uses on ``device`` (see the module docstring for the precedence)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "torch"
    wanted = _override or os.environ.get("ATOMTOOL_BACKEND", "auto").lower() or "auto"
    if wanted == "auto":
        return "triton" if device.type == "cuda" and _load_backend("triton") else "torch"
    if wanted not in BACKENDS:
        raise EngineError(f"ATOMTOOL_BACKEND={wanted!r} is not one of auto, {', '.join(BACKENDS)}")
    if not _load_backend(wanted):
        raise EngineError(f"op backend {wanted!r} was requested but atomtool.serve.ops.{wanted} cannot be imported")
    return wanted


def get_op(name: str, device: torch.device | str) -> Callable:
    """Return the implementation of op ``name`` for tensors on ``device``.

    Falls back to the torch reference when the selected backend does not implement ``name``. Ops outside
    :data:`OP_NAMES` (e.g. the MLA ops of ``torch_ref_mla``) are found once their module has called
    ``register_op(name, "torch", fn)``.

    Raises:
        EngineError: ``name`` is not an op.
    """
    backend = backend_for(device)
    fn = _REGISTRY.get((name, backend)) or _REGISTRY.get((name, "torch"))
    if fn is not None:
        return fn
    if name in OP_NAMES:
        from atomtool.serve.ops import torch_ref

        return getattr(torch_ref, name)
    known = sorted(set(OP_NAMES) | {n for n, _ in _REGISTRY})
    raise EngineError(f"unknown op {name!r}; known: {', '.join(known)}")

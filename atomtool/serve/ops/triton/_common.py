"""Shared helpers for the Triton kernels: interpreter detection, dot dtypes, launch sizes.

Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by the CPU test suite) stores bf16 as raw
16-bit integers and computes ``tl.dot`` on bf16 operands incorrectly, so under the interpreter every
kernel casts its dot operands to float32 (``dot_dtype``). On a GPU, bf16/fp16 operands go to the tensor
cores as they are and float32 operands use ``input_precision="ieee"`` (no TF32), so a float32 model
run on CUDA stays comparable with the float32 reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype dot operands are cast to for activations of ``dtype`` (see module doc)."""
    if interpreting() or dtype not in _TL_DTYPE:
        return tl.float32
    return _TL_DTYPE[dtype]


def _patch_interpreter_index() -> None:
    """Make Triton 3.6's interpreter accept tensor loop bounds under NumPy >= 2.

    The interpreter turns a scalar used as ``range`` bound into an int with ``int(ndarray)``, which NumPy 2
    rejects for its 1-element 1-d scalars; this wraps its tensor patch to take the element instead. Applied
    only when TRITON_INTERPRET is set (CPU tests); compiled GPU kernels are unaffected.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_atomtool_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._atomtool_index_fix = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_index()


def pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


@triton.jit
def dot_acc(a, b, acc, DOT_DTYPE: tl.constexpr):
    """acc + a @ b with operands cast to DOT_DTYPE (float32 dots are IEEE, not TF32)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)

"""Shared helpers for the Triton kernels: interpreter detection, dot dtypes, launch sizes, paged-cache
addressing.

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
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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


def _patch_interpreter_fp8() -> None:
    """Make Triton 3.6's interpreter round float32 / float16 -> float8e4nv to nearest even, as the GPU does.

    The interpreter's own downcast rounds half up on the mantissa bits and drops the carry into the exponent
    (31.07 -> 16 instead of 32), which the W8A8 activation quantization (``linear._act_quant``) would inherit
    in the CPU tests. This routes those conversions through torch's IEEE cast, saturating at +-448 as the
    GPU's ``cvt.rn.satfinite`` does. Applied only when TRITON_INTERPRET is set.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_atomtool_fp8_fix", False):
        return

    def patched(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(input).astype(np.float32))
            return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(input, input_dtype, output_dtype, rounding_mode)

    patched._atomtool_fp8_fix = True
    interpreter._convert_float = patched


if interpreting():
    _patch_interpreter_index()
    _patch_interpreter_fp8()


_SM_COUNT: dict[str, int] = {}
_PDL: dict[str, bool] = {}


def launch_pdl_args(device: torch.device) -> dict:
    """Launch keyword arguments for programmatic dependent launch (PDL, CUDA >= sm90), or {} where unavailable.

    With PDL a kernel's programs may start while the previous kernel on the stream is still finishing: the
    launch latency and the previous kernel's last partial wave overlap the next kernel's start (and whatever it
    does before :func:`grid_dependency_wait`, which may only read immutable data such as weights). Every kernel
    given these arguments must call ``grid_dependency_wait(USE_PDL)`` before it reads or writes anything a
    preceding kernel may touch. CUDA graphs keep the programmatic edges (CUDA >= 12.3). Off on CPU, under the
    interpreter, on GPUs before Hopper and with ``ATOMTOOL_PDL=0`` (for A/B measurements).
    """
    if device.type != "cuda" or interpreting():
        return {}
    key = str(device)
    if key not in _PDL:
        major, _ = torch.cuda.get_device_capability(device)
        _PDL[key] = (major >= 9 and torch.version.hip is None
                     and os.environ.get("ATOMTOOL_PDL", "1") not in ("", "0"))
    return {"USE_PDL": True, "launch_pdl": True} if _PDL[key] else {}


@triton.jit
def grid_dependency_wait(USE_PDL: tl.constexpr):
    """Under PDL (:func:`launch_pdl_args`): wait until the preceding kernel has completed and its writes are
    visible, then let the next kernel launch (its programs wait in turn before touching our outputs).
    Nothing without PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Hint the memory system to bring the lines holding ``ptrs`` into L2 (PTX ``prefetch.global.L2``); no
    value, no effect on any result, so it is allowed before :func:`grid_dependency_wait` on any address (a
    kernel under PDL uses it for its immutable weights while the previous kernel runs). CUDA only: call it
    under ``USE_PDL``, which the interpreter never sets."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def programs_per_row(rows: int, units: int, device: torch.device, per_sm: int | None) -> int:
    """Programs per row for a launch over ``rows`` rows of ``units`` work units each (positions blocks,
    segments), each program looping over the units p, p + programs, ... of its row: about ``per_sm`` programs
    per SM over all rows, at least 1, at most ``units``. ``per_sm`` None: one program per unit. Under the
    interpreter (not CUDA) 3, so a program still loops over several units as on a GPU at long rows."""
    if per_sm is None:
        return units
    if device.type != "cuda":
        return min(units, 3)
    key = str(device)
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(units, per_sm * _SM_COUNT[key] // rows))


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


@triton.jit
def online_softmax_step(scores, m_i, l_i):
    """One step of the online (streaming) softmax of FlashAttention (Dao et al. 2022), base 2.

    scores: [R, N] float32 logits already scaled by log2(e) (-inf where masked); m_i / l_i: [R] running max
    and running sum. Returns (p [R, N] = 2^(scores - m_new), alpha [R] = 2^(m_i - m_new), the new max, the new
    sum); the caller rescales its accumulator by alpha and adds p @ V. A row with every score -inf so far
    keeps m = -inf and contributes zeros (never NaN).
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def token_sequence(t, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_B: tl.constexpr):
    """The sequence ``b`` owning query row ``t`` of the step (``cu_q[b] <= t < cu_q[b+1]``; needs
    BLOCK_B >= num_seqs) and the token's position ``seq_lens[b] - (cu_q[b+1] - t)`` in it.
    Returns (b, qpos), int32 scalars."""
    offs_b = tl.arange(0, BLOCK_B)
    ends = tl.load(cu_q_ptr + 1 + offs_b, mask=offs_b < num_seqs, other=1 << 30)
    b = tl.sum((ends <= t).to(tl.int32), axis=0)
    q_end = tl.load(cu_q_ptr + b + 1)
    seq_len = tl.load(seq_lens_ptr + b)
    return b, seq_len - (q_end - t)


@triton.jit
def paged_rows(bt_ptr, b, s_bt, s, s_ok, block_size, s_block, s_slot):
    """Element offsets (int64) of positions ``s`` of sequence ``b`` in a paged plane ``[N, bs, ...]`` with
    strides (s_block, s_slot): block ``block_table[b, s // bs]``, slot ``s % bs``; masked-off positions
    (``~s_ok``) read block 0."""
    blk = tl.load(bt_ptr + b.to(tl.int64) * s_bt + s // block_size, mask=s_ok, other=0).to(tl.int64)
    return blk * s_block + (s % block_size).to(tl.int64) * s_slot

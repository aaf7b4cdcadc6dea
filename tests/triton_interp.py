"""Run a test module's Triton kernels on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

Triton decides when it is first imported whether ``@triton.jit`` means "interpret" (its own ``tl.sum`` & co.
included), so the variable must be set before that import. A module calls :func:`setup_interpreter` at its
very top, before importing torch-side code that may import triton. When another test module of the same
pytest session already imported triton compiled, the module's tests cannot run in this process: the
:func:`harness` fixture skips them and its ``test_suite_in_a_fresh_process`` reruns the whole file in a
fresh interpreter instead (so every case still runs, in CI too).

This module imports neither torch nor triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = "ATOMTOOL_TRITON_TEST_CHILD"


_PREIMPORTED: bool | None = None


def setup_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1``; True when triton was already imported compiled in this process.

    Decided once per process, at the first call: after it the variable is set, so a later module could not
    tell "imported compiled before any of us" from "imported interpreted by an earlier module" (the first
    case makes every ``@triton.jit`` defined earlier a compiled function, which interpreted kernels then
    cannot call).
    """
    global _PREIMPORTED
    if _PREIMPORTED is None:
        _PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        os.environ["TRITON_INTERPRET"] = "1"
    return _PREIMPORTED


def _exact_interpreted_dot() -> None:
    """Make the interpreter's ``tl.dot`` give each output element the same float32 value wherever its row sits.

    The interpreter computes a dot with ``np.matmul`` in float32, i.e. with the BLAS that numpy ships, and
    OpenBLAS's Haswell sgemm kernel (picked on AVX2 machines without AVX-512, e.g. AMD EPYC) sums a row's
    products in an order that depends on the row's position in the tile: row 6 of a 16-row tile and the same
    data as row 0 differ in the last bit. A GPU's tensor cores do not, and the batch-invariance tests (a row
    alone == the same row in a batch) check our kernels' tile and split order, not the CPU's BLAS. So float32
    dots accumulate in float64 here and round once: exact products, an order-free sum up to double rounding.
    Applied once per process, only where triton runs interpreted."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_atomtool_exact", False):
        return

    def operand(h):  # the original's conversion (FP8 operands are widened through float16), then to float64
        data = h.data
        if h.dtype.primitive_bitwidth == 8 and h.dtype.is_floating():
            data = interpreter._convert_float(data, h.dtype, tl.float16, None).view(np.float16)
        return data.astype(np.float64)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32:  # integer / float16 accumulators: as Triton does it
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        prod = np.matmul(operand(a), operand(b)).astype(np.float32)
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot._atomtool_exact = True
    builder.create_dot = create_dot


def harness(module_file: str, preimported: bool):
    """(autouse fixture, test) for a module: bind them as module attributes, e.g.
    ``_interpreted_only, test_suite_in_a_fresh_process = harness(__file__, PREIMPORTED)``."""

    @pytest.fixture(autouse=True)
    def _in_process_only_with_an_interpreted_triton(request):
        if preimported and request.node.name != "test_suite_in_a_fresh_process":
            pytest.skip("triton was imported compiled earlier in this session: covered by test_suite_in_a_fresh_process")
        if not preimported:
            _exact_interpreted_dot()

    @pytest.mark.skipif(not preimported, reason="triton is interpreted in this process: tests run here")
    def test_suite_in_a_fresh_process():
        if os.environ.get(_CHILD):
            pytest.fail("triton is imported before this module even in a fresh process (by a conftest?)")
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        env[_CHILD] = "1"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file], env=env,
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]

    return _in_process_only_with_an_interpreted_triton, test_suite_in_a_fresh_process

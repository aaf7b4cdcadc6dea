"""What the decode kernels compile to on Hopper, without a GPU: registers, spills, shared memory, SASS size.

Issue 7's batch-1 gap sits in latency-bound kernels (docs/PERFORMANCE.md, session 7), and the first questions
about a change to one of them are static: does it still fit in shared memory, does it spill, how many
instructions does a warp run, does ptxas serialize its wgmma (message C7515: every Hopper tensor-core
instruction then waits for the previous one). Triton compiles for ``sm_90a`` on any machine with its bundled
``ptxas`` and ``nvdisasm``, so this tool answers those questions on the CPU machine, before spending device
time. Each kernel is compiled with the configuration the engine launches it with at decode (read from the
modules' config constants, DeepSeek-V3.2 dimensions), so a changed constant shows up here.

    python -m benchmarks.sass_report [--only NAME[,NAME...]] [--arch 90]

Prints one row per kernel (and records it in ``$BENCH_OUT/results.jsonl``, bench ``sass_report``): registers
per thread, spill bytes (stores + loads), shared memory, SASS instructions (static count), tensor-core
instructions (``wgmma``: SASS HGMMA + QGMMA, the FP8 form; ``mma_sync``: HMMA) and whether ptxas serialized the
wgmma. Integer arguments are specialized as Triton's launcher does at a real DeepSeek-V3.2 batch-1 launch
(1 becomes a constant, multiples of 16 are marked divisible): without that the same kernel compiles to other
code (more instructions, spills, even serialized wgmma), so an offline compile that skips it misleads. Static counts, not
timings: a kernel with fewer instructions is not always faster (step 42 in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common as C


class SassReportError(RuntimeError):
    """The Triton install has no sm_90 toolchain (ptxas / nvdisasm), or a kernel failed to compile."""


@dataclass(frozen=True)
class KernelSpec:
    """One kernel to compile: ``module`` / ``name`` of the ``@triton.jit`` function, the Triton type of each
    runtime argument (``types``: name -> ``*bf16``, ``i32``, ``tensordesc<...>``...; arguments not named are
    ``i32``), the constexpr values (``constexprs``) and the integer arguments' values at a DeepSeek-V3.2
    batch-1 decode launch (``ints``: Triton specializes a launch on them, see :func:`int_specialization`), all
    functions so they read the engine's config when called,
    the launch options (``options``: num_warps, num_stages) and a short description of the configuration."""

    label: str
    module: str
    name: str
    types: Callable[[], dict[str, str]]
    constexprs: Callable[[], dict[str, Any]]
    options: Callable[[], dict[str, int]]
    config: Callable[[], str]
    ints: Callable[[], dict[str, int]] = dict


def _mla():
    return importlib.import_module("atomtool.serve.ops.triton.mla")


def _linear():
    return importlib.import_module("atomtool.serve.ops.triton.linear")


def _moe():
    return importlib.import_module("atomtool.serve.ops.triton.moe")


def _bf16():
    import triton.language as tl

    return tl.bfloat16


def _split_consts() -> dict[str, Any]:
    return dict(SPARSE=True, SPAN_MIN=_mla().SPLIT_CHUNK_SPARSE, BLOCK_H=_mla().MLA_DECODE_CONFIG.block_h,
                BLOCK_N=_mla().MLA_DECODE_CONFIG.block_n, R_PAD=512, P_PAD=64, DOT_DTYPE=_bf16(), USE_PDL=True)


def _merge_consts() -> dict[str, Any]:
    return dict(SPARSE=True, SPAN_MIN=_mla().SPLIT_CHUNK_SPARSE, N_CHUNKS=2048 // _mla().SPLIT_CHUNK_SPARSE,
                BLOCK_M=_mla().MERGE_UV_BLOCK_M, BLOCK_R=_mla().MERGE_UV_BLOCK_R, N_RB=512 // _mla().MERGE_UV_BLOCK_R,
                DV_PAD=128, DOT_DTYPE=_bf16(), HAS_SCALE=True, USE_PDL=True)


def _absorb_consts() -> dict[str, Any]:
    return dict(BLOCK_M=_mla().MERGE_UV_BLOCK_M, DN_PAD=128, BLOCK_R=_mla().MERGE_UV_BLOCK_R,
                N_RB=512 // _mla().MERGE_UV_BLOCK_R, ROW_BLOCKS=_mla().ABSORB_ROW_BLOCKS, DOT_DTYPE=_bf16(),
                HAS_SCALE=True, USE_PDL=True)


def _gemm_consts(w8a8: bool) -> dict[str, Any]:
    cfg = _linear().FP8_LINEAR_W8A8_CONFIG if w8a8 else _linear().FP8_LINEAR_CONFIG
    return dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_DTYPE=_bf16(),
                USE_PDL=True, ACT_FP8=w8a8, ROUND_SCALE=w8a8, SWAP_AB=cfg.swap_ab or w8a8)


def _gemm_types(w8a8: bool) -> dict[str, str]:
    cfg = _linear().FP8_LINEAR_W8A8_CONFIG if w8a8 else _linear().FP8_LINEAR_CONFIG
    return {"a_desc": f"tensordesc<bf16[16,{cfg.block_k}]>", "w_desc": f"tensordesc<fp8e4nv[{cfg.block_n},{cfg.block_k}]>",
            "s_ptr": "*fp32", "bias_ptr": "*fp32", "c_ptr": "*fp32"}


def _gemm_spec(w8a8: bool) -> KernelSpec:
    def cfg():
        return _linear().FP8_LINEAR_W8A8_CONFIG if w8a8 else _linear().FP8_LINEAR_CONFIG

    return KernelSpec(
        f"fp8_linear_{'w8a8' if w8a8 else 'weight_only'}", "atomtool.serve.ops.triton.linear",
        "_fp8_block_gemm_tma_kernel", lambda: _gemm_types(w8a8), lambda: _gemm_consts(w8a8),
        lambda: {"num_warps": cfg().num_warps, "num_stages": cfg().num_stages},
        lambda: f"TMA, 16 x {cfg().block_n} x {cfg().block_k} tiles{', W8A8' if w8a8 else ''}",
        lambda: _gemm_ints(cfg()))


def _gemm_ints(cfg) -> dict[str, int]:
    """o_proj (N 7168, K 16384) at M = 1: the split-K plan the launcher computes."""
    n_splits, k_chunk = _linear().split_k_plan(7168, 16384, cfg.block_n, cfg.block_k, cfg.split_target)
    return dict(M=1, N=7168, K=16384, bn=128, bk=128, k_chunk=k_chunk, s_sn=128, s_cm=7168,
                s_cs=0 if n_splits == 1 else 7168)


def _moe_consts(w8a8: bool) -> dict[str, Any]:
    cfg = _moe().MOE_GEMM_W8A8_CONFIG if w8a8 else _moe().MOE_GEMM_CONFIG
    return dict(A_PER_TOKEN=True, MUL_WEIGHT=False, FP8=True, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=128,
                DOT_DTYPE=_bf16(), SWAP_AB=cfg.swap_ab, USE_PDL=True, ACT_FP8=w8a8, ROUND_SCALE=w8a8, DIRECT=True)


def _moe_spec(w8a8: bool) -> KernelSpec:
    def cfg():
        return _moe().MOE_GEMM_W8A8_CONFIG if w8a8 else _moe().MOE_GEMM_CONFIG

    return KernelSpec(
        f"moe_gemm_{'w8a8' if w8a8 else 'weight_only'}", "atomtool.serve.ops.triton.moe", "_moe_gemm_kernel",
        lambda: {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "s_ptr": "*fp32", "c_ptr": "*fp32", "w_ptr": "*fp32",
                 "sorted_ptr": "*i32", "expert_ptr": "*i32"},
        lambda: _moe_consts(w8a8), lambda: {"num_warps": cfg().num_warps, "num_stages": cfg().num_stages},
        lambda: f"16 x {cfg().block_n} x 128 tiles, gate/up at batch 1 (direct){', W8A8' if w8a8 else ''}",
        lambda: dict(N=4096, K=7168, num_pairs=8, top_k=8, E=256, bn=128, bk=128, s_am=7168, s_be=4096 * 7168,
                     s_bn=7168, s_se=32 * 56, s_sn=56, s_cm=4096))


#: key positions of a block-table row (a 4096-token context in 64-token blocks plus one block)
_S = 65 * 64

#: the kernels of one DeepSeek-V3.2 decode step this tool knows how to compile, in step order
KERNELS: dict[str, KernelSpec] = {
    "indexer_keys": KernelSpec(
        "indexer_keys", "atomtool.serve.ops.triton.indexer", "_indexer_keys_kernel",
        lambda: {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": "*bf16", "key_ptr": "*i32", "rng_ptr": "*i32",
                 "cu_q_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "cos_ptr": "*fp32",
                 "sin_ptr": "*fp32"},
        lambda: dict(BLOCK_H=64, BLOCK_D=128, BLOCK_N=64, BLOCK_B=1, DOT_DTYPE=_bf16(), ROPE=True,
                     INTERLEAVED=False, USE_PDL=True),
        lambda: {"num_warps": 4, "num_stages": 3},
        lambda: "64 heads x 128 (query rope on 64 dims), 64 positions per step",
        lambda: dict(num_seqs=1, row0=0, Hi=64, Di=128, block_size=64, S=_S, nprog=_S // 64, half=32,
                     s_qt=64 * 128, s_qh=128, s_wt=64, s_kb=64 * 128, s_ks=128, s_bt=_S // 64, s_key=_S,
                     s_rng=2, s_ct=32, s_st=32)),
    "mla_split": KernelSpec(
        "mla_split", "atomtool.serve.ops.triton.mla", "_mla_split_kernel",
        lambda: {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "lat_ptr": "*bf16", "ws_acc_ptr": "*fp32",
                 "ws_ml_ptr": "*fp32", "cu_q_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32",
                 "topk_ptr": "*i32", "sm_scale": "fp32"},
        _split_consts,
        lambda: {"num_warps": _mla().MLA_DECODE_CONFIG.num_warps, "num_stages": _mla().MLA_DECODE_CONFIG.num_stages},
        lambda: (f"{_mla().MLA_DECODE_CONFIG.block_h} heads x {_mla().MLA_DECODE_CONFIG.block_n} keys, "
                 f"latent 512 + rope 64, sparse chunks of {_mla().SPLIT_CHUNK_SPARSE}"),
        lambda: dict(H=128, R=512, P=64, K=2048, block_size=64, n_chunks=2048 // _mla().SPLIT_CHUNK_SPARSE,
                     s_qnt=128 * 512, s_qnh=512, s_qpt=128 * 192, s_qph=192, s_lb=64 * 576, s_ls=576,
                     s_bt=_S // 64, s_tk=2048)),
    "mla_absorb": KernelSpec(
        "mla_absorb", "atomtool.serve.ops.triton.mla", "_mla_absorb_kernel",
        lambda: {"q_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "o_ptr": "*bf16"},
        _absorb_consts, lambda: {"num_warps": 8, "num_stages": 1},
        lambda: f"W_UK 128 x 512 FP8 (row scales) preloaded, {_mla().MERGE_UV_BLOCK_M}-row blocks",
        lambda: dict(T=1, DN=128, R=512, bk=128, s_qt=128 * 192, s_qh=192, s_wh=256 * 512, s_wd=512, s_sh=256 * 4,
                     s_sd=4, s_ot=128 * 512, s_oh=512)),
    "mla_merge_uv": KernelSpec(
        "mla_merge_uv", "atomtool.serve.ops.triton.mla", "_mla_merge_uv_kernel",
        lambda: {"ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "o_ptr": "*bf16",
                 "cu_q_ptr": "*i32", "seq_lens_ptr": "*i32"},
        _merge_consts, lambda: {"num_warps": 8, "num_stages": 1},
        lambda: (f"{_mla().MERGE_UV_BLOCK_M} rows, W_UV 128 x 512 FP8 (row scales) in steps of "
                 f"{_mla().MERGE_UV_BLOCK_R}, preloaded"),
        lambda: dict(B=1, H=128, R=512, DV=128, K=2048, bk=128, s_wh=256 * 512, s_wv=512, s_sh=256 * 4, s_sv=4,
                     s_ot=128 * 128, s_oh=128)),
    "fp8_linear_w8a8": _gemm_spec(True),
    "fp8_linear_weight_only": _gemm_spec(False),
    "moe_gemm_w8a8": _moe_spec(True),
    "moe_gemm_weight_only": _moe_spec(False),
}

def toolchain() -> tuple[Path, Path]:
    """(ptxas, nvdisasm) bundled with Triton's NVIDIA backend. Raises SassReportError when absent, or when
    Triton's interpreter is on (``TRITON_INTERPRET=1`` makes every kernel an interpreted Python function that
    cannot be compiled)."""
    import triton

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SassReportError("Triton's interpreter is on (TRITON_INTERPRET=1): run in a process without it")

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    tools = (bin_dir / "ptxas", bin_dir / "nvdisasm")
    missing = [str(t) for t in tools if not os.access(t, os.X_OK)]
    if missing:
        raise SassReportError(f"no sm_90 toolchain in this Triton install (missing {', '.join(missing)})")
    return tools


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def parse_ptxas(text: str) -> dict[str, Any]:
    """Registers, spill bytes and wgmma serialization from ``ptxas -v`` output (first function reported).
    Raises SassReportError when the output has no register line (ptxas failed)."""
    regs = _PTXAS_REGS.search(text)
    if regs is None:
        raise SassReportError(f"ptxas reported no registers:\n{text.strip()[-600:]}")
    spill = _PTXAS_SPILL.search(text)
    return {"registers": int(regs.group(1)),
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
            "wgmma_serialized": "C7515" in text or "wgmma.mma_async instructions are serialized" in text}


def sass_histogram(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count over the instructions of an ``nvdisasm -c`` listing."""
    return collections.Counter(m.group(1) for m in map(_SASS_OP.search, sass.splitlines()) if m)


def int_specialization(value: int) -> tuple[str, bool]:
    """(signature type, 16-divisible) of an integer launch argument as Triton's launcher specializes it: 1 becomes
    the constant 1, a multiple of 16 is marked divisible (addresses and masks built from it vectorize), a value
    past int32 is i64."""
    if value == 1:
        return "constexpr", False
    return ("i64" if not -2**31 <= value < 2**31 else "i32"), value % 16 == 0


def compile_kernel(spec: KernelSpec, arch: int = 90) -> dict[str, Any]:
    """Compile ``spec`` for ``sm_{arch}`` and return its row (see the module doc). Raises SassReportError."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas, nvdisasm = toolchain()
    fn = getattr(importlib.import_module(spec.module), spec.name)
    consts = spec.constexprs()
    types = spec.types()
    ints = spec.ints()
    signature, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[arg] = "constexpr"
            constexprs[arg] = consts[arg] if arg in consts else fn.params[i].default
        elif arg in ints:
            signature[arg], divisible = int_specialization(ints[arg])
            if signature[arg] == "constexpr":
                constexprs[arg] = ints[arg]
            elif divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[arg] = types.get(arg, "i32")
            if signature[arg].startswith("*"):  # the engine's tensors start 16-byte aligned
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = spec.options()
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32), options={**opts, "launch_pdl": True})
    except Exception as exc:  # OutOfResources, a compile error: reported as the row's failure
        raise SassReportError(f"{spec.label}: compile failed ({type(exc).__name__}: {exc})") from exc
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        run = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
        info = parse_ptxas(run.stdout + run.stderr)
        cubin = Path(tmp) / "t.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True).stdout
    ops = sass_histogram(sass)
    return {"kernel": spec.label, "config": spec.config(), **opts, **info,
            "shared_kb": round(compiled.metadata.shared / 1024, 1), "sass_instructions": sum(ops.values()),
            "wgmma": ops["HGMMA"] + ops["QGMMA"], "mma_sync": ops["HMMA"], "arch": f"sm_{arch}a"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help=f"comma-separated kernels of: {', '.join(KERNELS)}")
    ap.add_argument("--arch", type=int, default=90, help="SM version to compile for (90: Hopper)")
    args = ap.parse_args(argv)
    names = list(KERNELS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in KERNELS]
    if unknown or not names:
        raise SystemExit(f"sass_report: unknown kernel(s) {unknown or args.only!r}; choose from {', '.join(KERNELS)}")
    try:
        toolchain()
    except SassReportError as exc:
        raise SystemExit(f"sass_report: {exc}") from None
    rows, failed = [], []
    for name in names:
        try:
            rows.append(C.record("sass_report", **compile_kernel(KERNELS[name], args.arch)))
        except SassReportError as exc:
            failed.append(name)
            print(f"  {exc}", flush=True)
    C.print_table(f"decode kernels on sm_{args.arch}a (static: ptxas -v and nvdisasm)", rows,
                  ["kernel", "num_warps", "num_stages", "registers", "spill_bytes", "shared_kb", "sass_instructions",
                   "wgmma", "mma_sync", "wgmma_serialized", "config"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

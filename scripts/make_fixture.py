"""Write a tiny test checkpoint with transformers' save_pretrained (tests/checkpoints.py), optionally
re-exported in a quantized on-disk format, e.g. to reproduce the README's `atomtool inspect` output.

    python scripts/make_fixture.py /tmp/glm-fp8 --arch glm_moe_dsa --dtype bfloat16 --format fp8-block --fp8-block 16

Archs: llama, qwen2, qwen3, deepseek_v3, deepseek_v32, glm_moe_dsa. Formats (--format): hf (default),
fp8-block, ct-int4, ct-fp8, nvfp4, mxfp4 (MoE archs only: it quantizes the routed experts), awq, gptq.
The output appears all at once (written to a temporary sibling directory, then renamed) or not at all.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import checkpoints as ck  # noqa: E402

WRITERS = {
    "ct-int4": ck.write_ct_int4_checkpoint, "ct-fp8": ck.write_ct_fp8_checkpoint, "nvfp4": ck.write_nvfp4_checkpoint,
    "mxfp4": ck.write_mxfp4_checkpoint, "awq": ck.write_awq_checkpoint, "gptq": ck.write_gptq_checkpoint,
}
MOE_ONLY_FORMATS = ("mxfp4",)  # gpt-oss style MXFP4 packs only routed experts


def _is_moe(arch: str) -> bool:
    cfg = ck.tiny_config(arch)
    return bool(getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0))


def _write(args: argparse.Namespace, out: Path) -> None:
    drop = ["indexer_types"] if args.drop_indexer_types else []
    dtype = getattr(torch, args.dtype)
    if args.format == "hf":
        ck.write_hf_checkpoint(out, args.arch, seed=args.seed, dtype=dtype, drop_config_keys=drop)
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = ck.write_hf_checkpoint(Path(tmp) / "src", args.arch, seed=args.seed, dtype=dtype,
                                     drop_config_keys=drop)
        if args.format == "fp8-block":
            ck.write_fp8_block_checkpoint(src, out, block=args.fp8_block or 128,
                                          modules_to_not_convert=args.modules_to_not_convert)
        else:
            WRITERS[args.format](src, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output directory (must not exist)")
    p.add_argument("--arch", default="glm_moe_dsa", choices=ck.ARCHS)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", default="hf", choices=["hf", "fp8-block", *WRITERS])
    p.add_argument("--fp8-block", type=int, default=None,
                   help="FP8 block size (rows = cols; default 128); only with --format fp8-block")
    p.add_argument("--modules-to-not-convert", nargs="*", default=None,
                   help="fp8-block: a GLM-style exclusion list (default: none, as DeepSeek ships)")
    p.add_argument("--drop-indexer-types", action="store_true",
                   help="remove indexer_types from config.json (keep only index_topk_freq/offset)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists")
    if args.format != "fp8-block":
        for flag, value in (("--fp8-block", args.fp8_block), ("--modules-to-not-convert", args.modules_to_not_convert)):
            if value is not None:
                p.error(f"{flag} applies to --format fp8-block only (got --format {args.format})")
    if args.fp8_block is not None and args.fp8_block <= 0:
        p.error(f"--fp8-block must be a positive integer, got {args.fp8_block}")
    if args.format in MOE_ONLY_FORMATS and not _is_moe(args.arch):
        moe = [a for a in ck.ARCHS if _is_moe(a)]
        p.error(f"--format {args.format} needs an MoE arch (routed experts to quantize): {', '.join(moe)}; "
                f"{args.arch} is dense")
    out = args.out.expanduser().absolute()
    if not out.parent.is_dir():
        p.error(f"{out.parent}: no such directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # same filesystem: rename is atomic
    try:
        _write(args, tmp / "ckpt")
        (tmp / "ckpt").rename(out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

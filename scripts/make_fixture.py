"""Write a tiny test checkpoint with transformers' save_pretrained (tests/checkpoints.py), optionally
re-exported in a quantized on-disk format, e.g. to reproduce the README's `atomtool inspect` output.

    python scripts/make_fixture.py /tmp/glm-fp8 --arch glm_moe_dsa --dtype bfloat16 --fp8-block 16

Archs: llama, qwen2, qwen3, deepseek_v3, deepseek_v32, glm_moe_dsa. Formats (--format): hf (default),
fp8-block, ct-int4, ct-fp8, nvfp4, mxfp4, awq, gptq.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output directory (must not exist)")
    p.add_argument("--arch", default="glm_moe_dsa", choices=ck.ARCHS)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", default="hf", choices=["hf", "fp8-block", *WRITERS])
    p.add_argument("--fp8-block", type=int, default=128, help="FP8 block size (rows = cols)")
    p.add_argument("--modules-to-not-convert", nargs="*", default=None,
                   help="fp8-block: a GLM-style exclusion list (default: none, as DeepSeek ships)")
    p.add_argument("--drop-indexer-types", action="store_true",
                   help="remove indexer_types from config.json (keep only index_topk_freq/offset)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists")
    drop = ["indexer_types"] if args.drop_indexer_types else []
    dtype = getattr(torch, args.dtype)
    if args.format == "hf":
        ck.write_hf_checkpoint(args.out, args.arch, seed=args.seed, dtype=dtype, drop_config_keys=drop)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            src = ck.write_hf_checkpoint(Path(tmp) / "src", args.arch, seed=args.seed, dtype=dtype,
                                         drop_config_keys=drop)
            if args.format == "fp8-block":
                ck.write_fp8_block_checkpoint(src, args.out, block=args.fp8_block,
                                              modules_to_not_convert=args.modules_to_not_convert)
            else:
                WRITERS[args.format](src, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

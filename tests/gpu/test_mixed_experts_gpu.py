"""GPU check of an FP8 block MoE checkpoint whose MoE layers leave one routed expert BF16
(``modules_to_not_convert``): convert stacks those layers in BF16 / F32 with the FP8 experts dequantized,
next to layers whose experts stay FP8 (the FP8 fused-MoE kernel). Served from the raw directory and from the
``--dtype float32`` layout on CUDA in float32 with the Triton backend, the greedy tokens equal transformers'
on the exactly dequantized weights.

Run: ``.venv/bin/pytest -q tests/gpu/test_mixed_experts_gpu.py`` (skipped without CUDA).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_models_gpu import FAMILIES, LENGTHS, N_NEW, _hf_greedy, _prompt
from typer.testing import CliRunner

from atomtool.cli import app
from atomtool.serve.sampling_params import SamplingParams
from tests.checkpoints import write_fp8_block_checkpoint, write_hf_checkpoint
from tests.test_convert_tester5 import dequantized_copy


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(raw FP8 checkpoint, its ``--dtype float32`` layout, transformers on the dequantized weights on CUDA).
    Tiny GLM-5: layer 0 dense, layers 1-3 MoE; expert 3 of layers 2 and 3 is left BF16 (layer 1's experts
    all FP8), so FP8 and dequantized expert stacks are served side by side."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mixed-experts")
    src = write_hf_checkpoint(root / "src", "glm_moe_dsa", seed=4, **FAMILIES["glm_moe_dsa"])
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    odd = [f"model.layers.{i}.mlp.experts.3." for i in range(2, n)]
    fp8 = write_fp8_block_checkpoint(src, root / "fp8", block=(16, 16), float_dtype=None, leave_float=odd,
                                     modules_to_not_convert=[s.rstrip(".") for s in odd])
    layout = root / "layout"
    res = CliRunner().invoke(app, ["convert", str(fp8), str(layout), "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert "dequantized to F32 (exact)" in res.stderr
    deq = dequantized_copy(fp8, root / "dequant")
    hf = AutoModelForCausalLM.from_pretrained(str(deq), dtype=torch.float32, attn_implementation="eager")
    return fp8, layout, hf.eval().to("cuda")


@pytest.mark.parametrize("which", ["raw", "layout"])
def test_mixed_fp8_bf16_experts_float32_greedy_equals_dequantized_transformers(mixed, which):
    from atomtool.serve.llm import LLM

    fp8, layout, hf = mixed
    llm = LLM(str(fp8 if which == "raw" else layout), device="cuda", dtype="float32", backend="triton",
              kv_cache_memory=1 << 26, max_model_len=256)
    stacks = [m for name, m in llm.engine.model.named_modules() if name.endswith("mlp.experts")]
    kinds = {m.w13.weight.dtype for m in stacks}
    assert kinds == {torch.float8_e4m3fn, torch.float32}, kinds  # FP8 stacks next to dequantized ones
    prompts = [_prompt(n, 500 + i) for i, n in enumerate(LENGTHS)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        ref, _ = _hf_greedy(hf, p, N_NEW)
        assert o.token_ids == ref, (which, len(p), kinds)

"""Test fixtures: tiny REAL checkpoints written by transformers' ``save_pretrained`` plus quantized variants.

Every stage's tests build their inputs here (import as ``from tests.checkpoints import ...``):

- :func:`tiny_config` / :func:`write_hf_checkpoint`: a tiny, structurally complete model of one of
  :data:`ARCHS` (Llama with GQA, Qwen2, Qwen3 with qk-norm, DeepSeek-V3 MLA+MoE, DeepSeek-V3.2 MLA+DSA+MoE,
  GLM-MoE-DSA with an IndexShare schedule), randomly initialised with a seed and written by transformers
  itself (the real on-disk names/dtypes), with a tiny character-level tokenizer and a generation_config.
- quantized copies of such a checkpoint in each scheme's real on-disk format (research/quant.md §2):
  :func:`write_fp8_block_checkpoint` (DeepSeek/GLM FP8: ``weight_scale_inv``), compressed-tensors int4
  pack-quantized and FP8, ModelOpt NVFP4, gpt-oss MXFP4, AWQ and GPTQ. FP8 block values are exact
  (see :func:`dequantize_fp8_block_checkpoint` for oracle comparisons); the 4-bit formats carry real
  packing for FP8/int4-CT and random-but-correctly-shaped payloads for the others (header-correct).

Shapes of the tiny MLA models (all archs share ``hidden_size`` 64 and ``vocab_size`` 128): 4 heads,
q_lora_rank 32, kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head_dim 16, 8 routed experts (top-2, 2 groups,
topk_group 1), 1 shared expert, first_k_dense_replace 1, indexer 4 heads x 16 dims, ``index_topk`` 8 (prompts
longer than 8 tokens exercise the top-k selection).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import string
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ARCHS = ("llama", "qwen2", "qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")

#: GLM fixture schedule: 4 layers, index_topk_freq 2, index_skip_topk_offset 2 -> full, full, shared, full.
GLM_FREQ_ROLES = ["full", "full", "shared", "full"]
#: explicit indexer_types for the GLM variant (tiny_config("glm_moe_dsa", indexer_types=GLM_EXPLICIT_TYPES)).
GLM_EXPLICIT_TYPES = ["full", "shared", "shared", "full"]

_MLA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=512,
    routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False,
)
_DSA = dict(index_topk=8, index_n_heads=4, index_head_dim=16)
_DENSE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)

_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_DENSE},
    "qwen2": {**_DENSE, "num_hidden_layers": 2},
    "qwen3": {**_DENSE},
    "deepseek_v3": {**_MLA},
    "deepseek_v32": {**_MLA, **_DSA},
    "glm_moe_dsa": {**_MLA, **_DSA, "num_hidden_layers": 4, "index_topk_freq": 2, "index_skip_topk_offset": 2},
}
_CONFIG_CLASSES = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "deepseek_v3": "DeepseekV3Config",
    "deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig",
}


def tiny_config(arch: str, **overrides: Any):
    """A tiny, structurally complete ``transformers`` config of ``arch`` (one of :data:`ARCHS`).

    ``overrides`` replace defaults (e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=5``,
    ``indexer_types=[...]`` for GLM's explicit schedule). For ``glm_moe_dsa`` the default schedule comes from
    ``index_topk_freq=2`` / ``index_skip_topk_offset=2`` (:data:`GLM_FREQ_ROLES`); passing ``indexer_types``
    drops the freq/offset keys. ``architectures`` is set to the CausalLM class.

    Raises:
        ValueError: unknown ``arch``.
    """
    import transformers

    if arch not in _DEFAULTS:
        raise ValueError(f"unknown fixture arch {arch!r}; expected one of {ARCHS}")
    kwargs = {**_DEFAULTS[arch], **overrides}
    if arch == "glm_moe_dsa" and "indexer_types" in overrides:
        for key in ("index_topk_freq", "index_skip_topk_offset"):
            if key not in overrides:
                kwargs.pop(key, None)
    cfg = getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)
    cfg.architectures = [_arch_name(arch)]
    return cfg


def _arch_name(arch: str) -> str:
    return {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
        "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    }[arch]


def build_model(arch: str, seed: int = 0, **overrides: Any):
    """Instantiate the transformers CausalLM for ``tiny_config(arch, **overrides)`` in float32 with non-trivial
    seeded weights (see :func:`randomize_`). Returns the model in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> None:
    """Re-initialise every parameter and float buffer so that bugs show: matrices ~ N(0, std), embeddings
    ~ N(0, 0.5), norm weights ~ 1 + N(0, 0.1), biases and ``e_score_correction_bias`` ~ N(0, 0.1).
    Rotary ``inv_freq`` buffers are left alone."""
    gen = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if b.is_floating_point() and "inv_freq" not in n
    ]
    for name, t in tensors:
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if "norm" in owner.rsplit(".", 1)[-1] and leaf == "weight":
            val = 1.0 + 0.1 * noise
        elif leaf in ("bias", "e_score_correction_bias") or t.dim() == 1:
            val = 0.1 * noise
        elif "embed" in name:
            val = 0.5 * noise
        else:
            val = std * noise
        t.copy_(val.to(t.dtype))


def write_hf_checkpoint(
    path: str | Path,
    arch: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    max_shard_size: str | int | None = None,
    tokenizer: bool = True,
    drop_config_keys: Iterable[str] = (),
    **overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` checkpoint with transformers' ``save_pretrained`` into ``path``.

    Args:
        path: output directory (created).
        arch: one of :data:`ARCHS`; ``overrides`` go to :func:`tiny_config`.
        seed: weight seed (same seed -> same weights).
        dtype: storage dtype; for float16/bfloat16, the model's ``_keep_in_fp32_modules_strict`` tensors
            (``e_score_correction_bias``) stay float32 (and ``_keep_in_fp32_modules`` for float16), as
            transformers does when it loads with that dtype.
        max_shard_size: e.g. ``"20KB"`` to get a sharded checkpoint with ``model.safetensors.index.json``.
        tokenizer: also save :func:`make_tokenizer`'s tokenizer (tokenizer.json + tokenizer_config.json).
        drop_config_keys: keys removed from the written config.json (e.g. ``["indexer_types"]`` to leave
            only ``index_topk_freq``/``index_skip_topk_offset``, the form real configs use).
    Returns:
        the checkpoint directory.
    """
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, seed, **overrides)
    if dtype != torch.float32:
        keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            keep |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                if t.is_floating_point() and "inv_freq" not in name and not any(k in name for k in keep):
                    t.data = t.data.to(dtype)
        model.config.dtype = dtype
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    cfg = model.config
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id, do_sample=False).save_pretrained(path)
    if tokenizer:
        make_tokenizer().save_pretrained(path)
    drop = list(drop_config_keys)
    if drop:
        raw = json.loads((path / "config.json").read_text())
        for key in drop:
            raw.pop(key, None)
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer():
    """A tiny character-level ``PreTrainedTokenizerFast`` (ids < 128): ``<pad>``=0, ``<s>``=1 (bos),
    ``</s>``=2 (eos), ``<unk>``=3, role markers, then printable ASCII characters. Decoding joins characters
    (no added spaces). Carries a simple chat template (``<|role|>content\\n``)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    assert len(vocab) <= 128
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=specials[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------------------------------
# helpers shared by the quantized writers


def load_state_dict(src: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a (single-file or sharded) safetensors checkpoint directory, by name."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def _copy_side_files(src: Path, dst: Path) -> dict[str, Any]:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def write_state_dict(dst: str | Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Write ``tensors`` as ``model.safetensors`` or, with ``shards > 1``, as ``shards`` files plus a
    ``model.safetensors.index.json`` (the HF sharded layout); the split is by sorted name."""
    dst = Path(dst)
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(dst / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(dst / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _write_config(dst: Path, cfg: dict[str, Any], qcfg: dict[str, Any] | None) -> None:
    cfg = copy.deepcopy(cfg)
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


#: module-name endings real quantized releases leave in a float dtype (router, indexer weights_proj, heads)
_FLOAT_MODULE_ENDINGS = ("mlp.gate", "indexer.weights_proj", "lm_head", "embed_tokens", "shared_head.head",
                         "eh_proj")


def is_quantizable_linear(name: str, t: torch.Tensor) -> bool:
    """True for a 2-D ``<module>.weight`` that FP8/int4 releases quantize: every linear projection except
    the MoE router ``mlp.gate``, ``indexer.weights_proj``, ``lm_head``, embeddings and norms."""
    if not name.endswith(".weight") or t.dim() != 2:
        return False
    module = name[: -len(".weight")]
    if "norm" in module.rsplit(".", 1)[-1]:
        return False
    return not module.endswith(_FLOAT_MODULE_ENDINGS)


def _selected(name: str, leave_float: Iterable[str]) -> bool:
    return not any(s in name for s in leave_float)


def _quantize_linears(
    src: Path,
    dst: Path,
    quantize: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    selected: Callable[[str], bool] = lambda name: True,
    other: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Copy ``src``'s side files into ``dst`` and return (its config.json, its tensors re-encoded): every
    :func:`is_quantizable_linear` weight whose name passes ``selected`` is replaced by the tensors
    ``quantize(module, weight)`` returns (``module`` = name without ``.weight``); any other tensor becomes
    ``other(name, tensor)`` (unchanged by default). The caller writes tensors and config."""
    cfg = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_state_dict(src).items():
        if is_quantizable_linear(name, t) and selected(name):
            out.update(quantize(name[: -len(".weight")], t))
        else:
            out[name] = other(name, t)
    return cfg, out


# --------------------------------------------------------------------------------------------------
# FP8 block (DeepSeek-V3/V3.2, GLM-5 FP8 releases; HF quant_method "fp8")

FP8_MAX = 448.0


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w`` [N, K] to float8_e4m3fn with one fp32 scale per ``block`` tile.

    Returns (q [N, K] float8_e4m3fn, scale_inv [ceil(N/b0), ceil(K/b1)] float32) with
    ``w ~= q.float() * scale_inv[i // b0, j // b1]`` (the DeepSeek convention: ``_inv`` is a multiplier).
    """
    n, k = w.shape
    b0, b1 = block
    rn, rk = math.ceil(n / b0), math.ceil(k / b1)
    w = w.float()
    padded = torch.zeros(rn * b0, rk * b1)
    padded[:n, :k] = w
    tiles = padded.view(rn, b0, rk, b1)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / FP8_MAX).float()
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rn * b0, rk * b1)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Exact inverse of the storage: ``q.float() * scale_inv`` broadcast over ``block`` tiles -> float32 [N, K]."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return q.float() * s


def write_fp8_block_checkpoint(
    src: str | Path,
    dst: str | Path,
    block: int | tuple[int, int] = 128,
    *,
    float_dtype: torch.dtype | None = torch.bfloat16,
    modules_to_not_convert: list[str] | None = None,
    leave_float: Iterable[str] = (),
    scale_fmt: str | None = None,
    shards: int = 1,
) -> Path:
    """Write ``src`` (a :func:`write_hf_checkpoint` dir) in the FP8 block format DeepSeek/GLM ship.

    Quantized (see :func:`is_quantizable_linear`): ``<m>.weight`` float8_e4m3fn [N, K] +
    ``<m>.weight_scale_inv`` float32 [ceil(N/b0), ceil(K/b1)]. Left float (cast to ``float_dtype``, None keeps
    the source dtype): embeddings, lm_head, norms, router ``mlp.gate`` (its ``e_score_correction_bias`` stays
    float32), ``indexer.weights_proj``, indexer k_norm, and any tensor whose name contains one of
    ``leave_float``. quantization_config = ``{quant_method fp8, fmt e4m3, activation_scheme dynamic,
    weight_block_size [b0, b1]}`` with NO exclusion list (DeepSeek style) unless ``modules_to_not_convert``
    is given (GLM style, e.g. ``["model.layers.1.self_attn.indexers_proj"]``).

    ``block`` may be small (e.g. 16 or (16, 32)) so tiny models get non-aligned parts. Tokenizer, generation
    config and other side files are copied.
    """
    src, dst = Path(src), Path(dst)
    b = (block, block) if isinstance(block, int) else tuple(block)

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_fp8_block(t, b)
        return {m + ".weight": q, m + ".weight_scale_inv": s}

    def other(name: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and float_dtype is not None and not name.endswith("e_score_correction_bias"):
            return t.to(float_dtype)
        return t

    cfg, out = _quantize_linears(src, dst, quantize, lambda name: _selected(name, leave_float), other)
    write_state_dict(dst, out, shards)
    qcfg: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": list(b)}
    if scale_fmt:
        qcfg["scale_fmt"] = scale_fmt
    if modules_to_not_convert is not None:
        qcfg["modules_to_not_convert"] = list(modules_to_not_convert)
    if float_dtype is not None:
        cfg["dtype"] = str(float_dtype).removeprefix("torch.")
    _write_config(dst, cfg, qcfg)
    return dst


def dequantize_fp8_block_checkpoint(dst: str | Path) -> dict[str, torch.Tensor]:
    """Read a :func:`write_fp8_block_checkpoint` dir back: every FP8 weight exactly dequantized to float32
    (``q * scale_inv``), scale tensors dropped, other tensors as stored. Use as the oracle state dict."""
    dst = Path(dst)
    b = tuple(json.loads((dst / "config.json").read_text())["quantization_config"]["weight_block_size"])
    sd = load_state_dict(dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8_block(t, sd[name + "_scale_inv"], b)
        else:
            out[name] = t
    return out


# --------------------------------------------------------------------------------------------------
# compressed-tensors (llm-compressor): int4 pack-quantized (W4A16) and FP8 float-quantized


#: the ``ignore`` list llm-compressor recipes give DeepSeek/GLM checkpoints: router, indexer weights, head
CT_DEFAULT_IGNORE = ("lm_head", "re:.*mlp\\.gate$", "re:.*indexer\\.weights_proj$")


def _pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack unsigned 4-bit values [N, K] (K % 8 == 0) into int32 [N, K/8], low nibble = lowest column."""
    n, k = q.shape
    q = q.to(torch.int64).view(n, k // 8, 8)
    packed = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        packed |= (q[:, :, i] & 0xF) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def write_ct_int4_checkpoint(src: str | Path, dst: str | Path, group_size: int = 32, *,
                             ignore: list[str] | None = None, leave_float: Iterable[str] = ()) -> Path:
    """compressed-tensors ``pack-quantized`` W4A16 (symmetric int4, group strategy), as llm-compressor
    writes it: ``<m>.weight_packed`` I32 [N, K/8], ``<m>.weight_scale`` BF16 [N, K/G], ``<m>.weight_shape``
    I64 [2] = [N, K]. ``ignore`` defaults to :data:`CT_DEFAULT_IGNORE`
    (tensors matching them and ``leave_float`` stay float). Values are really quantized."""
    src, dst = Path(src), Path(dst)

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = t.shape
        g = t.float().view(n, k // group_size, group_size)
        scale = (g.abs().amax(-1) / 7.0).clamp(min=1e-8)
        q = (g / scale[..., None]).round().clamp(-8, 7).view(n, k) + 8
        return {m + ".weight_packed": _pack_int4_rows(q), m + ".weight_scale": scale.to(torch.bfloat16),
                m + ".weight_shape": torch.tensor([n, k], dtype=torch.int64)}

    cfg, out = _quantize_linears(src, dst, quantize, lambda name: _selected(name, leave_float))
    write_state_dict(dst, out)
    qcfg = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
                        "symmetric": True, "dynamic": False, "actorder": None, "block_structure": None,
                        "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": ignore if ignore is not None else list(CT_DEFAULT_IGNORE),
        "kv_cache_scheme": None, "version": "0.10.2",
    }
    _write_config(dst, cfg, qcfg)
    return dst


def write_ct_fp8_checkpoint(src: str | Path, dst: str | Path, strategy: str = "channel", *,
                            ignore: list[str] | None = None, leave_float: Iterable[str] = ()) -> Path:
    """compressed-tensors ``float-quantized`` FP8 (W8A8 dynamic per-token activations): ``<m>.weight``
    F8_E4M3 [N, K] + ``<m>.weight_scale`` F32 [N, 1] (``strategy="channel"``) or [1] (``"tensor"``)."""
    src, dst = Path(src), Path(dst)

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        w = t.float()
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        return {m + ".weight": (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
                m + ".weight_scale": scale.float()}

    cfg, out = _quantize_linears(src, dst, quantize, lambda name: _selected(name, leave_float))
    write_state_dict(dst, out)
    qcfg = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                        "dynamic": False, "group_size": None, "block_structure": None, "actorder": None},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}},
        "ignore": ignore if ignore is not None else list(CT_DEFAULT_IGNORE),
        "kv_cache_scheme": None,
    }
    _write_config(dst, cfg, qcfg)
    return dst


# --------------------------------------------------------------------------------------------------
# header-correct formats with random payloads: NVFP4 (ModelOpt), MXFP4 (gpt-oss), AWQ, GPTQ


def _rand_int(shape, gen, dtype, high=2**31 - 1, low=0):
    return torch.randint(low, high, tuple(shape), generator=gen, dtype=torch.int64).to(dtype)


def write_nvfp4_checkpoint(src: str | Path, dst: str | Path, *, exclude_modules: list[str] | None = None,
                           legacy_hf_quant_config: bool = True, seed: int = 0) -> Path:
    """NVIDIA ModelOpt NVFP4: ``<m>.weight`` U8 [N, K/2] (two e2m1 per byte), ``<m>.weight_scale`` F8_E4M3
    [N, K/16], ``<m>.weight_scale_2`` F32 [], ``<m>.input_scale`` F32 []. Config: ``quantization_config``
    {quant_method modelopt, quant_algo NVFP4, group_size 16, exclude_modules} and, when
    ``legacy_hf_quant_config``, an ``hf_quant_config.json`` with the same facts (as nvidia/* releases ship).
    ``exclude_modules`` (fnmatch globs) default to ``["lm_head", "*.mlp.gate", "*indexer*"]``; modules
    they match stay float. Payload values are random."""
    import fnmatch

    src, dst = Path(src), Path(dst)
    gen = torch.Generator().manual_seed(seed)
    excl = exclude_modules if exclude_modules is not None else ["lm_head", "*.mlp.gate", "*indexer*"]

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = t.shape
        return {m + ".weight": _rand_int((n, k // 2), gen, torch.uint8, 256),
                m + ".weight_scale": (torch.rand(n, k // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn),
                m + ".weight_scale_2": torch.tensor(0.01, dtype=torch.float32),
                m + ".input_scale": torch.tensor(0.02, dtype=torch.float32)}

    def selected(name: str) -> bool:
        return not any(fnmatch.fnmatch(name[: -len(".weight")], p) for p in excl)

    cfg, out = _quantize_linears(src, dst, quantize, selected)
    write_state_dict(dst, out)
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excl}
    _write_config(dst, cfg, {"quant_method": "modelopt", **q})
    if legacy_hf_quant_config:
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": q}, indent=2))
    return dst


def write_mxfp4_checkpoint(src: str | Path, dst: str | Path, *, seed: int = 0) -> Path:
    """gpt-oss style MXFP4 of an MoE checkpoint: per layer, the routed experts are stacked into
    ``mlp.experts.gate_up_proj_blocks`` U8 [E, 2I, H/32, 16] + ``gate_up_proj_scales`` U8 [E, 2I, H/32]
    (E8M0 exponents) and ``mlp.experts.down_proj_blocks`` U8 [E, H, I/32, 16] + ``down_proj_scales``
    U8 [E, H, I/32]; everything else stays as in ``src``. quantization_config = {quant_method mxfp4,
    modules_to_not_convert [model.layers.*.self_attn, model.layers.*.mlp.gate, model.embed_tokens, lm_head]}.
    Payload values are random."""
    import re

    src, dst = Path(src), Path(dst)
    gen = torch.Generator().manual_seed(seed)
    cfg = _copy_side_files(src, dst)
    sd = load_state_dict(src)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    for name, t in sd.items():
        m = pat.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    if not experts:
        raise ValueError(f"{src}: no routed experts to quantize (MXFP4 fixtures need an MoE arch)")
    for prefix, per in experts.items():
        e = len(per)
        inter, hidden = per[0]["gate_proj"].shape
        out[prefix + ".gate_up_proj_blocks"] = _rand_int((e, 2 * inter, hidden // 32, 16), gen, torch.uint8, 256)
        out[prefix + ".gate_up_proj_scales"] = _rand_int((e, 2 * inter, hidden // 32), gen, torch.uint8, 130, 120)
        out[prefix + ".down_proj_blocks"] = _rand_int((e, hidden, inter // 32, 16), gen, torch.uint8, 256)
        out[prefix + ".down_proj_scales"] = _rand_int((e, hidden, inter // 32), gen, torch.uint8, 130, 120)
    write_state_dict(dst, out)
    _write_config(dst, cfg, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]})
    return dst


def _int4_zeros_scales(m: str, n: int, k: int, group_size: int,
                       gen: torch.Generator) -> dict[str, torch.Tensor]:
    """AWQ/GPTQ's random ``<m>.qzeros`` I32 [K/G, N/8] (packed 4-bit zeros) and ``<m>.scales`` F16
    [K/G, N] of a linear [N, K], drawn from ``gen`` in that order (after ``qweight``)."""
    return {m + ".qzeros": _rand_int((k // group_size, n // 8), gen, torch.int32),
            m + ".scales": (torch.rand(k // group_size, n, generator=gen) * 0.01).half()}


def write_awq_checkpoint(src: str | Path, dst: str | Path, group_size: int = 32, *, seed: int = 0,
                         modules_to_not_convert: list[str] | None = None) -> Path:
    """AutoAWQ GEMM 4-bit: ``<m>.qweight`` I32 [K, N/8], ``<m>.qzeros`` I32 [K/G, N/8], ``<m>.scales`` F16
    [K/G, N] (note the [in, out] orientation). quantization_config = {quant_method awq, bits 4, group_size G,
    zero_point true, version gemm, modules_to_not_convert}. Payload values are random."""
    src, dst = Path(src), Path(dst)
    gen = torch.Generator().manual_seed(seed)

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = t.shape
        return {m + ".qweight": _rand_int((k, n // 8), gen, torch.int32),
                **_int4_zeros_scales(m, n, k, group_size, gen)}

    cfg, out = _quantize_linears(src, dst, quantize)
    write_state_dict(dst, out)
    _write_config(dst, cfg, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                             "version": "gemm", "modules_to_not_convert": modules_to_not_convert})
    return dst


def write_gptq_checkpoint(src: str | Path, dst: str | Path, group_size: int = 32, *, seed: int = 0) -> Path:
    """AutoGPTQ / GPTQModel 4-bit: ``<m>.qweight`` I32 [K/8, N], ``<m>.qzeros`` I32 [K/G, N/8],
    ``<m>.scales`` F16 [K/G, N], ``<m>.g_idx`` I32 [K]. quantization_config = {quant_method gptq, bits 4,
    group_size G, desc_act false, sym true, lm_head false, checkpoint_format gptq}. Payload values random."""
    src, dst = Path(src), Path(dst)
    gen = torch.Generator().manual_seed(seed)

    def quantize(m: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = t.shape
        return {m + ".qweight": _rand_int((k // 8, n), gen, torch.int32),
                **_int4_zeros_scales(m, n, k, group_size, gen), m + ".g_idx": (torch.arange(k) // group_size).to(torch.int32)}

    cfg, out = _quantize_linears(src, dst, quantize)
    write_state_dict(dst, out)
    _write_config(dst, cfg, {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                             "sym": True, "lm_head": False, "checkpoint_format": "gptq"})
    return dst

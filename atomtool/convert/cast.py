"""Dtype policy of a conversion, the warnings it emits, and overflow-checked float casts.

Policy (issue 3, research/quant.md §5):

- ``auto`` keeps every stored dtype.
- An explicit target (``bfloat16`` | ``float16`` | ``float32``) casts *plain-float* tensors only: tensors of
  modules whose storage scheme is a float scheme, and float tensors outside linear modules (norms,
  embeddings). Quantized weights and their scales are never cast (that would be requantization), nor
  are integer tensors.
- Tensors the family keeps in FP32 (:attr:`atomtool.inspect.families.Family.fp32_keep`, e.g. the router's
  ``e_score_correction_bias``) keep their stored dtype whatever the target.
- Every float-to-float conversion is reported once per (source dtype -> target dtype) pair with a count,
  a few names and whether it is lossless (widening) or lossy.
- A cast that overflows (a finite source value becomes inf, e.g. BF16 above 65504 cast to FP16) raises
  :class:`~atomtool.errors.ConversionError` naming the tensor instead of writing inf.
"""

from __future__ import annotations

import torch

from atomtool.errors import ConversionError

#: --dtype values -> safetensors tags
DTYPE_TAGS: dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

#: float storage schemes (ModuleInfo.scheme) whose tensors are plain floats
FLOAT_SCHEMES = frozenset({"bf16", "fp16", "fp32", "fp64"})

#: safetensors tag -> torch dtype (the subset torch can hold; F4/F6 packed types are not here)
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
TAG_OF_TORCH: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

PLAIN_FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16"})

# significant bits (incl. the implicit one) and exponent range, to say lossless vs lossy
_MANTISSA = {"F64": 53, "F32": 24, "F16": 11, "BF16": 8}
_MAX_EXP = {"F64": 1023, "F32": 127, "F16": 15, "BF16": 127}


def torch_dtype(tag: str, *, tensor: str | None = None) -> torch.dtype:
    """torch dtype of a safetensors dtype tag.

    Raises:
        ConversionError: torch has no dtype for ``tag`` (packed sub-byte types such as ``F4``).
    """
    try:
        return TORCH_DTYPES[tag]
    except KeyError:
        where = f" ({tensor})" if tensor else ""
        raise ConversionError(f"dtype {tag}{where} cannot be read into a torch tensor") from None


def target_tag(dtype: str) -> str | None:
    """safetensors tag of a ``--dtype`` value; None for ``auto``.

    Raises:
        ConversionError: unknown dtype name.
    """
    if dtype == "auto":
        return None
    try:
        return DTYPE_TAGS[dtype]
    except KeyError:
        raise ConversionError(f"unknown --dtype {dtype!r}; expected auto, {', '.join(DTYPE_TAGS)}") from None


def is_lossless(src: str, dst: str) -> bool:
    """True when every ``src`` value is exactly representable in ``dst`` (a widening cast)."""
    return _MANTISSA[dst] >= _MANTISSA[src] and _MAX_EXP[dst] >= _MAX_EXP[src]


def describe_cast(src: str, dst: str) -> str:
    """Human explanation of a float cast: lossless widening, or what it loses."""
    if is_lossless(src, dst):
        return "lossless widening"
    parts = []
    if _MANTISSA[dst] < _MANTISSA[src]:
        parts.append(f"rounds to {_MANTISSA[dst]} significant bits")
    if _MAX_EXP[dst] < _MAX_EXP[src]:
        top = torch.finfo(TORCH_DTYPES[dst]).max
        tiny = torch.finfo(TORCH_DTYPES[dst]).tiny
        parts.append(f"|x| > {top:.6g} would overflow (checked: an error if any does), "
                     f"|x| < {tiny:.2g} loses precision")
    return "lossy: " + ", ".join(parts)


def output_dtype(stored: str, *, target: str | None, scheme: str, keep_fp32: bool) -> str:
    """The dtype tag a tensor gets in the layout.

    Args:
        stored: stored safetensors tag.
        target: target tag of ``--dtype`` (None for auto).
        scheme: storage scheme of the module the tensor belongs to (``"float"`` for tensors outside
            linear modules: norms, embeddings, router biases).
        keep_fp32: the family lists the tensor in ``fp32_keep``.
    """
    if target is None or keep_fp32 or stored not in PLAIN_FLOAT_TAGS:
        return stored
    if scheme != "float" and scheme not in FLOAT_SCHEMES:
        return stored  # a float tensor of a quantized module (scale, bias): never cast
    return target


def cast_messages(casts: list[tuple[str, str, str]], *, examples: int = 3) -> tuple[list[str], list[str]]:
    """One line per (source dtype -> target dtype) pair, split into (warnings, notes): a lossy cast is a
    warning, a lossless widening (BF16 -> F32) only an informational note.

    Args:
        casts: (tensor name, source tag, target tag) for every source tensor that is cast.
    Returns:
        (warnings, notes), messages such as ``"42 tensors cast F32 -> BF16 (lossy: rounds to 8 significant
        bits), e.g. a, b, c (+39 more)"`` / ``"3 tensors cast BF16 -> F32 (lossless widening), e.g. ..."``,
        each in first-seen pair order.
    """
    by_pair: dict[tuple[str, str], list[str]] = {}
    for name, src, dst in casts:
        by_pair.setdefault((src, dst), []).append(name)
    warnings: list[str] = []
    notes: list[str] = []
    for (src, dst), names in by_pair.items():
        shown = ", ".join(names[:examples])
        more = f" (+{len(names) - examples} more)" if len(names) > examples else ""
        noun = "tensor" if len(names) == 1 else "tensors"
        line = f"{len(names)} {noun} cast {src} -> {dst} ({describe_cast(src, dst)}), e.g. {shown}{more}"
        (notes if is_lossless(src, dst) else warnings).append(line)
    return warnings, notes


def cast_warnings(casts: list[tuple[str, str, str]], *, examples: int = 3) -> list[str]:
    """Every line of :func:`cast_messages`, warnings then notes (kept for callers that want them all)."""
    warnings, notes = cast_messages(casts, examples=examples)
    return warnings + notes


def checked_cast(t: torch.Tensor, dtype: torch.dtype, *, name: str) -> torch.Tensor:
    """Cast ``t`` to ``dtype``, refusing values that do not fit.

    Returns ``t`` itself when the dtype already matches.

    Raises:
        ConversionError: a finite value of ``t`` becomes +-inf in ``dtype`` (for FP8 targets, which torch
            saturates: exceeds the target's maximum); names the tensor, the largest magnitude and the maximum.
    """
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if out.is_floating_point() and t.is_floating_point() and torch.finfo(dtype).max < torch.finfo(t.dtype).max:
        if out.element_size() == 1:  # FP8: torch has no isinf for it, and the cast saturates instead
            bad = torch.isfinite(t) & (t.abs() > torch.finfo(dtype).max)
        else:
            bad = torch.isinf(out) & torch.isfinite(t)
        if bool(bad.any()):
            peak = float(t[torch.isfinite(t)].abs().max())
            raise ConversionError(
                f"{name}: casting {TAG_OF_TORCH.get(t.dtype, t.dtype)} -> {TAG_OF_TORCH.get(dtype, dtype)} "
                f"overflows (|value| up to {peak:.6g} > {torch.finfo(dtype).max:.6g}); "
                "use --dtype auto or a wider dtype")
    return out

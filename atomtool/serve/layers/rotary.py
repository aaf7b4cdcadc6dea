"""Rotary position embedding with HF-exact frequencies and rope scaling.

The inverse frequencies and the attention scaling come from transformers' own ``ROPE_INIT_FUNCTIONS``
(default, linear, llama3, yarn, ...) applied to the model's config, so every rope variant matches HF exactly
(why not our own formulas: one source of truth, and the oracle is HF). Per-token angles are
``position * inv_freq`` in float32, as HF computes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atomtool.errors import ConfigError, one_line
from atomtool.inspect.families import SEQUENCE_DEPENDENT_ROPE_TYPES, sequence_dependent_rope_message
from atomtool.serve.ops import get_op


def hf_config_from_flat(config_flat: dict[str, Any]):
    """A transformers config object for ``config_flat`` (its model_type's class, else ``PretrainedConfig``)."""
    from transformers import PretrainedConfig

    from atomtool.inspect.hf_config import config_kwargs
    from atomtool.inspect.hf_registry import config_class

    try:
        return (config_class(config_flat.get("model_type")) or PretrainedConfig)(**config_kwargs(config_flat))
    except Exception as exc:  # a config transformers cannot parse
        raise ConfigError(f"config.json: transformers cannot build its config: {one_line(exc)}") from exc


def rope_inv_freq(config_flat: dict[str, Any], head_dim: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [R/2] float32 on CPU, attention_scaling)`` exactly as HF's rotary embedding computes them.

    head_dim: the rotary dim to use instead of the config's ``head_dim`` (e.g. ``qk_rope_head_dim`` for MLA).

    Raises:
        ConfigError: a rope type that needs the dynamic sequence length (dynamic NTK, longrope) or is unknown.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config_from_flat(config_flat)
    if head_dim is not None:
        cfg.head_dim = head_dim
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        params = next(iter(params.values()))  # per-layer-type dicts: all our families use one rope
    rope_type = (params or {}).get("rope_type", "default")
    if rope_type in SEQUENCE_DEPENDENT_ROPE_TYPES:  # the rule inspect's feature-not-servable reads too
        raise ConfigError(sequence_dependent_rope_message(rope_type))
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        prf = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0))
        dim = int((head_dim or getattr(cfg, "head_dim", None)
                   or cfg.hidden_size // cfg.num_attention_heads) * prf)
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        raise ConfigError(f"unknown rope type {rope_type!r}; known: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv, scaling = fn(cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


#: largest per-position cos/sin table a :class:`RotaryEmbedding` precomputes (bytes); longer contexts than the
#: table covers fall back to computing the angles per step
TABLE_MAX_BYTES = 64 << 20


class RotaryEmbedding(nn.Module):
    """Applies rope to q/k slices: forward(positions [T] int64, x [T, H, R]) -> [T, H, R] (x's dtype).

    ``interleaved`` selects the GPT-J pair convention instead of NeoX ``rotate_half``. ``cos_sin(positions)``
    gives the per-token float32 tables ``([T, R/2], [T, R/2])`` (times the attention scaling) so a layer can
    rotate several tensors with one table.

    Per-step cost (issue 7): the tables of positions ``0 .. max_positions - 1`` (``max_position_embeddings``
    by default, capped at :data:`TABLE_MAX_BYTES`) are computed once, with the very elementwise ops the
    per-step path uses, into one ``[max_positions, R]`` float32 buffer (cos ‖ sin); ``cos_sin`` is then one
    row gather instead of the cast, product, cos, sin and scaling kernels of every step. Callers pass the
    host-side bound (``max(batch.seq_lens_cpu)``, no device sync) that says the gather is in range.
    """

    def __init__(self, config_flat: dict[str, Any], device: torch.device | str, *, head_dim: int | None = None,
                 interleaved: bool = False, max_positions: int | None = None) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config_flat, head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = scaling
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.interleaved = interleaved
        self._op = get_op("rotary_embedding", device)
        if max_positions is None:
            max_positions = int(config_flat.get("max_position_embeddings") or 0)
        max_positions = min(max_positions, TABLE_MAX_BYTES // (4 * max(self.rotary_dim, 1)))
        table = None
        if max_positions > 0:
            positions = torch.arange(max_positions, dtype=torch.int64, device=device)
            table = torch.cat(self._compute(positions), dim=-1)
        self.register_buffer("cos_sin_table", table, persistent=False)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def cos_sin(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, R/2] float32 (rows may be views of one [T, R] tensor:
        last dim contiguous, row stride R). ``bound``: a host-side number > every position (e.g.
        ``max(batch.seq_lens_cpu)``); when given and covered by the precomputed table, the rows are gathered
        from it, else computed."""
        table = self.cos_sin_table
        if table is None or bound is None or bound > table.shape[0]:
            return self._compute(positions)
        rows = table.index_select(0, positions)
        half = self.rotary_dim // 2
        return rows[:, :half], rows[:, half:]

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        cos, sin = self.cos_sin(positions)
        out = tuple(self._op(x, cos, sin, self.interleaved) for x in xs)
        return out[0] if len(out) == 1 else out

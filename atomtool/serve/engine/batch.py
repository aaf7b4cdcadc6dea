"""The per-step batch handed from the model runner to a model: explicit tensors, no global state."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One engine step's tokens for all scheduled sequences (prefill chunks and decodes mixed).

    T = total scheduled tokens, B = scheduled sequences (in scheduler order).

    input_ids: [T] int64 token ids, sequences concatenated. positions: [T] int64 absolute positions.
    cu_seqlens_q: [B+1] int32 prefix sums of query lengths. seq_lens: [B] int32 tokens in each
    sequence's KV after this step (cached context + new tokens); query token j of sequence b sits at
    position ``seq_lens[b] - q_len[b] + j`` and attends causally to positions <= its own.
    block_tables: [B, max_blocks] int32 physical KV block ids, -1 padded. slot_mapping: [T] int64
    ``block_id * block_size + offset`` where each new token's KV is written. logits_indices: [B] int64
    index into T of the last token of each sequence (its logits are sampled). is_decode: every
    sequence has exactly one query token. block_size: tokens per KV block.
    seq_lens_cpu / query_lens_cpu: the same lengths as python lists (no device sync for control flow).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    block_size: int
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass(frozen=True)
class KVPlaneSpec:
    """One per-token cache plane a layer needs: per-token shape (e.g. (Hkv, D) or (kv_lora_rank + rope,))."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

"""CUDA graphs for decode steps: capture once per batch size, replay with the step's tensors copied in.

A decode step launches hundreds of small kernels; replaying a captured CUDA graph removes their launch
overhead (the technique vLLM and SGLang use). Capture happens after the weights and the KV pool are
allocated (the graph bakes in their addresses) and only for pure-decode batches (one query token per
sequence). A batch of B sequences replays the graph of the smallest captured size >= B; the extra rows
are padding: slot -1 (the KV store skips them), one token of context read from block 0 (always a valid
address), and their logits are dropped.

Requirements on the model's forward (all met by the Triton ops, none by the torch reference, which reads
lengths on the host): no host sync, no data-dependent shapes. Host-side control flow may only read
``batch.seq_lens_cpu`` / ``query_lens_cpu`` to choose a code path, and the graphs are captured with every
sequence claiming the bucket's full context, so the captured path is the long-context one: for DSA that is
indexer + sparse MLA, which is exact for short contexts too (the indexer then selects every position).
``enforce_eager`` (``--enforce-eager``) turns graphs off; so does any device other than CUDA.

Context buckets: when ``max_model_len`` is long, each batch size up to :data:`SHORT_CONTEXT_MAX_BATCH` is
captured twice, once with block tables as wide as ``max_model_len`` and once with tables only
:func:`short_context` tokens wide, and a step whose longest sequence fits the short one replays that graph. Kernels choose their form from the table width (a
host-side shape): the DSA top-k selects rows narrower than ``SHORT_CONTEXT_WIDTH`` in one program instead
of its multi-program split mode, and grids sized by the width launch fewer idle programs. Every kernel's
result depends on each row's own length only (the split-KV chunking, the exact top-k), so the two graphs
give the same bits. H200, DeepSeek-V3.2 shape, 32k-wide pool, at 4k: batch 1 3.19 -> 3.135 ms per step,
batch 8 8.16 -> 8.12 ms, batch 64 even (29.67 / 29.70 ms), hence the batch limit, which also bounds the
extra capture time (docs/PERFORMANCE.md, issue 7 step 48).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from atomtool.serve.engine.batch import ForwardBatch

#: decode batch sizes captured by default (vLLM-like ladder), cut at ``max_num_seqs``
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
#: block tables narrower than this many tokens make the short-context graphs: the Triton top-k's
#: ``SPLIT_MIN_WIDTH`` (the width from which it selects a row with several programs), kept equal by a test
SHORT_CONTEXT_WIDTH = 8192
#: largest batch size captured in the short-context bucket too (larger batches: the full-width graph only)
SHORT_CONTEXT_MAX_BATCH = 32


def short_context(max_model_len: int, block_size: int) -> int | None:
    """Tokens of the short-context bucket: the longest whole-block context whose table is narrower than
    :data:`SHORT_CONTEXT_WIDTH` tokens; None when that is not shorter than ``max_model_len`` (one bucket)."""
    short = (SHORT_CONTEXT_WIDTH - 1) // block_size * block_size
    return short if 0 < short < max_model_len else None


def context_buckets(max_model_len: int, block_size: int) -> list[int]:
    """Context lengths captured (ascending; the last is ``max_model_len``)."""
    short = short_context(max_model_len, block_size)
    return [max_model_len] if short is None else [short, max_model_len]


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[int]:
    """Sorted batch sizes to capture: ``sizes`` up to ``max_num_seqs``, plus ``max_num_seqs`` itself."""
    out = sorted({s for s in sizes if 0 < s <= max_num_seqs} | {max_num_seqs})
    return out


class DecodeCudaGraphs:
    """Captured decode graphs of one model and KV pool.

    Args:
        forward: ``forward(batch) -> logits [B, vocab] float32`` for a decode batch, e.g.
            ``lambda b: model.compute_logits(model(b, kv_pool.caches)[b.logits_indices])``. It must follow
            the module docstring's rules.
        device: a CUDA device.
        max_num_seqs: largest batch to capture.
        max_model_len: longest sequence; block tables are ``ceil(max_model_len / block_size)`` wide.
        block_size: tokens per KV block.
        sizes: batch sizes to capture (default :data:`DEFAULT_BATCH_SIZES` cut at ``max_num_seqs``).

    Use: ``graphs.capture()`` once, then per step ``graphs.can_run(batch)`` and ``graphs.run(batch)``.
    """

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], device: torch.device | str, *,
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 sizes: Sequence[int] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.forward = forward
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs, sizes or DEFAULT_BATCH_SIZES)
        self.max_bs = self.sizes[-1]
        self.max_blocks = math.ceil(max_model_len / block_size)
        dev = self.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.contexts = context_buckets(max_model_len, block_size)
        #: (context bucket, batch size) -> graph and its output
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _static_batch(self, bs: int, context: int) -> ForwardBatch:
        width = math.ceil(context / self.block_size)
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs, :width],
            slot_mapping=self.slot_mapping[:bs], logits_indices=self.logits_indices[:bs], is_decode=True,
            block_size=self.block_size, seq_lens_cpu=[context] * bs, query_lens_cpu=[1] * bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per context bucket and size, longest and largest first (the others reuse its
        memory pool).

        The static inputs describe padding rows only (slot -1), so capturing writes nothing to the KV cache.
        """
        for context in reversed(self.contexts):
            for bs in reversed(self.sizes):
                if context != self.contexts[-1] and bs > SHORT_CONTEXT_MAX_BATCH:
                    continue
                batch = self._static_batch(bs, context)
                self.forward(batch)  # warm-up: compiles the Triton kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.forward(batch)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[context, bs] = graph
                self.outputs[context, bs] = out
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a pure-decode batch that fits a captured size and the block-table width."""
        return (bool(self.graphs) and batch.is_decode and batch.num_seqs <= self.max_bs
                and batch.num_tokens == batch.num_seqs and batch.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for ``batch`` (see :meth:`can_run`); returns logits [B, vocab] (a fresh copy)."""
        B = batch.num_seqs
        bs = next(s for s in self.sizes if s >= B)
        context = pick_context(self.contexts, batch.seq_lens_cpu, bs)
        # a row of at most `context` tokens uses only its table's first `width` entries
        width = min(batch.block_tables.shape[1], math.ceil(context / self.block_size))
        self.input_ids[:B].copy_(batch.input_ids)
        self.positions[:B].copy_(batch.positions)
        self.seq_lens[:B].copy_(batch.seq_lens)
        self.slot_mapping[:B].copy_(batch.slot_mapping)
        self.block_tables[:B, :width].copy_(batch.block_tables[:, :width])
        if bs > B:  # padding rows: one token of context in block 0, nothing stored
            self.seq_lens[B:bs].fill_(1)
            self.slot_mapping[B:bs].fill_(-1)
            self.block_tables[B:bs].zero_()
            self.input_ids[B:bs].zero_()
            self.positions[B:bs].zero_()
        self.graphs[context, bs].replay()
        return self.outputs[context, bs][:B].clone()


def pick_context(contexts: Sequence[int], seq_lens: Sequence[int], batch_size: int) -> int:
    """The shortest context bucket holding every sequence of the step (``contexts`` ascending, the last one
    ``max_model_len``, which holds every sequence the engine admits); the full one for a captured
    ``batch_size`` above :data:`SHORT_CONTEXT_MAX_BATCH` (only it was captured there)."""
    if batch_size > SHORT_CONTEXT_MAX_BATCH:
        return contexts[-1]
    longest = max(seq_lens, default=0)
    return next((c for c in contexts if c >= longest), contexts[-1])


def maybe_capture_decode_graphs(model, kv_caches, device: torch.device | str, *, enforce_eager: bool,
                                max_num_seqs: int, max_model_len: int, block_size: int,
                                sizes: Sequence[int] | None = None) -> DecodeCudaGraphs | None:
    """Capture decode graphs for ``model`` when they can be used; None otherwise.

    None when ``enforce_eager``, when ``device`` is not CUDA, or when the op backend there is the torch
    reference (it reads lengths on the host, which a graph cannot replay). Call it after the weights and the
    KV pool (``kv_caches``, the list of per-layer plane dicts) are allocated; the returned object's
    ``can_run(batch)`` / ``run(batch) -> logits [B, vocab]`` replace ``model.compute_logits(model(batch,
    kv_caches)[batch.logits_indices])`` for pure-decode batches.
    """
    from atomtool.serve.ops import backend_for

    device = torch.device(device)
    if enforce_eager or device.type != "cuda" or backend_for(device) == "torch":
        return None

    def forward(batch: ForwardBatch) -> torch.Tensor:
        hidden = model(batch, kv_caches)
        return model.compute_logits(hidden[batch.logits_indices])

    graphs = DecodeCudaGraphs(forward, device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              block_size=block_size, sizes=sizes)
    graphs.capture()
    return graphs

"""Context buckets of the decode CUDA graphs (atomtool.serve.engine.cuda_graphs): which contexts are captured
and which one a step replays. The graphs themselves need a GPU (tests/gpu/test_models_gpu.py compares the
buckets' logits bit for bit)."""

from __future__ import annotations

from atomtool.serve.engine.cuda_graphs import (
    SHORT_CONTEXT_MAX_BATCH,
    SHORT_CONTEXT_WIDTH,
    context_buckets,
    pick_context,
    short_context,
)


def test_short_bucket_matches_the_top_k_split_threshold():
    # the short graphs exist so the DSA top-k keeps its one-program form: their tables must stay below the
    # width from which it switches to split mode
    from atomtool.serve.ops.triton import topk

    assert SHORT_CONTEXT_WIDTH == topk.SPLIT_MIN_WIDTH
    for block_size in (1, 16, 64, 128):
        short = short_context(163840, block_size)
        width_tokens = -(-short // block_size) * block_size
        assert short % block_size == 0
        assert width_tokens < topk.SPLIT_MIN_WIDTH
        assert not topk.use_split(1, width_tokens)
        assert topk.use_split(1, width_tokens + block_size)  # the next whole block would be split mode


def test_buckets_only_when_the_model_is_longer():
    assert context_buckets(163840, 16) == [8176, 163840]
    assert context_buckets(32784, 64) == [8128, 32784]
    assert context_buckets(8176, 16) == [8176]  # the short bucket would not be shorter
    assert context_buckets(4112, 16) == [4112]
    assert context_buckets(512, 16) == [512]


def test_a_step_replays_the_shortest_bucket_holding_its_longest_sequence():
    contexts = [8176, 163840]
    assert pick_context(contexts, [1], 1) == 8176
    assert pick_context(contexts, [4096, 8176], 2) == 8176
    assert pick_context(contexts, [12, 8177], 2) == 163840
    assert pick_context(contexts, [163840], 1) == 163840
    assert pick_context([512], [100], 1) == 512


def test_large_batches_use_the_full_width_graph_only():
    contexts = [8176, 163840]
    assert pick_context(contexts, [100] * SHORT_CONTEXT_MAX_BATCH, SHORT_CONTEXT_MAX_BATCH) == 8176
    # 33 sequences replay the 48-row graph, which exists in the full-width bucket only
    assert pick_context(contexts, [100] * 33, 48) == 163840

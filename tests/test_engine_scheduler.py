"""BlockManager (ref counts, prefix cache) and Scheduler (token budget, chunking, preemption), no model."""

from __future__ import annotations

from atomtool.serve.engine.block_manager import BlockManager
from atomtool.serve.engine.scheduler import Scheduler
from atomtool.serve.engine.sequence import Sequence, SequenceStatus
from atomtool.serve.sampling_params import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=100))


def compute(bm, s, n):
    """Pretend the model computed ``n`` tokens of ``s`` (as the engine does after a step)."""
    assert bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.register_full_blocks(s)


def test_refcounts_and_free():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    assert bm.blocks_needed(a, 10) == 3
    compute(bm, a, 10)
    assert bm.num_free_blocks == 5 and [bm.blocks[b].ref_count for b in a.block_table] == [1, 1, 1]
    assert not bm.allocate(seq(range(100)), 100)  # all-or-nothing
    assert bm.num_free_blocks == 5
    bm.free_seq(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_prefix_hits_share_blocks_and_last_token_is_recomputed():
    bm = BlockManager(16, 4)
    a = seq(range(12))
    compute(bm, a, 12)  # 3 full blocks registered
    b = seq(range(12))
    assert bm.match_prefix(b) == 8  # the block holding the last token is not reused
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[x].ref_count for x in a.block_table] == [2, 2, 1]
    c = seq(list(range(8)) + [99, 98, 97, 96, 95])
    assert bm.match_prefix(c) == 8
    d = seq([0, 1, 2, 3, 0, 1, 2, 3, 9])  # same second-block tokens, different parent -> no hit there
    assert bm.match_prefix(d) == 4
    for s in (a, b, c, d):
        bm.free_seq(s)
    assert bm.num_free_blocks == 16
    e = seq(range(13))  # freed blocks keep their hashes: still a hit
    assert bm.match_prefix(e) == 12
    bm.free_seq(e)


def test_reallocated_blocks_lose_their_prefix_entry():
    bm = BlockManager(3, 4)
    a = seq(range(12))
    compute(bm, a, 12)
    bm.free_seq(a)
    other = seq([50] * 12)
    compute(bm, other, 12)  # takes every block, evicting a's entries
    bm.free_seq(other)
    assert bm.match_prefix(seq(range(12))) == 0


def run_steps(sched, bm, max_steps=200):
    """Drive the scheduler with a fake model; returns per-step (ids, token counts) and finished order."""
    steps = []
    finished = []
    for _ in range(max_steps):
        out = sched.schedule()
        if out.is_empty:
            break
        steps.append(([s.request_id for s in out.seqs], list(out.num_new_tokens), len(out.preempted)))
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
            s.num_computed_tokens += n
            bm.register_full_blocks(s)
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(7)
                if s.num_output_tokens >= 4:
                    sched.finish(s)
                    finished.append(s.request_id)
    return steps, finished


def test_budget_chunks_prefill_and_mixes_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    sched.add(seq(range(3), "short"))
    sched.add(seq(range(100, 114), "long"))
    steps, finished = run_steps(sched, bm)
    assert all(sum(n) <= 6 for _, n, _ in steps)
    assert steps[0] == (["short", "long"], [3, 3], 0)  # the long prompt is chunked behind the short one
    assert steps[1] == (["short", "long"], [1, 5], 0)  # a decode and a prefill chunk in one step
    assert sorted(finished) == ["long", "short"]
    assert bm.num_free_blocks == 64 and not sched.has_unfinished()


def test_max_num_seqs_limits_running():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        sched.add(seq([i] * 3, f"r{i}"))
    steps, finished = run_steps(sched, bm)
    assert all(len(ids) <= 2 for ids, _, _ in steps)
    assert finished == ["r0", "r1", "r2", "r3", "r4"]


def test_preemption_recomputes_latest_arrival():
    bm = BlockManager(6, 4)  # 24 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq(range(8), "a"), seq(range(20, 28), "b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # both prompts fit (2 + 2 blocks)
    assert [s.request_id for s in out.seqs] == ["a", "b"]
    for s in out.seqs:
        s.num_computed_tokens = s.num_tokens
        s.append_token(1)
    bm.allocate(seq(range(40, 48)), 8)  # someone else holds 2 blocks: no room for both decodes
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [s.request_id for s in out.seqs] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b and b.num_tokens == 9  # keeps its generated token, recomputed later

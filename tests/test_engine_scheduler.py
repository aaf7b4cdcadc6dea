"""BlockManager (ref counts, prefix cache) and Scheduler (token budget, chunking, preemption), no model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


def _check_invariants(bm, sched):
    refs = [0] * bm.num_total_blocks
    for s in sched.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        for b in s.block_table:
            refs[b] += 1
    for s in sched.waiting:
        assert s.block_table == []
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free) == {i for i, r in enumerate(refs) if r == 0}
    for h, bid in bm.hash_to_block.items():
        assert bm.blocks[bid].hash == h


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 20),
    max_num_seqs=st.integers(1, 6),
)
def test_random_workloads_keep_invariants_and_finish(data, num_blocks, block_size, budget, max_num_seqs):
    """Random prompts (shared prefixes included), budgets and aborts: ref counts always match the block
    tables, every step respects the budget, every request finishes, and no block leaks."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    capacity = num_blocks * block_size
    n_req = data.draw(st.integers(1, 8))
    seqs = []
    for i in range(n_req):
        max_new = data.draw(st.integers(1, 6))
        length = data.draw(st.integers(1, max(1, capacity - max_new)))
        prefix = data.draw(st.sampled_from([[], [1, 2, 3, 4, 5, 6, 7, 8]]))
        tokens = (prefix + [data.draw(st.integers(0, 3)) for _ in range(length)])[:capacity - max_new]
        s = Sequence(f"r{i}", tokens, SamplingParams(max_tokens=max_new))
        seqs.append(s)
        sched.add(s)
    aborted = set(data.draw(st.lists(st.sampled_from([s.request_id for s in seqs]), max_size=2)))
    for step in range(2000):
        if not sched.has_unfinished():
            break
        if step == 3:
            for s in seqs:
                if s.request_id in aborted and not s.is_finished:
                    sched.finish(s)
        out = sched.schedule()
        assert sum(out.num_new_tokens) <= budget and len(out.seqs) <= max_num_seqs
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert n >= 1
            s.num_computed_tokens += n
            bm.register_full_blocks(s)
            if s.num_computed_tokens == s.num_tokens:
                s.append_token(s.num_tokens % 5)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s)
        _check_invariants(bm, sched)
    assert not sched.has_unfinished()
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == num_blocks

"""ModelRunner.prepare (persistent block-table rows, numpy positions / slots) against a direct construction.

The reference below builds every ForwardBatch field from the ForwardBatch docstring, one token at a time, from
the sequences' current Python state. A random workload drives a real Scheduler / BlockManager (small KV pool,
4-token blocks, prefix caching on) through admissions with shared prefixes, chunked prefill, decode growth
across block boundaries, preemption, aborts and finishes; every step's batch must be identical.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from atomtool.serve.engine.block_manager import BlockManager
from atomtool.serve.engine.block_table_buffer import BlockTableBuffer
from atomtool.serve.engine.model_runner import ModelRunner
from atomtool.serve.engine.scheduler import Scheduler, SchedulerOutput
from atomtool.serve.engine.sequence import Sequence
from atomtool.serve.sampling_params import SamplingParams

CPU = torch.device("cpu")
FIELDS = ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping",
          "logits_indices")
DTYPES = dict(input_ids=torch.int64, positions=torch.int64, cu_seqlens_q=torch.int32, seq_lens=torch.int32,
              block_tables=torch.int32, slot_mapping=torch.int64, logits_indices=torch.int64)


def reference(sched: SchedulerOutput, bs: int) -> dict:
    """Each field straight from its definition, token by token."""
    ids, pos, slots, cu, lens, last = [], [], [], [0], [], []
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        for j in range(n):
            p = seq.num_computed_tokens + j
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
        cu.append(cu[-1] + n)
        lens.append(seq.num_computed_tokens + n)
        last.append(cu[-1] - 1)
    width = max(len(s.block_table) for s in sched.seqs)
    tables = torch.full((len(sched.seqs), width), -1, dtype=torch.int32)
    for i, s in enumerate(sched.seqs):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    i64, i32 = torch.int64, torch.int32
    return dict(input_ids=torch.tensor(ids, dtype=i64), positions=torch.tensor(pos, dtype=i64),
                cu_seqlens_q=torch.tensor(cu, dtype=i32), seq_lens=torch.tensor(lens, dtype=i32),
                block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
                logits_indices=torch.tensor(last, dtype=torch.int64),
                is_decode=all(n == 1 for n in sched.num_new_tokens), seq_lens_cpu=lens,
                query_lens_cpu=list(sched.num_new_tokens))


def assert_same(batch, ref: dict, bs: int) -> None:
    for f in FIELDS:
        got = getattr(batch, f)
        assert got.dtype == DTYPES[f] and got.device == CPU, f
        assert torch.equal(got, ref[f]), f"{f}: {got} != {ref[f]}"
    assert batch.is_decode == ref["is_decode"] and batch.block_size == bs
    assert batch.seq_lens_cpu == ref["seq_lens_cpu"] and all(type(x) is int for x in batch.seq_lens_cpu)
    assert batch.query_lens_cpu == ref["query_lens_cpu"]


def make_runner(bs: int, max_num_seqs: int, max_model_len: int) -> ModelRunner:
    # prepare reads only the pool's block size; no model runs here
    return ModelRunner(None, SimpleNamespace(block_size=bs), CPU, enforce_eager=True,
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_prepare_matches_reference_over_random_workload(seed):
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=40, block_size=bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=24)
    # few rows and a narrow initial width: row reuse, row growth and widening are all exercised
    runner = make_runner(bs, max_num_seqs=2, max_model_len=8)
    runner.block_tables.idle_steps = 5
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    seen = dict(steps=0, decode=0, mixed=0, boundary=0, preempt=0, abort=0, hits=0)
    nreq = 0
    last_len: dict[int, int] = {}
    for _ in range(400):
        if rng.random() < 0.3 or not sched.has_unfinished():
            head = rng.choice(prefixes)[:rng.randrange(4, 13)] if rng.random() < 0.6 else []
            prompt = head + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            sched.add(Sequence(f"r{nreq}", prompt, SamplingParams(max_tokens=rng.randrange(1, 30))))
            nreq += 1
        if sched.running and rng.random() < 0.05:  # abort a running or waiting request
            victim = rng.choice(sched.running + list(sched.waiting))
            sched.finish(victim)
            seen["abort"] += 1
        hits_before = bm.prefix_hits
        out = sched.schedule()
        seen["preempt"] += len(out.preempted)
        seen["hits"] += bm.prefix_hits > hits_before
        if out.is_empty:
            continue
        # a decode that got a new block since its previous step: the appended-row path
        seen["boundary"] += sum(n == 1 and len(s.block_table) > last_len.get(id(s), 1 << 30)
                                for s, n in zip(out.seqs, out.num_new_tokens, strict=True))
        last_len = {id(s): len(s.block_table) for s in out.seqs}
        batch = runner.prepare(out)
        assert_same(batch, reference(out, bs), bs)
        seen["steps"] += 1
        seen["decode" if batch.is_decode else "mixed"] += 1
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            bm.register_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
    # the workload really covered each case the incremental rows must handle
    assert all(v > 0 for v in seen.values()), seen
    assert runner.block_tables.table.shape[0] > 2 and runner.block_tables.table.shape[1] > 2


def test_prepare_reflects_block_table_replacement_and_appends_between_steps():
    """Same sequence object across steps: appended blocks, then a replaced (shorter, different) table."""
    bs = 2
    runner = make_runner(bs, max_num_seqs=1, max_model_len=4)
    seq = SimpleNamespace(token_ids=list(range(100, 110)), num_computed_tokens=0, block_table=[7, 3])
    # a longer neighbour: the batch is wider than seq's table, so stale ids in seq's row would show
    other = SimpleNamespace(token_ids=list(range(12)), num_computed_tokens=11,
                            block_table=[10, 11, 12, 13, 14, 15])
    for step in [
        lambda: None,
        lambda: seq.block_table.extend([9, 1, 4]),  # growth: past the initial width (2 blocks)
        lambda: setattr(seq, "block_table", [5]),  # freed and re-admitted: shorter new list
        lambda: setattr(seq, "block_table", [6, 8]),  # same length as before, different ids
    ]:
        step()
        n = 2 if len(seq.block_table) * bs >= 2 else 1
        seq.num_computed_tokens = len(seq.block_table) * bs - n
        out = SchedulerOutput(seqs=[seq, other], num_new_tokens=[n, 1])
        assert_same(runner.prepare(out), reference(out, bs), bs)


def test_block_table_buffer_releases_idle_rows_and_their_ids():
    buf = BlockTableBuffer(num_rows=2, max_blocks=2, idle_steps=2)
    a = SimpleNamespace(block_table=[1, 2, 3])
    b = SimpleNamespace(block_table=[4])
    rows, width = buf.sync([a, b])
    assert width == 3 and buf.gather(rows, width).tolist() == [[1, 2, 3], [4, -1, -1]]
    for _ in range(4):  # only b keeps being scheduled: a's row is released and cleared
        rows, width = buf.sync([b])
    assert buf.num_rows_in_use == 1 and buf.gather(rows, width).tolist() == [[4]]
    assert (buf.table == -1).sum() == buf.table.size - 1

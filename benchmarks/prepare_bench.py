"""Host cost of building one step's batch: the former list-based ``prepare`` against ``ModelRunner.prepare``.

Issue 7 (docs/PERFORMANCE.md): at decode batch 64 with 32k context the host spent ~15 ms per step in
``ModelRunner.prepare``, which padded every sequence's Python block table (64 x 2048 block ids) into a new
list of lists each step. The legacy builder below is that implementation (kept here only, not in the
package). No model runs: the state is a real :class:`Scheduler` / :class:`BlockManager` with ``--batch``
sequences of ``--ctx`` prompt tokens whose KV is marked computed, and each step is a real
``Scheduler.schedule()`` decode (one token per sequence, new blocks allocated at block boundaries) followed by
both builders on the same :class:`SchedulerOutput` (CPU tensors; the host work is the same on a GPU run, only
the final host-to-device copies are added there).

Reported: median / mean ms per step of each, and the ratio legacy / current.

Run: ``python -m benchmarks.prepare_bench [--batch 64] [--ctx 32768] [--steps 64] [--block-size 16]
[--prefill-chunk 0]`` (``--prefill-chunk N``: one extra sequence computes an N-token prefill chunk each step,
a mixed batch).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from atomtool.serve.engine.batch import ForwardBatch
from atomtool.serve.engine.block_manager import BlockManager
from atomtool.serve.engine.model_runner import ModelRunner
from atomtool.serve.engine.scheduler import Scheduler, SchedulerOutput
from atomtool.serve.engine.sequence import Sequence, SequenceStatus
from atomtool.serve.sampling_params import SamplingParams
from benchmarks import common as C


def legacy_prepare(sched: SchedulerOutput, block_size: int, device: torch.device) -> ForwardBatch:
    """``ModelRunner.prepare`` as it was before issue 7: Python lists rebuilt and padded every step."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    logits_idx: list[int] = []
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        input_ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        cu.append(cu[-1] + n)
        seq_lens.append(start + n)
        logits_idx.append(cu[-1] - 1)
    width = max(len(s.block_table) for s in sched.seqs)
    tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in sched.seqs]

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
        cu_seqlens_q=t(cu, torch.int32), seq_lens=t(seq_lens, torch.int32),
        block_tables=t(tables, torch.int32), slot_mapping=t(slots, torch.int64),
        logits_indices=t(logits_idx, torch.int64), is_decode=all(n == 1 for n in sched.num_new_tokens),
        block_size=bs, seq_lens_cpu=seq_lens, query_lens_cpu=list(sched.num_new_tokens))


def build_state(batch: int, ctx: int, block_size: int, steps: int, prefill_chunk: int):
    """A scheduler whose ``batch`` running sequences hold ``ctx`` tokens with ``ctx - 1`` computed."""
    nb = -(-(ctx + steps + 2) // block_size) + 1
    extra = -(-(prefill_chunk * (steps + 2) + 1) // block_size) + 1 if prefill_chunk else 0
    bm = BlockManager(batch * nb + extra + 1, block_size, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=batch + 1, max_num_batched_tokens=batch + max(prefill_chunk, 1))
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        seq = Sequence(f"r{i}", torch.randint(0, 32000, (ctx,), generator=g).tolist(), SamplingParams())
        assert bm.allocate(seq, ctx - 1)
        seq.num_computed_tokens = ctx - 1
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    if prefill_chunk:
        prompt = torch.randint(0, 32000, (prefill_chunk * (steps + 2) + 1,), generator=g).tolist()
        sched.add(Sequence("prefill", prompt, SamplingParams()))
    return sched


def advance(out: SchedulerOutput) -> None:
    """What the engine does after a step: the scheduled tokens are computed; decodes get a new token."""
    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(seq.num_tokens % 32000)


def run(batch: int, ctx: int, steps: int, block_size: int, prefill_chunk: int) -> dict[str, float]:
    cpu = torch.device("cpu")
    sched = build_state(batch, ctx, block_size, steps, prefill_chunk)
    runner = ModelRunner(None, SimpleNamespace(block_size=block_size), cpu, enforce_eager=True,
                         max_num_seqs=batch + 1, max_model_len=ctx + steps)
    old, new = [], []
    for step in range(steps + 2):
        out = sched.schedule()
        assert not out.preempted
        t0 = time.perf_counter()
        a = legacy_prepare(out, block_size, cpu)
        t1 = time.perf_counter()
        b = runner.prepare(out)
        t2 = time.perf_counter()
        if step >= 2:  # the first steps build the runner's per-sequence rows (a one-off per sequence)
            old.append(t1 - t0)
            new.append(t2 - t1)
        for f in ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping",
                  "logits_indices"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
        advance(out)
    return {"legacy_median_ms": 1e3 * statistics.median(old), "legacy_mean_ms": 1e3 * statistics.mean(old),
            "new_median_ms": 1e3 * statistics.median(new), "new_mean_ms": 1e3 * statistics.mean(new),
            "ratio_median": statistics.median(old) / statistics.median(new)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=C.positive_int, default=64)
    ap.add_argument("--ctx", type=C.positive_int, default=32768)
    ap.add_argument("--steps", type=C.positive_int, default=64)
    ap.add_argument("--block-size", type=C.positive_int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    r = run(a.batch, a.ctx, a.steps, a.block_size, a.prefill_chunk)
    print(f"prepare per step, batch {a.batch}, ctx {a.ctx}, block_size {a.block_size}, "
          f"prefill chunk {a.prefill_chunk}, {a.steps} steps (cpu, {a.threads} thread)")
    print(f"  legacy (list padding) : median {r['legacy_median_ms']:8.3f} ms  "
          f"mean {r['legacy_mean_ms']:8.3f} ms")
    print(f"  ModelRunner.prepare   : median {r['new_median_ms']:8.3f} ms  mean {r['new_mean_ms']:8.3f} ms")
    print(f"  ratio legacy / current (median): {r['ratio_median']:.1f}x")


if __name__ == "__main__":
    main()

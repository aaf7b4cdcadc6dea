"""DSA indexer top-k selection: our Triton radix select against the former ``torch.topk`` + ``torch.sort`` path.

Both select, per row of ``[T, S]`` scores, the ``K`` largest (ties to the lowest position) and list the
positions ascending. The old path (the indexer's selection before issue 7): int64 sort keys
``(orderable(score) << 32) | (2^31 - 1 - s)``, ``torch.topk(sorted=False)``, then ``torch.sort`` of the
positions. Ours: :func:`atomtool.serve.ops.triton.topk.topk_positions` on the int32 orderable keys (the
scratch and output allocations included). Key construction is outside the timed region for both: in the
indexer the scoring kernel writes the keys.

Per (T, S): microseconds per call, eager (CUDA events around ``--iters`` back-to-back calls, so host
launch cost shows when it exceeds the GPU time) and replayed from a CUDA graph (GPU time alone, as in
graph-captured decode), the ratio old / ours, and whether both selections are equal.

Variants of ours: ``--split off`` (one program per row), ``on`` (several programs per row, 4 launches),
``auto`` (``select_rows``' own choice), ``both`` (off and on, the default); ``--sweep`` times a grid of
split x block (1024, 2048, 4096) x num_warps (4, 8, 16) x bins (32, 64, 128) and prints the 10 fastest per
(T, S), to pick the module defaults (54 variants, mostly compile time: several minutes; ``--block``,
``--num-warps`` or ``--bins`` pin an axis).

Run: ``python -m benchmarks.topk_bench [--rows 1,8,64] [--ctx 4096,32768] [--topk 2048] [--iters 50]
[--dist relu|ties|zeros] [--split both] [--block 2048] [--bins 64] [--num-warps 8] [--sweep] [--no-graph]``;
``--smoke``: CPU under Triton's interpreter, tiny sizes (checks that the script runs, times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64", help="comma-separated query rows T")
    p.add_argument("--ctx", default="4096,32768", help="comma-separated context lengths S")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dist", choices=["relu", "ties", "zeros"], default="relu",
                   help="scores: weighted ReLU sums | quantized to 16 levels | 90%% exact zeros")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--bins", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--split", choices=["auto", "on", "off", "both"], default="both",
                   help="one program per row (off), several per row (on), select_rows' choice (auto)")
    p.add_argument("--sweep", action="store_true",
                   help="time a grid of split x block x num_warps x bins; print the 10 fastest per (T, S)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    return p.parse_args(argv)


def make_scores(T: int, S: int, dist: str, device, seed: int = 0):
    """[T, S] float32 scores shaped like indexer output: sum over 8 heads of w * ReLU(x)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.rand(T, 8, generator=g)[..., None] * torch.relu(torch.randn(T, 8, S, generator=g))).sum(1)
    if dist == "ties":
        x = (x * 4).round()
    elif dist == "zeros":
        x = torch.where(torch.rand(T, S, generator=g) < 0.9, torch.zeros(()), x)
    return x.to(device)


def old_select(scores, K: int):
    """The former path: int64 unique keys, torch.topk, sort of the positions; [T, K] int32, -1 padded."""
    import torch

    from atomtool.serve.ops.triton.topk import orderable_keys

    T, S = scores.shape
    signed = orderable_keys(scores) ^ torch.iinfo(torch.int32).min  # signed order = float order
    pos = torch.arange(S, device=scores.device)
    keys = (signed.long() << 32) | (2**31 - 1 - pos)
    return _old_from_keys(keys, K)


def _old_from_keys(keys, K: int):
    import torch

    S = keys.shape[1]
    top = keys if K >= S else torch.topk(keys, K, dim=1, sorted=False).values
    pos = torch.sort(2**31 - 1 - (top & 0xFFFFFFFF), dim=1).values
    out = torch.full((keys.shape[0], K), -1, dtype=torch.int32, device=keys.device)
    out[:, :min(K, S)] = pos.to(torch.int32)
    return out


def _time_us(fn, iters: int, cuda: bool, graph: bool) -> float:
    import torch

    if not cuda:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / iters)
    return best


def bench_one(T: int, S: int, K: int, iters: int, dist: str, device, graph: bool,
              variants: dict[str, dict]) -> list[dict]:
    """For one (T, S): per variant (name -> select_rows tuning) us per call of ours and of the old path
    (eager; graph replay on CUDA when ``graph``) and whether ours equals the old selection."""
    import torch

    from atomtool.serve.ops.triton.topk import orderable_keys, topk_positions

    cuda = device.type == "cuda"
    scores = make_scores(T, S, dist, device)
    keys = orderable_keys(scores)
    pos = torch.arange(S, device=device)
    keys64 = ((keys ^ torch.iinfo(torch.int32).min).long() << 32) | (2**31 - 1 - pos)
    lengths = torch.full((T,), S, dtype=torch.int32, device=device)
    want = old_select(scores, K)

    def old():
        return _old_from_keys(keys64, K)

    old_us = _time_us(old, iters, cuda, False)
    old_graph_us = _time_us(old, iters, True, True) if cuda and graph else None
    rows = []
    for name, tuning in variants.items():
        def ours(tuning=tuning):
            return topk_positions(keys, lengths, K, **tuning)

        r = {"T": T, "S": S, "K": K, "variant": name, "equal": bool(torch.equal(ours(), want)),
             "ours_us": _time_us(ours, iters, cuda, False), "old_us": old_us}
        if old_graph_us is not None:
            r["ours_graph_us"] = _time_us(ours, iters, True, True)
            r["old_graph_us"] = old_graph_us
        rows.append(r)
    return rows


def bench(rows, ctxs, K: int, iters: int, dist: str, device, graph: bool, variants: dict[str, dict]) -> list[dict]:
    """:func:`bench_one` for every (T, S) of ``rows`` x ``ctxs``, results concatenated."""
    return [r for T in rows for S in ctxs for r in bench_one(T, S, K, iters, dist, device, graph, variants)]


def print_table(results: list[dict], top: int | None = None) -> None:
    """A table of ``results``; with ``top``, per (T, S) only the ``top`` fastest variants."""
    graph = "ours_graph_us" in results[0]
    width = max(len(r["variant"]) for r in results)
    head = f"{'T':>5} {'S':>7} {'K':>5} {'variant':<{width}} {'ours us':>9} {'old us':>9} {'ratio':>6}"
    if graph:
        head += f" {'ours graph':>11} {'old graph':>10} {'ratio':>6}"
    print(head + "  equal")
    key = "ours_graph_us" if graph else "ours_us"
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["T"], r["S"]), []).append(r)
    for group in groups.values():
        for r in sorted(group, key=lambda r: r[key])[:top] if top else group:
            line = (f"{r['T']:>5} {r['S']:>7} {r['K']:>5} {r['variant']:<{width}} {r['ours_us']:>9.1f} "
                    f"{r['old_us']:>9.1f} {r['old_us'] / r['ours_us']:>6.2f}")
            if graph:
                line += (f" {r['ours_graph_us']:>11.1f} {r['old_graph_us']:>10.1f} "
                         f"{r['old_graph_us'] / r['ours_graph_us']:>6.2f}")
            print(line + f"  {r['equal']}")


def make_variants(args: argparse.Namespace) -> dict[str, dict]:
    """name -> select_rows tuning: the --split choice(s) with the given/default tuning, or the --sweep grid."""
    splits = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.split]
    if args.sweep:  # a given --block / --num-warps / --bins pins that axis of the grid
        grid = [(sp, b, w, nb) for sp in (False, True) for b in ([args.block] if args.block else (1024, 2048, 4096))
                for w in ([args.num_warps] if args.num_warps else (4, 8, 16))
                for nb in ([args.bins] if args.bins else (32, 64, 128))]
        return {f"split={int(sp)} block={b} warps={w} bins={nb}": {"split": sp, "block": b, "num_warps": w, "bins": nb}
                for sp, b, w, nb in grid}
    fixed = {k: v for k, v in (("block", args.block), ("bins", args.bins), ("num_warps", args.num_warps))
             if v is not None}
    if args.smoke:
        fixed.setdefault("block", 64)
    return {f"split={'auto' if sp is None else int(sp)}": {"split": sp, **fixed} for sp in splits}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    variants = make_variants(args)
    if args.smoke:
        device, rows, ctxs, K, iters = torch.device("cpu"), [1, 3], [300], 40, 2
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rows = [int(x) for x in args.rows.split(",")]
        ctxs = [int(x) for x in args.ctx.split(",")]
        K, iters = args.topk, args.iters
    print(f"device {device}, dist {args.dist}, {len(variants)} variant(s)")
    results = bench(rows, ctxs, K, iters, args.dist, device, not args.no_graph, variants)
    print_table(results, top=10 if args.sweep else None)
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

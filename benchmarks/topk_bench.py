"""DSA indexer top-k selection: our Triton radix select against the former ``torch.topk`` + ``torch.sort`` path.

Both select, per row, the ``K`` largest scores among the row's first ``n`` positions (ties to the lowest
position) and list the positions ascending. The old path (the indexer's selection before issue 7): int64
sort keys ``(orderable(score) << 32) | (2^31 - 1 - s)`` (positions >= n masked to the smallest key),
``torch.topk(sorted=False)`` over the whole key width, then ``torch.sort`` of the positions. Ours:
:func:`atomtool.serve.ops.triton.topk.topk_positions` on the int32 orderable keys (scratch and output
allocations included). Key construction is outside the timed region for both.

The engine's situation: CUDA-graph decode pads block tables to ``max_model_len``, so the key width S is the
model's maximum length while a row's real length n (``--ctx``) is often far shorter; ``--width W`` makes the
keys W wide (positions >= n hold the largest key: any read past n would show as a wrong selection).

``--indexer`` times the whole :func:`atomtool.serve.ops.triton.indexer_topk` instead (DeepSeek-V3.2 indexer:
64 heads x 128, bf16, block size 64, block tables W / 64 wide, one decode token per sequence of ``ctx``
tokens): the scoring kernel then supplies each row's key range, as in the engine. Its ``equal`` column says
whether the variant's selection equals the first variant's (every variant is exact, so all must agree).

Per (T, ctx): microseconds per call, eager (CUDA events around ``--iters`` back-to-back calls, so host
launch cost shows when it exceeds the GPU time) and replayed from a CUDA graph (GPU time alone, as in
graph-captured decode), the ratio old / ours, and whether the selections are equal.

Variants of ours: ``--split off`` (one program per row), ``on`` (several programs per row), ``auto``
(``select_rows``' own choice), ``both`` (off and on, the default); ``--candidates``: a short list of tunings
of both modes (a few seconds of compiling each), after which the module constants to set are printed;
``--cuda both``: the one-program mode both as the CUDA kernel (``atomtool/serve/ops/cuda/topk.cu``, rows of
at most 8192 keys) and as the Triton kernel;
``--sweep``: a grid of split x block x num_warps x bins (54 variants, several minutes; ``--block``,
``--num-warps``, ``--bins`` pin an axis), the 10 fastest per (T, ctx) printed.

Run: ``python -m benchmarks.topk_bench [--rows 1,8,64] [--ctx 4096,32768] [--width 163840] [--topk 2048]
[--iters 50] [--dist relu|ties|zeros] [--split both] [--block B] [--bins N] [--num-warps W] [--small-n N]
[--cand-bins N] [--cuda auto|on|off|both]
[--candidates | --sweep] [--indexer] [--no-graph]``; ``--smoke``: CPU under Triton's interpreter, tiny
sizes (checks that the script runs, times mean nothing).
The lead's tuning run: ``python -m benchmarks.topk_bench --indexer --candidates --rows 1,8,64
--ctx 4096,32768 --width 163840``.
"""

from __future__ import annotations

import argparse
import math
import os

#: --candidates, one program per row: (block, bins, num_warps, cand_bins)
ONE_PROGRAM_CANDIDATES = ((4096, 256, 16, 128), (4096, 256, 16, 64), (2048, 256, 8, 128), (8192, 256, 16, 128))
#: --candidates, split rows: (block, bins, num_warps, cand_bins, small_n, small_warps)
SPLIT_CANDIDATES = ((1024, 512, 8, 128, 4096, 16), (1024, 256, 8, 128, 4096, 16), (1024, 1024, 8, 128, 4096, 16),
                    (1024, 512, 8, 64, 4096, 16), (1024, 512, 8, 128, 0, 16), (2048, 512, 8, 128, 4096, 16))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64", help="comma-separated query rows T")
    p.add_argument("--ctx", default="4096,32768", help="comma-separated row lengths n (context lengths)")
    p.add_argument("--width", type=int, default=0,
                   help="key width S (the block table's width x block size); 0: S = ctx")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dist", choices=["relu", "ties", "zeros"], default="relu",
                   help="scores: weighted ReLU sums | quantized to 16 levels | 90%% exact zeros")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--bins", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--small-n", type=int, default=None, help="split mode: rows of <= this many in one program")
    p.add_argument("--cand-bins", type=int, default=None, help="buckets of the register rounds")
    p.add_argument("--split", choices=["auto", "on", "off", "both"], default="both",
                   help="one program per row (off), several per row (on), select_rows' choice (auto)")
    p.add_argument("--cuda", choices=["auto", "on", "off", "both"], default="auto",
                   help="one program per row: the CUDA kernel (on), the Triton one (off), select_rows' choice "
                        "(auto), or both")
    p.add_argument("--candidates", action="store_true",
                   help="time a short list of tunings of both modes and print the module defaults to set")
    p.add_argument("--sweep", action="store_true",
                   help="time a grid of split x block x num_warps x bins; print the 10 fastest per (T, ctx)")
    p.add_argument("--indexer", action="store_true", help="time indexer_topk (scoring + selection)")
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
    """The former path on whole rows: int64 unique keys, torch.topk, sort of the positions; [T, K] int32."""
    return _old_from_keys(_old_keys(scores, scores.shape[1]), K)


def _old_keys(scores, n: int):
    """int64 keys of the former path: score order, then lower position first; positions >= n smallest."""
    import torch

    from atomtool.serve.ops.triton.topk import orderable_keys

    S = scores.shape[1]
    signed = orderable_keys(scores) ^ torch.iinfo(torch.int32).min  # signed order = float order
    pos = torch.arange(S, device=scores.device)
    keys = (signed.long() << 32) | (2**31 - 1 - pos)
    return torch.where(pos < n, keys, torch.iinfo(torch.int64).min)


def _old_from_keys(keys, K: int):
    import torch

    S = keys.shape[1]
    top = keys if K >= S else torch.topk(keys, K, dim=1, sorted=False).values
    pos = torch.sort(2**31 - 1 - (top & 0xFFFFFFFF), dim=1).values
    out = torch.full((keys.shape[0], K), -1, dtype=torch.int32, device=keys.device)
    out[:, :min(K, S)] = pos.to(torch.int32)
    return out


def _time_us(fn, iters: int, cuda: bool, graph: bool) -> float:
    """Microseconds per ``fn()`` (:func:`benchmarks.common.seconds_per_call`: ``iters`` calls, eager or one
    CUDA graph, median of 10 timings)."""
    import torch

    from benchmarks import common as C

    device = torch.device("cuda" if cuda else "cpu")
    return C.seconds_per_call(fn, device, calls=iters, graph=graph) * 1e6


def _selection_case(T: int, n: int, width: int, K: int, dist: str, device):
    """Keys [T, width] (positions >= n hold the largest key), lengths [T] = n, the old path's closure and
    its selection (the expected one)."""
    import torch

    from atomtool.serve.ops.triton.topk import orderable_keys

    scores = make_scores(T, n, dist, device)
    keys = torch.full((T, width), -1, dtype=torch.int32, device=device)  # -1: the largest uint32 key
    keys[:, :n] = orderable_keys(scores)
    wide = torch.zeros((T, width), dtype=torch.float32, device=device)
    wide[:, :n] = scores
    keys64 = _old_keys(wide, n)
    lengths = torch.full((T,), n, dtype=torch.int32, device=device)

    def old():
        return _old_from_keys(keys64, K)

    return keys, lengths, old, old()


def _indexer_case(T: int, n: int, width: int, device, seed: int = 0, Hi: int = 64, Di: int = 128):
    """DeepSeek-V3.2 indexer inputs (Hi heads x Di) for T decode tokens of T sequences of n tokens, block
    tables of ``width / 64`` columns (the first ceil(n / 64) distinct blocks, then block 0, as CUDA-graph
    padding)."""
    import torch

    bs = 64
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: the cache is up to ~0.5 GB
    used = -(-n // bs)
    cols = max(-(-width // bs), used)
    nb = T * used + 1
    bt = torch.zeros((T, cols), dtype=torch.int32, device=device)
    bt[:, :used] = 1 + torch.randperm(T * used, generator=g, device=device).view(T, used).int()
    q = torch.randn(T, Hi, Di, generator=g, device=device).to(torch.bfloat16)
    w = torch.rand(T, Hi, generator=g, device=device) * Hi**-0.5
    kc = torch.randn(nb, bs, Di, generator=g, device=device).to(torch.bfloat16)
    cu = torch.arange(T + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((T,), n, dtype=torch.int32, device=device)
    return q, w, kc, cu, seq_lens, bt


def _query_rope(T: int, Di: int, device):
    """(cos, sin) [T, Di / 4] of the indexer's query rope (DeepSeek-V3.2: 64 of 128 dims), as the engine hands
    them to the scoring kernel."""
    import torch

    ang = torch.rand(T, Di // 4, generator=torch.Generator(device=device).manual_seed(1), device=device) * 100
    return ang.cos(), ang.sin()


def bench_one(T: int, S: int, K: int, iters: int, dist: str, device, graph: bool,
              variants: dict[str, dict], width: int = 0, indexer: bool = False) -> list[dict]:
    """For one (T, n = S): per variant (name -> select_rows tuning) us per call of ours and of the old path
    (eager; graph replay on CUDA when ``graph``) and whether ours equals the old selection (``indexer``:
    the first variant's). ``width``: key width (0: S)."""
    import torch

    from atomtool.serve.ops.triton import indexer_topk
    from atomtool.serve.ops.triton.topk import topk_positions

    cuda = device.type == "cuda"
    width = max(width, S)
    old_us = old_graph_us = None
    if indexer:  # interpreter (CPU): a narrow indexer, the selection is the same
        args = _indexer_case(T, S, width, device, Hi=64 if cuda else 4, Di=128 if cuda else 16)
        width = args[5].shape[1] * 64  # the key width: block-table columns x block size
        want = None
    else:
        keys, lengths, old, want = _selection_case(T, S, width, K, dist, device)
        old_us = _time_us(old, iters, cuda, False)
        old_graph_us = _time_us(old, iters, True, True) if cuda and graph else None
    rows = []
    if indexer:  # the scoring launch alone (+ a memset of the range it folds): the baseline of every variant
        from atomtool.serve.ops.triton.indexer import indexer_keys
        from atomtool.serve.ops.triton.topk import row_range_buffer

        rng = row_range_buffer(T, device)
        tabs = _query_rope(T, args[0].shape[-1], device)

        def scoring():
            indexer_keys(*args, 0, T, rng, *tabs)
            rng.zero_()

        r = {"T": T, "S": S, "W": width, "K": K, "variant": "(scoring only)", "tuning": None, "equal": True,
             "ours_us": _time_us(scoring, iters, cuda, False), "old_us": None}
        if cuda and graph:
            r["ours_graph_us"] = _time_us(scoring, iters, True, True)
            r["old_graph_us"] = None
        rows.append(r)
    for name, tuning in variants.items():
        if indexer:
            def ours(tuning=tuning):
                return indexer_topk(*args, K, *tabs, **tuning)
        else:
            def ours(tuning=tuning):
                return topk_positions(keys, lengths, K, **tuning)
        got = ours()
        if want is None:
            want = got
        r = {"T": T, "S": S, "W": width, "K": K, "variant": name, "tuning": tuning,
             "equal": bool(torch.equal(got, want)), "ours_us": _time_us(ours, iters, cuda, False),
             "old_us": old_us}
        if cuda and graph:
            r["ours_graph_us"] = _time_us(ours, iters, True, True)
            r["old_graph_us"] = old_graph_us
        rows.append(r)
    return rows


def bench(rows, ctxs, K: int, iters: int, dist: str, device, graph: bool, variants: dict[str, dict],
          width: int = 0, indexer: bool = False) -> list[dict]:
    """:func:`bench_one` for every (T, ctx) of ``rows`` x ``ctxs``, results concatenated."""
    return [r for T in rows for S in ctxs
            for r in bench_one(T, S, K, iters, dist, device, graph, variants, width, indexer)]


def _time_key(results: list[dict]) -> str:
    return "ours_graph_us" if "ours_graph_us" in results[0] else "ours_us"


def print_table(results: list[dict], top: int | None = None) -> None:
    """A table of ``results``; with ``top``, per (T, ctx) only the ``top`` fastest variants."""
    graph = "ours_graph_us" in results[0]
    width = max(len(r["variant"]) for r in results)

    def num(x, w):
        return f"{x:>{w}.1f}" if x is not None else f"{'-':>{w}}"

    def ratio(a, b):
        return f"{a / b:>6.2f}" if a is not None else f"{'-':>6}"

    scoring = any(r["tuning"] is None for r in results)  # indexer mode: the scoring-only baseline
    head = f"{'T':>5} {'ctx':>7} {'width':>7} {'K':>5} {'variant':<{width}} {'ours us':>9} {'old us':>9} {'ratio':>6}"
    if graph:
        head += f" {'ours graph':>11} {'old graph':>10} {'ratio':>6}"
    if scoring:
        head += f" {'select us':>9}"
    print(head + "  equal")
    key = _time_key(results)
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["T"], r["S"]), []).append(r)
    for group in groups.values():
        base = next((r[key] for r in group if r["tuning"] is None), None)
        for r in sorted(group, key=lambda r: r[key])[:top] if top else group:
            line = (f"{r['T']:>5} {r['S']:>7} {r['W']:>7} {r['K']:>5} {r['variant']:<{width}} "
                    f"{num(r['ours_us'], 9)} {num(r['old_us'], 9)} {ratio(r['old_us'], r['ours_us'])}")
            if graph:
                line += (f" {num(r['ours_graph_us'], 11)} {num(r['old_graph_us'], 10)} "
                         f"{ratio(r['old_graph_us'], r['ours_graph_us'])}")
            if scoring:  # the selection's share: the variant minus the scoring launch alone
                line += f" {num(r[key] - base if base is not None else None, 9)}"
            print(line + f"  {r['equal']}")


def recommend(results: list[dict]) -> dict[str, int]:
    """Module defaults of :mod:`atomtool.serve.ops.triton.topk` from timed variants of both modes.

    Per mode, the tuning with the smallest geometric mean over the (T, ctx) points of its time relative to
    the mode's best at that point (graph replay when timed). Then per T, the mode whose chosen tuning
    takes less time summed over the ctxs: ``SPLIT_MAX_ROWS`` = the smallest T at which one program per row
    wins (rows below it are split), twice the largest T when split always wins, 1 when it never does.
    """
    key = _time_key(results)
    points = sorted({(r["T"], r["S"]) for r in results})
    chosen: dict[bool, dict] = {}
    for split in (False, True):
        mine = [r for r in results if r["tuning"] is not None and r["tuning"].get("split") is split]
        if not mine:
            continue
        best = {p: min(r[key] for r in mine if (r["T"], r["S"]) == p) for p in points}
        score: dict[str, list[float]] = {}
        for r in mine:
            score.setdefault(r["variant"], []).append(math.log(r[key] / best[(r["T"], r["S"])]))
        name = min(score, key=lambda v: sum(score[v]) / len(score[v]))
        chosen[split] = next(r["tuning"] for r in mine if r["variant"] == name)
    out: dict[str, int] = {}
    if False in chosen:
        t = chosen[False]
        out.update(BLOCK=t["block"], BINS=t["bins"], NUM_WARPS=t["num_warps"])
    if True in chosen:
        t = chosen[True]
        out.update(SPLIT_BLOCK=t["block"], SPLIT_BINS=t["bins"], SPLIT_NUM_WARPS=t["num_warps"])
        out.update({name: t[k] for name, k in (("SPLIT_SMALL_N", "small_n"), ("SPLIT_SMALL_NUM_WARPS", "small_warps"))
                    if k in t})
    # one constant for both modes: the split winner's (decode latency) unless only one mode was timed
    for sp in (True, False):
        if sp in chosen and "cand_bins" in chosen[sp]:
            out["CAND_BINS"] = chosen[sp]["cand_bins"]
            break
    if len(chosen) == 2:
        rows = sorted({T for T, _ in points})
        total = {(T, sp): sum(r[key] for r in results if r["T"] == T and r["tuning"] == chosen[sp])
                 for T in rows for sp in (False, True)}
        one_wins = [T for T in rows if total[(T, False)] <= total[(T, True)]]
        if not one_wins:
            out["SPLIT_MAX_ROWS"] = 2 * rows[-1]
        else:
            out["SPLIT_MAX_ROWS"] = one_wins[0] if one_wins[0] > rows[0] else 1
    return out


def make_variants(args: argparse.Namespace) -> dict[str, dict]:
    """name -> select_rows tuning: the --split choice(s) with the given/default tuning, the --candidates
    list, or the --sweep grid."""
    if args.candidates:
        out = {f"one b={b} bins={nb} w={w} cb={cb}":
               {"split": False, "block": b, "bins": nb, "num_warps": w, "cand_bins": cb}
               for b, nb, w, cb in ONE_PROGRAM_CANDIDATES}
        out.update({f"split b={b} bins={nb} w={w} cb={cb} small={sm}/{sw}":
                    {"split": True, "block": b, "bins": nb, "num_warps": w, "cand_bins": cb, "small_n": sm,
                     "small_warps": sw}
                    for b, nb, w, cb, sm, sw in SPLIT_CANDIDATES})
        return out
    splits = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.split]
    if args.sweep:  # a given --block / --num-warps / --bins pins that axis of the grid
        grid = [(sp, b, w, nb) for sp in (False, True) for b in ([args.block] if args.block else (1024, 2048, 4096))
                for w in ([args.num_warps] if args.num_warps else (4, 8, 16))
                for nb in ([args.bins] if args.bins else (128, 256, 512))]
        return {f"split={int(sp)} block={b} warps={w} bins={nb}": {"split": sp, "block": b, "num_warps": w, "bins": nb}
                for sp, b, w, nb in grid}
    fixed = {k: v for k, v in (("block", args.block), ("bins", args.bins), ("num_warps", args.num_warps),
                               ("small_n", args.small_n), ("cand_bins", args.cand_bins)) if v is not None}
    if args.smoke:
        fixed.setdefault("block", 64)
        fixed.setdefault("cand_bins", 32)
        fixed.setdefault("small_n", 256)
    cudas = {"auto": [None], "on": [True], "off": [False], "both": [False, True]}[args.cuda]
    out = {}
    for sp in splits:
        for cu in (cudas if sp is not True else [None]):  # the CUDA kernel serves the one-program mode only
            name = f"split={'auto' if sp is None else int(sp)}" + ("" if cu is None else " cuda" if cu else " triton")
            out[name] = {"split": sp, **fixed, **({} if cu is None else {"cuda": cu})}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    variants = make_variants(args)
    if args.smoke:
        from atomtool.serve.ops.triton import topk

        topk.CAND_BLOCK = 256  # interpreter-sized register tiles (the interpreter's cost grows with them)
        device, rows, ctxs, K, iters, width = torch.device("cpu"), [1, 3], [300], 40, 1, args.width
        if args.candidates:  # interpreter-sized stand-ins of the candidate list
            variants = {"one": {"split": False, "block": 512, "bins": 64, "num_warps": 4, "cand_bins": 64},
                        "one small block": {"split": False, "block": 64, "bins": 32, "num_warps": 4, "cand_bins": 32},
                        "split": {"split": True, "block": 64, "bins": 64, "num_warps": 4, "small_n": 0,
                                  "cand_bins": 32, "small_warps": 4},
                        "split small": {"split": True, "block": 64, "bins": 64, "num_warps": 4, "small_n": 512,
                                        "cand_bins": 64, "small_warps": 4}}
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rows = [int(x) for x in args.rows.split(",")]
        ctxs = [int(x) for x in args.ctx.split(",")]
        K, iters, width = args.topk, args.iters, args.width
        if args.candidates and args.iters == 50:  # a shorter default: 10 variants x every (T, ctx)
            iters = 20
    if any(n <= K for n in ctxs):
        raise SystemExit(f"error: every --ctx must exceed --topk {K} (shorter rows select every position)")
    print(f"device {device}, dist {args.dist}, {len(variants)} variant(s)"
          + (", indexer_topk (scoring + selection)" if args.indexer else ""))
    results = bench(rows, ctxs, K, iters, args.dist, device, not args.no_graph, variants, width, args.indexer)
    print_table(results, top=10 if args.sweep else None)
    if args.candidates or args.sweep:
        rec = recommend(results)
        print("set in atomtool/serve/ops/triton/topk.py: " + ", ".join(f"{k} = {v}" for k, v in rec.items()))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
